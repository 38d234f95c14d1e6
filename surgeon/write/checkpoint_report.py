"""The report of a reinit of a checkpoint on disk, and what it says beside the tables: the dry run's notes, the
reproduce command, the Hub commit message. Shared by the one-process run (surgeon.api) and the ranks'
(surgeon.write.ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .._version import __version__
from ..errors import opt
from ..modes import get_mode
from ..open.source import folder_output_files
from ..report.report import Report
from ..vocab.spectrum import ProjectionRow

if TYPE_CHECKING:
    from ..detect.hints import Hints
    from ..formats.fileio import IOFigures
    from ..hub.push import PushTarget
    from ..open.source import Source
    from ..plan.planner import Plan
    from ..vocab.detection import Detection
    from .output import Destination


def source_label(source: Source) -> str:
    """How reports name the input: the Hub id for a Hub model (its cache path is in the notes)."""
    return f"{source.hub_id}@{source.hub_revision or 'main'}" if source.hub_id else str(source.path)


def planned_rows(source: Source, plan: Plan) -> list[ProjectionRow]:
    """A dry run's rows: what the real run would change, nothing computed."""
    return [
        ProjectionRow(
            c.block,
            c.role,
            None,
            heads_changed=c.heads,
            bias_zeroed=(plan.steps[c.step] if c.step is not None else plan).options.zero_bias
            and c.projection.bias is not None,
            dtype=source.primary.tensors[c.projection.weight.tensor].element or "",
            strength=c.strength,
            step=c.step,
        )
        for c in plan.changes
    ]


def dry_run_notes(source: Source, dest: Destination, *, overwrite: bool, push: PushTarget | None) -> list[str]:
    """What a dry run says besides the plan: an output in the way, the files a push would send."""
    notes = [f"the real run patches {dest.path} in place" if dest.in_place else f"the real run writes {dest.path}"]
    if dest.path.exists() and not overwrite and not dest.in_place:
        notes.append(f"{dest.path} exists: the real run needs {opt('overwrite', True)} or another {opt('output')}")
    if push is not None:
        weights, carried = folder_output_files(source)
        files = sorted({*weights, *carried, "README.md"})  # the folder surgeon writes, its model card included
        notes.append(f"the real run pushes {dest.path.name} to {push.repo_id}: {len(files)} files, {', '.join(files)}")
        from ..hub.push import NO_TOKEN_YET, has_token

        if not has_token(push.token):
            notes.append(NO_TOKEN_YET)
    return notes


def reinit_report(
    source: Source,
    detection: Detection,
    plan: Plan,
    dest: Destination,
    rows: list[ProjectionRow],
    notes: list[str],
    *,
    device: str,
    seconds: float = 0.0,
    bytes_written: int = 0,
    dry_run: bool = True,
    transfer: dict[str, int] | None = None,
    io: IOFigures | None = None,
) -> Report:
    """The reinit's report, made once from what was planned or done."""
    return Report(
        "reinit",
        source_label(source),
        source.describe(),
        detection.blocks,
        tuple(rows),
        options=plan.options_record(),  # with the mode's defaults from config (redraw: the family's std)
        output=str(dest.path),
        dry_run=dry_run,
        seconds=seconds,
        bytes_written=bytes_written,
        device=device,
        notes=tuple(notes),
        transfer=transfer,
        io=io,
    )


def reproduce(model: str | Path, source: Source, plan: Plan, hints: Hints, dest: Path) -> str:
    """The model card's command that makes the same output again (a recipe's: with ``--recipe``, its file shown
    beside it in the card)."""
    from ..report.card import reproduce_command

    if source.hub_id:
        label, revision = source.hub_id, source.hub_commit
    else:  # its name only: a path, relative or absolute, would publish a local directory layout
        label, revision = Path(model).name, None
    options = plan.options_record()
    return reproduce_command(label, revision=revision, options=options, hints=hints, output=dest.name)


def commit_message(source: Source, plan: Plan) -> str:
    """A push's default commit message: what was re-initialized, of which model."""
    of = f" of {source.hub_id}" if source.hub_id else ""
    n = len(plan.touched_blocks)
    blocks = f"{n} attention block{'s' if n != 1 else ''}"
    if plan.steps:
        return f"A recipe of {len(plan.steps)} steps on {blocks}{of} (surgeon {__version__})"
    targets = ",".join(plan.options.to_dict()["targets"])
    return f"{get_mode(plan.options.mode).label} of {targets} in {blocks}{of} (surgeon {__version__})"
