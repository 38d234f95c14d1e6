"""Pushing a Hub model's re-initialization by changes only: the changed shards, the card and the record are
uploaded; every other file of the output is committed as a server-side copy from the source repo at the
commit it was read from (never a branch name, which could move between planning and commit).

huggingface_hub 2.x copies across repositories (``CommitOperationCopy(src_repo_id=...)``: the large files
are duplicated server-side through the source repo's duplicate endpoint); before it, or where the Hub
refuses the copy, surgeon uploads every file instead and says why in one line.

``surgeon push OUTPUT`` does the same for a whole output made from a Hub model: its record names the model and
the commit it was read from (``origin``), and every file whose bytes equal that commit's file of the same path
(sha256 for large files, the git blob id for the others) is copied rather than uploaded. The record is read
as hostile input, but it can only make a push copy bytes the folder holds anyway: nothing is copied that was
not compared.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import opt
from .failures import one_line

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationCopy

    from ..errors import PushError
    from ..open.source import Source


@dataclass(frozen=True)
class ServerCopies:
    """The files a push commits as copies of ``repo_id`` at ``commit`` (same paths on both sides)."""

    repo_id: str
    commit: str
    files: tuple[str, ...]
    sizes: Mapping[str, int] = field(default_factory=dict, compare=False)  # each file's bytes, for the report

    def operations(self) -> list[CommitOperationCopy]:
        from huggingface_hub import CommitOperationCopy

        return [
            CommitOperationCopy(f, f, src_repo_id=self.repo_id, src_repo_type="model", src_revision=self.commit)
            for f in self.files
        ]


class CopyRefused(Exception):
    """The server-side copy could not be done; the message is the one-line reason."""


def no_copy_reason(source: Source, *, output_given: bool, no_server_copy: bool) -> str | None:
    """Why a push of ``source``'s re-initialization cannot copy unchanged files server-side (None: it can)."""
    from huggingface_hub import CommitOperationCopy, __version__

    from .remote import ranged

    if output_given or ranged(source) is None or len(source.weights) > 1:
        return ""  # not a Hub model read by Range, or a full output asked for: nothing to say
    if no_server_copy:
        return f"uploading every file ({opt('no_server_copy', True)})"
    if "src_repo_id" not in getattr(CommitOperationCopy, "__dataclass_fields__", {}):
        return f"uploading every file: huggingface_hub {__version__} has no cross-repo copies (2.x has)"
    return None


def copies_for(source: Source, staged: list[str]) -> ServerCopies:
    """What a full output of ``source`` holds and the staging folder (``staged``) does not: copied."""
    from ..files.folder import file_in
    from ..open.source import folder_output_files
    from .remote import ranged

    weights, carried = folder_output_files(source)
    assert source.hub_id is not None and source.hub_commit is not None
    rest = sorted({*weights, *carried} - set(staged) - {"README.md"})
    read_by_range = ranged(source)
    headers = read_by_range.headers if read_by_range is not None else {}
    sizes = {f: headers[f].file_size for f in rest if f in headers}
    for f in rest:
        path = None if f in sizes else file_in(source.folder, f)
        if path is not None:
            sizes[f] = path.stat().st_size
    return ServerCopies(source.hub_id, source.hub_commit, tuple(rest), sizes)


def copies_from_record(
    folder: Path, files: list[str], token: str | None, *, repo_id: str, revision: str | None
) -> tuple[ServerCopies | None, str | None]:
    """The files of an output folder its record's origin holds unchanged, to copy server-side rather than
    upload, and a one-line note where none can be (None, None: the folder was not made from a Hub model).
    Files the destination (``repo_id`` at ``revision``) holds unchanged already are left to the upload,
    which sends nothing for them: copied again, they would make a commit that changes nothing."""
    from huggingface_hub import CommitOperationCopy, HfApi, __version__

    from ..errors import SurgeonError
    from ..report.record import parse_record, read_card

    card = folder / "README.md"
    try:
        records = read_card(card) if card.is_file() else []
        origin = parse_record(records[0], str(card)).origin if records else None
    except SurgeonError as exc:  # not surgeon's record: pushed as it is, every file uploaded
        return None, f"every file uploaded: {exc.args[0]}"
    if origin is None:
        return None, None
    source, commit = origin
    if "src_repo_id" not in getattr(CommitOperationCopy, "__dataclass_fields__", {}):
        return None, f"uploading every file: huggingface_hub {__version__} has no cross-repo copies (2.x has)"
    candidates = [f for f in files if f != "README.md"]  # the card is always new
    api = HfApi(token=token)
    try:  # any failure (an HTTP error, no network, a malformed answer) only means no copies: said, then uploaded
        found = {e.path: e for e in api.get_paths_info(source, candidates, revision=commit)}
    except Exception as exc:
        why = f"could not ask {source}@{commit[:12]} about its files ({one_line(exc)})"
        return None, f"{why}; uploading every file instead"
    same = [f for f in candidates if f in found and _same_bytes(folder / f, found[f])]
    try:
        there = {e.path: e for e in api.get_paths_info(repo_id, same, revision=revision)} if same else {}
    except Exception:  # no such repo or branch yet (or no answer): nothing counts as there
        there = {}
    same = [f for f in same if not (f in there and _same_bytes(folder / f, there[f]))]
    sizes = {f: (folder / f).stat().st_size for f in same}
    return (ServerCopies(source, commit, tuple(same), sizes) if same else None), None


def _same_bytes(path: Path, remote: Any) -> bool:
    """Whether the local file holds the bytes of the Hub's entry: its sha256 for a large file, its git blob id
    for the others; sizes are compared first, so most files that differ are not read."""
    import hashlib

    lfs, size = getattr(remote, "lfs", None), path.stat().st_size
    if getattr(remote, "size", None) != size:
        return False
    digest = hashlib.sha256() if lfs is not None else hashlib.sha1(b"blob %d\0" % size)  # git's blob id
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest() == (lfs.sha256 if lfs is not None else getattr(remote, "blob_id", None))


def is_copy_error(exc: BaseException, copies: ServerCopies) -> bool:
    """Whether ``exc`` came from the copy (the duplicate endpoint, or asking the source repo about its files)."""
    from huggingface_hub.errors import HfHubHTTPError

    if type(exc).__name__ == "FileDuplicationError":  # huggingface_hub 2.x only
        return True
    response: Any = getattr(exc, "response", None)
    url = str(getattr(getattr(response, "request", None), "url", "")) if response is not None else ""
    return isinstance(exc, HfHubHTTPError) and f"/api/models/{copies.repo_id}/" in url


def refused(exc: BaseException) -> CopyRefused:
    # a duplication error lists each file's reason on a line of its own: all on one line, shortened
    why = " ".join(str(exc).split()) if type(exc).__name__ == "FileDuplicationError" else one_line(exc)
    why = why if len(why) <= 300 else why[:297] + "..."
    return CopyRefused(f"the Hub refused the server-side copy ({why}); uploading every file instead")


def complete_staging(folder: Path, source: Source) -> None:
    """Make the staging folder the whole output: the unchanged shards (fetched, so as their source) and
    the files carried over, beside the changed shards and card already there."""
    from ..files.folder import file_in

    weights = source.primary
    for file in weights.all_files:
        if not (folder / file).exists():
            shutil.copyfile(weights.local_path(file), folder / file)  # a remote shard is fetched here
    for rel in source.extra_files:  # as copy_extras does, but the new card stays
        path = file_in(source.folder, rel)
        if path is not None and not (folder / rel).exists():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, folder / rel)


def resume_by_reinit(exc: PushError) -> PushError:
    """A push by changes that stopped part-way is finished by the same reinit run again (its output is the
    same bytes, and what reached the Hub is not sent again), not by pushing the staging folder alone."""
    import re

    from ..errors import PushError

    text = re.sub(
        r"run `surgeon push [^`]*` to finish",
        "run the same `surgeon reinit` again with --overwrite to finish",
        str(exc),
    )
    return PushError(text, uploaded=exc.uploaded, not_uploaded=exc.not_uploaded)


def predicted(source: Source, changed: list[str]) -> tuple[str, dict[str, int]]:
    """What a push by changes will move, from the headers read (a dry run's line, and its figures for the
    report's transfer): the changed shards' bytes, downloaded and then uploaded (with the record added to
    their headers), and the copies."""
    from ..text.sizes import fmt_bytes
    from .remote import ranged

    weights = ranged(source)
    assert weights is not None  # a push by changes is planned only for these
    moved = sum(weights.headers[f].file_size for f in changed)
    copied = sum(h.file_size for f, h in weights.headers.items() if f not in changed)
    line = (
        f"the real run downloads {len(changed)} changed shard(s) ({', '.join(changed)}: {moved:,} bytes), "
        f"uploads them with the record added and the card, and copies {len(weights.files) - len(changed)} "
        f"unchanged shard(s) ({fmt_bytes(copied)}) and the other files server-side from "
        f"{source.hub_id}@{str(source.hub_commit)[:12]}"
    )
    return line, {"predicted_downloaded": moved, "predicted_copied_server_side": copied}
