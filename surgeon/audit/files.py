"""A folder output against its original, file by file.

surgeon writes into a folder output: the weight files of every weight set of the original (rewritten:
their tensors are checked one by one elsewhere), the files it carries over (byte for byte: config.json,
tokenizer, code, ...) and its model card README.md. Anything else is not surgeon's: a file that is
missing, added (a ``model.safetensors`` beside the shards, a ``.bin`` beside the ``.safetensors``, a
Python file an ``auto_map`` points to) or changed is a mismatch. ``.git`` and ``.cache`` (bookkeeping no
loader reads, that a download may add) are not compared, as surgeon does not read them in an input.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import VerificationError
from ..formats.fileio import same_bytes
from ..open.source import SKIP_DIRS, folder_output_files
from ..report.record import Record, read_card_record

if TYPE_CHECKING:
    from ..open.source import Source

CARD = "README.md"
# files git or the Hub adds to a repository: loaders never read them
HOSTING = {".gitattributes"}


def output_files(folder: Path) -> dict[str, Path]:
    """Every file under ``folder`` (relative posix path -> path), links not followed into other folders."""
    found: dict[str, Path] = {}
    for root, dirs, files in os.walk(folder, followlinks=False):
        here = Path(root)
        if here == folder:
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for d in dirs:
            if (here / d).is_symlink():
                raise VerificationError(
                    f"{folder}: {(here / d).relative_to(folder).as_posix()} is a link to a folder; surgeon writes no links"
                )
        for f in files:
            found[(here / f).relative_to(folder).as_posix()] = here / f
    return found


def expected_files(src: Source) -> tuple[set[str], set[str]]:
    """(weight files surgeon rewrites, files it copies byte for byte: index files and, from a folder, the
    non-weight files) in a folder output of ``src``."""
    weights, carried = folder_output_files(src)
    return set(weights), set(carried) - {CARD}


def check_folder(src: Source, out: Source, output: str | Path) -> int:
    """Every file of the folder output ``out`` is one surgeon writes, and the carried ones are byte-identical;
    returns how many files were compared byte for byte."""
    weights, carried = expected_files(src)
    found = output_files(out.folder)
    for rel, path in found.items():
        _regular(path, rel, output)
    for rel in sorted(set(found) - weights - carried - {CARD} - HOSTING):
        raise VerificationError(
            f"{output}: {rel} {_what_added(rel, src)}, which surgeon does not write: the output was changed after surgeon made it"
        )
    for rel in sorted((weights | carried) - set(found)):
        raise VerificationError(
            f"{output}: {rel} of {src.path} is missing from it; surgeon writes every file of its original"
        )
    for rel in sorted(carried):
        if not same_bytes(src.folder / rel, found[rel]):
            raise VerificationError(f"{output}: {rel} differs from {src.path}'s; surgeon carries it over byte for byte")
    return len(carried)


def _regular(path: Path, rel: str, output: str | Path) -> None:
    try:
        mode = os.stat(path).st_mode  # a link to a regular file (a Hub cache snapshot) is read through
    except OSError:
        raise VerificationError(f"{output}: {rel} is a link to nothing; surgeon writes regular files") from None
    if not stat.S_ISREG(mode):
        raise VerificationError(f"{output}: {rel} is not a regular file; surgeon writes regular files")


def _what_added(rel: str, src: Source) -> str:
    from ..formats.registry import STATE_DICT_SUFFIXES, format_of
    from ..open.source import STALE_WEIGHT_SUFFIXES

    if (src.folder / rel).is_file():
        return f"is there, a file of {src.path} that surgeon leaves out of its outputs (another copy of the weights, not rewritten)"
    if format_of(rel.rsplit("/", 1)[-1]) is not None or rel.endswith(STATE_DICT_SUFFIXES + STALE_WEIGHT_SUFFIXES):
        return "was added: weights a loader may read instead of the re-initialized ones"
    return "was added"


def check_card(src: Source, out: Source, record: Record, output: str | Path) -> None:
    """README.md: surgeon's card with this record, or (an in-place output) the original's, unchanged."""
    theirs = src.folder / CARD if src.kind == "folder" else None
    card = out.folder / CARD if (out.folder / CARD).is_file() else None
    if card is None:
        if theirs is not None and theirs.is_file():
            raise VerificationError(
                f"{output}: {CARD} of {src.path} is missing from it, and surgeon writes a model card there"
            )
        return
    if theirs is not None and theirs.is_file() and same_bytes(theirs, card):
        return
    own = read_card_record(card)  # its one record (several: refused), never one of the source's, escaped in it
    if own is None:
        raise VerificationError(f"{output}: its {CARD} is neither surgeon's model card nor {src.path}'s")
    if not isinstance(own, dict) or _as_weights_hold(own) != _as_weights_hold(record.raw):
        raise VerificationError(
            f"{output}: the record in its {CARD} is not the record of its weights: the card was changed after surgeon wrote it"
        )


def _as_weights_hold(record: dict) -> dict:
    """The record as both the card and the weights carry it: an ONNX model's record adds the copies its writer
    made, and the card the Hub model it was made from."""
    return {k: v for k, v in record.items() if k not in ("copies", "origin")}
