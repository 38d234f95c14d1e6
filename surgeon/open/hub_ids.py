"""Hub model ids: what is shaped like ``org/name``, and the huggingface_hub progress bars."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import OptionError, opt
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


# git's ref-name rules (`git check-ref-format`), plus '%': huggingface_hub puts a revision into URLs and into the
# cache's refs/ folder as a file name, so anything that could walk a path there is refused before it is called.
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\%]")
_COMMIT = re.compile(r"[0-9a-f]{40}")
MAX_REVISION = 255


def check_revision(revision: str | None, what: str = opt("revision")) -> str | None:
    """``revision`` if it is a commit hash or a branch/tag name git would accept; else a one-line OptionError.

    Checked where a revision enters (every command's ``--revision``, a push's branch), before huggingface_hub
    sees it: ``../../x`` would make the client write ``refs/../../x`` outside the cache, or read a file there."""
    if revision is None:
        return None
    if not isinstance(revision, str):
        raise OptionError(f"{what} must be a branch, tag or commit hash (a string), not {type(revision).__name__}")
    why = _ref_fault(revision)
    if why is not None:
        raise OptionError(
            f"{what} {shown_revision(revision)} is not a branch, tag or commit hash ({why}): "
            "give one as the Hub shows it (e.g. main, v1.0, or a 40-character commit hash)"
        )
    return revision


def _ref_fault(ref: str) -> str | None:
    """Why ``ref`` breaks git's ref-name rules (or holds '%'), or None."""
    if not ref:
        return "it is empty"
    if len(ref) > MAX_REVISION:
        return f"it is longer than {MAX_REVISION} characters"
    bad = next((c for c in ref if _REF_FORBIDDEN.match(c) or not c.isprintable()), None)
    if bad is not None:
        return "it holds a space" if bad == " " else f"it holds {ascii(bad)}"
    for part in ("..", "@{", "//"):
        if part in ref:
            return f"it holds {part!r}"
    if ref == "@" or ref.startswith("/") or ref.endswith(("/", ".")):
        return "it is '@', or starts with '/', or ends with '/' or '.'"
    if any(part.startswith(".") or part.endswith(".lock") for part in ref.split("/")):
        return "a part of it starts with '.' or ends with '.lock'"
    return None


def check_commit(commit: str, repo_id: str) -> str:
    """A commit hash the Hub or the cache answered: 40 hex digits, or the answer is not used (it names a folder)."""
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        raise OptionError(
            f"the Hugging Face Hub (or the cache's refs/) gave {shown_revision(str(commit))} as the commit of {repo_id}, "
            f"which is not a commit hash: give {opt('revision')} as a 40-character commit hash, or clear that repo from the cache"
        )
    return commit


def shown_revision(text: str) -> str:
    """A revision in a message: quoted, control characters escaped, at most 80 characters."""
    return repr(text if len(text) <= 80 else text[:77] + "...")


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
    from .._compat import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if enabled or are_progress_bars_disabled():
        yield
        return
    if hasattr(disable_progress_bars, "__enter__"):  # huggingface_hub 2.0+: restores the caller's setting on exit
        with disable_progress_bars():
            yield
        return
    disable_progress_bars()  # before 2.0 a plain switch: they were on (checked above), so on again after
    try:
        yield
    finally:
        enable_progress_bars()
