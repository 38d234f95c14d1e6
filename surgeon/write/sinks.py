"""Where a reinit's output goes, as a sink with one interface, chosen once from the source and what was asked.

Every sink is made by :func:`open_sink` after every check that can refuse it (nothing is written before), and
carries its :class:`~surgeon.write.output.Destination`: the files on disk the executors write (a file, an .onnx
and its data files, a new folder, a folder merged or a file patched in place). What differs is before and after
the weights: :meth:`Sink.predict` says what a dry run's real run would write and move, :meth:`Sink.finish` what
happens once the weights are on disk: nothing for a disk sink; the commit for a Hub sink (:class:`HubFolder`: the
whole folder uploaded; :class:`HubChanges`: only the changed shards and the card, the rest copied server-side from
the source repo). The pipeline (``surgeon.api``) and the executors never ask which sink they hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import HubError, OptionError, opt
from .checkpoint_report import commit_message, dry_run_notes
from .output import Destination, resolve_destination

if TYPE_CHECKING:
    from ..hub.push import PushTarget
    from ..hub.push_result import PushResult
    from ..open.source import Source
    from ..plan.planner import Plan


@dataclass(frozen=True)
class Outcome:
    """What a sink says beside the weights: notes for the report, and figures for its ``transfer``."""

    notes: tuple[str, ...] = ()
    transfer: Mapping[str, int] = field(default_factory=dict)


class Sink(Protocol):
    """An output: its files on disk (``dest``), what a dry run predicts, what follows the weights."""

    @property
    def dest(self) -> Destination: ...

    @property
    def title(self) -> str:
        """What the model card calls the output."""
        ...

    def predict(self, source: Source, plan: Plan) -> Outcome:
        """What the real run would write, and move over the network (a dry run; nothing is sent)."""
        ...

    def finish(self, source: Source, plan: Plan, *, progress: bool) -> Outcome:
        """What follows once the weights are written (the weights are on disk whatever it raises)."""
        ...


@dataclass(frozen=True)
class DiskSink:
    """A file, files, a folder, or the input changed in place: the weights written are the output."""

    dest: Destination
    overwrite: bool = False

    @property
    def title(self) -> str:
        return self.dest.path.name

    def predict(self, source: Source, plan: Plan) -> Outcome:
        return Outcome(tuple(dry_run_notes(source, self.dest, overwrite=self.overwrite, push=None)))

    def finish(self, source: Source, plan: Plan, *, progress: bool) -> Outcome:
        return Outcome()


@dataclass(frozen=True)
class HubFolder:
    """A folder written whole, then committed to a Hub repo (``why``: the line saying why it is not pushed by
    changes, where there is one to say)."""

    dest: Destination
    target: PushTarget
    overwrite: bool = False
    why: str = ""

    @property
    def title(self) -> str:
        return self.target.repo_id

    def predict(self, source: Source, plan: Plan) -> Outcome:
        notes = dry_run_notes(source, self.dest, overwrite=self.overwrite, push=self.target)
        return Outcome(tuple([*([self.why] if self.why else []), *notes, *_deletions(source, self.target)]))

    def finish(self, source: Source, plan: Plan, *, progress: bool) -> Outcome:
        try:
            pushed = self.target.push(self.dest.path, default_message=commit_message(source, plan), progress=progress)
        except HubError as exc:  # the output is on disk: say so, and keep the error's type
            raise _on_disk(exc, self.dest) from None
        return _pushed([*([self.why] if self.why else [])], pushed)


@dataclass(frozen=True)
class HubChanges:
    """A Hub model's re-initialization pushed by changes: the changed shards and the card are staged and
    uploaded, every other file of the output copied server-side from the source repo at the commit read
    (``surgeon.hub.copies``); where the Hub refuses the copy, the whole output is made and uploaded."""

    dest: Destination
    target: PushTarget
    overwrite: bool = False

    @property
    def title(self) -> str:
        return self.target.repo_id

    def predict(self, source: Source, plan: Plan) -> Outcome:
        from ..hub.copies import predicted

        notes = dry_run_notes(source, self.dest, overwrite=self.overwrite, push=self.target)
        line, figures = predicted(source, source.primary.changed_files(plan.tensors()))  # type: ignore[attr-defined]
        return Outcome(tuple([*notes, line, *_deletions(source, self.target)]), figures)

    def finish(self, source: Source, plan: Plan, *, progress: bool) -> Outcome:
        from ..errors import PushError
        from ..hub.copies import CopyRefused, complete_staging, copies_for, resume_by_reinit

        message, folder, notes = commit_message(source, plan), self.dest.path, []
        try:
            try:
                staged = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
                pushed = self.target.push(
                    folder, default_message=message, progress=progress, copies=copies_for(source, staged)
                )
            except CopyRefused as why:  # nothing was committed: make the whole output here, and upload it
                notes.append(str(why))
                complete_staging(folder, source)  # the unchanged shards are fetched as they are copied in
                pushed = self.target.push(folder, default_message=message, progress=progress, server_copy=False)
        except HubError as exc:
            if isinstance(exc, PushError):  # the folder holds only the changes: never pushed alone
                exc = resume_by_reinit(exc)
            raise _on_disk(exc, self.dest) from None
        return _pushed(notes, pushed)


def _deletions(source: Source, target: PushTarget) -> list[str]:
    """A dry run's line on the destination's other weights, which the real push deletes in its commit (read-only:
    where the destination cannot be asked, it says so and the real push decides)."""
    from ..open.source import folder_output_files

    weights, carried = folder_output_files(source)
    try:
        doomed = target.would_delete([*weights, *carried, "README.md"])
    except HubError as exc:
        return [f"could not ask {target.repo_id} which files it holds ({exc}); the real push decides what it deletes"]
    if not doomed:
        return []
    return [
        f"the real push deletes {len(doomed)} other weight file(s) {target.repo_id} holds, which a loader would read "
        f"instead of the new weights or beside them: {', '.join(doomed)} ({opt('keep_other_weights', True)} keeps them)"
    ]


def _on_disk(exc: HubError, dest: Destination) -> HubError:
    exc.context = f"wrote {dest.path}, but the push failed: "
    return exc


def _pushed(notes: list[str], pushed: PushResult) -> Outcome:
    lines = [*notes, *pushed.notes, pushed.summary(), f"files pushed: {', '.join(pushed.files)}"]
    return Outcome(tuple(lines), {"uploaded": pushed.bytes, "copied_server_side": pushed.copied_bytes})


@dataclass(frozen=True)
class WriteTo:
    """Where a reinit writes: the output (``staged``: a push's staging folder, which holds only what changed),
    in place or not, over an existing output or not, or nothing (a dry run); the push and the card's lineage."""

    output: str | Path | None = None
    in_place: bool = False
    overwrite: bool = False
    dry_run: bool = False
    push: PushTarget | None = None
    staged: bool = False
    base_model: str | None = None

    @property
    def patches_input(self) -> bool:
        """Whether the run changes its input on disk (with a push, in place names the branch read instead)."""
        return self.in_place and self.push is None


def open_sink(source: Source, to: WriteTo) -> Sink:
    """The sink for ``source``'s output, after every check that can refuse it (nothing written before).

    ``to.push``: the output folder is committed there; with ``to.in_place``, onto the source repo's own branch
    (a push that would rewrite the branch the model was read from is refused without it). ``to.staged``: the
    output is the push's staging folder, which holds only what changed where the push can go by changes."""
    output, in_place, push, staged = to.output, to.in_place, to.push, to.staged
    overwrite = to.overwrite or to.dry_run  # a dry run writes nothing, so nothing is in its way
    if push is None:
        return DiskSink(resolve_destination(source, output, in_place=in_place, overwrite=overwrite), overwrite)
    _check_branch(source, push, onto_source=in_place)
    from ..hub.copies import no_copy_reason

    why = no_copy_reason(source, output_given=output is not None and not staged, no_server_copy=push.no_server_copy)
    dest = resolve_destination(source, output, in_place=False, overwrite=overwrite, push=True, changes_only=why is None)
    if why is None:
        return HubChanges(dest, push, overwrite)
    return HubFolder(dest, push, overwrite, why)


def _check_branch(source: Source, push: PushTarget, *, onto_source: bool) -> None:
    """A push onto the branch its model was read from rewrites that model: only when asked for (``onto_source``),
    which is refused for any other destination."""
    branch = push.branch or "main"
    same = source.hub_id == push.repo_id and not push.create_pr and branch == (source.hub_revision or "main")
    if same and not onto_source:
        raise OptionError(
            f"{push.repo_id} is the model read, and the push would commit over its {branch} branch: pass "
            f"{opt('in_place', True)} to rewrite it there, or push to a branch ({opt('push_branch', 'NAME')}) or as a "
            f"pull request ({opt('create_pr', True)})"
        )
    if onto_source and not same:
        where = f"{source.hub_id}@{source.hub_revision or 'main'}" if source.hub_id else f"the local {source.path}"
        raise OptionError(
            f"{opt('in_place', True)} with {opt('push_to_hub')} rewrites the Hub model read on its own branch, and "
            f"the model read is {where}, not {push.repo_id}@{branch}: leave out {opt('in_place', True)}"
        )
