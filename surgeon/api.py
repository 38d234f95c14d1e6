"""The typed Python API over checkpoints on disk: open -> detect -> plan -> apply -> write -> report."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch

from . import hub
from .apply import Engine, inspect_blocks, resolve_device
from .detect.config import Hints
from .detect.names import Detection, detect
from ._version import __version__
from .errors import CheckpointError, OptionError
from .output import copy_extras, output_kind, resolve_output, staged, tree_size
from .plan import Plan, ReinitOptions, make_plan
from .report import ProjectionRow, Report
from .selection import IndexSpec
from .source import Source


def load(model: str | Path, *, config: str | Path | None = None, revision: str | None = None, progress: bool = False) -> Source:
    """Open a checkpoint: a file, a sharded index, a model folder, or a Hub id ``org/name`` (a local path wins)."""
    return hub.open_model(model, config=config, revision=revision, progress=progress)


def _label(source: Source) -> str:
    """How reports name the input: the Hub id for a Hub model (its cache path is in the notes)."""
    return f"{source.hub_id}@{source.hub_revision or 'main'}" if source.hub_id else str(source.path)


def _detect(source: Source, hints: Hints) -> Detection:
    found = source.primary.detect(source.config, hints)
    if found is not None:
        return found
    return detect(source.primary.tensors, source.config, hints, source=str(source.path))


def inspect_checkpoint(
    model: str | Path,
    *,
    revision: str | None = None,
    config: str | Path | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    force_hints: bool = False,
    device: str | torch.device = "auto",
    progress: bool = False,
) -> Report:
    """Find the attention blocks of a checkpoint and the condition numbers of their projections.

    ``model`` is a path or a Hugging Face Hub id (``org/name``, at ``revision``).
    """
    dev = resolve_device(device)
    start = time.perf_counter()
    source = load(model, config=config, revision=revision, progress=progress)
    detection = _detect(source, Hints(num_heads, num_kv_heads, head_dim, force_hints))
    weights = source.primary
    with _progress(progress, len({p.weight.tensor for b in detection.blocks for p in b.projections}), "inspect") as bar:
        spectra = inspect_blocks(detection.blocks, weights.read, dev, progress=bar.update if bar else None)
    rows = [
        ProjectionRow(block, proj.role, spectra[(block.module, proj.role)], dtype=str(weights.tensors[proj.weight.tensor].torch_dtype).removeprefix("torch."))
        for block in detection.blocks
        for proj in block.projections
    ]
    return Report(
        "inspect", _label(source), weights.describe(), detection.blocks, rows,
        seconds=time.perf_counter() - start, device=str(dev), notes=source.notes + detection.notes[:5],
    )


def reinit_checkpoint(
    model: str | Path,
    *,
    revision: str | None = None,
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
    force_hints: bool = False,
    progress: bool = False,
    push_to_hub: str | None = None,
    private: bool = False,
    push_revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
) -> Report:
    """Re-initialize the chosen Q/K/V projections of a checkpoint and write a new one beside it.

    ``model`` is a path or a Hugging Face Hub id (``org/name``, at ``revision``). A folder output gets a
    model card (README.md). ``push_to_hub="org/name"`` then uploads the output folder in one commit
    (see :func:`surgeon.hub.push_folder` for ``private``, ``push_revision``, ``create_pr``, ``token``).
    """
    if push_to_hub is None and (private or push_revision or create_pr or commit_message):
        raise OptionError("--private, --push-revision, --create-pr and --commit-message go with --push-to-hub org/name")
    if push_to_hub is not None:
        if in_place:
            raise OptionError("--push-to-hub pushes a new output folder; it cannot be combined with --in-place")
        push_to_hub = hub.check_push(push_to_hub, revision=push_revision, create_pr=create_pr, token=token)
    options = ReinitOptions(
        layers=layers, targets=targets, heads=heads, attention=attention, stack=stack, mode=mode,
        strength=strength, value_identity=value_identity, keep_scale=keep_scale, bias=bias, seed=seed,
    ).validated()
    dev = resolve_device(device)
    start = time.perf_counter()
    source = load(model, config=config, revision=revision, progress=progress)
    if push_to_hub is not None and output_kind(source) != "folder":
        raise OptionError(f"--push-to-hub uploads a model folder, and the output of {source.path.name} is a single file: give the model folder as MODEL")
    hints = Hints(num_heads, num_kv_heads, head_dim, force_hints)
    detection = _detect(source, hints)
    plan = make_plan(detection.blocks, options)
    dest = resolve_output(source, output, in_place=in_place, overwrite=overwrite or dry_run)
    report = Report(
        "reinit", _label(source), source.describe(), detection.blocks, options=options.to_dict(),
        output=str(dest), dry_run=dry_run, device=str(dev), notes=source.notes + detection.notes[:5],
    )
    if dry_run:
        if dest.exists() and not overwrite and not in_place:
            report.notes.append(f"{dest} exists: the real run needs --overwrite or another -o")
        report.rows = [
            ProjectionRow(c.block, c.role, None, heads_changed=c.heads, bias_zeroed=options.zero_bias and c.projection.bias is not None,
                          dtype=str(source.primary.tensors[c.projection.weight.tensor].torch_dtype).removeprefix("torch."))
            for c in plan.changes
        ]
        if push_to_hub is not None:
            report.notes.append(f"the real run pushes {dest.name} to {push_to_hub}")
        return report
    for weights in source.weights:
        weights.check_plan(plan)
    engine = Engine(plan, dev)
    _check_secondary_sets(source, engine)
    kind = "merge" if in_place and source.kind != "file" else output_kind(source)
    with _progress(progress, len(engine.tensor_names) * len(source.weights), "reinit") as bar:
        with staged(dest, kind, file_name=source.path.name, notes=report.notes) as tmp:
            for i, weights in enumerate(source.weights):
                weights.save(tmp, _updates_fn(weights, engine, record=i == 0, bar=bar), plan.record())
            if kind == "folder" and source.kind == "folder":
                copy_extras(source, tmp)
            command = _reproduce(model, source, options, hints, dest)
            _after_write(source, plan, engine, tmp, kind, command=command, title=push_to_hub or dest.name)
    report.rows = [
        ProjectionRow(r.block, r.role, r.before, r.after, r.heads, r.dtype, r.bias_zeroed) for r in engine.ordered_results()
    ]
    report.seconds = time.perf_counter() - start
    report.bytes_written = tree_size(dest) if kind != "merge" else sum((dest / f).stat().st_size for w in source.weights for f in w.all_files)
    if push_to_hub is not None:
        try:
            pushed = hub.push_folder(
                dest, push_to_hub, private=private, revision=push_revision, create_pr=create_pr,
                commit_message=commit_message or _commit_message(source, plan), token=token, progress=progress,
            )
        except hub.HubError as exc:  # the output is on disk: say so, and keep the error's type
            exc.args = (f"wrote {dest}, but the push failed: {exc}",)
            raise
        report.notes += pushed.notes + [pushed.summary()]
    return report


def _reproduce(model: str | Path, source: Source, options: ReinitOptions, hints: Hints, dest: Path) -> str:
    from .card import reproduce_command

    if source.hub_id:
        label, revision = source.hub_id, source.hub_commit
    else:  # a relative path as typed; never an absolute one (it would publish a local directory layout)
        label, revision = (str(model) if not Path(model).is_absolute() else Path(model).name), None
    return reproduce_command(label, revision=revision, options=options.to_dict(), hints=hints, output=dest.name)


def _commit_message(source: Source, plan: Plan) -> str:
    targets = ",".join(plan.options.to_dict()["targets"])
    of = f" of {source.hub_id}" if source.hub_id else ""
    n = len(plan.touched_blocks)
    return f"Conditioned re-initialization of {targets} in {n} attention block{'s' if n != 1 else ''}{of} (surgeon {__version__})"


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


def _after_write(source: Source, plan: Plan, engine: Engine, tmp: Path, kind: str, *, command: str, title: str) -> None:
    """Files written beside the weights: the model card of a folder output.

    In-place runs ("merge") replace the weight files only and leave the folder's README.md alone.
    """
    if kind == "folder":
        from .card import write_card

        write_card(tmp, source=source, plan=plan, results=engine.ordered_results(), command=command, title=title)


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
