"""surgeon._compat: the private torch / huggingface_hub APIs surgeon uses resolve on the installed versions,
and a release without one fails in one line naming the versions that work."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata

import pytest

from surgeon import _compat
from surgeon.errors import DependencyError, SurgeonError

from helpers.paths import ROOT


def test_every_wrapped_api_resolves_on_the_installed_versions():
    # Fails loudly on a torch or huggingface_hub that moved or dropped one of them: that is its purpose.
    _compat.check()
    for name, (module, attr, _) in _compat.APIS.items():
        value = getattr(_compat, name)
        assert value is (sys.modules[module] if attr is None else getattr(sys.modules[module], attr))
    # what only newer releases offer is the release's own, or None where it has none (the caller falls back)
    for name, (module, attr, _) in _compat.NEWER.items():
        found = getattr(sys.modules.get(module), attr or "", None)
        assert getattr(_compat, name) is found
    hub = _release(metadata.version("huggingface-hub"))
    assert (_compat.get_cached_repo_tree is None) == (hub < (2, 0, 0))
    assert _compat.hub_http().__name__ == ("httpx2" if hub >= (2, 0, 0) else "httpx")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def test_the_tested_versions_are_the_floors_and_installed_ones_are_not_older():
    """TESTED (what the error message promises) are the floors the package declares (the floors job installs
    exactly those), and what is installed here is not older. A newer release is judged by the API test above."""
    for dist, tested in _compat.TESTED.items():
        installed = metadata.version(dist)
        assert _release(installed) >= _release(tested), f"{dist} {installed} is older than the tested floor {tested}"
    pyproject = ROOT / "pyproject.toml"  # the source tree's, else the installed package's
    if pyproject.is_file():
        tomllib = pytest.importorskip("tomllib")  # Python 3.11+
        requires = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    else:
        requires = metadata.requires("attention-surgeon") or []
    for dist, tested in _compat.TESTED.items():
        floor = next(r for r in requires if re.match(rf"{dist}\s*>=", r, re.I))
        assert tested.startswith(floor.split(">=")[1].split(",")[0].strip()), (floor, tested)


def test_a_missing_attribute_names_the_installed_and_the_tested_version():
    torch_version = metadata.version("torch")
    with pytest.raises(DependencyError) as err:
        _compat.resolve("torch.distributed.tensor", "NoSuchPlacement", "torch")
    assert str(err.value) == (
        f"torch {torch_version} has no torch.distributed.tensor.NoSuchPlacement (AttributeError); "
        f"surgeon {_compat_version()} is tested with torch 2.13.0: pip install 'torch==2.13.0'"
    )
    assert isinstance(err.value, SurgeonError) and "\n" not in str(err.value)


def test_a_missing_module_names_the_tested_version():
    with pytest.raises(
        DependencyError,
        match=r"^huggingface-hub \S+ has no huggingface_hub\._gone \(ModuleNotFoundError\); "
        r"surgeon \S+ is tested with huggingface-hub 1\.3\.0: pip install 'huggingface-hub==1\.3\.0'$",
    ):
        _compat.resolve("huggingface_hub._gone", None, "huggingface-hub")
    with pytest.raises(AttributeError):
        _compat.NotAnApi  # noqa: B018


def test_importing_surgeon_imports_neither_package():
    code = (
        "import sys, surgeon._compat\nassert not {'torch', 'huggingface_hub'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _compat_version() -> str:
    from surgeon import __version__

    return __version__
