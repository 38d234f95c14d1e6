"""The typed Python API over checkpoints on disk: open -> detect -> plan -> apply -> write -> report."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .compute.devices import check_device, resolve_device
from .compute.per_file import Progress
from .detect import detect_source
from .detect.hints import HINT_KEYWORDS, HintInput, Hints
from .errors import OptionError, SurgeonError, opt
from .hub.read import open_model
from .modes import get_mode
from .open.hub_ids import require_repo_id
from .open.source import Source
from .options import Recipe, ReinitOptions
from .plan.planner import Plan, prepare_checkpoint, prepare_recipe, read_recipe
from .report.report import Report
from .text.notes import capped
from .vocab.spectrum import ProjectionRow
from .write.carry_out import ONE_PROCESS, CardFacts, Executor, Job
from .write.checkpoint_report import planned_rows, reinit_report, reproduce, source_label
from .write.journal import hold
from .write.sinks import Outcome, Sink, WriteTo, open_sink

if TYPE_CHECKING:  # torch is imported when tensors are first touched, so that opening, planning and
    import torch  # the byte copies of a reinit run while it loads

    from .hub.push import PushTarget  # imported by a push only (0.07 s of imports)
    from .vocab.detection import Detection


def inspect_checkpoint(
    model: str | Path,
    *,
    hints: Hints | None = None,
    revision: str | None = None,
    config: str | Path | None = None,
    device: str | torch.device = "auto",
    full: bool = False,
    progress: bool = False,
    verify_layout: bool = False,
    jacobian: bool = False,
    inputs: str | Path | None = None,
    emit_layout: str | Path | None = None,
    emit_recipe: str | Path | None = None,
    **hint_keywords: HintInput | bool | str | Path,
) -> Report:
    """Find the attention blocks of a checkpoint and the condition numbers of their projections.

    Per-head condition numbers are always computed. The checkpoint is opened and detected once for every
    check asked for.

    Args:
        model: A path (safetensors, PyTorch, ONNX file, DCP or model folder) or a Hub id ``org/name``;
            ONNX blocks are found by walking the graph.
        hints: What config.json does not say (a :class:`~surgeon.detect.hints.Hints`).
        revision: The Hub model's branch, tag or commit (default: main).
        config: A config.json to read heads from (default: the one beside the weights).
        device: Where factorizations run: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        full: Also each whole projection's kappa and spectral norm.
        progress: Show a progress bar on stderr.
        verify_layout: Also check the blocks against the forward of the architecture config.json names
            (a note, or a LayoutError).
        jacobian: Also the attention Jacobian report (``report.jacobian``).
        inputs: With ``jacobian``: text lines or a .pt of token ids (default: a built-in sample).
        emit_layout: Write the detected layout to this file, in the form ``layout`` reads.
        emit_recipe: Write the recipe of a surgeon output (its record: a recipe's steps, or its one run) to this
            file, in the TOML ``recipe`` reads, so that the run can be replayed or edited.
        **hint_keywords: Fields of Hints (``num_heads``, ``num_kv_heads``, ``head_dim``, ``force_hints``,
            ``layout``: a layout file whose rules are tried before the built-in ones), replacing those of
            ``hints``.

    Returns:
        The report: the blocks found and each projection's condition numbers.

    Raises:
        CheckpointError: The checkpoint cannot be read.
        NoAttentionFoundError: No attention projection was found.
        OptionError: An argument is out of range or goes with another.
        HubError: The Hub model cannot be fetched.

    >>> report = inspect_checkpoint("model.safetensors", num_heads=12)  # doctest: +SKIP
    """
    hints = Hints.build(hints, **hint_keywords)
    if inputs is not None and not jacobian:
        raise OptionError(f"{opt('inputs')} goes with {opt('jacobian', True)}")
    from .compute.engine import inspect_blocks

    dev = resolve_device(device)
    start = time.perf_counter()
    # read by Range where it can: the measured tensors' bytes, not whole shards (the jacobian loads the model)
    source = open_model(model, config=config, revision=revision, progress=progress, whole=jacobian)
    detection = detect_source(source, hints)
    weights = source.primary
    if emit_layout is not None:
        if weights.graph:
            raise OptionError(
                f"{opt('emit_layout')} writes tensor names, but an ONNX graph's attention is found by walking the graph"
            )
        from .detect.layout_emit import emit, write_layout

        write_layout(emit(weights.tensors, source.config, hints, detection.blocks), emit_layout)
    if emit_recipe is not None:
        _emit_recipe(source, emit_recipe)
    tensors = {p.weight.tensor for b in detection.blocks for p in b.projections}
    with hold(source, exclusive=False), Progress(progress, len(tensors), "inspect") as bar:
        spectra = inspect_blocks(detection.blocks, weights.read, dev, progress=bar.update if bar else None, whole=full)
    unread = [f"cannot be read, left as it is by any reinit: {u.why}" for u in detection.unreadable]
    rest = [u.module or "the top-level attention module" for u in detection.unreadable[3:]]
    unread = unread[:3] + ([f"and {len(rest)} more that cannot be read: {', '.join(rest)}"] if rest else [])
    notes = [
        *source.notes,
        *detection.left_alone,
        *unread,
        *capped(detection.notes, "detection notes"),
        *_moved(source),
    ]
    if emit_layout is not None:
        notes.append(f"wrote the detected layout to {emit_layout} (give it back with {opt('layout', emit_layout)})")
    if emit_recipe is not None:
        notes.append(f"wrote the recipe of its record to {emit_recipe} (run it with {opt('recipe', emit_recipe)})")
    if verify_layout:
        from .audit.layout import check_layout

        notes.append(check_layout(source, detection.blocks).summary())
    report_jacobian = None
    if jacobian:
        from .compute.jacobian import source_jacobian

        report_jacobian = source_jacobian(source, inputs=inputs)
    rows = [
        ProjectionRow(
            block, p.role, spectra[(block.module, p.role)], dtype=weights.tensors[p.weight.tensor].element or ""
        )
        for block in detection.blocks
        for p in block.projections
    ]
    return Report(
        "inspect",
        source_label(source),
        weights.describe(),
        detection.blocks,
        tuple(rows),
        seconds=time.perf_counter() - start,
        device=str(dev),
        notes=tuple(notes),
        jacobian=report_jacobian,
        transfer=source.transfer.to_dict() if source.transfer is not None else None,
    )


def reinit_checkpoint(
    model: str | Path,
    *,
    options: ReinitOptions | None = None,
    hints: Hints | None = None,
    output: str | Path | None = None,
    in_place: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
    push: PushTarget | str | None = None,
    device: str | torch.device = "auto",
    revision: str | None = None,
    config: str | Path | None = None,
    full: bool = False,
    progress: bool = False,
    distributed: bool = False,
    base_model: str | None = None,
    recipe: Recipe | str | Path | None = None,
    **keywords: Any,
) -> Report:
    """Re-initialize the chosen Q/K/V projections of a checkpoint and write a new one.

    Every tensor not re-initialized keeps its bytes. A folder output gets a model card. ONNX: an .onnx
    with external data written as ``out.onnx`` gets its data beside it (``out.onnx.data``); a shared
    initializer that must change becomes a copy for the chosen projections.

    Args:
        model: A path (safetensors, PyTorch, ONNX file, DCP or model folder) or a Hub id ``org/name``.
        options: What to re-initialize and how (a :class:`~surgeon.options.ReinitOptions`; default: the
            conditioned reset of every layer).
        hints: What config.json does not say (a :class:`~surgeon.detect.hints.Hints`).
        output: Where to write (default: beside the input).
        in_place: Change the input itself (safetensors: only the changed byte ranges, journaled; see
            :mod:`surgeon.write.journal`).
        overwrite: Replace an existing output.
        dry_run: Plan only; write nothing.
        push: Upload the output folder in one commit: a repo id, or a :class:`~surgeon.hub.push.PushTarget`
            for a branch, a pull request, a private repo or a token.
        device: Where generation and factorizations run: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        revision: The Hub model's branch, tag or commit (default: main).
        config: A config.json to read heads from (default: the one beside the weights).
        full: Also each whole projection's kappa and spectral norm.
        progress: Show a progress bar on stderr.
        distributed: Run on every rank of a torchrun job (or of a training script's process group): each
            rank calls this with the same arguments and writes its own share of a DCP or sharded
            safetensors folder (:mod:`surgeon.write.ranks`); the output is the one a single process
            writes, byte for byte, and every rank returns the whole report.
        base_model: The Hub model a local MODEL comes from, ``org/name``, for the model card's lineage (its
            ``base_model`` metadata and first line); default: a Hub MODEL's own id, else the ``base_model`` the
            source's own card names.
        recipe: Several steps in one pass over the bytes, instead of ``options``: a
            :class:`~surgeon.options.Recipe`, or a .toml/.yaml file of one (``surgeon.plan.planner.read_recipe``).
        **keywords: Fields of ReinitOptions (``layers``, ``targets``, ``mode``, ``seed``, ...) or of Hints
            (``num_heads``, ``head_dim``, ...), replacing those of ``options`` and ``hints``.

    Returns:
        The report: the blocks, each projection's condition numbers before and after, the output.

    Raises:
        CheckpointError: The checkpoint cannot be read.
        NoAttentionFoundError: No attention projection was found.
        OptionError: An option is out of range, or options that do not go together.
        SelectionError: The selection names layers or heads the model does not have.
        OutputError: The output cannot be written (e.g. it exists without ``overwrite``).
        HubError: The Hub model cannot be fetched, or the push failed (the output is on disk).
        TypeError: A keyword is neither an option nor a hint.

    >>> reinit_checkpoint("model.safetensors", layers="0-11", output="reset.safetensors")  # doctest: +SKIP
    >>> reinit_checkpoint("./bert", options=ReinitOptions(targets="q,k"), push="me/bert-reset")  # doctest: +SKIP
    """
    opts, hints = _options_and_hints(options, hints, keywords)
    if recipe is not None:
        given = [k for k in keywords if k in {f.name for f in fields(ReinitOptions)}]
        if options is not None or given:
            raise OptionError(
                f"{opt('recipe')} holds the options of each of its steps: give them there, not as "
                f"{opt(given[0]) if given else opt('options')}"
            )
        if distributed:
            raise OptionError(f"{opt('recipe')} runs in one process: run it without torchrun")
    chosen: ReinitOptions | Recipe = (
        opts if recipe is None else recipe if isinstance(recipe, Recipe) else read_recipe(recipe)
    )
    target = _push_target(push, dry_run=dry_run)
    if base_model is not None:
        base_model = require_repo_id(base_model, opt("base_model"))
    check_device(device)
    staging = target.staging if target is not None else None
    if staging is not None:
        if output is not None:
            raise OptionError(
                f"{opt('staging')} is where a push stages what changed, and {opt('output')} writes the whole "
                "output: give one of them"
            )
        output = staging
    read = ReadFrom(model, revision, config)
    write_to = WriteTo(output, in_place, overwrite, dry_run, target, staging is not None, base_model)
    if not distributed:
        return _reinit(read, RunWith(chosen, hints, device, full, progress), write_to, ONE_PROCESS)
    from .write import ranks

    ranks.refuse(in_place=in_place, push=target is not None)
    group = ranks.Ranks.join()
    try:  # no progress bars: the ranks' would share one terminal
        return _reinit(read, RunWith(opts, hints, device, full, False), write_to, ranks.RankedRun(group))
    finally:
        group.close()


@dataclass(frozen=True)
class ReadFrom:
    """What a reinit reads: MODEL (a path or a Hub id), its revision, the config.json to read heads from."""

    model: str | Path
    revision: str | None = None
    config: str | Path | None = None


@dataclass(frozen=True)
class RunWith:
    """How a reinit runs: the options, the hints, where it computes, what it measures and shows."""

    options: ReinitOptions | Recipe
    hints: Hints
    device: str | torch.device = "auto"
    full: bool = False
    progress: bool = False


def _reinit(read: ReadFrom, how: RunWith, to: WriteTo, executor: Executor) -> Report:
    """The checkpoint path, stage by stage: open, sink, detect, plan, then predict (a dry run) or carry out
    (through ``executor``) and finish, report."""
    start = time.perf_counter()

    def prepare() -> tuple[Source, Sink, Detection, Plan]:
        source = open_model(
            read.model, config=read.config, revision=read.revision, progress=how.progress,
            recover=to.patches_input and not to.dry_run,
        )  # fmt: skip
        sink = open_sink(source, to)
        executor.check(source, sink.dest)
        detection = detect_source(source, how.hints)
        if isinstance(how.options, Recipe):  # each step's SOURCE, where its mode reads one
            references = [_open_reference(step, how.progress) for step in how.options.steps]
            return source, sink, detection, prepare_recipe(source, detection, how.options, references)
        reference = _open_reference(how.options, how.progress)  # restore's SOURCE (None: the mode reads none)
        return source, sink, detection, prepare_checkpoint(source, detection, how.options, reference=reference)

    source, sink, detection, plan = executor.step(prepare)  # a refusal on one rank stops them all
    notes = [*source.notes, *capped(detection.notes, "detection notes"), *plan.notes]
    if to.dry_run:
        predicted = sink.predict(source, plan)
        rows = planned_rows(source, plan)
        return reinit_report(
            source, detection, plan, sink.dest, rows, [*notes, *predicted.notes, *_moved(source)],
            device=str(how.device), transfer=_figures(source, predicted),
        )  # fmt: skip
    card = CardFacts(
        sink.title,
        lambda: reproduce(read.model, source, plan, how.hints, sink.dest.path),
        to.base_model,
    )
    with hold(source, exclusive=to.patches_input):  # in place: alone; a copy: never while an in-place run patches it
        done = executor.carry_out(Job(source, detection, plan, sink.dest, how.device, how.full, how.progress, card))
    seconds = time.perf_counter() - start
    finished = sink.finish(source, plan, progress=how.progress)
    return reinit_report(
        source, detection, plan, sink.dest, done.rows, [*notes, *done.notes, *_moved(source), *finished.notes],
        device=done.device, seconds=seconds, bytes_written=done.bytes_written, io=done.io, dry_run=False,
        transfer=_figures(source, finished),
    )  # fmt: skip


def _emit_recipe(source: Source, path: str | Path) -> None:
    """The recipe of the output ``source`` (its last record: a recipe's steps or its one run) written to ``path``."""
    from .report.record import parse_record, stored_history

    found, where = stored_history(source)
    if not found:
        raise OptionError(
            f"{opt('emit_recipe')} writes the recipe surgeon recorded in an output, and {source.path} holds no record "
            f"in {where}"
        )
    record = parse_record(found[-1], f"{source.path} ({where})")
    recipe = record.recipe or Recipe((record.options,))
    notes = {
        i: "SOURCE was a checkpoint on disk, named here by its name only: write its path (the record keeps its sha256)"
        for i, run in enumerate(record.runs)
        if run.source is not None and "sha256" in run.source
    }
    Path(path).write_text(recipe.to_toml(notes), encoding="utf-8")


def _open_reference(options: ReinitOptions, progress: bool) -> Source | None:
    """The checkpoint the mode reads besides MODEL (restore's SOURCE: a path or a Hub id), opened, or None."""
    named = get_mode(options.mode).source(options)
    if named is None:
        return None
    if named[1] is not None and Path(named[0]).exists():
        raise OptionError(f"{opt('from_revision')} applies to a Hub SOURCE, and {named[0]} is a local path")
    try:
        return open_model(named[0], revision=named[1], progress=progress)
    except SurgeonError as exc:  # said of SOURCE, not of MODEL
        exc.context = f"SOURCE {named[0]}: {exc.context or ''}"
        raise


def _moved(source: Source) -> list[str]:
    """The report's line on what reading the weights moved over the network (none where they are on disk)."""
    return [source.transfer.note()] if source.transfer is not None else []


def _figures(source: Source, outcome: Outcome) -> dict[str, int] | None:
    """The report's ``transfer``: what reading moved, and what the sink moved (or would)."""
    if source.transfer is None and not outcome.transfer:
        return None
    return {**(source.transfer.to_dict() if source.transfer is not None else {}), **outcome.transfer}


_PUSH_KEYWORDS = {  # a push setting given as a keyword of reinit_checkpoint -> the PushTarget field that takes it
    "push_to_hub": "repo_id",
    "private": "private",
    "push_branch": "branch",
    "create_pr": "create_pr",
    "commit_message": "commit_message",
    "token": "token",
}


def _options_and_hints(
    options: ReinitOptions | None, hints: Hints | None, keywords: dict[str, Any]
) -> tuple[ReinitOptions, Hints]:
    """The options and hints objects, with their fields given as keywords replaced."""
    option_names = [f.name for f in fields(ReinitOptions)]
    unknown = sorted(set(keywords) - set(option_names) - set(HINT_KEYWORDS))
    pushed = [k for k in unknown if k in _PUSH_KEYWORDS]
    if pushed:  # push settings given as keywords of their own: pointed to PushTarget, which takes them
        raise TypeError(
            f"unexpected keyword argument {pushed[0]!r}: a push is push='org/name', or "
            f"push=PushTarget('org/name', {_PUSH_KEYWORDS[pushed[0]]}=...) for its other settings"
        )
    if unknown:
        raise TypeError(
            f"unexpected keyword argument {unknown[0]!r}; the options are {', '.join(option_names)}, "
            f"the hints {', '.join(HINT_KEYWORDS)}"
        )
    hint_keywords = {k: keywords.pop(k) for k in HINT_KEYWORDS if k in keywords}
    return ReinitOptions.build(options, **keywords), Hints.build(hints, **hint_keywords)


def _push_target(push: PushTarget | str | None, *, dry_run: bool) -> PushTarget | None:
    """The push a reinit asks for, checked before anything is opened (its token too, unless nothing is sent)."""
    if push is None:
        return None
    from .hub.push import PushTarget

    if not isinstance(push, (PushTarget, str)):
        raise TypeError(f"push must be a repo id 'org/name' or a surgeon.PushTarget, not {type(push).__name__}")
    target = push if isinstance(push, PushTarget) else PushTarget(push)
    if not dry_run:
        target.check_token()
    return target
