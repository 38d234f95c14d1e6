"""The typed Python API over checkpoints on disk: open -> detect -> plan -> apply -> write -> report."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import hub
from ._version import __version__
from .detect import Detection, detect_source
from .detect.config import HintInput, Hints
from .errors import CheckpointError, HubError, OptionError, opt
from .journal import check_in_place, hold, refuse_second_copies
from .modes import get_mode
from .output import companion_files, copy_extras, output_kind, resolve_output, staged, tree_size
from .plan import Plan, ReinitOptions, prepare
from .report import ProjectionRow, Report
from .source import Source

if TYPE_CHECKING:  # torch is imported when tensors are first touched, so that opening, planning and
    import torch  # the byte copies of a reinit run while it loads

    from .apply import Engine


def load(
    model: str | Path,
    *,
    config: str | Path | None = None,
    revision: str | None = None,
    progress: bool = False,
    recover: bool = False,
) -> Source:
    """Open a checkpoint: a file, a sharded index, a model folder, or a Hub id ``org/name`` (a local path wins).

    A checkpoint an interrupted in-place run left behind is refused (``surgeon recover``), or rolled back
    first with ``recover=True`` (what an in-place run on it does)."""
    return hub.open_model(model, config=config, revision=revision, progress=progress, recover=recover)


def _label(source: Source) -> str:
    """How reports name the input: the Hub id for a Hub model (its cache path is in the notes)."""
    return f"{source.hub_id}@{source.hub_revision or 'main'}" if source.hub_id else str(source.path)


def check_device(device: str | torch.device | None) -> None:
    """Refuse a misspelt --device before anything is opened (whether it exists is checked with torch)."""
    text = "auto" if device is None else str(device)
    kind, _, index = text.partition(":")
    if kind in ("meta", "mps", "xpu", "xla", "hpu", "mtia", "privateuseone"):
        raise OptionError(f"unsupported device {text!r}: use auto, cpu, cuda or cuda:N")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise OptionError(f"unknown device {text!r}: use auto, cpu, cuda or cuda:N")


def inspect_checkpoint(
    model: str | Path,
    *,
    revision: str | None = None,
    config: str | Path | None = None,
    num_heads: HintInput = None,
    num_kv_heads: HintInput = None,
    head_dim: HintInput = None,
    force_hints: bool = False,
    device: str | torch.device = "auto",
    full: bool = False,
    progress: bool = False,
    verify_layout: bool = False,
    jacobian: bool = False,
    inputs: str | Path | None = None,
) -> Report:
    """Find the attention blocks of a checkpoint and the condition numbers of their projections.

    ``model`` is a path (safetensors, PyTorch, ONNX file or folder) or a Hugging Face Hub id (``org/name``,
    at ``revision``); ONNX blocks are found by walking the graph. Per-head condition numbers are always computed; the whole-projection kappa and spectral norm with ``full=True``.
    ``verify_layout=True`` also checks the blocks against the forward of the architecture config.json names
    (:func:`surgeon.layout_check.verify_layout`; a note, or a LayoutError); ``jacobian=True`` adds the attention
    Jacobian report (``report.jacobian``; ``inputs``: text lines or a .pt of token ids). The checkpoint is
    opened and detected once for all of them.
    """
    if inputs is not None and not jacobian:
        raise OptionError(f"{opt('inputs')} goes with {opt('jacobian', True)}")
    from .apply import inspect_blocks, resolve_device

    dev = resolve_device(device)
    start = time.perf_counter()
    source = load(model, config=config, revision=revision, progress=progress)
    detection = detect_source(source, Hints(num_heads, num_kv_heads, head_dim, force_hints))
    weights = source.primary
    with (
        hold(source, exclusive=False),
        _progress(progress, len({p.weight.tensor for b in detection.blocks for p in b.projections}), "inspect") as bar,
    ):
        spectra = inspect_blocks(detection.blocks, weights.read, dev, progress=bar.update if bar else None, whole=full)
    rows = [
        ProjectionRow(
            block,
            proj.role,
            spectra[(block.module, proj.role)],
            dtype=weights.tensors[proj.weight.tensor].element or "",
        )
        for block in detection.blocks
        for proj in block.projections
    ]
    report = Report(
        "inspect",
        _label(source),
        weights.describe(),
        detection.blocks,
        rows,
        seconds=time.perf_counter() - start,
        device=str(dev),
        notes=source.notes + detection.notes[:5],
    )
    if verify_layout:
        from .layout_check import check_layout

        report.notes.append(check_layout(source, detection.blocks).summary())
    if jacobian:
        from .jacobian import source_jacobian

        report.jacobian = source_jacobian(source, inputs=inputs)
    return report


@dataclass(frozen=True)
class PushTarget:
    """Where and how a reinit's output folder is pushed (``push_to_hub`` and its companions)."""

    repo_id: str
    private: bool = False
    revision: str | None = None
    create_pr: bool = False
    commit_message: str | None = None
    token: str | None = None


def reinit_checkpoint(
    model: str | Path,
    *,
    options: ReinitOptions | None = None,
    revision: str | None = None,
    output: str | Path | None = None,
    in_place: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
    device: str | torch.device = "auto",
    config: str | Path | None = None,
    num_heads: HintInput = None,
    num_kv_heads: HintInput = None,
    head_dim: HintInput = None,
    force_hints: bool = False,
    full: bool = False,
    progress: bool = False,
    push_to_hub: str | None = None,
    private: bool = False,
    push_revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
    **option_keywords: Any,
) -> Report:
    """Re-initialize the chosen Q/K/V projections of a checkpoint and write a new one beside it.

    How: ``options`` (a :class:`~surgeon.plan.ReinitOptions`), or its fields as keywords (``layers``,
    ``targets``, ``heads``, ``attention``, ``stack``, ``mode``, ``strength``, ``value_identity``,
    ``keep_scale``, ``bias``, ``seed``, ``gain``, ``std``), which replace those of ``options``. ``model``: a path (safetensors, PyTorch, ONNX file or folder) or a Hub id (``org/name``, at ``revision``).
    A folder output gets a model card. ONNX: ``output="out.onnx"`` for an .onnx with external data writes
    out.onnx with its data beside it (``out.onnx.data``), a path without .onnx a folder; a shared initializer
    that must change becomes a copy for the chosen projections. ``push_to_hub="org/name"`` uploads the output
    folder in one commit (see :func:`surgeon.hub.push_folder`: ``private``, ``push_revision``, ``create_pr``, ``token``).
    ``in_place=True`` on safetensors patches only the changed byte ranges, journaled (see
    :mod:`surgeon.journal`). ``full=True`` also measures each whole projection's kappa and spectral norm.
    """
    opts = ReinitOptions.build(options, **option_keywords)
    push = _push_target(push_to_hub, private, push_revision, create_pr, commit_message, token, in_place=in_place)
    opts = opts.validated()
    check_device(device)
    start = time.perf_counter()
    source = load(model, config=config, revision=revision, progress=progress, recover=in_place and not dry_run)
    _check_push_output(push, source)
    if in_place:  # refused before any write: a second copy of the weights left stale; for a byte patch, shared bytes
        refuse_second_copies(source)
        if source.primary.patches_in_place:
            check_in_place(source)
    hints = Hints(num_heads, num_kv_heads, head_dim, force_hints)
    detection = detect_source(source, hints)
    plan = prepare(
        detection.blocks,
        opts,
        config=source.config,
        shapes={n: t.shape for n, t in source.primary.tensors.items()},
        whole_tensors=source.primary.rewrites_whole_tensors,
        depths=detection.depths,
    )
    opts = plan.options  # with the mode's defaults from config (redraw: the family's std)
    dest = resolve_output(source, output, in_place=in_place, overwrite=overwrite or dry_run, folder=push is not None)
    report = Report(
        "reinit",
        _label(source),
        source.describe(),
        detection.blocks,
        options=opts.to_dict(),
        output=str(dest),
        dry_run=dry_run,
        device=str(device),
        notes=source.notes + detection.notes[:5] + plan.notes,
    )
    if dry_run:
        return _plan_report(report, source, plan, dest, overwrite=overwrite, in_place=in_place, push=push)
    with hold(source, exclusive=in_place):  # in place: alone; a copy: never while an in-place run patches it
        _run_and_write(
            report,
            source,
            detection,
            plan,
            dest,
            device=device,
            full=full,
            progress=progress,
            in_place=in_place,
            push=push,
            command=lambda: _reproduce(model, source, opts, hints, dest),
        )
    report.seconds = time.perf_counter() - start
    if push is not None:
        _push(report, dest, push, source, plan, progress=progress)
    return report


def _push_target(
    repo_id: str | None,
    private: bool,
    revision: str | None,
    create_pr: bool,
    commit_message: str | None,
    token: str | None,
    *,
    in_place: bool,
) -> PushTarget | None:
    """The push a reinit asks for, checked before anything is opened; None without ``push_to_hub``."""
    if repo_id is None:
        if private or revision or create_pr or commit_message:
            raise OptionError(
                f"{opt('private')}, {opt('push_revision')}, {opt('create_pr')} and {opt('commit_message')} "
                f"go with {opt('push_to_hub', 'org/name')}"
            )
        return None
    if in_place:
        raise OptionError(
            f"{opt('push_to_hub')} pushes a new output folder; it cannot be combined with {opt('in_place', True)}"
        )
    repo_id = hub.check_push(repo_id, revision=revision, create_pr=create_pr, token=token)
    return PushTarget(repo_id, private, revision, create_pr, commit_message, token)


def _check_push_output(push: PushTarget | None, source: Source) -> None:
    if push is not None and output_kind(source) == "file":
        raise OptionError(
            f"{opt('push_to_hub')} uploads a model folder, and the output of {source.path.name} is a single file: "
            "give the model folder as MODEL"
        )


def _run_and_write(
    report: Report,
    source: Source,
    detection: Detection,
    plan: Plan,
    dest: Path,
    *,
    device,
    full: bool,
    progress: bool,
    in_place: bool,
    push: PushTarget | None,
    command,
) -> None:
    """Compute the new values and write them (a patch in place, or a copy); fill in the report's rows."""
    for weights in source.weights:
        report.notes += weights.check_plan(plan, detection)
    _check_secondary_sets(source, plan.tensors())
    run = _Run(plan, device, whole=full, progress=progress, total=len(plan.tensors()) * len(source.weights))
    try:
        if in_place and source.primary.patches_in_place:
            from .journal import patch_in_place

            report.notes += patch_in_place(source, run.updates_for(source.primary, record=True), plan.record())
            kind = "patch"
        else:
            title = push.repo_id if push is not None else dest.name
            kind = _write_copy(
                source, plan, run, dest, in_place=in_place, title=title, notes=report.notes, command=command
            )
    finally:
        run.close()
    if run.started:
        report.device = str(run.engine.device)
        report.rows = [
            ProjectionRow(r.block, r.role, r.before, r.after, r.heads, r.dtype, r.bias_zeroed)
            for r in run.engine.ordered_results()
        ]
    else:
        report.rows = []
    if kind == "patch":
        report.bytes_written = run.bytes_changed
    elif kind == "merge":
        report.bytes_written = sum((dest / f).stat().st_size for w in source.weights for f in w.all_files)
    elif kind == "files":
        report.bytes_written = sum(p.stat().st_size for p in [dest, *companion_files(source, dest)])
    else:
        report.bytes_written = tree_size(dest)


def _push(report: Report, dest: Path, push: PushTarget, source: Source, plan: Plan, *, progress: bool) -> None:
    try:
        pushed = hub.push_folder(
            dest,
            push.repo_id,
            private=push.private,
            revision=push.revision,
            create_pr=push.create_pr,
            commit_message=push.commit_message or _commit_message(source, plan),
            token=push.token,
            progress=progress,
        )
    except HubError as exc:  # the output is on disk: say so, and keep the error's type
        exc.context = f"wrote {dest}, but the push failed: "
        raise
    report.notes += pushed.notes + [pushed.summary()]


def _plan_report(
    report: Report, source: Source, plan: Plan, dest: Path, *, overwrite: bool, in_place: bool, push: PushTarget | None
) -> Report:
    """A dry run: the plan as rows, nothing computed or written."""
    if dest.exists() and not overwrite and not in_place:
        report.notes.append(f"{dest} exists: the real run needs {opt('overwrite', True)} or another {opt('output')}")
    report.rows = [
        ProjectionRow(
            c.block,
            c.role,
            None,
            heads_changed=c.heads,
            bias_zeroed=plan.options.zero_bias and c.projection.bias is not None,
            dtype=source.primary.tensors[c.projection.weight.tensor].element or "",
        )
        for c in plan.changes
    ]
    if push is not None:
        report.notes.append(f"the real run pushes {dest.name} to {push.repo_id}")
    return report


def _write_copy(
    source: Source, plan: Plan, run: _Run, dest: Path, *, in_place: bool, command, title: str, notes: list[str]
) -> str:
    """Write the re-initialized checkpoint into a staging folder, then move it into place.

    ``command()`` gives the model card's reproduce command; it is made after the weights, so that
    nothing delays the start of the byte copies.
    """
    kind = "merge" if in_place and source.kind != "file" else output_kind(source, dest)
    if kind == "files":  # an .onnx with external data, written as the file dest with its data beside it
        with staged(dest, kind, file_name=dest.name, notes=notes) as tmp:
            source.primary.save_as(tmp, dest.name, run.updates_for(source.primary, record=True), plan.record())
        return kind
    with staged(dest, kind, file_name=source.path.name, notes=notes) as tmp:
        for i, weights in enumerate(source.weights):
            weights.save(tmp, run.updates_for(weights, record=i == 0), plan.record())
        if kind == "folder" and source.kind == "folder":
            copy_extras(source, tmp)
        if kind == "folder":
            from .card import write_card

            write_card(
                tmp, source=source, plan=plan, results=run.engine.ordered_results(), command=command(), title=title
            )
    return kind


class _Updates:
    """The new values of one weight set's changing tensors, computed one at a time (see UpdatesFn)."""

    def __init__(self, run: _Run, weights, record: bool) -> None:
        self.run, self.weights, self.record = run, weights, record
        self.order = [n for n in run.plan.tensors() if n in weights.tensors]
        self.names = frozenset(self.order)

    def __call__(self, file: str) -> Iterator[tuple[str, torch.Tensor]]:
        run = self.run
        for name in self.order:
            info = self.weights.tensors[name]
            if info.file != file:
                continue
            yield name, run.engine.update(name, self.weights.read(name), record=self.record)
            run.bytes_changed += info.nbytes
            if run._bar.bar is not None:
                run._bar.bar.update(1)


class _Run:
    """The compute side of a reinit: the Engine, made (and torch imported) on first use.

    Formats call ``updates(file)`` once per file after starting that file's byte copy, so the
    torch import and the math overlap the copying.
    """

    def __init__(self, plan: Plan, device, *, whole: bool, progress: bool, total: int) -> None:
        self.plan, self.device, self.whole = plan, device, whole
        self._engine: Engine | None = None
        self._bar = _progress(progress, total, "reinit")
        self.bytes_changed = 0

    @property
    def started(self) -> bool:
        return self._engine is not None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            from .apply import Engine, resolve_device

            self._engine = Engine(self.plan, resolve_device(self.device), whole=self.whole)
            self._bar.__enter__()
        return self._engine

    def updates_for(self, weights, *, record: bool) -> _Updates:
        return _Updates(self, weights, record)

    def close(self) -> None:
        self._bar.__exit__(None, None, None)


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
    return f"{get_mode(plan.options.mode).label} of {targets} in {n} attention block{'s' if n != 1 else ''}{of} (surgeon {__version__})"


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
