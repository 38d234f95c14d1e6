"""Pushing a folder to the Hub in one commit (repo and branch created when needed), checked as a whole.

Before the commit, a :class:`~surgeon.hub.push_result.PushPlan` states what the destination will hold, file by
file (path, size, oid): the uploads, the server-side copies, and the deletions: files already there that a
loader would read instead of or beside the new weights (another weight layout, a stale index, shards of
another count; :func:`other_weights`), deleted in the same commit unless kept as asked. After the commit, the
new commit's files are compared with the plan (and with the other weights kept); any difference is an error
naming the files and the command that puts them right.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..errors import CheckpointError, HubAuthError, HubError, OptionError, PushError, opt
from ..files.bounded import CARD_LIMIT, read_bytes
from ..files.folder import walk
from ..formats.journal_file import SUFFIX
from ..formats.registry import NOT_WEIGHTS, STATE_DICT_SUFFIXES
from ..open.hub_ids import check_revision, hf_progress, require_repo_id
from ..open.recovery import refuse_journals
from ..open.source import STALE_WEIGHT_SUFFIXES
from ..text.redact import remember
from .copies import (
    CopyRefused,
    Made,
    ServerCopies,
    copies_from_origin,
    file_oid,
    how_made,
    is_copy_error,
    part_of_a_model,
    pinned,
    planned_file,
    refuse_part,
    refused,
    resume_command,
    same_reinit,
)
from .failures import few, one_line, read_error, write_error
from .http import use_policy
from .push_result import (
    PlannedFile,
    PushPlan,
    PushResult,
    as_run,
    not_as_planned,
    partial_push_error,
    push_command,
)

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd, HfApi

# Never uploaded: version control and huggingface_hub's own bookkeeping (same as upload_folder).
_PUSH_SKIP = {".git", ".cache"}
# What the Hub stores as large (LFS) files by its default .gitattributes, besides anything of 10 MiB or more: how
# a dry run, which asks the Hub nothing, predicts which oid is a file's (the real push takes the Hub's answer).
_HUB_LFS_SUFFIXES = (
    *".7z .arrow .bin .bz2 .ckpt .ftz .gz .h5 .joblib .mlmodel .model .msgpack .npy .npz .onnx .ot".split(),
    *".parquet .pb .pickle .pkl .pt .pth .rar .safetensors .tar .tflite .tgz .wasm .xz .zip .zst".split(),
)
_HUB_LFS_SIZE = 10 * 1024 * 1024
# What a training run leaves beside the model it saves (transformers' Trainer, Accelerate, Lightning, loggers): the
# state to resume training, not the model. Left out of a push unless asked for (``include``).
_TRAINING_FOLDERS = ("checkpoint-*", "global_step*", "runs", "logs", "wandb", "mlruns", "lightning_logs",
    "tensorboard", "__pycache__", ".ipynb_checkpoints")  # fmt: skip
_TRAINING_FILES = ("optimizer.*", "scheduler.*", "scaler.*", "rng_state*.pth", "training_args.bin",
    "trainer_state.json", "all_results.json", "train_results.json", "eval_results.json", "*.log",
    "events.out.tfevents.*", "latest")  # fmt: skip


@dataclass(frozen=True)
class PushTarget:
    """Where and how a reinit's output folder is pushed; checked when made, before anything is opened.

    Args:
        repo_id: The Hub model repo, ``org/name`` (created if missing).
        private: Create the repo as private (an existing repo keeps its visibility).
        branch: The branch to commit to, created from main if missing (default: main).
        create_pr: Open a pull request against main instead of committing.
        commit_message: The commit message (default: what was re-initialized).
        token: The Hub token (default: HF_TOKEN or `hf auth login`).
        no_server_copy: Upload every file, even those a Hub source holds unchanged (default: copy those
            server-side from the source's commit; see :mod:`surgeon.hub.copies`).
        staging: The folder a push by changes stages the changed shards and the card in, for a reinit
            given no output (default: ``./NAME-reinit``); where the changes cannot be pushed alone, the
            whole output goes there.
        keep_other_weights: Keep the files of the destination that a loader would read instead of or beside the
            new weights (:func:`other_weights`; default: delete them in the same commit); a note warns of them.

    Raises:
        OptionError: The repo id or the branch is malformed, or ``create_pr`` is given a branch.
    """

    repo_id: str
    private: bool = False
    branch: str | None = None
    create_pr: bool = False
    commit_message: str | None = None
    token: str | None = field(default=None, repr=False)
    no_server_copy: bool = False
    staging: str | Path | None = None
    keep_other_weights: bool = False

    def __post_init__(self) -> None:  # the token is checked by check_token, where the caller chooses
        object.__setattr__(self, "repo_id", _check_target(self.repo_id, self.branch, self.create_pr))

    def check_token(self) -> None:
        """Check that a token to push with is there (the argument, HF_TOKEN or `hf auth login`).

        Raises:
            HubAuthError: There is none.
        """
        _push_token(self.token)

    @classmethod
    def build(cls, repo_id: str | None, **settings: Any) -> PushTarget | None:
        """The push a shell's options ask for: a target, or None where no repo id is given.

        Args:
            repo_id: The Hub model repo, or None for no push.
            **settings: The other fields of :class:`PushTarget` (``private``, ``branch``, ...), as it takes them;
                each may be None or false for its default.

        Returns:
            The target, or None without a repo id.

        Raises:
            OptionError: A push setting is given without a repo id, or the target is malformed.
            TypeError: A setting is not a field of PushTarget.
        """
        unknown = sorted(set(settings) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"PushTarget.build() got an unexpected keyword argument {unknown[0]!r}")
        given = {k: v for k, v in settings.items() if v is not None and v is not False}  # a flag left out
        if repo_id is None:
            if set(given) - {"token"}:
                raise OptionError(
                    f"{opt('private')}, {opt('push_branch')}, {opt('create_pr')} and {opt('commit_message')} "
                    f"go with {opt('push_to_hub', 'org/name')}"
                )
            return None
        return cls(repo_id, **given)

    def push(
        self,
        folder: Path,
        *,
        default_message: str,
        progress: bool = False,
        copies: ServerCopies | None = None,
        server_copy: bool = True,
    ) -> PushResult:
        """Upload ``folder`` here (:func:`push_folder`), with ``default_message`` where no commit message was
        given; ``copies``: files committed as server-side copies besides; ``server_copy=False``: no copies
        from the folder's record either (a copy was refused already)."""
        return push_folder(
            folder,
            self.repo_id,
            private=self.private,
            branch=self.branch,
            create_pr=self.create_pr,
            commit_message=self.commit_message or default_message,
            token=self.token,
            progress=progress,
            copies=copies,
            server_copy=server_copy and not self.no_server_copy,
            keep_other_weights=self.keep_other_weights,
        )

    def would_delete(self, files: Iterable[str]) -> list[str]:
        """The files this push would delete from the destination, were the output to hold ``files``
        (:func:`would_delete`; none where ``keep_other_weights``). Read-only."""
        return would_delete(
            self.repo_id,
            files,
            branch=self.branch,
            create_pr=self.create_pr,
            token=self.token,
            keep_other_weights=self.keep_other_weights,
        )


def _check_target(repo_id: str, branch: str | None, create_pr: bool) -> str:
    """The repo id and branch of a push are well formed; returns the repo id."""
    repo_id = require_repo_id(repo_id, "push target")
    if create_pr and branch not in (None, "main"):
        raise OptionError(
            f"{opt('create_pr', True)} opens a pull request against main; leave out the branch ({opt('branch')} / {opt('push_branch')})"
        )
    check_revision(branch, "the branch to push to")
    if branch is not None and branch.startswith("refs/") and not re.fullmatch(r"refs/pr/\d+", branch):
        raise OptionError(
            f"{branch!r} is not a branch to push to: give a branch name (or refs/pr/N to add to a pull request)"
        )
    return repo_id


def _push_token(token: str | None) -> str:
    from huggingface_hub import get_token

    found = token or get_token()
    remember(found)
    if not found:
        raise HubAuthError("pushing to the Hub needs a token with write access: set HF_TOKEN or run `hf auth login`")
    return found


@dataclass(frozen=True)
class _Push:
    """One push's settings, and the commands that finish it (``retry``) or put its files right (``fix``)."""

    folder: Path
    repo_id: str
    private: bool
    branch: str | None
    create_pr: bool
    commit_message: str | None
    commit_description: str | None
    token: str | None
    progress: bool
    keep_other_weights: bool
    retry: str
    fix: str
    skipped: tuple[str, ...] = ()  # the folder's files the selection leaves out
    skipped_bytes: int = 0


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    branch: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    commit_description: str | None = None,
    token: str | None = None,
    progress: bool = False,
    dry_run: bool = False,
    copies: ServerCopies | None = None,
    server_copy: bool = True,
    keep_other_weights: bool = False,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> PushResult:
    """Upload the model files of ``folder`` to the model repo ``repo_id`` in one commit, checked before and after.

    A folder made by ``surgeon reinit`` from a Hub model says so in its record: the files it holds unchanged
    are copied server-side from that model's commit rather than uploaded (``server_copy=False``: every file
    uploaded); where the copy cannot be done, every file is uploaded and a note says why. The record is the
    one in the folder's weights: a card that carries another is refused. ``copies``: files for the same commit
    that are not in ``folder``, copied server-side from another repo at a pinned commit (a push by changes,
    whose staging folder holds the rest); where the Hub refuses them, :class:`~surgeon.hub.copies.CopyRefused`
    is raised before anything is committed. A folder that is part of a model (a staging folder alone) is refused.

    By default a push sends the files a model needs (weights, index, config, generation config, tokenizer files,
    card, sentence-transformers module folders, ...) and leaves out what training leaves beside them: Trainer
    checkpoints (``checkpoint-*``), optimizer, scheduler and RNG state, ``training_args.bin``, logs (``runs/``,
    ``*.log``, ``trainer_state.json``); a note names what was left out and its size. ``include`` / ``exclude``:
    globs on the folder's relative paths, as ``hf upload`` takes them (``*`` matches ``/`` too; a pattern ending
    in ``/`` is a folder); ``include`` replaces the default selection.

    Files of the destination that a loader would read instead of or beside the new weights are deleted in the
    same commit (``keep_other_weights=True``: kept, with a note that warns of them). After the commit, what the
    destination holds is compared with the plan (:class:`~surgeon.hub.push_result.PushPlan`).

    Large files are uploaded before the commit, one at a time, so a failure can say which reached the Hub;
    running the same push again uploads only the rest (the Hub already holds the others) and commits.

    Args:
        folder: The folder to upload (e.g. an output of ``surgeon reinit``); links out of it are refused.
        repo_id: The Hub model repo, ``org/name``; created (``private`` when asked) if missing.
        private: Create the repo as private.
        branch: The branch to commit to, created from main if missing (default: main).
        create_pr: Open a pull request against main instead of committing.
        commit_message: The commit message (default: ``Upload FOLDER with surgeon VERSION``).
        commit_description: The commit's longer description.
        token: The Hub token (default: HF_TOKEN or `hf auth login`).
        progress: Show the Hub client's progress bars.
        dry_run: Make every check, then return the plan: the files that would be uploaded, copied and deleted;
            send nothing (the destination and a Hub source are asked read-only questions).
        copies: Files not in the folder, copied server-side into the same commit.
        server_copy: Copy what the folder's record names as unchanged from a Hub model, server-side.
        keep_other_weights: Keep the destination's other weights (default: delete them in the same commit).
        include: Push only the files matching one of these globs (default: the model's files).
        exclude: Leave out the files matching one of these globs.

    Returns:
        What was pushed (or, for a dry run, what would be).

    Raises:
        OptionError: The folder, the repo id or the branch cannot be pushed, or the folder is part of a model.
        CheckpointError: The folder's card carries another record than its weights.
        HubError: The Hub refused or failed (PushError: part-way, saying what arrived; or the commit left the
            destination other than planned, naming the files).
    """
    use_policy()  # every request of the push (a dry run's questions too) runs under the Hub HTTP policy
    folder = Path(folder)
    if folder.is_dir():  # a half-patched folder (an in-place run's journal beside its weights) is never offered
        refuse_journals(folder, unfinished=True)
    repo_id = _check_target(repo_id, branch, create_pr)
    files, left_out = _files_to_push(folder)
    files, skipped = select_files(files, include, exclude)
    if not files:
        raise OptionError(f"no file of {folder} is left to push by {_selection_words(include, exclude)}")
    skipped_bytes = sum((folder / f).stat().st_size for f in skipped)
    if skipped:
        left_out = [_left_out_note(skipped, skipped_bytes, include), *left_out]
    made = how_made(folder)
    commands = _commands(folder, repo_id, made, staged=copies is not None, branch=branch, create_pr=create_pr,
        private=private, commit_message=commit_message, server_copy=server_copy, keep=keep_other_weights,
        include=include, exclude=exclude)  # fmt: skip
    partial = part_of_a_model(folder, files, copies.files if copies is not None else ())
    if partial is not None:
        raise refuse_part(folder, partial, commands.resume)
    own_copies = copies is None and server_copy
    if own_copies:  # read-only questions to the Hub: a dry run asks them too
        origin = copies_from_origin(folder, files, made, token)
        if origin.lacks and made.origin is not None:
            held = f"{made.origin[0]}@{made.origin[1][:12]}"
            why = f"it holds no {origin.lacks[0]}, which {held} holds and every whole output of it carries"
            raise refuse_part(folder, why, commands.resume)
        copies = origin.copies
        left_out += [origin.note] if origin.note else []
    push = _Push(folder, repo_id, private, branch, create_pr, commit_message, commit_description, token, progress,
        keep_other_weights, commands.retry, commands.fix, tuple(skipped), skipped_bytes)  # fmt: skip
    if dry_run:
        return _dry_run(push, files, left_out, copies, own_copies)
    try:
        try:
            return _push(push, files, left_out, copies, own_copies)
        except CopyRefused as why:  # nothing was committed: upload the rest too (what was sent is not sent again)
            if not own_copies:  # the caller's copies: the caller decides what to upload instead
                raise
            return _push(push, files, [*left_out, str(why)], None, False)
    except HubError as exc:
        if exc.follow_up is None:  # a push stopped part-way names its own command, with what reached the Hub
            exc.follow_up = f"retry with {as_run(push.retry)}"
        raise


@dataclass(frozen=True)
class _Commands:
    """The commands a push's errors end with: ``retry`` (the same push again), ``fix`` (every file uploaded,
    nothing copied: what puts right a destination the commit left other than planned) and ``resume`` (for a
    folder made by a reinit whose card says how: that reinit, pushing by changes again; None where unknown)."""

    retry: str
    fix: str
    resume: str | None


def _commands(
    folder: Path,
    repo_id: str,
    made: Made,
    *,
    staged: bool,
    branch: str | None,
    create_pr: bool,
    private: bool,
    commit_message: str | None,
    server_copy: bool,
    keep: bool,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> _Commands:
    """A push's commands. A staging folder (``staged``: the caller copies the rest) is never pushed alone: its
    commands are the reinit's that made it (or, where its card does not say, words saying to run it again)."""
    settings: dict[str, Any] = {"branch": branch, "create_pr": create_pr, "private": private,
        "commit_message": commit_message, "keep_other_weights": keep}  # fmt: skip
    resume = resume_command(folder, made.reproduce, repo_id, **settings)
    if staged:
        fix = resume_command(folder, made.reproduce, repo_id, no_server_copy=True, **settings)
        return _Commands(resume or same_reinit(), fix or same_reinit(no_server_copy=True), resume)
    retry = push_command(folder, repo_id, no_server_copy=not server_copy, include=include, exclude=exclude, **settings)
    fix = push_command(folder, repo_id, no_server_copy=True, include=include, exclude=exclude, **settings)
    return _Commands(retry, fix, resume)


NO_TOKEN_YET = "no Hub token found: the real push needs one with write access (HF_TOKEN or `hf auth login`)"


def has_token(token: str | None = None) -> bool:
    """Whether a token to push with is there (the argument, HF_TOKEN or `hf auth login`); nothing is sent."""
    from huggingface_hub import get_token

    return bool(token or get_token())


def _dry_run(
    push: _Push, files: list[str], left_out: list[str], copies: ServerCopies | None, own_copies: bool
) -> PushResult:
    """The plan, made as the push would make it from read-only questions; nothing is sent, so no token is needed
    (the result says whether the real push has one). Which files are large is the Hub's default here."""
    from huggingface_hub import HfApi, constants

    notes = list(left_out)
    api = HfApi(token=push.token)
    try:
        there = read_destination(api, push.repo_id, push.branch, push.create_pr)
    except Exception as exc:  # the real push reads it again, with its token
        there = Destination(None, {})
        notes.append(
            f"could not read what {push.repo_id} holds ({one_line(exc)}): the real push reads it before it commits"
        )
    if copies is not None and own_copies:
        copies = _not_there(copies, there)
    elif copies is not None:
        try:
            copies = pinned(copies, push.token)
        except CopyRefused as why:
            notes.append(str(why))
            copies = None
    rest = [f for f in files if copies is None or f not in copies.files]
    uploads = []
    for f in rest:
        path = push.folder / f
        size = path.stat().st_size
        lfs = there.files[f].lfs if f in there.files else (size >= _HUB_LFS_SIZE or f.endswith(_HUB_LFS_SUFFIXES))
        uploads.append(PlannedFile(f, size, file_oid(path, lfs), lfs))
    plan = _plan(push, there, uploads, copies, predicted=True)
    notes += _kept_note(plan) + ([] if has_token(push.token) else [NO_TOKEN_YET])
    url = f"{constants.ENDPOINT.rstrip('/')}/{push.repo_id}"
    return PushResult(
        push.repo_id, url, push.branch or "main", False, "", "", None, rest, [], [], sum(u.size for u in uploads),
        notes, dry_run=True, deleted=[f.path for f in plan.deletions], kept=list(plan.kept), plan=plan,
        left_out=list(push.skipped), left_out_bytes=push.skipped_bytes, **_copied(copies),
    )  # fmt: skip


def _push(
    push: _Push, files: list[str], left_out: list[str], copies: ServerCopies | None, own_copies: bool
) -> PushResult:
    """One commit of the folder's files, ``copies`` and the deletions of the plan; then the destination checked
    against the plan."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    from .._compat import upload_state

    token = _push_token(push.token)
    api = HfApi(token=token)
    created, notes = _prepare_repo(api, push.repo_id, token, private=push.private, branch=push.branch,
        create_pr=push.create_pr)  # fmt: skip
    notes = left_out + notes
    try:
        there = read_destination(api, push.repo_id, push.branch, push.create_pr)
    except Exception as exc:
        raise write_error(exc, push.repo_id, token, "reading what it holds") from None
    if copies is not None:  # the folder's own copies: those there already are uploads the Hub skips
        copies = _not_there(copies, there) if own_copies else pinned(copies, token)
    rest = [f for f in files if copies is None or f not in copies.files]
    ops = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(push.folder / f)) for f in rest]
    with hf_progress(push.progress):
        done = _preupload(api, push.repo_id, token, ops, branch=push.branch, create_pr=push.create_pr, retry=push.retry)
        states = {op.path_in_repo: upload_state(op) for op in ops}
        uploads = [PlannedFile(op.path_in_repo, op.upload_info.size, str(states[op.path_in_repo][2]),
            states[op.path_in_repo][0] == "lfs") for op in ops]  # fmt: skip
        plan = _plan(push, there, uploads, copies)
        deletions = [CommitOperationDelete(path_in_repo=f.path) for f in plan.deletions]
        message = push.commit_message or f"Upload {push.folder.resolve().name} with surgeon {__version__}"
        try:
            info = api.create_commit(
                push.repo_id,
                [*ops, *(copies.operations() if copies else []), *deletions],
                commit_message=message,
                commit_description=push.commit_description,
                revision=push.branch,
                create_pr=push.create_pr,
            )
        except Exception as exc:
            if copies is not None and is_copy_error(exc, copies):
                raise refused(exc) from None
            raise partial_push_error(exc, push.repo_id, token, ops, len(ops), done, push.retry) from None
    _check_pushed(api, plan, info.oid, info.commit_url, push)
    unchanged = [f for f, (_, remote, local) in states.items() if remote is not None and remote == local]
    large = [f for f, (mode, _, _) in states.items() if mode == "lfs" and f not in unchanged]
    return PushResult(
        push.repo_id, f"{api.endpoint}/{push.repo_id}", push.branch or "main", created, info.oid, info.commit_url,
        info.pr_url, rest, large, unchanged, sum(u.size for u in uploads if u.path not in unchanged),
        notes + _kept_note(plan), deleted=[f.path for f in plan.deletions], kept=list(plan.kept), plan=plan,
        left_out=list(push.skipped), left_out_bytes=push.skipped_bytes, **_copied(copies),
    )  # fmt: skip


def _plan(
    push: _Push, there: Destination, uploads: list[PlannedFile], copies: ServerCopies | None, *, predicted: bool = False
) -> PushPlan:
    """What the destination will hold: the uploads and copies, without the other weights it holds now."""
    copied = tuple(copies.planned[f] for f in copies.files) if copies is not None else ()
    other = other_weights([f.path for f in (*uploads, *copied)], there.files)
    return PushPlan(
        push.repo_id, push.branch or "main", there.commit, tuple(uploads), copied,
        f"{copies.repo_id}@{copies.commit}" if copies is not None else None,
        deletions=() if push.keep_other_weights else tuple(there.files[f] for f in other),
        kept=tuple(other) if push.keep_other_weights else (), predicted=predicted,
    )  # fmt: skip


def _kept_note(plan: PushPlan) -> list[str]:
    if not plan.kept:
        return []
    return [
        f"kept {few(list(plan.kept))} in {plan.repo_id} as asked ({opt('keep_other_weights', True)}): other weights "
        "than the ones pushed, which a loader may read instead of them or beside them"
    ]


def _not_there(copies: ServerCopies, there: Destination) -> ServerCopies | None:
    """The copies less the files the destination holds with the same bytes already: uploaded instead, they send
    nothing (copied again, they would make a commit that changes nothing)."""
    return copies.without(f for f in copies.files if there.files.get(f) == copies.planned.get(f))


def _check_pushed(api: HfApi, plan: PushPlan, commit: str, commit_url: str, push: _Push) -> None:
    """The new commit holds what the plan says, file by file (size and oid), none of what it deletes, and no
    other weights but those kept (a commit made between the plan and this one could have added some).

    Raises:
        PushError: It does not (the files and the command that puts them right), or cannot be read back.
    """
    try:
        listing = api.list_repo_tree(plan.repo_id, revision=commit, recursive=True)
        found = {f.path: f for f in map(planned_file, listing) if f is not None}
    except Exception as exc:
        error = PushError(
            f"pushed to {plan.repo_id} ({commit_url}), but could not read back what it holds to check it "
            f"({one_line(write_error(exc, plan.repo_id, push.token or '', 'reading back'))})"
        )
        error.follow_up = f"run {as_run(push.retry)} to check it again (what is there is not sent again)"
        raise error from None
    wrong = plan.differences(found)
    wrong += [f"{f} is there, other weights" for f in other_weights(plan.holds, found) if f not in plan.kept]
    if wrong:
        raise not_as_planned(plan, commit_url, wrong, push.fix)


@dataclass(frozen=True)
class Destination:
    """What a push's destination holds: the commit it would go on top of (None: no such repo yet), and its
    files by path."""

    commit: str | None
    files: Mapping[str, PlannedFile]


def read_destination(api: HfApi, repo_id: str, branch: str | None, create_pr: bool) -> Destination:
    """What ``repo_id`` holds where a push would commit: ``branch`` (a new one starts from main), or main for a
    pull request. Read-only; a repo that does not exist (or that the token cannot see) holds nothing."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    revision = "main" if create_pr or branch is None else branch
    try:
        try:
            commit = api.repo_info(repo_id, revision=revision).sha
        except RevisionNotFoundError:
            if revision.startswith("refs/"):
                raise
            commit = api.repo_info(repo_id).sha  # a branch not there yet is made from main
    except GatedRepoError:
        raise
    except RepositoryNotFoundError:
        return Destination(None, {})
    assert commit is not None
    listing = api.list_repo_tree(repo_id, revision=commit, recursive=True)
    return Destination(commit, {f.path: f for f in map(planned_file, listing) if f is not None})


def is_weight_file(path: str) -> bool:
    """Whether a loader reads ``path`` as weights (or their index), by its name: the state-dict formats and their
    indexes, and the exports surgeon leaves out of its outputs (ONNX, GGUF, TF, Flax, ...)."""
    name = PurePosixPath(path).name
    if name in NOT_WEIGHTS or name.startswith(("rng_state", "optimizer", "scheduler")):
        return False
    return name.endswith(STATE_DICT_SUFFIXES + STALE_WEIGHT_SUFFIXES)


def other_weights(pushed: Iterable[str], there: Iterable[str]) -> list[str]:
    """The files of a destination (``there``) that a loader would read instead of or beside the weights among
    ``pushed``: weight files and indexes, in a folder where the push puts weights, that the push does not write.

    transformers reads ``model.safetensors`` before ``model.safetensors.index.json``, and safetensors before
    ``pytorch_model*.bin``: a single file left beside new shards is read instead of them, an index left beside
    a new single file names shards of other weights, and shards of another count stay behind an index that
    no longer names them. A ``pytorch_model*.bin`` beside new safetensors is read by whoever asks for it
    (``use_safetensors=False``, other tools), with the old weights: it is another layout too. Other folders
    (``onnx/``, a variant's) are left alone.
    """
    pushed = set(pushed)
    folders = {PurePosixPath(f).parent for f in pushed if is_weight_file(f)}
    return sorted(f for f in there if f not in pushed and PurePosixPath(f).parent in folders and is_weight_file(f))


def would_delete(
    repo_id: str,
    files: Iterable[str],
    *,
    branch: str | None = None,
    create_pr: bool = False,
    token: str | None = None,
    keep_other_weights: bool = False,
) -> list[str]:
    """The files of ``repo_id`` (at ``branch``, or main for a pull request) a push of ``files`` would delete:
    its other weights (:func:`other_weights`; none where ``keep_other_weights``). Read-only, for a dry run:
    [] where the repo does not exist yet (or the token cannot see it).

    Raises:
        OptionError: The repo id or the branch is malformed.
        HubError: The Hub cannot be asked (one line).
    """
    from huggingface_hub import HfApi

    repo_id = _check_target(repo_id, branch, create_pr)
    try:
        there = read_destination(HfApi(token=token), repo_id, branch, create_pr)
    except Exception as exc:
        raise read_error(exc, repo_id, branch, False) from None
    return [] if keep_other_weights else other_weights(files, there.files)


def _copied(copies: ServerCopies | None) -> dict[str, Any]:
    """A result's fields on the server-side copies: the files, where from, and their bytes (what the Hub
    duplicates instead of receiving)."""
    if copies is None:
        return {}
    size = sum(copies.sizes.get(f, 0) for f in copies.files)
    return {"copied": list(copies.files), "copied_from": f"{copies.repo_id}@{copies.commit}", "copied_bytes": size}


def _files_to_push(folder: Path) -> tuple[list[str], list[str]]:
    """The folder's files and a note on what was left out; refused if one is a link out of the folder, an
    in-place run's undo journal, or the Hub would refuse its README.md."""
    files, left_out = _folder_files(folder)
    journal = next((f for f in files if f.endswith((SUFFIX, SUFFIX + ".tmp"))), None)
    if journal is not None:
        raise OptionError(
            f"{folder / journal} is an in-place run's undo journal, never pushed; run `surgeon recover` on its checkpoint first"
        )
    _check_card(folder)
    return files, left_out


def is_training_file(path: str) -> bool:
    """Whether ``path`` (relative, ``/``-separated) is something training leaves beside a model rather than part of
    it: in a checkpoint or log folder, or optimizer, scheduler and RNG state, training arguments, logs."""
    parts = PurePosixPath(path).parts
    if any(fnmatch.fnmatchcase(p, g) for p in parts[:-1] for g in _TRAINING_FOLDERS):
        return True
    return any(fnmatch.fnmatchcase(parts[-1], g) for g in _TRAINING_FILES)


def _matches(path: str, patterns: Sequence[str]) -> bool:
    """Whether ``path`` matches a glob as ``hf upload`` reads them: ``*`` matches ``/`` too, ``dir/`` is ``dir/*``."""
    return any(fnmatch.fnmatch(path, p + "*" if p.endswith("/") else p) for p in patterns)


def select_files(
    files: Sequence[str], include: Sequence[str] | None = None, exclude: Sequence[str] | None = None
) -> tuple[list[str], list[str]]:
    """(pushed, left out): ``files`` (relative paths) split by the selection of a push. Without ``include``, the
    model's files (not :func:`is_training_file`); with it, those matching it; less those matching ``exclude``."""
    pushed: list[str] = []
    left: list[str] = []
    for f in files:
        wanted = _matches(f, include) if include else not is_training_file(f)
        (pushed if wanted and not (exclude and _matches(f, exclude)) else left).append(f)
    return pushed, left


def _selection_words(include: Sequence[str] | None, exclude: Sequence[str] | None) -> str:
    words = [f"{opt('include', ' '.join(include))}" if include else "the default selection (the model's files)"]
    return " and ".join(words + ([opt("exclude", " ".join(exclude))] if exclude else []))


def _left_out_note(skipped: list[str], size: int, include: Sequence[str] | None) -> str:
    """One line: what the selection left out (folders counted as one), its size, and how to push it anyway."""
    from ..text.sizes import fmt_bytes

    grouped: dict[str, int] = {}
    for f in skipped:
        top = f.split("/", 1)[0] + "/" if "/" in f else f
        grouped[top] = grouped.get(top, 0) + 1
    names = [f"{k} ({n} files)" if k.endswith("/") else k for k, n in grouped.items()]
    why = "not asked for" if include else "training state and logs, not the model"
    return (
        f"left out {len(skipped)} files ({fmt_bytes(size)}), {why}: {few(names, 4)} "
        f"(to push them: {opt('include', 'GLOB')})"
    )


def _prepare_repo(
    api: HfApi, repo_id: str, token: str, *, private: bool, branch: str | None, create_pr: bool
) -> tuple[bool, list[str]]:
    """Create the repo and the branch where they do not exist: (whether the repo was created, notes)."""
    try:
        created, notes = _ensure_repo(api, repo_id, private=private)
        if branch is not None and not create_pr and not branch.startswith("refs/pr/"):
            api.create_branch(repo_id, branch=branch, exist_ok=True)
    except Exception as exc:
        raise write_error(exc, repo_id, token, "prepare") from None
    return created, notes


def _preupload(
    api: HfApi,
    repo_id: str,
    token: str,
    ops: list[CommitOperationAdd],
    *,
    branch: str | None,
    create_pr: bool,
    retry: str,
) -> list[str]:
    """Upload the large files one at a time before the commit; returns those sent through the large-file path."""
    from .._compat import upload_state

    done: list[str] = []
    for i, op in enumerate(ops):
        try:
            api.preupload_lfs_files(repo_id, additions=[op], revision=branch, create_pr=create_pr)
        except Exception as exc:
            raise partial_push_error(exc, repo_id, token, ops, i, done, retry) from None
        if upload_state(op)[0] == "lfs":
            done.append(op.path_in_repo)
    return done


def _folder_files(folder: Path) -> tuple[list[str], list[str]]:
    """What a push uploads: the folder's own files (a link out of it is refused, see folder_files), and a note
    on what it leaves out (links to folders, FIFOs and the like)."""
    if not folder.is_dir():
        what = "a file" if folder.is_file() else "not there"
        raise OptionError(f"{folder} is {what}: surgeon push uploads a model folder (the output of surgeon reinit)")
    found = walk(folder, prune=lambda rel, is_folder: (is_folder and rel.name in _PUSH_SKIP) or rel.name == ".DS_Store")
    if not found.files:
        raise OptionError(f"{folder} is empty: nothing to push")
    return found.files, found.note()


def _check_card(folder: Path) -> None:
    """A README.md the Hub would refuse (bad YAML front matter) fails here, before any upload."""
    readme = folder / "README.md"
    if not readme.is_file():
        return
    from huggingface_hub import ModelCard

    raw = read_bytes(readme, what="model card", limit=CARD_LIMIT)
    try:
        ModelCard(raw.decode("utf-8"))
    except Exception as exc:
        raise CheckpointError(
            f"{readme}: the model card's metadata does not parse ({one_line(exc)}); fix or remove it before pushing"
        ) from None


def _ensure_repo(api: HfApi, repo_id: str, *, private: bool) -> tuple[bool, list[str]]:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        info = api.repo_info(repo_id)
    except GatedRepoError:
        return False, []
    except RepositoryNotFoundError:
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        return True, [f"created the {'private ' if private else ''}model repo {repo_id}"]
    notes = []
    if private and info.private is False:
        notes.append(
            f"{repo_id} already exists and is public: {opt('private', True)} only applies to a repo surgeon creates"
        )
    return False, notes
