"""The typed Python API over checkpoints on disk: open -> detect -> plan -> apply -> write -> report."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch

from .apply import Engine, inspect_blocks, resolve_device
from .detect.config import Hints
from .detect.names import Detection, detect
from .errors import CheckpointError, OptionError
from .output import copy_extras, output_kind, resolve_output, staged, tree_size
from .plan import Plan, ReinitOptions, make_plan
from .report import ProjectionRow, Report
from .selection import IndexSpec
from .source import Source, open_source


def load(model: str | Path, *, config: str | Path | None = None, revision: str | None = None) -> Source:
    """Open a checkpoint: a file, a sharded index, a model folder (or, with the hub module, a Hub id)."""
    if revision is not None:
        raise OptionError("--revision applies to Hugging Face Hub ids only")
    return open_source(model, config=config)


def _detect(source: Source, hints: Hints) -> Detection:
    found = source.primary.detect(source.config, hints)
    if found is not None:
        return found
    return detect(source.primary.tensors, source.config, hints, source=str(source.path))


def inspect_checkpoint(
    model: str | Path,
    *,
    config: str | Path | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    device: str | torch.device = "auto",
    progress: bool = False,
) -> Report:
    """Find the attention blocks of a checkpoint and the condition numbers of their projections."""
    dev = resolve_device(device)
    start = time.perf_counter()
    source = load(model, config=config)
    detection = _detect(source, Hints(num_heads, num_kv_heads, head_dim))
    weights = source.primary
    with _progress(progress, len({p.weight.tensor for b in detection.blocks for p in b.projections}), "inspect") as bar:
        spectra = inspect_blocks(detection.blocks, weights.read, dev, progress=bar.update if bar else None)
    rows = [
        ProjectionRow(block, proj.role, spectra[(block.module, proj.role)], dtype=str(weights.tensors[proj.weight.tensor].torch_dtype).removeprefix("torch."))
        for block in detection.blocks
        for proj in block.projections
    ]
    return Report(
        "inspect", str(source.path), weights.describe(), detection.blocks, rows,
        seconds=time.perf_counter() - start, device=str(dev), notes=detection.notes[:5],
    )


def reinit_checkpoint(
    model: str | Path,
    *,
    output: str | Path | None = None,
    in_place: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
    layers: IndexSpec = "all",
    targets: str | Iterable[str] = ("q", "k", "v"),
    heads: IndexSpec = "all",
    attention: str = "all",
    stack: str | Iterable[str] | None = None,
    mode: str = "conditioned",
    strength: float | None = None,
    value_identity: str = "block",
    keep_scale: bool = False,
    bias: str = "auto",
    seed: int = 0,
    device: str | torch.device = "auto",
    config: str | Path | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    progress: bool = False,
) -> Report:
    """Re-initialize the chosen Q/K/V projections of a checkpoint and write a new one beside it."""
    options = ReinitOptions(
        layers=layers, targets=targets, heads=heads, attention=attention, stack=stack, mode=mode,
        strength=strength, value_identity=value_identity, keep_scale=keep_scale, bias=bias, seed=seed,
    ).validated()
    dev = resolve_device(device)
    start = time.perf_counter()
    source = load(model, config=config)
    detection = _detect(source, Hints(num_heads, num_kv_heads, head_dim))
    plan = make_plan(detection.blocks, options)
    dest = resolve_output(source, output, in_place=in_place, overwrite=overwrite or dry_run)
    report = Report(
        "reinit", str(source.path), source.describe(), detection.blocks, options=options.to_dict(),
        output=str(dest), dry_run=dry_run, device=str(dev), notes=detection.notes[:5],
    )
    if dry_run:
        if dest.exists() and not overwrite and not in_place:
            report.notes.append(f"{dest} exists: the real run needs --overwrite or another -o")
        report.rows = [
            ProjectionRow(c.block, c.role, None, heads_changed=c.heads, bias_zeroed=options.zero_bias and c.projection.bias is not None)
            for c in plan.changes
        ]
        return report
    for weights in source.weights:
        weights.check_plan(plan)
    engine = Engine(plan, dev)
    _check_secondary_sets(source, engine)
    kind = "merge" if in_place and source.kind != "file" else output_kind(source)
    with _progress(progress, len(engine.tensor_names) * len(source.weights), "reinit") as bar:
        with staged(dest, kind, file_name=source.path.name) as tmp:
            for i, weights in enumerate(source.weights):
                weights.save(tmp, _updates_fn(weights, engine, record=i == 0, bar=bar), plan.record())
            if kind == "folder" and source.kind == "folder":
                copy_extras(source, tmp)
            _after_write(source, plan, engine, tmp, kind)
    report.rows = [
        ProjectionRow(r.block, r.role, r.before, r.after, r.heads, r.dtype, r.bias_zeroed) for r in engine.ordered_results()
    ]
    report.seconds = time.perf_counter() - start
    report.bytes_written = tree_size(dest) if kind != "merge" else sum((dest / f).stat().st_size for w in source.weights for f in w.all_files)
    return report


def _updates_fn(weights, engine: Engine, *, record: bool, bar):
    def updates(file: str) -> dict[str, torch.Tensor]:
        out = {}
        for name in engine.tensor_names:
            info = weights.tensors.get(name)
            if info is None or info.file != file:
                continue
            out[name] = engine.update(name, weights.read(name), record=record)
            if bar is not None:
                bar.update(1)
        return out

    return updates


def _check_secondary_sets(source: Source, engine: Engine) -> None:
    """A folder with the same weights twice (safetensors and .bin): both must hold every edited tensor."""
    primary = source.primary.tensors
    for other in source.weights[1:]:
        for name in engine.tensor_names:
            theirs = other.tensors.get(name)
            if theirs is None or theirs.shape != primary[name].shape:
                raise CheckpointError(
                    f"{source.folder} holds two weight sets ({source.primary.describe()} and {other.describe()}) "
                    f"that disagree on {name!r}; point surgeon at one file, or remove the stale copy"
                )


def _after_write(source: Source, plan: Plan, engine: Engine, tmp: Path, kind: str) -> None:
    """Hook for extra files written beside the weights (the model card, in the hub module)."""


class _progress:
    """A tqdm bar on stderr that appears only for runs longer than a second."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.enabled, self.total, self.desc, self.bar = enabled, total, desc, None

    def __enter__(self):
        if self.enabled and self.total:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc=self.desc, unit="tensor", delay=1.0, leave=False)
        return self.bar

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
