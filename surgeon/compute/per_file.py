"""The compute side of a reinit on a checkpoint: the Engine, made (and torch imported) on first use.

Formats call ``updates(file)`` once per file after starting that file's byte copy, so the torch import
and the math overlap the copying; nothing here imports torch until a tensor is asked for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..plan.planner import Plan

if TYPE_CHECKING:
    import torch
    from tqdm.auto import tqdm

    from ..formats.base import WeightSet
    from ..vocab.spectrum import ProjectionRow
    from .engine import Engine


class Compute:
    """One run's Engine on a device (``auto`` resolved once, when the Engine is made), its progress bar,
    and the bytes its updates rewrote."""

    def __init__(
        self, plan: Plan, device: str | torch.device | None, *, whole: bool, progress: bool, total: int
    ) -> None:
        self.plan, self.device, self.whole = plan, device, whole
        self._engine: Engine | None = None
        self._bar = Progress(progress, total, "reinit")
        self.bytes_changed = 0

    @property
    def started(self) -> bool:
        return self._engine is not None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            from .._compat import prefer_huge_pages

            prefer_huge_pages()  # before torch's first tensor (the engine's module imports torch)
            from .devices import resolve_device
            from .engine import Engine

            self._engine = Engine(self.plan, resolve_device(self.device), whole=self.whole)
            self._bar.__enter__()
        return self._engine

    def results(self) -> list[ProjectionRow]:
        """What the engine did, in plan order ([] when nothing was computed)."""
        return self._engine.ordered_results() if self._engine is not None else []

    def updates_for(self, weights: WeightSet, record: bool) -> Updates:
        return Updates(self, weights, record)

    def used_device(self) -> str:
        """The device the engine ran on (the one asked for, when nothing was computed)."""
        return str(self._engine.device) if self._engine is not None else str(self.device)

    def advance(self, tensors: int = 1) -> None:
        """Count ``tensors`` more done on the progress bar (when it shows)."""
        if self._bar.bar is not None:
            self._bar.bar.update(tensors)

    def close(self) -> None:
        self._bar.__exit__(None, None, None)


class Updates:
    """The new values of one weight set's changing tensors, computed one at a time (see UpdatesFn)."""

    def __init__(self, run: Compute, weights: WeightSet, record: bool) -> None:
        self.run, self.weights, self.record = run, weights, record
        self.order = [n for n in run.plan.tensors() if n in weights.tensors]
        self.names = frozenset(self.order)

    def __call__(self, file: str) -> Iterator[tuple[str, torch.Tensor]]:
        return self.only({n for n in self.order if self.weights.tensors[n].file == file})

    def only(self, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The new values of ``names`` (those of them that change), in plan order: a rank's share of the work."""
        run = self.run
        for name in self.order:
            if name not in names:
                continue
            info = self.weights.tensors[name]
            yield name, run.engine.update(name, self.weights.read(name), record=self.record)
            run.bytes_changed += info.nbytes
            run.advance()


class Progress:
    """A tqdm bar on stderr that appears only for runs longer than a second."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.enabled, self.total, self.desc = enabled, total, desc
        self.bar: tqdm | None = None

    def __enter__(self) -> tqdm | None:
        if self.enabled and self.total:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc=self.desc, unit="tensor", delay=1.0, leave=False)
        return self.bar

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
