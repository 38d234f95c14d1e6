"""The private or fast-moving APIs of other packages that surgeon uses, in one place.

torch's DTensor internals (placements, a shard's local shape and offset) and huggingface_hub's cache
and progress-bar helpers move or vanish between releases without notice. Every use goes through a
name here, imported on first use (importing surgeon imports neither package), and a release that lacks
one fails with one line naming the versions surgeon is tested with, not an ImportError deep in a run.
``check()`` resolves them all (the tests and the wheel smoke test call it).
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import DependencyError

# The versions every API below is tested with (CI installs exactly these; pyproject.toml's floors match).
TESTED = {"torch": "2.13.0", "huggingface-hub": "2.4.0"}

# name -> (module, attribute in it, or None for the module itself, distribution that provides it)
APIS: dict[str, tuple[str, str | None, str]] = {
    "DTensor": ("torch.distributed.tensor", "DTensor", "torch"),
    "Shard": ("torch.distributed.tensor", "Shard", "torch"),
    "Replicate": ("torch.distributed.tensor", "Replicate", "torch"),
    "Partial": ("torch.distributed.tensor", "Partial", "torch"),
    "compute_local_shape_and_global_offset": (
        "torch.distributed.tensor._utils",
        "compute_local_shape_and_global_offset",
        "torch",
    ),
    "get_cached_repo_tree": ("huggingface_hub", "get_cached_repo_tree", "huggingface-hub"),
    "CachedRepoTreeNotFoundError": ("huggingface_hub.errors", "CachedRepoTreeNotFoundError", "huggingface-hub"),
    "repo_folder_name": ("huggingface_hub.file_download", "repo_folder_name", "huggingface-hub"),
    "are_progress_bars_disabled": ("huggingface_hub.utils", "are_progress_bars_disabled", "huggingface-hub"),
    "disable_progress_bars": ("huggingface_hub.utils", "disable_progress_bars", "huggingface-hub"),
    "httpx2": ("httpx2", None, "huggingface-hub"),  # huggingface_hub's HTTP client (its exceptions)
}


def installed_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def resolve(module: str, attr: str | None, dist: str) -> Any:
    """``module.attr`` (or the module), or a DependencyError naming the versions that work."""
    try:
        found = importlib.import_module(module)
        return found if attr is None else getattr(found, attr)
    except (ImportError, AttributeError) as exc:
        from ._version import __version__

        what = f"{module}.{attr}" if attr else module
        have = installed_version(dist)
        has = f"{dist} {have}" if have else f"{dist} (not installed)"
        tested = TESTED.get(dist)
        fix = (
            f"; surgeon {__version__} is tested with {dist} {tested}: pip install '{dist}=={tested}'" if tested else ""
        )
        raise DependencyError(f"{has} has no {what} ({type(exc).__name__}){fix}") from None


def check() -> None:
    """Resolve every API surgeon uses (raises DependencyError on the first one missing)."""
    for name in APIS:
        __getattr__(name)


def __getattr__(name: str) -> Any:
    spec = APIS.get(name)
    if spec is None:
        raise AttributeError(f"module 'surgeon._compat' has no attribute {name!r}")
    value = resolve(*spec)
    globals()[name] = value
    return value
