"""Pushing a folder to the Hub in one commit (repo and branch created when needed)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..errors import CheckpointError, HubAuthError, HubError, OptionError, PushError, opt
from ..files.bounded import CARD_LIMIT, read_bytes
from ..files.folder import walk
from ..formats.journal_file import SUFFIX
from ..open.hub_ids import check_revision, hf_progress, require_repo_id
from ..open.recovery import refuse_journals
from ..text.redact import remember
from .copies import CopyRefused, ServerCopies, copies_from_record, is_copy_error, refused
from .failures import one_line, write_error
from .http import use_policy
from .push_result import PushResult, partial_push_error, push_command

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd, HfApi

# Never uploaded: version control and huggingface_hub's own bookkeeping (same as upload_folder).
_PUSH_SKIP = {".git", ".cache"}


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
) -> PushResult:
    """Upload every file of ``folder`` to the model repo ``repo_id`` in one commit.

    A folder made by ``surgeon reinit`` from a Hub model names that model and commit in its record: the files
    it holds unchanged are copied server-side from there rather than uploaded (``server_copy=False``: every
    file uploaded); where the copy cannot be done, every file is uploaded and a note says why.
    ``copies``: files for the same commit that are not in ``folder``, copied server-side from another repo at a
    pinned commit (``copies``); where the Hub refuses them, :class:`~surgeon.hub.copies.CopyRefused` is
    raised before anything is committed.

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
        dry_run: Make every check, then return the files that would be uploaded; send nothing.
        copies: Files not in the folder, copied server-side into the same commit.
        server_copy: Copy what the folder's record names as unchanged from a Hub model, server-side.

    Returns:
        What was pushed (or, for a dry run, what would be).

    Raises:
        OptionError: The folder, the repo id or the branch cannot be pushed.
        HubError: The Hub refused or failed (PushError: part-way, saying what arrived).
    """
    from huggingface_hub import constants

    use_policy()  # every request of the push (a dry run's questions too) runs under the Hub HTTP policy
    folder = Path(folder)
    if folder.is_dir():  # a half-patched folder (an in-place run's journal beside its weights) is never offered
        refuse_journals(folder, unfinished=True)
    repo_id = _check_target(repo_id, branch, create_pr)
    files, left_out = _files_to_push(folder)
    own_copies = copies is None and server_copy
    if own_copies:  # read-only questions to the Hub: a dry run asks them too
        copies, why = copies_from_record(folder, files, token, repo_id=repo_id, revision=branch)
        left_out += [why] if why else []
    rest = [f for f in files if copies is None or f not in copies.files]  # what is uploaded
    if dry_run:  # nothing is sent, so no token is needed: the result says whether the real push has one
        url, size = f"{constants.ENDPOINT.rstrip('/')}/{repo_id}", sum((folder / f).stat().st_size for f in rest)
        notes = left_out + ([] if has_token(token) else [NO_TOKEN_YET])
        return PushResult(
            repo_id, url, branch or "main", False, "", "", None, rest, [], [], size, notes, dry_run=True,
            **_copied(copies),
        )  # fmt: skip
    retry = push_command(
        folder, repo_id, branch=branch, create_pr=create_pr, private=private, commit_message=commit_message,
        no_server_copy=not server_copy,
    )  # fmt: skip
    where = (private, branch, create_pr, commit_message, commit_description, token, progress, retry)
    try:
        try:
            return _push(folder, repo_id, rest, left_out, *where, copies)
        except CopyRefused as why:  # nothing was committed: upload the rest too (what was sent is not sent again)
            if not own_copies:  # the caller's copies: the caller decides what to upload instead
                raise
            return _push(folder, repo_id, files, [*left_out, str(why)], *where, None)
    except HubError as exc:
        if not isinstance(exc, PushError):  # a partial push names its own command, with what reached the Hub
            exc.follow_up = f"retry with `{retry}`"
        raise


NO_TOKEN_YET = "no Hub token found: the real push needs one with write access (HF_TOKEN or `hf auth login`)"


def has_token(token: str | None = None) -> bool:
    """Whether a token to push with is there (the argument, HF_TOKEN or `hf auth login`); nothing is sent."""
    from huggingface_hub import get_token

    return bool(token or get_token())


def _push(
    folder: Path,
    repo_id: str,
    files: list[str],
    left_out: list[str],
    private: bool,
    branch: str | None,
    create_pr: bool,
    commit_message: str | None,
    commit_description: str | None,
    token: str | None,
    progress: bool,
    retry: str,
    copies: ServerCopies | None,
) -> PushResult:
    """One commit of ``files`` (and ``copies``); ``retry``: the ``surgeon push`` command that finishes it, for the
    error of a push stopped part-way."""
    from huggingface_hub import CommitOperationAdd, HfApi

    token = _push_token(token)
    api = HfApi(token=token)
    created, notes = _prepare_repo(api, repo_id, token, private=private, branch=branch, create_pr=create_pr)
    notes = left_out + notes
    ops = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(folder / f)) for f in files]
    with hf_progress(progress):
        done = _preupload(api, repo_id, token, ops, branch=branch, create_pr=create_pr, retry=retry)
        message = commit_message or f"Upload {folder.resolve().name} with surgeon {__version__}"
        try:
            info = api.create_commit(
                repo_id,
                [*ops, *(copies.operations() if copies else [])],
                commit_message=message,
                commit_description=commit_description,
                revision=branch,
                create_pr=create_pr,
            )
        except Exception as exc:
            if copies is not None and is_copy_error(exc, copies):
                raise refused(exc) from None
            raise partial_push_error(exc, repo_id, token, ops, len(ops), done, retry) from None
    unchanged = [op.path_in_repo for op in ops if op._remote_oid is not None and op._remote_oid == op._local_oid]
    large = [op.path_in_repo for op in ops if op._upload_mode == "lfs" and op.path_in_repo not in unchanged]
    sent = sum((folder / f).stat().st_size for f in files if f not in unchanged)
    url = f"{api.endpoint}/{repo_id}"
    return PushResult(
        repo_id,
        url,
        branch or "main",
        created,
        info.oid,
        info.commit_url,
        info.pr_url,
        files,
        large,
        unchanged,
        sent,
        notes,
        **_copied(copies),
    )


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
    done: list[str] = []
    for i, op in enumerate(ops):
        try:
            api.preupload_lfs_files(repo_id, additions=[op], revision=branch, create_pr=create_pr)
        except Exception as exc:
            raise partial_push_error(exc, repo_id, token, ops, i, done, retry) from None
        if op._upload_mode == "lfs":
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
