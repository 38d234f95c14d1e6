"""Carrying out a plan: compute the new values and write them, in one process or over ranks.

The checkpoint path (``surgeon.api``) is one pipeline over an executor: this module's :data:`ONE_PROCESS`,
or ``surgeon.write.ranks.RankedRun`` under torchrun, which adds only "my files, barrier, gather".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from ..compute.per_file import Compute
from ..errors import CheckpointError
from ..formats.fileio import IOFigures, metered
from .output import OutputKind

if TYPE_CHECKING:
    import torch

    from ..open.source import Source
    from ..plan.planner import Plan
    from ..vocab.detection import Detection
    from ..vocab.spectrum import ProjectionRow
    from .output import Destination

T = TypeVar("T")


@dataclass(frozen=True)
class CardFacts:
    """What the model card says beyond the run itself: its title, the reproduce command (made when the card is
    written, so that nothing delays the byte copies), and the Hub model the source comes from."""

    title: str
    command: Callable[[], str]
    base_model: str | None = None


@dataclass(frozen=True)
class Job:
    """What carrying out a plan takes: the source and what was found and planned in it, where the output goes,
    where it computes (``full``: also each whole projection's spectrum; ``progress``: a bar on stderr), the card."""

    source: Source
    detection: Detection
    plan: Plan
    dest: Destination
    device: str | torch.device
    full: bool
    progress: bool
    card: CardFacts


@dataclass(frozen=True)
class Done:
    """What carrying out a plan gave: the report's rows and notes, the device used, the bytes the output holds
    (``bytes_written``; a patch: the bytes it rewrote) and what writing it moved (``io``: written from memory,
    copied or shared by the kernel, read; None where not counted)."""

    rows: list[ProjectionRow]
    notes: list[str]
    device: str
    bytes_written: int
    io: IOFigures | None = None


class Executor(Protocol):
    """Where a plan is carried out: the steps every run takes, and the one step that differs (the writing)."""

    def step(self, work: Callable[[], T]) -> T:
        """Run one step of the pipeline (every rank alike: a refusal on one stops them all)."""
        ...

    def check(self, source: Source, dest: Destination) -> None:
        """Refuse, before detection, what this executor cannot write."""
        ...

    def carry_out(self, job: Job) -> Done:
        """Compute the new values and write them to ``job.dest``, the model card last."""
        ...


class OneProcess:
    """The executor of a run in this process alone."""

    def step(self, work: Callable[[], T]) -> T:
        return work()

    def check(self, source: Source, dest: Destination) -> None:
        return None

    def carry_out(self, job: Job) -> Done:
        source, plan, dest, card = job.source, job.plan, job.dest, job.card
        write_plans = [weights.write_plan(plan, job.detection) for weights in source.weights]
        notes = [note for write_plan in write_plans for note in write_plan.notes]
        _check_secondary_sets(source, plan.tensors())
        from ..report.card import source_card, write_card

        original = source_card(source) if dest.gets_card else None  # a card that cannot be read refuses here
        run = Compute(
            plan, job.device, whole=job.full, progress=job.progress, total=len(plan.tensors()) * len(source.weights)
        )

        def write_the_card(folder: Path) -> None:
            write_card(
                folder, source=source, original=original, plan=plan, results=run.results(), command=card.command(),
                title=card.title, base_model=card.base_model,
            )  # fmt: skip

        try:
            with metered() as meter:
                notes += dest.write(source, run.updates_for, plan.record(), write_plans, card=write_the_card)
        finally:
            run.close()
        size = dest.size(source, patched=run.bytes_changed)
        return Done(
            run.results(),
            notes,
            run.used_device(),
            size,
            io_figures(meter.figures(), size, patched=dest.kind is OutputKind.PATCH),
        )


def io_figures(counted: IOFigures, size: int, *, patched: bool) -> IOFigures:
    """What writing moved: the kernel's copies and the reads as counted; written, what a patch rewrote, and of
    any other output every byte that is not a kernel copy (the files copied beside the weights, the card, the
    formats that write every byte)."""
    return IOFigures(counted.written if patched else max(size - counted.kernel, 0), counted.kernel, counted.read)


ONE_PROCESS = OneProcess()


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
