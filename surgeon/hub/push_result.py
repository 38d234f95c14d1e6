"""What a push says it did: the result of one that finished (or of a dry run), and the error of one
that stopped part-way, naming what reached the Hub and the command that finishes the job."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import HubAccessError, HubAuthError, HubError, PushError
from .failures import few, write_error

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd


@dataclass
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
        copied: Files committed as server-side copies of ``copied_from`` (``org/name@commit``), not uploaded.
        copied_bytes: Their bytes.
        notes: What the push says besides (a repo created, files left out).
        dry_run: Nothing was sent.
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
        }

    def summary(self) -> str:
        """One line (names shown escaped)."""
        from ..text.shown import shown
        from ..text.sizes import fmt_bytes

        if self.dry_run:
            copies = (
                f" and copy {len(self.copied)} unchanged files ({fmt_bytes(self.copied_bytes)}) server-side from "
                f"{self.copied_from}"
                if self.copied
                else ""
            )
            return shown(
                f"dry run: would push these {len(self.files)} files ({fmt_bytes(self.bytes)}){copies} to "
                f"{self.repo_id} (branch {self.revision}); nothing was sent"
            )
        changed = len(self.files) - len(self.unchanged)
        if not changed:
            return shown(
                f"nothing to push: all {len(self.files)} files are on {self.repo_id} (branch {self.revision}) already, unchanged"
            )
        what = f"{changed} files ({fmt_bytes(self.bytes)}, {len(self.large_files)} through the large-file path)"
        if self.unchanged:
            what += f" ({len(self.unchanged)} files already there unchanged)"
        if self.copied:
            what += (
                f", and {len(self.copied)} unchanged files ({fmt_bytes(self.copied_bytes)}) copied server-side "
                f"from {self.copied_from}"
            )
        if self.pr_url:
            return shown(f"opened a pull request on {self.repo_id} with {what}: {self.pr_url}")
        return shown(f"pushed {what} to {self.repo_id} (branch {self.revision}) in one commit: {self.commit_url}")

    def listing(self) -> list[str]:
        """Every file of the push, one line each (the exact list uploaded, or that a dry run would upload)."""
        from ..text.shown import shown

        unchanged = set(self.unchanged)
        return [f"  {shown(f)}{' (already there, unchanged)' if f in unchanged else ''}" for f in self.files] + [
            f"  {shown(f)} (copied server-side)" for f in self.copied
        ]


def push_command(
    folder: Path,
    repo_id: str,
    *,
    branch: str | None,
    create_pr: bool,
    private: bool,
    commit_message: str | None = None,
    no_server_copy: bool = False,
) -> str:
    """The ``surgeon push`` command that sends ``folder`` as the push that failed would have."""
    flags = (
        (f" --branch {shlex.quote(branch)}" if branch else "")
        + (" --create-pr" if create_pr else "")
        + (" --private" if private else "")
        + (f" --commit-message {shlex.quote(commit_message)}" if commit_message else "")
        + (" --no-server-copy" if no_server_copy else "")
    )
    return f"surgeon push {shlex.quote(str(folder))} {repo_id}{flags}"


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
    (:func:`push_command`)."""
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
    return PushError(
        f"push to {repo_id} {what}: run `{rerun}` to finish (the Hub keeps what was uploaded; it is not sent again)",
        uploaded=list(done),
        not_uploaded=pending,
    )
