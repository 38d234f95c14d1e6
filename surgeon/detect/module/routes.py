"""The routes of module detection: transformers names + config, nn.MultiheadAttention, the forward probe."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from torch import nn

from ...errors import LayoutError, NoAttentionFoundError, SurgeonError, TensorParallelError
from ...formats.base import TensorInfo
from ...text.notes import capped
from ...vocab.blocks import ROLES, AttentionBlock, Projection, Rows, slot_offsets
from ...vocab.config_keys import FRAMEWORK_CONFIGS, framework_config
from ..base_model import base_path, relative_to
from ..by_name import detect, match_modules, with_companions
from ..families import SAVED_SPLIT
from ..hints import Hints
from ..libraries import roles_by_position, with_separate_biases
from ..placement import join, kind, stack_depths
from .decode import kept_norms_note, placed, prefixed, probe_blocks, under
from .probe import NORMS


@dataclass(frozen=True)
class ModuleDetection:
    """Attention blocks of a module, with the parameters their tensor names refer to."""

    blocks: tuple[AttentionBlock, ...]
    params: Mapping[str, nn.Parameter]  # tensor name used in blocks -> the parameter
    # tensor, or (tensor, role) for a fused tensor saved split per role -> checkpoint name (the draws' key)
    seed_names: Mapping[str | tuple[str, str], str] = field(default_factory=dict)
    routes: Mapping[str, str] = field(default_factory=dict)  # block module -> "names", "class" or "forward"
    notes: tuple[str, ...] = ()
    depths: Mapping[str, int] = field(default_factory=dict)  # stack -> its layers, with those without attention


@dataclass
class _Found:
    """What detect_module gathers, route by route, before it hands on one frozen ModuleDetection."""

    blocks: list[AttentionBlock] = field(default_factory=list)
    seed_names: dict[str | tuple[str, str], str] = field(default_factory=dict)
    routes: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    depths: dict[str, int] = field(default_factory=dict)


def detect_module(module: nn.Module, *, hints: Hints | None = None, example_inputs: Any = None) -> ModuleDetection:
    """Every attention block of ``module``; raises a SurgeonError when some cannot be resolved."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, not {type(module).__name__}")
    hints = hints or Hints()
    params = dict(module.named_parameters())
    found = _Found()
    handled: list[str] = []  # module paths whose subtree is settled
    for prefix, hf, config in _configured_models(module):
        handled.append(prefix)
        try:
            detection = detect(_tensor_infos(hf), config, hints, source=f"{type(hf).__name__} (in memory)")
        except NoAttentionFoundError:
            continue  # e.g. a vision tower without attention; nothing to do there
        except LayoutError as exc:
            if hints.num_heads is not None:  # the user said how many heads: the names were the way
                raise
            try:  # names and config do not settle it: ask the forward
                blocks = probe_blocks(hf, example_inputs=example_inputs, hints=hints, prefix=prefix, notes=found.notes)
            except SurgeonError as probe_exc:
                raise LayoutError(f"{exc} (the forward did not settle it either: {probe_exc})") from None
            _add(found, blocks, "forward")
            found.notes.append(
                f"{type(hf).__name__}: its names and config do not settle the layout, so it was read from the forward"
            )
            continue
        renames = checkpoint_names(hf) if hasattr(hf.config, "to_dict") else {}  # a framework's: its own names
        blocks = [prefixed(b, prefix) for b in detection.blocks]
        _add(found, blocks, "names")
        found.depths.update({f"{prefix}.{s}" if prefix else s: n for s, n in detection.depths.items()})
        base = base_path(hf)  # the draws' keys: relative to the base model (no task-class bert. / model.)
        for block in blocks:
            for name in block.tensors():
                rel = relative_to(name, prefix)
                saved = renames.get(rel, rel)
                found.seed_names[name] = relative_to(saved, base) if rel.startswith(base + ".") else saved
        found.notes += capped(detection.notes, "detection notes")
        found.notes += kept_norms_note(_norms_in(module, blocks), blocks)
    own: list[AttentionBlock] = []
    for path, mha in module.named_modules():
        if isinstance(mha, nn.MultiheadAttention) and not under(path, handled):
            own.append(_mha_block(path, mha))
            handled.append(path)
    routes = {b.module: "class" for b in own}
    rest = [n for n in params if params[n].dim() == 2 and params[n].is_floating_point() and not under(n, handled)]
    if rest:
        probed, route = _unnamed_blocks(module, example_inputs, hints, handled, found.notes)
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        probed = with_companions(  # EVA's q_bias, joint attention's context; kinds the names settle (SD3.5's attn2)
            roles_by_position([with_separate_biases(b, shapes) for b in probed], shapes), shapes
        )
        own += probed
        routes.update({b.module: route for b in probed})
        found.seed_names.update(_saved_split(probed))
        _refuse_unseen(module, rest, probed, example_inputs)
    if own:
        own = placed(own)
        _add(found, own, None, routes)
        found.depths.update(stack_depths([b.stack for b in own], [n for n, _ in module.named_modules()]))
    if not found.blocks:
        raise NoAttentionFoundError(_nothing(module))
    return ModuleDetection(
        tuple(found.blocks), params, found.seed_names, found.routes, tuple(found.notes), found.depths
    )


def _add(found: _Found, blocks: list[AttentionBlock], route: str | None, routes: dict[str, str] | None = None) -> None:
    found.blocks += blocks
    for b in blocks:
        found.routes[b.module] = route or (routes or {}).get(b.module, "forward")


def _unnamed_blocks(
    module: nn.Module, example_inputs: Any, hints: Hints, handled: list[str], notes: list[str]
) -> tuple[list[AttentionBlock], str]:
    """The blocks outside transformers models and their route: the forward, or (tensor parallel) the names."""
    try:
        return probe_blocks(module, example_inputs=example_inputs, hints=hints, skip=handled, notes=notes), "forward"
    except TensorParallelError:
        if hints.num_heads is None:
            raise
        return _named_blocks(module, handled, hints, notes), "names"


def _named_blocks(module: nn.Module, handled: list[str], hints: Hints, notes: list[str]) -> list[AttentionBlock]:
    """Under tensor parallelism: the layout from the parameter names (global shapes) and the heads passed."""
    infos = {n: i for n, i in _tensor_infos(module).items() if not under(n, handled)}
    detection = detect(infos, {}, hints, source=f"{type(module).__name__} (in memory, tensor parallel)")
    notes.append(
        "tensor parallelism: the forward sees each rank's local heads, so the layout was read from the parameter "
        "names and the heads passed; each rank writes the rows of the global tensors it holds"
    )
    notes += capped(detection.notes, "detection notes")
    return list(detection.blocks)


def _saved_split(blocks: list[AttentionBlock]) -> dict[str | tuple[str, str], str]:
    """(fused tensor, role) -> the name its rows of that role are saved under (families.SAVED_SPLIT)."""
    out: dict[str | tuple[str, str], str] = {}
    for block in blocks:
        for proj in block.projections:
            tensor = proj.weight.tensor
            saved = SAVED_SPLIT.get(tensor.removeprefix(f"{block.module}.") if block.module else tensor, {})
            if proj.role in saved:
                out[(tensor, proj.role)] = join(block.module, saved[proj.role])
    return out


def _norms_in(module: nn.Module, blocks: list[AttentionBlock]) -> dict[str, str]:
    """Per-head normalizations inside attention modules found by name (Qwen3's q_norm/k_norm over head_dim):
    they can only act on the per-head queries/keys. norm module -> the block's query tensor."""
    out = {}
    by_module = {b.module: b for b in blocks}
    for path, m in module.named_modules():
        block = by_module.get(path.rpartition(".")[0])
        weight = getattr(m, "weight", None)
        if block and NORMS.search(type(m).__name__) and isinstance(weight, nn.Parameter):
            if weight.numel() == block.head_dim:
                out[path] = block.q.weight.tensor
    return out


def _tensor_infos(module: nn.Module) -> dict[str, TensorInfo]:
    return {
        n: TensorInfo(
            n,
            tuple(p.shape),
            str(p.dtype).removeprefix("torch."),
            str(p.dtype).removeprefix("torch."),
            "",
            p.numel() * p.element_size(),
        )
        for n, p in module.named_parameters()
    }


def _configured_models(module: nn.Module) -> list[tuple[str, Any, dict]]:
    """The outermost submodules (the module itself included) whose config says their heads, with that config in
    config.json's terms: transformers ``PreTrainedModel``s, and models holding a framework's config object
    (FRAMEWORK_CONFIGS: a litgpt GPT's ``litgpt.Config``)."""
    out: list[tuple[str, Any, dict]] = []
    for path, m in module.named_modules():
        config = _config_of(m)
        if config is not None and not under(path, [p for p, _, _ in out]):
            out.append((path, m, config))
    return out


def _config_of(m: nn.Module) -> dict | None:
    config: Any = getattr(m, "config", None)
    if any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__) and hasattr(config, "to_dict"):
        return config.to_dict()
    spelled = f"{type(config).__module__}.{type(config).__qualname__}"
    framework = next((f for f in FRAMEWORK_CONFIGS if spelled in f.config_classes), None)
    return None if framework is None else framework_config(framework, vars(config))


def checkpoint_names(model: nn.Module) -> dict[str, str]:
    """In-memory parameter name -> the name ``save_pretrained`` writes (transformers' renamings undone).

    Only pure renamings are followed; a parameter that a converter splits or merges keeps its name.
    Returns {} when transformers has no conversion mapping (older versions: names are the same).
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            apply_converters,
            apply_renamings,
        )
    except ImportError:
        return {}
    try:
        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:  # built from a config: mirror revert_weight_conversion (no prefix changes)
            conversions = [
                c
                for c in get_model_conversion_mapping(cast(Any, model), add_legacy=False)
                if not isinstance(c, PrefixChange)
            ]
        reverse = [c.reverse_transform() for c in list(conversions)[::-1]]
    except Exception:  # a transformers version with another mapping API: keep the in-memory names
        return {}
    renamings = [r for r in reverse if isinstance(r, WeightRenaming)]
    converters = [r for r in reverse if isinstance(r, WeightConverter)]
    out = {}
    for name, _ in model.named_parameters():
        _, pattern = apply_converters(name, converters)
        out[name] = name if pattern is not None else apply_renamings(name, renamings)
    return out


# --- torch.nn.MultiheadAttention -------------------------------------------------------------


def _mha_block(path: str, mha: nn.MultiheadAttention) -> AttentionBlock:
    heads, d = mha.num_heads, mha.head_dim
    join = (lambda leaf: f"{path}.{leaf}") if path else (lambda leaf: leaf)
    qkv = slot_offsets("qkv", heads, heads, d)
    bias = join("in_proj_bias") if mha.in_proj_bias is not None else None
    projs = {}
    for role in ROLES:
        if mha._qkv_same_embed_dim:
            weight = Rows(join("in_proj_weight"), 0, qkv[role], d)
            width = mha.embed_dim
        else:
            tensor = getattr(mha, f"{role}_proj_weight")
            weight = Rows(join(f"{role}_proj_weight"), 0, slot_offsets(role, heads, heads, d)[role], d)
            width = tensor.shape[1]
        projs[role] = Projection(role, weight, Rows(bias, 0, qkv[role], d) if bias else None, width)
    cross = not mha._qkv_same_embed_dim or kind(path) == "cross"
    layout = "fused in_proj" if mha._qkv_same_embed_dim else "separate in_proj"
    return AttentionBlock(
        "", 0, "cross" if cross else "self", path, layout, heads, heads, d, projs["q"], projs["k"], projs["v"]
    )


def _nothing(module: nn.Module) -> str:
    names = [n for n, _ in module.named_parameters()]
    sample = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"no attention found in {type(module).__name__}: looked at {len(names)} parameters ({sample}); its forward "
        "hands nothing to scaled_dot_product_attention or softmax(Q K^T) V computed from its own parameters"
    )


def _refuse_unseen(module: nn.Module, rest: list[str], probed: list[AttentionBlock], example_inputs: Any) -> None:
    """Parameters named like attention projections that no observed attention product used."""
    used = {r.tensor for b in probed for p in b.projections for r in (p.weight, p.bias) if r is not None}
    infos = {n: TensorInfo(n, (0, 0), "", None, "", 0) for n in rest if n not in used}
    for owner, rule in match_modules(infos).items():
        weights = [join(owner, part.weight) for part in rule.parts]
        if any(w in used for w in weights):
            continue
        hint = (
            "pass example_inputs=... (the inputs of its usual forward)"
            if example_inputs is None
            else "its forward never used them on the example inputs"
        )
        raise LayoutError(
            f"{owner or type(module).__name__} looks like attention ({', '.join(w.removeprefix(owner + '.') for w in weights)}) "
            f"but surgeon did not see it compute an attention product; {hint}"
        )
