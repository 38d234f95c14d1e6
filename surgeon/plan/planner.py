"""From detected blocks and the user's selection to a plan: which heads of which projections change how."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..detect.base_model import CheckpointDrawKeys
from ..detect.placement import kind
from ..errors import CheckpointError, OptionError, SelectionError, SurgeonError, opt
from ..modes import get_mode
from ..options import RECIPE_METHOD, Recipe, ReinitOptions
from ..vocab.blocks import AttentionBlock, Unreadable
from ..vocab.change import Change
from ..vocab.selection import IndexSelection, format_indices, parse_attention

if TYPE_CHECKING:
    from ..formats.base import TensorInfo, WeightSet
    from ..open.source import Source
    from ..vocab.detection import Detection


@dataclass(frozen=True)
class Reference:
    """SOURCE, the checkpoint a restore reads: its weights (read tensor by tensor), its name as published (a Hub id,
    or the file or folder's name: never a local path), and what the record says it is (``identity``: the Hub model
    and commit, or the sha256 of each of its weight files)."""

    weights: WeightSet
    label: str
    revision: str | None
    identity: Mapping[str, Any]

    @classmethod
    def of(cls, source: Source) -> Reference:
        """``source`` as a restore's SOURCE: named and identified (its files hashed where it is not a Hub model)."""
        weights = source.primary
        if source.hub_id and source.hub_commit:
            return cls(weights, source.hub_id, source.hub_commit, {"repo": source.hub_id, "commit": source.hub_commit})
        return cls(weights, source.path.name, None, {"sha256": file_digests(weights)})


def file_digests(weights: WeightSet) -> dict[str, str]:
    """The sha256 of each file of a weight set on disk (its shards and index), by name relative to its folder."""
    import hashlib

    digests = {}
    for name in weights.all_files:
        digest = hashlib.sha256()
        with open(weights.folder / name, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
        digests[name] = digest.hexdigest()
    return digests


@dataclass(frozen=True)
class Plan:
    options: ReinitOptions
    blocks: tuple[AttentionBlock, ...]  # everything detected
    changes: tuple[Change, ...] = ()
    # the tensors the mode writes besides Q/K/V (Mode.find_outputs): block module -> (W_O tensor, nn.Linear layout)
    outputs: Mapping[str, tuple[str, bool]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what the selection skipped or reaches beyond its layers
    layout: Mapping[str, str] | None = None  # the layout file the blocks were read with: kept in the record
    # tensor, or (tensor, role) for a fused tensor saved split per role -> the name its draws are keyed by: the
    # name relative to the model's own base (no task-class prefix such as bert. or model.); absent: the tensor's own
    draw_keys: Mapping[str | tuple[str, str], str] = field(default_factory=dict)
    # the Hub model and commit the checkpoint was read from, kept in the card's record only (the weights are
    # the same bytes wherever they were read from): `surgeon push` of the output copies the files it holds
    # unchanged from there, server-side (surgeon.hub.copies)
    origin: Mapping[str, str] | None = None
    # the checkpoint a mode with a reference reads (restore's SOURCE), opened, and how the record names it
    reference: Reference | None = None
    # a recipe of several steps: each step's own plan (its changes tagged with its number), applied in order; this
    # plan's changes are all of theirs, its options the first step's (prepare_recipe)
    steps: tuple[Plan, ...] = ()

    @property
    def touched_blocks(self) -> list[AttentionBlock]:
        seen: dict[str, AttentionBlock] = {}
        for c in self.changes:
            seen.setdefault(c.block.module, c.block)
        return list(seen.values())

    def tensors(self) -> list[str]:
        if self.steps:  # every step's, in the order the steps first touch them
            return list(dict.fromkeys(name for step in self.steps for name in step.tensors()))
        names: list[str] = []
        for c in self.changes:
            p = c.projection
            for rows in (p.weight, p.bias if self.options.bias_policy != "keep" else None):
                if rows is not None and rows.tensor not in names:
                    names.append(rows.tensor)
        names += [t for t, _ in self.outputs.values() if t not in names]
        return names

    def options_record(self) -> dict:
        """The options as reports record them: ``ReinitOptions.to_dict()``, or a recipe's ``{"steps": [...]}``."""
        return {"steps": [step.options.to_dict() for step in self.steps]} if self.steps else self.options.to_dict()

    def record(self) -> dict:
        """What surgeon did, for the output's metadata: no paths, no times, so outputs are reproducible. A recipe
        records each step (its method, options, blocks and SOURCE) under ``steps``, in order."""
        if self.steps:
            from ..text.redact import redact_obj

            steps = [
                {k: v for k, v in step.record().items() if k not in ("tool", "version", "layout")}
                for step in self.steps
            ]
            recipe: dict[str, Any] = {"tool": "surgeon", "version": __version__, "method": RECIPE_METHOD}
            recipe["steps"] = steps
            if self.layout is not None:
                recipe["layout"] = dict(self.layout)
            return redact_obj(recipe)
        blocks = []
        for block in self.touched_blocks:
            entry: dict = {
                "module": block.module,
                "stack": block.stack,
                "layer": block.layer,
                "kind": block.kind,
                "targets": {},
            }
            if block.shared_layers:  # one block that these layers all run: every one of them changes
                entry["shared_layers"] = list(block.shared_layers)
            for c in self.changes:
                if c.block.module == block.module:
                    entry["targets"][c.role] = "all" if len(c.heads) == c.projection.heads else format_indices(c.heads)
            blocks.append(entry)
        from ..text.redact import redact_obj

        record: dict[str, Any] = {
            "tool": "surgeon",
            "version": __version__,
            "method": get_mode(self.options.mode).method,
            "options": self.options.to_dict(),
            "blocks": blocks,
        }
        if self.layout is not None:  # verify reads the blocks with this layout, or refuses
            record["layout"] = dict(self.layout)
        if self.reference is not None:  # verify reads SOURCE again: the Hub commit, or files with these digests
            record["from"] = dict(self.reference.identity)
        return redact_obj(record)  # never a token, even one typed into an option


def prepare_checkpoint(
    source: Source, detection: Detection, options: ReinitOptions, *, reference: Source | None = None
) -> Plan:
    """:func:`prepare` for a checkpoint on disk (a reinit, and verify re-deriving one): its config, its
    tensors' shapes, whether its format rewrites whole tensors, and its stacks' depths; ``reference``: SOURCE,
    opened, for a mode that reads one (restore), checked against the tensors the plan changes."""
    weights = source.primary
    if reference is not None:  # named in the options as published: a Hub id and its commit, or a name, never a path
        found = Reference.of(reference)
        options = get_mode(options.mode).with_reference(options, found.label, found.revision)
    plan = prepare(
        detection.blocks,
        options,
        config=source.config,
        shapes={n: t.shape for n, t in weights.tensors.items()},
        whole_tensors=weights.rewrites_whole_tensors,
        depths=detection.depths,
        unreadable=detection.unreadable,
        reference=found if reference is not None else None,
    )
    if plan.reference is not None:
        _check_reference(plan, plan.reference, weights.tensors)
    keys = CheckpointDrawKeys(plan.tensors(), source.config)  # resolved when drawn, or here where two may share
    plan = replace(plan, draw_keys=keys)
    if keys.may_share():
        _refuse_shared_draws(plan)
    # named in the report and the card too; the layout file the blocks were read with, kept in the record
    origin = {"repo": source.hub_id, "commit": source.hub_commit} if source.hub_id and source.hub_commit else None
    return replace(plan, notes=(*detection.left_alone, *plan.notes), layout=detection.layout, origin=origin)


RECIPE_LIMIT = 1 << 20  # a recipe file: a few lines per step


def read_recipe(path: str | Path) -> Recipe:
    """The recipe in ``path``: TOML (``[[step]]`` tables) or YAML (``steps:``, a list of mappings), by its suffix.

    Raises:
        OptionError: Not a .toml/.yaml file, not readable as one, or not a recipe (surgeon.options.Recipe.from_data).
    """
    from ..files.bounded import read_text

    where = Path(path)
    kind = where.suffix.lower()
    if kind not in (".toml", ".yaml", ".yml"):
        raise OptionError(f"{opt('recipe', where)} is neither a .toml nor a .yaml file: write the recipe as one")
    text = read_text(where, what="recipe", limit=RECIPE_LIMIT)
    try:
        if kind == ".toml":
            import tomllib  # Python 3.11+

            data: Any = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except ImportError:
        raise OptionError(f"{where}: this Python reads no TOML (3.11 and later do): write the recipe as YAML") from None
    except Exception as exc:  # noqa: BLE001 - the parsers' own errors: one line, with where
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OptionError(f"{where} cannot be read as {kind.lstrip('.').upper()}: {first}") from None
    return Recipe.from_data(data, str(where))


def prepare_recipe(
    source: Source, detection: Detection, recipe: Recipe, references: Sequence[Source | None] = ()
) -> Plan:
    """The plan of a recipe: each step planned as :func:`prepare_checkpoint` plans a run (``references``: each
    step's SOURCE, None where its mode reads none), then put together so that one pass carries them all out. A
    recipe of one step is that step's plan, so it writes what the same run writes, record included."""
    refs = list(references) or [None] * len(recipe.steps)
    if len(recipe.steps) == 1:
        return prepare_checkpoint(source, detection, recipe.steps[0], reference=refs[0])
    if source.primary.graph:
        raise OptionError(
            f"a recipe of several steps rewrites tensors in one pass, which an ONNX graph's shared initializers do "
            f"not allow: run the steps one at a time ({opt('recipe')} of one step each)"
        )
    plans = []
    for i, (step, ref) in enumerate(zip(recipe.steps, refs, strict=True)):
        mode = get_mode(step.mode)
        if not mode.exact:
            raise OptionError(
                f"step {i} of the recipe is {opt('mode', mode.name)}, which verify checks within rounding, not byte "
                "for byte, so the steps after it could not be re-derived: run it on its own, before or after the recipe"
            )
        try:
            plan = prepare_checkpoint(source, detection, step, reference=ref)
        except SurgeonError as exc:
            exc.context = f"step {i} of the recipe: {exc.context or ''}"
            raise
        plans.append(replace(plan, changes=tuple(replace(c, step=i) for c in plan.changes)))
    first = plans[0]
    return replace(
        first,
        changes=tuple(c for plan in plans for c in plan.changes),
        outputs={k: v for plan in plans for k, v in plan.outputs.items()},
        notes=tuple(dict.fromkeys(n for plan in plans for n in plan.notes)),
        draw_keys={k: v for plan in plans for k, v in plan.draw_keys.items()},
        reference=None,
        steps=tuple(plans),
    )


def prepare(
    blocks: Sequence[AttentionBlock],
    options: ReinitOptions,
    *,
    config: Any = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    whole_tensors: bool = True,
    depths: Mapping[str, int] | None = None,
    unreadable: Sequence[Unreadable] = (),
    draw_keys: Mapping[str | tuple[str, str], str] | None = None,
    reference: Reference | None = None,
) -> Plan:
    """The one planning step of every entry point (checkpoints, verify, models in memory, init hooks).

    Fills in what the mode takes from the model's ``config``, makes the plan and
    adds the extra tensors the mode writes (W_O, found among ``shapes``: tensor name -> shape).
    ``whole_tensors``: whether the weights' format can rewrite tensors besides Q/K/V
    (``WeightSet.rewrites_whole_tensors``), for modes that write more (W_O); ``depths``: each stack's number of layers,
    those without attention included (Detection.depths), so that layer numbers are the model's own;
    ``draw_keys``: the names the draws are keyed by, where they are not the tensors' own (``Plan.draw_keys``);
    ``reference``: SOURCE, for a mode that reads one (only a checkpoint on disk or on the Hub can be SOURCE).
    """
    mode = get_mode(options.mode)
    if mode.reference and reference is None:
        raise OptionError(
            f"{opt('mode', mode.name)} reads the tensors of another checkpoint ({opt('from_')}), which surgeon opens "
            "for a checkpoint it re-initializes: restore a checkpoint on disk or on the Hub (surgeon.reinit_checkpoint)"
        )
    if mode.writes_outputs and not whole_tensors:
        raise OptionError(
            f"{opt('mode', mode.name)} is not supported on these weights: it rewrites W_O too, and in this format "
            "(an ONNX graph) surgeon patches Q/K/V initializers only; use a safetensors/PyTorch checkpoint"
        )
    plan = make_plan(blocks, mode.with_defaults(options, config), depths, unreadable)
    plan = replace(plan, outputs=mode.find_outputs(plan, shapes or {}), draw_keys=dict(draw_keys or {}))
    if draw_keys:  # else each tensor's draws are keyed by its own name: no two alike
        _refuse_shared_draws(plan)
    return replace(plan, reference=reference) if reference is not None else plan


def _check_reference(plan: Plan, reference: Reference, mine: Mapping[str, TensorInfo]) -> None:
    """Every tensor the plan changes is in SOURCE under the same name, with the same shape and dtype: one line
    naming the first that is not."""
    theirs = reference.weights.tensors
    for name in plan.tensors():
        found, ours = theirs.get(name), mine[name]
        if found is None:
            raise CheckpointError(
                f"SOURCE {reference.label} holds no tensor {name}: restore from a checkpoint of the same "
                "architecture, saved under the same tensor names"
            )
        if tuple(found.shape) != tuple(ours.shape):
            raise CheckpointError(
                f"{name} is {list(found.shape)} in SOURCE {reference.label} and {list(ours.shape)} here: restore "
                "from a checkpoint of the same architecture"
            )
        if (found.element or found.dtype) != (ours.element or ours.dtype):
            raise CheckpointError(
                f"{name} is {found.element or found.dtype} in SOURCE {reference.label} and {ours.element or ours.dtype} "
                "here: restore from a checkpoint saved in the same dtype (or convert one of them first)"
            )


def _refuse_shared_draws(plan: Plan) -> None:
    """Refuse two tensors whose draws would be keyed alike (by the name in the base model, and the role).

    They would get the same heads, where the card says each draw depends on its tensor's name. Refused rather
    than keyed by their full names: then a tensor's heads would depend on whether the other is there, and differ
    from the heads the same model gets alone (its base checkpoint, any task class of it), silently. Refused, the
    user says which copy is meant (a checkpoint holding a model twice is read as one by a loader, which takes one
    copy) and the seed of each. One line, naming both, before anything is written.
    """
    keys = plan.draw_keys
    seen: dict[tuple[str, str], Change] = {}
    for change in plan.changes:
        tensor = change.projection.weight.tensor
        key = keys.get((tensor, change.role)) or keys.get(tensor) or tensor
        first = seen.setdefault((key, change.role), change)
        other = first.projection.weight.tensor
        if other == tensor:
            continue
        stacks = (first.block.stack, change.block.stack)
        how = f" ({opt('stack', stacks[0])}, then {opt('stack', stacks[1])})" if stacks[0] != stacks[1] else ""
        raise SelectionError(
            f"{other} and {tensor} would draw the same heads: draws are keyed by a tensor's name inside its base "
            f"model (no task-class prefix such as bert., no path of a module holding it) and both are {key} there; "
            f"re-initialize them one at a time{how}, "
            f"with different {opt('seed')} values if they should differ"
        )


def _stack_matches(stack: str, wanted: list[str]) -> bool:
    comps = stack.split(".")
    return any(w == stack or w in comps for w in wanted)


def make_plan(
    blocks: Sequence[AttentionBlock],
    options: ReinitOptions,
    depths: Mapping[str, int] | None = None,
    unreadable: Sequence[Unreadable] = (),
) -> Plan:
    """The changes ``options`` select. Layers are the model's own numbers; ``depths`` (stack -> its
    layers, those without attention included) lets ``-1`` and ranges reach past the last attention layer.
    ``unreadable``: attention detection could not read; a selection that includes one is refused."""
    left = _check_unreadable(blocks, unreadable, options, depths or {})
    kinds = parse_attention(options.attention)
    chosen = [b for b in blocks if b.kind in kinds]
    if options.stack is not None:
        wanted = list(options.stack)
        stacks = list(dict.fromkeys(b.stack for b in blocks))
        unknown = [w for w in wanted if not any(_stack_matches(s, [w]) for s in stacks)]
        if unknown:
            raise SelectionError(
                f"no stack named {unknown[0]!r}: this model's stacks are {', '.join(s or '(top level)' for s in stacks)}"
            )
        chosen = [b for b in chosen if _stack_matches(b.stack, wanted)]
    if not chosen:
        raise SelectionError(f"no {options.attention}-attention blocks in this model (it has {_kinds_present(blocks)})")
    changes: list[Change] = []
    notes = left
    by_stack: dict[str, list[AttentionBlock]] = {}
    for b in chosen:
        by_stack.setdefault(b.stack, []).append(b)
    what = "attention" if options.attention == "all" else f"{options.attention}-attention"
    picks = {
        s: _pick_layers(s, members, blocks, depths or {}, options.layers, len(by_stack) > 1, what)
        for s, members in by_stack.items()
    }
    if not any(isinstance(p, set) for p in picks.values()):
        raise next(iter(picks.values()))  # type: ignore[misc]  # no stack has the selected layers: the first reason
    for stack, members in by_stack.items():
        layers = picks[stack]
        if not isinstance(layers, set):
            why = layers.message.replace(_PICK_A_STACK, "")  # other stacks have the layer: no advice needed
            notes.append(f"{stack or 'the model'} skipped: {why}")
            continue
        notes += _layer_notes(stack, members, layers, options.layers, what)
        for block in members:
            if not layers & set(block.users):
                continue
            q_heads = options.heads.resolve(block.heads, where=f"{block.module} ({block.heads} heads)")
            for role in options.targets:
                heads = q_heads if role == "q" else _kv_heads(block, q_heads, role)
                if heads:
                    changes.append(Change(block, role, tuple(heads)))
    if not changes:
        raise SelectionError(
            f"the selection picks no projection: check {opt('layers')}, {opt('heads')}, {opt('targets')} and {opt('attention')}"
        )
    if options.strength is not None:  # each change at its layer's t: a ramp runs over each stack's selected layers
        at = options.strength.per_layer([c.block for c in changes])
        changes = [replace(c, strength=at[(c.block.stack, c.block.layer)]) for c in changes]
    return Plan(options=options, blocks=tuple(blocks), changes=tuple(changes), notes=tuple(notes))


def _check_unreadable(
    blocks: Sequence[AttentionBlock],
    unreadable: Sequence[Unreadable],
    options: ReinitOptions,
    depths: Mapping[str, int],
) -> list[str]:
    """Refuse a selection that includes attention surgeon cannot read; name the rest as left untouched."""
    kinds = parse_attention(options.attention)
    wanted = list(options.stack) if options.stack is not None else None
    notes = []
    for u in unreadable:
        depth = max([depths.get(u.stack, 0), u.layer + 1] + [max(b.users) + 1 for b in blocks if b.stack == u.stack])
        try:
            layers = set(options.layers.resolve(depth, where=u.stack or "the model"))
        except SelectionError:
            layers = set()
        if u.layer in layers and kind(u.module) in kinds and (wanted is None or _stack_matches(u.stack, wanted)):
            others = sorted(layers - {x.layer for x in unreadable if x.stack == u.stack})
            skip = (
                f"e.g. {opt('layers', format_indices(others))}"
                if others
                else f"name the other stacks with {opt('stack', 'NAME')}"
                if wanted is None
                else None
            )
            raise SelectionError(
                f"layer {u.layer} of {u.stack or 'the model'} holds attention surgeon cannot read, so it would be left "
                f"as it is: {u.why}; leave it out of the selection" + (f" ({skip})" if skip else "")
            )
        notes.append(u.module or "the top-level attention module")
    if not notes:
        return []
    first = next(u for u in unreadable if (u.module or "the top-level attention module") == notes[0])
    # every block named (attention left alone is never silent), the first with why
    more = f"and {len(notes) - 1} more such blocks left untouched: {', '.join(notes[1:])}" if len(notes) > 1 else ""
    return [f"left untouched: {first.why}"] + ([more] if more else [])


_PICK_A_STACK = f" (pick a stack with {opt('stack')})"


def _pick_layers(
    stack: str,
    members: list[AttentionBlock],
    blocks: Sequence[AttentionBlock],
    depths: Mapping[str, int],
    spec: IndexSelection,
    several: bool,
    what: str,
) -> set[int] | SelectionError:
    """The selected layers of ``stack``, or why it has none (the error to raise if no stack has any)."""
    depth = max([depths.get(stack, 0)] + [max(b.users) + 1 for b in blocks if b.stack == stack])
    where = f"{stack or 'the model'}" + (_PICK_A_STACK if several else "")
    try:
        layers = set(spec.resolve(depth, where=where))
    except SelectionError as exc:
        return exc
    attended = sorted({layer for b in members for layer in b.users})
    if not layers & set(attended):
        return SelectionError(
            f"{opt('layers', spec.spelled)} selects only layers without {what} in {stack or 'the model'} "
            f"(layer{'s' if len(layers) > 1 else ''} {format_indices(sorted(layers))}): the layers with {what} are {format_indices(attended)}"
        )
    return layers


def _layer_notes(
    stack: str, members: list[AttentionBlock], layers: set[int], spec: IndexSelection, what: str
) -> list[str]:
    """Which selected layers have no attention, and which shared blocks change several layers."""
    notes = []
    attended = {layer for b in members for layer in b.users}
    without = sorted(layers - attended)
    if without and not spec.all:
        notes.append(
            f"layer{'s' if len(without) > 1 else ''} {format_indices(without)} of {stack or 'the model'} "
            f"{'have' if len(without) > 1 else 'has'} no {what}"
            + (" (e.g. Mamba, convolution or recurrent layers)" if what == "attention" else "")
            + ": skipped"
        )
    for block in members:
        if len(block.users) > 1 and layers & set(block.users):
            notes.append(
                f"{block.module} is one block that layers {format_indices(list(block.users))} of {stack} all run: "
                f"re-initializing it changes every one of those layers"
            )
    return notes


def _kv_heads(block: AttentionBlock, q_heads: list[int], role: str) -> list[int]:
    """Key/value heads whose whole group of query heads is selected (GQA/MQA share them)."""
    selected = set(q_heads)
    out = []
    for g in range(block.kv_heads):
        members = {h for h in range(block.heads) if block.kv_head(h) == g}
        if members <= selected:
            out.append(g)
        elif members & selected:
            raise SelectionError(
                f"{opt('heads', format_indices(sorted(selected)))} splits key/value head {g} of {block.module}, which serves "
                f"query heads {format_indices(sorted(members))}: select whole groups or use {opt('targets', 'q')}"
            )
    return out


def _kinds_present(blocks: Sequence[AttentionBlock]) -> str:
    kinds = sorted({b.kind for b in blocks})
    return " and ".join(f"{k}-attention" for k in kinds)
