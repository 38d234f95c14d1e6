"""Carrying out a plan on a checkpoint in one process: compute the new values and write them to the destination."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ..compute.per_file import Compute
from ..errors import CheckpointError
from .checkpoint_report import done_rows

if TYPE_CHECKING:
    import torch

    from ..open.source import Source
    from ..plan.planner import Plan
    from ..report.report import ProjectionRow
    from ..vocab.detection import Detection
    from .output import Destination


class Done(NamedTuple):
    """What carrying out a plan gave: the report's rows and notes, the device used, the bytes written."""

    rows: list[ProjectionRow]
    notes: list[str]
    device: str
    bytes_written: int


def carry_out(
    source: Source,
    detection: Detection,
    plan: Plan,
    dest: Destination,
    *,
    device: str | torch.device,
    full: bool,
    progress: bool,
    title: str,
    command: Callable[[], str],
    base_model: str | None = None,
) -> Done:
    """Compute the new values and write them to ``dest``.

    ``command()`` gives the model card's reproduce command; it is made after the weights, so that
    nothing delays the start of the byte copies."""
    write_plans = [weights.write_plan(plan, detection) for weights in source.weights]
    notes = [note for write_plan in write_plans for note in write_plan.notes]
    _check_secondary_sets(source, plan.tensors())
    from ..report.card import source_card, write_card

    original = source_card(source) if dest.gets_card else None  # a card that cannot be read refuses here
    run = Compute(plan, device, whole=full, progress=progress, total=len(plan.tensors()) * len(source.weights))

    def card(folder: Path) -> None:
        write_card(
            folder, source=source, original=original, plan=plan, results=run.results(), command=command(), title=title,
            base_model=base_model,
        )  # fmt: skip

    try:
        notes += dest.write(source, run.updates_for, plan.record(), write_plans, card=card)
    finally:
        run.close()
    rows = done_rows(run.results())
    used = str(run.engine.device) if run.started else str(device)
    return Done(rows, notes, used, dest.size(source, patched=run.bytes_changed))


def _check_secondary_sets(source: Source, tensors: list[str]) -> None:
    """A folder with the same weights twice (safetensors and .bin): both must hold every edited tensor."""
    primary = source.primary.tensors
    for other in source.weights[1:]:
        for name in tensors:
            theirs = other.tensors.get(name)
            if theirs is None or theirs.shape != primary[name].shape:
                raise CheckpointError(
                    f"{source.folder} holds two weight sets ({source.primary.describe()} and {other.describe()}) "
                    f"that disagree on {name!r}; point surgeon at one file, or remove the stale copy"
                )
