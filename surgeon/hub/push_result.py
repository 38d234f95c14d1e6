"""What a push says it will do and did: the plan (what the destination will hold, file by file, and what it
deletes), the result of a push that finished (or of a dry run), and the errors of one that stopped part-way
or left the destination other than planned, each naming the command that finishes the job."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import HubAccessError, HubAuthError, HubError, PushError, shell_spelling
from .failures import few, write_error

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd


@dataclass(frozen=True)
class PlannedFile:
    """One file as the destination holds it (or will): its path, size and oid (the sha256 of a large file, the
    git blob id of the others), and whether it is a large (LFS) file."""

    path: str
    size: int
    oid: str
    lfs: bool

    def to_dict(self) -> dict:
        return {"path": self.path, "size": self.size, "oid": self.oid, "lfs": self.lfs}


@dataclass(frozen=True)
class PushPlan:
    """What a push will leave in ``repo_id`` on ``revision``, decided before it commits and checked after.

    Attributes:
        repo_id: The repo pushed to.
        revision: The branch (or ``refs/pr/N``) committed to; a pull request's base for a new one.
        base: The commit the plan was made against (None: the repo does not exist yet).
        uploads: The folder's files, as uploaded (those already there unchanged are sent no bytes).
        copies: The files copied server-side from ``copied_from``, as the answer they were decided from says.
        copied_from: ``org/name@commit``, where there are copies.
        deletions: Files the destination holds that a loader would read instead of or beside the new weights
            (another weight layout, a stale index, shards of another count), deleted in the same commit.
        kept: Those files, kept as asked (``keep_other_weights``): a warning names them.
        predicted: A dry run's plan: which files are large (and so which oid is theirs) is the Hub's default,
            not its answer.
    """

    repo_id: str
    revision: str
    base: str | None
    uploads: tuple[PlannedFile, ...]
    copies: tuple[PlannedFile, ...] = ()
    copied_from: str | None = None
    deletions: tuple[PlannedFile, ...] = ()
    kept: tuple[str, ...] = ()
    predicted: bool = False

    @property
    def holds(self) -> dict[str, PlannedFile]:
        """The files the push writes, by path: what the destination holds for them after the commit."""
        return {f.path: f for f in (*self.uploads, *self.copies)}

    def differences(self, found: Mapping[str, PlannedFile]) -> list[str]:
        """How ``found`` (the destination's files after the commit, by path) differs from the plan, one item
        per file (empty: it holds what was planned)."""
        wrong = []
        for path, want in self.holds.items():
            got = found.get(path)
            if got is None:
                wrong.append(f"{path} is missing")
            elif (got.size, got.oid) != (want.size, want.oid):
                wrong.append(
                    f"{path} holds {got.size:,} bytes with oid {got.oid[:12]}, not {want.size:,} with {want.oid[:12]}"
                )
        wrong += [f"{f.path} is still there (it was to be deleted)" for f in self.deletions if f.path in found]
        return wrong

    def to_dict(self) -> dict:
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "base": self.base,
            "uploads": [f.to_dict() for f in self.uploads],
            "copies": [f.to_dict() for f in self.copies],
            "copied_from": self.copied_from,
            "deletions": [f.to_dict() for f in self.deletions],
            "kept": list(self.kept),
            "predicted": self.predicted,
        }


@dataclass(frozen=True)
class PushResult:
    """What a push did: one commit (or pull request) with these files.

    Attributes:
        repo_id: The repo pushed to.
        repo_url: Its URL.
        revision: The branch committed to ("main" by default).
        created_repo: Whether the push created the repo.
        commit: The commit's id ("" for a dry run).
        commit_url: The commit's URL.
        pr_url: The pull request's URL, where one was opened.
        files: Every file of the push, as uploaded (or as a dry run would upload them).
        large_files: Those sent through the large-file path (LFS / Xet).
        unchanged: Those already on the Hub with the same content, left out of the commit.
        bytes: The bytes sent (the files uploaded; those already on the Hub are not sent again).
        notes: What the push says besides (a repo created, files left out, other weights kept).
        dry_run: Nothing was sent.
        copied: Files committed as server-side copies of ``copied_from`` (``org/name@commit``), not uploaded.
        copied_from: The repo and pinned commit they were copied from.
        copied_bytes: Their bytes.
        deleted: Files of the destination deleted in the same commit: other weights a loader would read
            instead of or beside the new ones (for a dry run: those it would delete).
        kept: Such files kept, as asked (``keep_other_weights``).
        plan: What the destination was to hold, file by file; after a push, it was checked to hold it.
        left_out: The folder's files the push left out (training state and logs by default; see ``include`` and
            ``exclude`` of :func:`~surgeon.hub.push.push_folder`).
        left_out_bytes: Their bytes.
    """

    repo_id: str
    repo_url: str
    revision: str  # the branch committed to ("main" by default)
    created_repo: bool
    commit: str
    commit_url: str
    pr_url: str | None
    files: list[str]
    large_files: list[str]  # sent through the large-file path (LFS / Xet)
    unchanged: list[str]  # already on the Hub with the same content: left out of the commit
    bytes: int
    notes: list[str] = field(default_factory=list)
    dry_run: bool = False  # nothing was sent: ``files`` is what the push would upload
    copied: list[str] = field(default_factory=list)  # committed as server-side copies, not uploaded
    copied_from: str | None = None  # the repo and pinned commit they were copied from ("org/name@sha")
    copied_bytes: int = 0  # their bytes, duplicated by the Hub instead of sent
    deleted: list[str] = field(default_factory=list)  # other weights deleted in the same commit
    kept: list[str] = field(default_factory=list)  # other weights kept as asked
    plan: PushPlan | None = None
    left_out: list[str] = field(default_factory=list)  # the folder's files not pushed (not the model's, or not asked)
    left_out_bytes: int = 0

    def to_dict(self) -> dict:
        """The result as ``surgeon push --json`` prints it."""
        return {
            "repo_id": self.repo_id,
            "repo_url": self.repo_url,
            "revision": self.revision,
            "created_repo": self.created_repo,
            "commit": self.commit,
            "commit_url": self.commit_url,
            "pr_url": self.pr_url,
            "files": self.files,
            "large_files": self.large_files,
            "unchanged": self.unchanged,
            "bytes": self.bytes,
            "notes": self.notes,
            "dry_run": self.dry_run,
            "copied": self.copied,
            "copied_from": self.copied_from,
            "copied_bytes": self.copied_bytes,
            "deleted": self.deleted,
            "kept": self.kept,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "left_out": self.left_out,
            "left_out_bytes": self.left_out_bytes,
        }

    def summary(self) -> str:
        """One line (names shown escaped)."""
        from ..text.shown import shown
        from ..text.sizes import fmt_bytes

        copies = (
            f"{len(self.copied)} unchanged files ({fmt_bytes(self.copied_bytes)}) server-side from {self.copied_from}"
        )
        deleted = f"{len(self.deleted)} files of other weights a loader would read ({few(self.deleted)})"
        if self.dry_run:
            return shown(
                f"dry run: would push these {len(self.files)} files ({fmt_bytes(self.bytes)})"
                + (f" and copy {copies}" if self.copied else "")
                + (f", and delete {deleted}," if self.deleted else "")
                + f" to {self.repo_id} ({self.repo_url}, branch {self.revision}); nothing was sent"
            )
        changed = len(self.files) - len(self.unchanged)
        if not changed and not self.copied and not self.deleted:
            return shown(
                f"nothing to push: all {len(self.files)} files are on {self.repo_id} (branch {self.revision}) already, unchanged"
            )
        what = f"{changed} files ({fmt_bytes(self.bytes)}, {len(self.large_files)} through the large-file path)"
        if self.unchanged:
            what += f" ({len(self.unchanged)} files already there unchanged)"
        if self.copied:
            what += f", and {len(self.copied)} unchanged files ({fmt_bytes(self.copied_bytes)}) copied server-side from {self.copied_from}"
        if self.deleted:
            what += f", and deleted {deleted}"
        if self.pr_url:
            return shown(f"opened a pull request on {self.repo_id} with {what}: {self.pr_url}")
        return shown(f"pushed {what} to {self.repo_id} (branch {self.revision}) in one commit: {self.commit_url}")

    def listing(self) -> list[str]:
        """Every file of the push, one line each (the exact list uploaded, or that a dry run would upload), then
        the copies, the deletions, the other weights kept and the folder's files left out."""
        from ..text.shown import shown

        unchanged = set(self.unchanged)
        return (
            [f"  {shown(f)}{' (already there, unchanged)' if f in unchanged else ''}" for f in self.files]
            + [f"  {shown(f)} (copied server-side)" for f in self.copied]
            + [f"  {shown(f)} (deleted: other weights)" for f in self.deleted]
            + [f"  {shown(f)} (kept: other weights)" for f in self.kept]
            + [f"  {shown(f)} (left out)" for f in self.left_out]
        )


def push_command(
    folder: Path,
    repo_id: str,
    *,
    branch: str | None,
    create_pr: bool,
    private: bool,
    commit_message: str | None = None,
    no_server_copy: bool = False,
    keep_other_weights: bool = False,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> str:
    """The ``surgeon push`` command that sends ``folder`` as the push that failed would have."""
    q = shlex.quote
    flags = [
        *([shell_spelling("branch", q(branch))] if branch else []),
        *([shell_spelling("create_pr", "True")] if create_pr else []),
        *([shell_spelling("private", "True")] if private else []),
        *([shell_spelling("commit_message", q(commit_message))] if commit_message else []),
        *([shell_spelling("no_server_copy", "True")] if no_server_copy else []),
        *([shell_spelling("keep_other_weights", "True")] if keep_other_weights else []),
        *[shell_spelling("include", q(g)) for g in include or ()],
        *[shell_spelling("exclude", q(g)) for g in exclude or ()],
    ]
    return " ".join(["surgeon", "push", q(str(folder)), repo_id, *flags])


def as_run(command: str) -> str:
    """A command in a message, in backquotes (words saying what to run, where the command is not known, as they
    are)."""
    return f"`{command}`" if command.startswith("surgeon ") else command


def finish(command: str) -> str:
    """What a push stopped part-way ends with: the command that finishes it."""
    return f"run {as_run(command)} to finish (the Hub keeps what was uploaded; it is not sent again)"


def partial_push_error(
    exc: Exception,
    repo_id: str,
    token: str,
    ops: Sequence[CommitOperationAdd],
    failed_at: int,
    done: list[str],
    rerun: str,
) -> Exception:
    """One line: what reached the Hub, what did not, and ``rerun``, the command that finishes the job
    (:func:`push_command`, or the reinit that makes a push by changes again), as the error's follow-up."""
    base = write_error(exc, repo_id, token, "push")
    if not isinstance(base, HubError) or (isinstance(base, (HubAuthError, HubAccessError)) and not done):
        return base  # refused outright: nothing reached the Hub, the plain reason is the whole story
    # the file that failed and those after it first: they are what the re-run will send
    pending = [op.path_in_repo for op in ops[failed_at:]] + [
        op.path_in_repo for op in ops[:failed_at] if op.path_in_repo not in done
    ]
    if failed_at < len(ops):
        before = (
            f"uploaded before it: {few(done)} ({len(done)} large files)"
            if done
            else "no large file was uploaded before it"
        )
        what = f"stopped at {ops[failed_at].path_in_repo} ({base}); {before}; not uploaded: {few(pending)}; nothing was committed"
    else:
        what = f"failed at the commit ({base}); all {len(done)} large files were uploaded, but nothing was committed"
    error = PushError(f"push to {repo_id} {what}", uploaded=list(done), not_uploaded=pending)
    error.follow_up = finish(rerun)
    return error


def not_as_planned(plan: PushPlan, commit_url: str, wrong: list[str], fix: str) -> PushError:
    """The error of a push whose commit left the destination other than planned (what a server-side copy was
    given differs from what it was decided from, say): the files, and the command that puts them right."""
    error = PushError(
        f"pushed to {plan.repo_id} ({commit_url}), but it does not hold what the push planned: {few(wrong)}"
    )
    error.follow_up = f"run {as_run(fix)} to upload them (nothing is copied server-side then)"
    return error
