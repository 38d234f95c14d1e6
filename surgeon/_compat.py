"""The private or fast-moving APIs of other packages that surgeon uses, in one place.

torch's DTensor internals (placements, a shard's local shape and offset) and huggingface_hub's cache
and progress-bar helpers move or vanish between releases without notice. Every use goes through a
name here, imported on first use (importing surgeon imports neither package), and a release that lacks
one fails with one line naming the versions surgeon is tested with, not an ImportError deep in a run.
``check()`` resolves them all (the tests and the wheel smoke test call it).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from .errors import DependencyError

# The oldest versions every API below is tested with (pyproject.toml's floors; the floors job installs exactly
# these, CI's main venv the newest).
TESTED = {"torch": "2.13.0", "huggingface-hub": "1.3.0"}

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
    "repo_folder_name": ("huggingface_hub.file_download", "repo_folder_name", "huggingface-hub"),
    "cache_commit_hash": (
        "huggingface_hub.file_download",
        "_cache_commit_hash_for_specific_revision",
        "huggingface-hub",
    ),
    "are_progress_bars_disabled": ("huggingface_hub.utils", "are_progress_bars_disabled", "huggingface-hub"),
    "disable_progress_bars": ("huggingface_hub.utils", "disable_progress_bars", "huggingface-hub"),
    "enable_progress_bars": ("huggingface_hub.utils", "enable_progress_bars", "huggingface-hub"),
}

# What only newer releases offer: None on an older one, where the caller falls back (huggingface_hub 2.0 added
# the cached repo listing; before it, the files of the cached snapshot folder are what is known offline).
NEWER: dict[str, tuple[str, str | None, str]] = {
    "get_cached_repo_tree": ("huggingface_hub", "get_cached_repo_tree", "huggingface-hub"),
    "CachedRepoTreeNotFoundError": ("huggingface_hub.errors", "CachedRepoTreeNotFoundError", "huggingface-hub"),
    "RevisionResolutionError": ("huggingface_hub.errors", "RevisionResolutionError", "huggingface-hub"),
}


# torch's CPU allocator asks the kernel for huge pages for its large tensors only where this variable is set (it
# reads it at its first allocation). surgeon's per-head math fills tens of MB of new tensors per projection, and
# faulting them in 4 KiB pages took as long as the GEMMs that fill them (25 ms against 10 ms for one 32 MB
# float64 product). Where the user set it either way, theirs stands; once torch has allocated, it changes nothing.
TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


def prefer_huge_pages() -> None:
    """Let torch back its large CPU tensors with huge pages (call before torch's first allocation)."""
    os.environ.setdefault(TORCH_HUGE_PAGES, "1")


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


def hub_http() -> Any:
    """The HTTP client module huggingface_hub raises through (its connection errors): httpx2 from 2.0, httpx
    in 1.x."""
    major = int((installed_version("huggingface-hub") or "0").split(".")[0])
    return resolve("httpx2" if major >= 2 else "httpx", None, "huggingface-hub")


def check() -> None:
    """Resolve every API surgeon uses (raises DependencyError on the first one missing)."""
    for name in [*APIS, *NEWER]:
        __getattr__(name)
    hub_http()
    check_upload_state()


def __getattr__(name: str) -> Any:
    spec = APIS.get(name)
    if spec is not None:
        value = resolve(*spec)
    elif name in NEWER:
        try:
            value = resolve(*NEWER[name])
        except DependencyError:
            value = None
    else:
        raise AttributeError(f"module 'surgeon._compat' has no attribute {name!r}")
    globals()[name] = value
    return value


def hub_client_factory() -> Any:
    """The factory huggingface_hub makes its shared HTTP client with (the client's own, or the one a user set with
    its public ``set_client_factory``), which has no public getter: surgeon's policy wraps it (``hub.http``)."""
    return resolve("huggingface_hub.utils._http", "_GLOBAL_CLIENT_FACTORY", "huggingface-hub")


# huggingface_hub's private bookkeeping on a CommitOperationAdd, set by preupload_lfs_files: how the Hub takes the
# file ("lfs" or "regular"), the oid it holds at that path (None: none), and the file's own oid (sha256 for a
# large file, the git blob id for the others). No public API says it; a push reads it through here only.
ADD_STATE = ("_upload_mode", "_remote_oid", "_local_oid")


def upload_state(operation: Any) -> tuple[str | None, str | None, str | None]:
    """(upload mode, the Hub's oid at the path, the file's oid) of a CommitOperationAdd after preupload."""
    _check_add_state(type(operation))
    mode = operation._upload_mode
    return mode, operation._remote_oid, operation._local_oid if mode is not None else None


def check_upload_state() -> None:
    """The bookkeeping ``upload_state`` reads is there (``check`` calls it)."""
    from huggingface_hub import CommitOperationAdd

    _check_add_state(CommitOperationAdd)


def _check_add_state(cls: type) -> None:
    missing = [name for name in ADD_STATE if not hasattr(cls, name)]
    if missing:
        from ._version import __version__

        tested = TESTED["huggingface-hub"]
        raise DependencyError(
            f"huggingface-hub {installed_version('huggingface-hub')} has no CommitOperationAdd.{missing[0]}; "
            f"surgeon {__version__} is tested with huggingface-hub {tested}: pip install 'huggingface-hub=={tested}'"
        )
