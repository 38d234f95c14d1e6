"""A reinit of a checkpoint on disk spread over the processes of ``torchrun`` (or of a training script under it).

Every rank opens, detects and plans the same checkpoint (the plan is a deterministic value), then writes
only its own data files into one staging folder: DCP's ``.distcp`` files and a sharded safetensors folder's
shards are dealt out round-robin in the checkpoint's file order. Draws are keyed by (seed, tensor, role,
head), so a rank computes the very values one process would. After a barrier rank 0 writes the files
the ranks share (``.metadata`` or the index, the folder's other files, the model card from every rank's
results) and renames the staging folder into place; a failure on any rank removes it and every rank
raises. Collectives are gloo's, on the CPU, whatever backend the training script uses.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import OptionError, RankFailed, opt
from .carry_out import Done, Job

if TYPE_CHECKING:
    from ..compute.per_file import Compute
    from ..formats.write_plan import WritePlan
    from ..open.source import Source
    from ..vocab.spectrum import ProjectionRow
    from .output import Destination

T = TypeVar("T")


def under_torchrun() -> bool:
    """True in a process that torchrun started with more than one rank (its WORLD_SIZE)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


@dataclass
class Ranks:
    rank: int
    world: int
    group: Any  # a gloo process group (None: the default group, itself gloo)
    owned: bool  # surgeon initialized the default group, and destroys it at the end

    @classmethod
    def join(cls) -> Ranks:
        """This process's rank: the training script's process group, or one made from torchrun's variables."""
        import torch.distributed as dist

        owned = False
        if not dist.is_initialized():
            if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
                raise OptionError(
                    "distributed=True runs under torchrun (RANK, WORLD_SIZE, MASTER_ADDR are not set) or in a "
                    "script that has called torch.distributed.init_process_group; start it with torchrun --nproc-per-node N"
                )
            # torch.distributed.checkpoint first: imported once a gloo group exists (as opening a DCP folder
            # does), torch 2.13 aborts at exit in about one run in four ("terminate called without an active
            # exception"), though every rank finished its work
            import torch.distributed.checkpoint  # noqa: F401

            dist.init_process_group("gloo")
            owned = True
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return cls(dist.get_rank(), dist.get_world_size(), group, owned)

    def close(self) -> None:
        import torch.distributed as dist

        if self.owned:
            dist.destroy_process_group()

    def agree(self, ok: bool) -> bool:
        """Whether every rank is ok (a collective: every rank calls it at the same point)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(flag, group=self.group)
        return int(flag.item()) == 0

    def gather(self, value: T) -> list[T]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def broadcast(self, value: T | None) -> T | None:
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def step(self, work: Callable[[], T]) -> T:
        """Run ``work`` on this rank; raise on every rank if it failed on any (this rank's own error here)."""
        try:
            value = work()
        except BaseException:
            self.agree(False)
            raise
        if not self.agree(True):
            raise RankFailed("another rank failed (its error is in its output); nothing was written")
        return value

    def mine(self, files: list[str]) -> list[str]:
        """This rank's share of ``files``: round-robin in the checkpoint's own file order."""
        return files[self.rank :: self.world]


def refuse(*, in_place: bool, push: bool, source: Source | None = None, dest: Destination | None = None) -> None:
    """One line for what cannot run spread over ranks; checked on every rank alike (nothing depends on the rank)."""
    if in_place:
        raise OptionError(
            f"{opt('in_place', True)} patches the input under one journal and cannot run over several ranks; "
            f"run it in one process, or write a new folder with {opt('output')}"
        )
    if push:
        raise OptionError(f"{opt('push_to_hub')} does not run over several ranks; push the output with `surgeon push`")
    if source is None or dest is None:
        return
    from ..formats.base import RankedWeightSet
    from .output import OutputKind

    weights = source.primary
    if len(source.weights) != 1 or not isinstance(weights, RankedWeightSet) or dest.kind is not OutputKind.FOLDER:
        raise OptionError(
            f"{source.path} is {weights.describe()}: several ranks run on a DCP folder or a sharded safetensors "
            "folder; run this in one process"
        )


@dataclass(frozen=True)
class RankedRun:
    """The executor of a run spread over ``ranks`` (see the module's docstring); the pipeline is the one of a
    single process (``surgeon.api``): every rank opens, detects and plans alike, each step agreed by all."""

    ranks: Ranks

    def step(self, work: Callable[[], T]) -> T:
        return self.ranks.step(work)

    def check(self, source: Source, dest: Destination) -> None:
        refuse(in_place=False, push=False, source=source, dest=dest)

    def carry_out(self, job: Job) -> Done:
        """Each rank writes its share; the model card is rank 0's, from every rank's results. No progress bar:
        the ranks' bars would share one terminal."""
        from ..compute.per_file import Compute
        from ..report.card import source_card, write_card

        group, source, plan, dest, card = self.ranks, job.source, job.plan, job.dest, job.card
        write_plan = group.step(lambda: source.primary.write_plan(plan, job.detection))
        original = group.step(lambda: source_card(source) if group.rank == 0 else None)
        run = Compute(plan, job.device, whole=job.full, progress=False, total=len(plan.tensors()))

        def write_the_card(folder: Path, results: list[ProjectionRow]) -> None:
            write_card(
                folder, source=source, original=original, plan=plan, results=results, command=card.command(),
                title=card.title, base_model=card.base_model,
            )  # fmt: skip

        try:
            written, results = write(group, source, dest, run, plan.record(), write_plan, card=write_the_card)
        finally:
            run.close()
        return Done(results, [*write_plan.notes, *written], run.used_device(), dest.size(source, patched=0))


def write(
    ranks: Ranks,
    source: Source,
    dest: Destination,
    run: Compute,
    record: dict,
    write_plan: WritePlan,
    *,
    card: Callable[[Path, list[ProjectionRow]], None],
) -> tuple[list[str], list[ProjectionRow]]:
    """Write the output folder with every rank, through the destination's own steps (a single process takes the
    same ones in ``Destination.write``): rank 0 stages, every rank writes its share of the data files, rank 0
    writes the shared files and the card from every rank's results; returns (notes, the results of all ranks)."""
    from ..formats.base import RankedWeightSet

    weights = source.primary
    assert isinstance(weights, RankedWeightSet)  # refuse() let only these through
    mine = ranks.mine(weights.files)
    notes: list[str] = []
    with ExitStack() as stack:

        def stage() -> Path | None:
            return stack.enter_context(dest.staging(notes)) if ranks.rank == 0 else None

        tmp = ranks.broadcast(ranks.step(stage))
        assert tmp is not None
        ranks.step(lambda: dest.write_weights(tmp, source, run.updates_for, record, [write_plan], share=mine))
        engine = run.engine if run.started else None
        shares = ranks.gather(
            (engine.results if engine else {}, engine.biases_zeroed if engine else frozenset(), ranks.rank, mine)
        )
        results = _merge(run, shares)

        def finish() -> None:
            if ranks.rank == 0:
                dest.write_shared(tmp, source, card=lambda folder: card(folder, results), shares=True)
                stack.close()  # the rename into place

        ranks.step(finish)
    notes += [f"rank {r} of {ranks.world} wrote {', '.join(files) or 'no data file'}" for _, _, r, files in shares]
    return notes, results


def _merge(run: Compute, shares: list) -> list[ProjectionRow]:
    """Every rank's results in plan order (a tensor cut over two ranks' files is computed by both: one is kept),
    a bias zeroed by any rank marked so (the bias may be stored in another rank's file than its weight)."""
    found: dict = {}
    zeroed: set = set()
    for results, z, _, _ in shares:
        zeroed |= z
        for key, result in results.items():
            found.setdefault(key, result)
    out = []
    for change in run.plan.changes:
        key = (change.block.module, change.role)
        if key in found:
            row = found[key]
            out.append(replace(row, bias_zeroed=True) if key in zeroed else row)
    return out
