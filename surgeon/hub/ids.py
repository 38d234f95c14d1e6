"""Hub model ids: what is shaped like ``org/name``, and the huggingface_hub progress bars."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import (
    OptionError,
)
from ..formats.registry import WEIGHT_SUFFIXES

HF_PREFIX = "hf://"


# --- ids ---------------------------------------------------------------------------------------

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
# `sub/model.safetensors` that does not exist is a mistyped path, not a Hub id.
_PATH_SUFFIXES = WEIGHT_SUFFIXES + (".json", ".h5", ".gguf", ".msgpack")


def parse_repo_id(text: str) -> str | None:
    """``org/name`` (or ``hf://org/name``) when ``text`` is shaped like a Hub model id, else None."""
    name = text.removeprefix(HF_PREFIX).removeprefix("models/") if text.startswith(HF_PREFIX) else text
    if not _REPO_ID.fullmatch(name) or ".." in name or "--" in name or name.endswith((".", "-", "_")):
        return None
    if not text.startswith(HF_PREFIX) and name.lower().endswith(_PATH_SUFFIXES):
        return None
    return name


def require_repo_id(text: str, what: str) -> str:
    repo_id = parse_repo_id(text if text.startswith(HF_PREFIX) else HF_PREFIX + text)
    if repo_id is None:
        raise OptionError(
            f"{what} {text!r} is not a Hub repository id: write it as org/name (letters, digits, '-', '_', '.')"
        )
    return repo_id


@contextmanager
def hf_progress(enabled: bool) -> Iterator[None]:
    """huggingface_hub's own download/upload bars only when surgeon shows progress (a terminal)."""
    from .._compat import are_progress_bars_disabled, disable_progress_bars

    if enabled or are_progress_bars_disabled():
        yield
        return
    with disable_progress_bars():  # restores the caller's setting on the way out
        yield
