"""Pushing a Hub model's re-initialization by changes only: the changed shards, the card and the record are
uploaded; every other file of the output is committed as a server-side copy from the source repo at the
commit it was read from (never a branch name, which could move between planning and commit).

huggingface_hub 1.17 or newer copies across repositories (``CommitOperationCopy(src_repo_id=...)``: the large
files are duplicated server-side through the source repo's duplicate endpoint); before it, or where the Hub
refuses the copy, surgeon uploads every file instead and says why in one line.

``surgeon push OUTPUT`` does the same for a whole output made from a Hub model: the record in its weights
(and its card's, which must be the same record) says how it was made, and the card's record names the model and
the commit it was read from (``origin``); every file whose bytes equal that commit's file of the same path
(sha256 for large files, the git blob id for the others) is copied rather than uploaded. The record is read
as hostile input, but it can only make a push copy bytes the folder holds anyway: nothing is copied that was
not compared, and the push checks what the destination holds after its commit.

A staging folder (what a push by changes uploads) is not a model: pushed alone it is refused, with the
``surgeon reinit`` command that makes and pushes the whole output again (:func:`part_of_a_model`).
"""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, OptionError, SurgeonError, opt, shell_spelling
from .failures import few, one_line
from .push_result import PlannedFile

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationCopy

    from ..errors import PushError
    from ..open.source import Source

# huggingface_hub's first release with cross-repo copies (CommitOperationCopy's src_repo_id)
CROSS_REPO_COPIES = "1.17"


@dataclass(frozen=True)
class ServerCopies:
    """The files a push commits as copies of ``repo_id`` at ``commit`` (same paths on both sides); ``planned``:
    what each holds, from the answer the copy was decided from (empty: the push asks the source once)."""

    repo_id: str
    commit: str
    files: tuple[str, ...]
    sizes: Mapping[str, int] = field(default_factory=dict, compare=False)  # each file's bytes, for the report
    planned: Mapping[str, PlannedFile] = field(default_factory=dict, compare=False)

    def operations(self) -> list[CommitOperationCopy]:
        from huggingface_hub import CommitOperationCopy

        return [
            CommitOperationCopy(f, f, src_repo_id=self.repo_id, src_repo_type="model", src_revision=self.commit)
            for f in self.files
        ]

    def without(self, paths: Iterable[str]) -> ServerCopies | None:
        """These copies less ``paths`` (None where none is left)."""
        drop = set(paths)
        files = tuple(f for f in self.files if f not in drop)
        return replace(self, files=files) if files else None


class CopyRefused(Exception):
    """The server-side copy could not be done; the message is the one-line reason."""


def has_cross_repo_copies() -> bool:
    from huggingface_hub import CommitOperationCopy

    return "src_repo_id" in getattr(CommitOperationCopy, "__dataclass_fields__", {})


def _no_cross_repo_copies() -> str:
    from huggingface_hub import __version__

    return (
        f"uploading every file: huggingface_hub {__version__} has no cross-repo copies "
        f"(huggingface_hub {CROSS_REPO_COPIES} or newer has)"
    )


def no_copy_reason(source: Source, *, output_given: bool, no_server_copy: bool) -> str | None:
    """Why a push of ``source``'s re-initialization cannot copy unchanged files server-side (None: it can)."""
    from .remote import ranged

    if output_given or ranged(source) is None or len(source.weights) > 1:
        return ""  # not a Hub model read by Range, or a full output asked for: nothing to say
    if no_server_copy:
        return f"uploading every file ({opt('no_server_copy', True)})"
    if not has_cross_repo_copies():
        return _no_cross_repo_copies()
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


# --- how a folder was made: its weights' record, and its card's ----------------------------------


@dataclass(frozen=True)
class Made:
    """How an output folder says it was made: the record in its weights, and its card's where that is the same
    record (``origin``: the Hub model and commit it was read from; ``reproduce``: the card's
    ``surgeon reinit`` command, re-quoted, its output named last; ``note``: why the origin is not used)."""

    origin: tuple[str, str] | None = None
    reproduce: str | None = None
    note: str | None = None


def how_made(folder: Path) -> Made:
    """What ``folder``'s records say of how it was made. The record is the weights' own (safetensors
    ``__metadata__``, ONNX ``metadata_props``; a PyTorch file has no slot, so its card keeps it); a card that
    carries another record than its weights is refused: pushed, it would publish a record of other weights.

    Raises:
        CheckpointError: The card's own record is not the record of the folder's weights.
    """
    from ..report.record import parse_record, read_card

    card = folder / "README.md"
    try:
        own = read_card(card)[:1] if card.is_file() else []
    except SurgeonError as exc:  # not surgeon's card: pushed as it is, every file uploaded
        return Made(note=f"every file uploaded: {exc.args[0]}")
    record, where = _weights_record(folder)
    if where is None:  # no weights surgeon reads: the card's record speaks for nothing here
        return Made()
    if own and record is not None and _as_weights_hold(own[0]) != _as_weights_hold(record):
        raise CheckpointError(
            f"{card}: its surgeon record is not the record in the folder's weights ({where}): the card was changed "
            "after surgeon wrote it; restore the card surgeon wrote, or take the record out of it, and push again"
        )
    if own and record is None:
        raise CheckpointError(
            f"{card}: it carries a surgeon record, and the folder's weights hold none ({where}): the card is not "
            "theirs; take the record out of it, and push again"
        )
    if record is None:
        return Made()
    reproduce = _reproduce_command(card) if own else None
    # the origin is the weights' where they name one; else the card's, whose record is theirs (checked above)
    chosen, label = (own[0], str(card)) if own and not _names_origin(record) else (record, f"{folder} ({where})")
    try:
        origin = parse_record(chosen, label).origin
    except SurgeonError as exc:  # not surgeon's record: pushed as it is, every file uploaded
        return Made(reproduce=reproduce, note=f"every file uploaded: {exc.args[0]}")
    return Made(origin, reproduce)


def _weights_record(folder: Path) -> tuple[Any, str | None]:
    """The last surgeon record the folder's weights hold (None: none) and where they keep it; (None, None)
    where the folder holds no weights surgeon reads."""
    from ..open.source import open_source
    from ..report.record import stored_history

    try:
        source = open_source(folder)
        found, where = stored_history(source)
    except SurgeonError:
        return None, None
    return (found[-1] if found else None), where


def _names_origin(record: Any) -> bool:
    return isinstance(record, dict) and "origin" in record


def _as_weights_hold(record: Any) -> Any:
    """The record as both the card and the weights carry it: an ONNX model's record adds the copies its writer
    made, and the card the Hub model it was made from (``origin``)."""
    return {k: v for k, v in record.items() if k not in ("copies", "origin")} if isinstance(record, dict) else record


def _reproduce_command(card: Path) -> str | None:
    """The card's ``surgeon reinit`` command (its Reproduce section), re-quoted; None where it has none that
    ends with the output it wrote (the card is a stranger's text: only a reinit command comes out)."""
    from ..files.bounded import CARD_LIMIT, read_text

    text = read_text(card, what="model card", limit=CARD_LIMIT)
    found = re.search(r"^## Reproduce\s*$.*?^```bash\n(surgeon reinit [^\n]*)\n```", text, re.M | re.S)
    try:
        args = shlex.split(found.group(1)) if found else []
    except ValueError:
        return None
    if args[:2] != ["surgeon", "reinit"] or len(args) < 5 or args[-2] != _OUTPUT_FLAG:
        return None
    return shlex.join(args)


_OUTPUT_FLAG = shell_spelling("output", "out").split()[0]  # how the card's command names the output (-o)


def resume_command(
    folder: Path,
    reproduce: str | None,
    repo_id: str,
    *,
    branch: str | None,
    create_pr: bool,
    private: bool,
    commit_message: str | None,
    no_server_copy: bool = False,
    keep_other_weights: bool = False,
) -> str | None:
    """The ``surgeon reinit`` that makes a push by changes again, staging in ``folder`` (its changes are the same
    bytes; what reached the Hub is not sent again): the card's reproduce command (``reproduce``, see
    :class:`Made`) with the push's own settings in place of its output. None where the card has none."""
    if reproduce is None:
        return None
    q = shlex.quote
    args = shlex.split(reproduce)[:-2]  # the output it wrote: the staging folder takes its place
    flags = [
        shell_spelling("push_to_hub", repo_id),
        *([shell_spelling("push_branch", q(branch))] if branch else []),
        *([shell_spelling("create_pr", "True")] if create_pr else []),
        *([shell_spelling("private", "True")] if private else []),
        *([shell_spelling("commit_message", q(commit_message))] if commit_message else []),
        *([shell_spelling("no_server_copy", "True")] if no_server_copy else []),
        *([shell_spelling("keep_other_weights", "True")] if keep_other_weights else []),
        shell_spelling("staging", q(str(folder))),
        shell_spelling("overwrite", "True"),
    ]
    return " ".join([shlex.join(args), *flags])


def same_reinit(no_server_copy: bool = False) -> str:
    """The resume command where the card does not say it: the reinit that made the staging folder, again."""
    extra = f" and {shell_spelling('no_server_copy', 'True')}" if no_server_copy else ""
    return f"the same `surgeon reinit` again with {shell_spelling('overwrite', 'True')}{extra}"


# --- a staging folder is not a model ----------------------------------------------------------------

_SHARD = re.compile(r"-\d{5}-of-\d{5}\.[^/]+$")  # model-00007-of-00008.safetensors: one of a sharded set


def part_of_a_model(folder: Path, files: list[str], also: Iterable[str] = ()) -> str | None:
    """Why ``folder`` (with ``also``: files copied into the same commit) is part of a model rather than one: an
    index that names weight files it does not hold, or shards without their index. None where it is whole.

    Raises:
        CheckpointError: An index in it cannot be read.
    """
    from ..formats.base import read_index
    from ..formats.registry import FORMATS

    indexes = tuple(s for f in FORMATS if not f.alone for s in f.index_suffixes if s.endswith(".index.json"))
    held = set(files) | set(also)
    for index in sorted(f for f in files if f.endswith(indexes)):
        where = PurePosixPath(index).parent
        shard_suffix = PurePosixPath(index.removesuffix(".index.json")).suffix
        named = {(where / s).as_posix() for s in read_index(folder / index, shard_suffix).values()}
        missing = sorted(named - held)
        if missing:
            return f"its {index} names {_files(len(missing), 'weight file')} it does not hold ({few(missing)})"
    shards = sorted(f for f in files if _SHARD.search(f) and f not in set(also))
    if shards and not any(f.endswith(indexes) for f in held):
        return f"it holds {_files(len(shards), 'shard')} of a sharded model ({few(shards)}) and no index"
    return None


def _files(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def refuse_part(folder: Path, why: str, resume: str | None) -> OptionError:
    """The one-line refusal of a push of a folder that is part of a model (:func:`part_of_a_model`)."""
    how = f"run `{resume}`" if resume else f"run {same_reinit()}, or push the whole output that run makes"
    return OptionError(
        f"{folder} is not a whole model: {why}, as the staging folder of a push by changes does (the rest is "
        f"copied from the source repo); pushed alone it would publish part of a model: to make and push the "
        f"whole, {how}"
    )


# --- copies of an output's unchanged files ----------------------------------------------------------


# What every whole output of a model folder carries where its source has it: a folder made from a Hub model that
# lacks it is part of an output (the staging folder of a push by changes from a one-file model)
_EVERY_OUTPUT_CARRIES = ("config.json",)


@dataclass(frozen=True)
class FromOrigin:
    """What a folder's origin says (:func:`copies_from_origin`): the files to copy from it, a note where none can
    be, and the files it holds that every whole output of it carries and the folder lacks (``lacks``)."""

    copies: ServerCopies | None = None
    note: str | None = None
    lacks: tuple[str, ...] = ()


def copies_from_origin(folder: Path, files: list[str], made: Made, token: str | None) -> FromOrigin:
    """The files of an output folder its origin holds unchanged, to copy server-side rather than upload, and a
    one-line note where none can be (nothing: the folder was not made from a Hub model). Each file's entry
    in the source's answer is kept: the push plans with it and checks the destination against it. The same
    question asks for the files every whole output carries: where the origin holds one the folder lacks, the
    folder is part of an output."""
    from huggingface_hub import HfApi

    if made.origin is None:
        return FromOrigin(note=made.note)
    source, commit = made.origin
    if not has_cross_repo_copies():
        return FromOrigin(note=_no_cross_repo_copies())
    candidates = [f for f in files if f != "README.md"]  # the card is always new
    carried = [f for f in _EVERY_OUTPUT_CARRIES if f not in files]
    api = HfApi(token=token)
    try:  # any failure (an HTTP error, no network, a malformed answer) only means no copies: said, then uploaded
        answer = api.get_paths_info(source, candidates + carried, revision=commit)
        found = {f.path: f for f in map(planned_file, answer) if f is not None}
    except Exception as exc:
        why = f"could not ask {source}@{commit[:12]} about its files ({one_line(exc)})"
        return FromOrigin(note=f"{why}; uploading every file instead")
    same = [f for f in candidates if f in found and same_bytes(folder / f, found[f])]
    planned = {f: found[f] for f in same}
    sizes = {f: (folder / f).stat().st_size for f in same}
    copies = ServerCopies(source, commit, tuple(same), sizes, planned) if same else None
    return FromOrigin(copies, lacks=tuple(f for f in carried if f in found))


def planned_file(entry: Any) -> PlannedFile | None:
    """A Hub tree or paths-info entry as the file it is (None for a folder): its size and oid (sha256 for a large
    file, the git blob id for the others)."""
    from huggingface_hub.hf_api import RepoFile

    if not isinstance(entry, RepoFile):
        return None
    lfs = entry.lfs
    return PlannedFile(entry.path, entry.size, lfs.sha256 if lfs is not None else entry.blob_id, lfs is not None)


def file_oid(path: Path, lfs: bool) -> str:
    """The oid the Hub gives ``path``'s bytes: their sha256 for a large file, their git blob id for the others."""
    import hashlib

    digest = hashlib.sha256() if lfs else hashlib.sha1(b"blob %d\0" % path.stat().st_size)  # git's blob id
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def same_bytes(path: Path, remote: PlannedFile) -> bool:
    """Whether the local file holds the bytes of the Hub's entry; sizes are compared first, so most files that
    differ are not read."""
    return path.stat().st_size == remote.size and file_oid(path, remote.lfs) == remote.oid


def pinned(copies: ServerCopies, token: str | None) -> ServerCopies:
    """``copies`` with each file's entry in the source's answer (asked once, at the pinned commit), where the
    caller gave none: the push plans with it and checks the destination against it.

    Raises:
        CopyRefused: The source cannot be asked, lacks one of the files, or holds one of another size.
    """
    from huggingface_hub import HfApi

    if set(copies.planned) >= set(copies.files):
        return copies
    try:
        answer = HfApi(token=token).get_paths_info(copies.repo_id, list(copies.files), revision=copies.commit)
    except Exception as exc:
        raise refused(exc) from None
    found = {f.path: f for f in map(planned_file, answer) if f is not None}
    wrong = [f for f in copies.files if f not in found or copies.sizes.get(f, found[f].size) != found[f].size]
    if wrong:
        raise CopyRefused(
            f"{copies.repo_id}@{copies.commit[:12]} does not hold {few(wrong)} as read; uploading every file instead"
        )
    return replace(copies, planned={f: found[f] for f in copies.files})


def is_copy_error(exc: BaseException, copies: ServerCopies) -> bool:
    """Whether ``exc`` came from the copy (the duplicate endpoint, or asking the source repo about its files)."""
    from huggingface_hub.errors import HfHubHTTPError

    if type(exc).__name__ == "FileDuplicationError":  # huggingface_hub 1.17+ only
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


def resume_by_reinit(exc: PushError, command: str | None = None) -> PushError:
    """A push by changes that stopped part-way is finished by the reinit that made it, run again (its output
    is the same bytes, and what reached the Hub is not sent again), not by pushing the staging folder alone.
    ``command``: that reinit; by default the error keeps the one the push read from the staging folder's card
    (:func:`resume_command`), or says to run the same reinit again where the card did not say it."""
    from .push_result import finish

    if command is not None:
        exc.follow_up = finish(command)
    elif exc.follow_up is None:
        exc.follow_up = finish(same_reinit())
    return exc


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
