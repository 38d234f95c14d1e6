"""What name-based detection refuses to read, and why: layouts surgeon does not rewrite, quantized or
non-matrix projection weights, one head count for blocks of different widths, module paths that read
as surgeon's own block names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import CheckpointError, LayoutError, UnsupportedWeightsError, opt
from ..formats.base import TensorInfo
from ..vocab.blocks import AttentionBlock, Unreadable, split_module
from .config import ConfigView
from .families import QUANT_PARAMS, REFUSED, RULES, Rule
from .placement import join, place
from .shapes import pointwise


def refused_layouts(tensors: Mapping[str, TensorInfo]) -> list[Unreadable]:
    """The modules of each refused layout present (REFUSED), each with why."""
    out = []
    for rule in REFUSED:
        modules = [n[: -len(rule.weights[0]) - 1] for n in tensors if n.endswith("." + rule.weights[0])]
        modules = [m for m in modules if all(join(m, w) in tensors for w in rule.weights)]
        places = place(modules)
        for m in modules:
            why = f"{m} uses {rule.name}, which surgeon does not re-initialize: {rule.why}"
            out.append(Unreadable(places[m].stack, places[m].layer, m, why))
    return out


def refuse_mixed_widths(blocks: list[AttentionBlock], view: ConfigView) -> None:
    """One --num-heads without a config cannot be right for blocks of different widths: a count that
    fits one splits the others into heads they do not have (a 4-head block read as 16 heads)."""
    count = view.hints.num_heads
    if view.has_config or view.hints.force or not isinstance(count, int):
        return
    widths: dict[int, list[AttentionBlock]] = {}
    for b in blocks:
        widths.setdefault(b.heads * b.head_dim, []).append(b)
    if len(widths) < 2:
        return
    listed = "; ".join(
        f"{w} wide: {', '.join(b.module or '(top level)' for b in bs[:2])}{', ...' if len(bs) > 2 else ''}"
        for w, bs in widths.items()
    )
    stacks = {w: {b.stack for b in bs} for w, bs in widths.items()}
    apart = all(not (a & b) for i, a in enumerate(stacks.values()) for b in list(stacks.values())[i + 1 :])
    per_stack = ",".join(f"{s}=N" for ss in stacks.values() for s in sorted(ss) if s)
    how = (
        f"give each stack its own count ({opt('num_heads', per_stack)})"
        if apart and per_stack
        else "describe the model"
    )
    raise LayoutError(
        f"one {opt('num_heads', count)} for attention blocks of different widths ({listed}): a count that fits one splits "
        f"the others into heads they do not have; {how}, pass {opt('config', 'PATH')}, or {opt('force_hints', True)} to split every block into {count} heads"
    )


def refuse_quantized(tensors: Mapping[str, TensorInfo]) -> None:
    leaves = {p.weight.rsplit(".", 1)[0] for rule in RULES for p in rule.parts if "." in p.weight}
    for name in tensors:
        module, _, param = name.rpartition(".")
        if param in QUANT_PARAMS and module.rpartition(".")[2] in leaves:
            raise UnsupportedWeightsError(
                f"{module} is quantized ({param} {tensors[name].dtype}): surgeon rewrites float weights only; "
                "re-initialize the float checkpoint, then quantize",
                tensor=name,
            )


def refuse_marker_names(module: str) -> None:
    """A checkpoint's module path that ends like a block surgeon names ("x:context", "x[global]") would read as one."""
    if split_module(module)[0] != module:
        raise CheckpointError(
            f"the tensors under {module} look like attention projections, but their module path ends like the name "
            "surgeon gives a block's second stream or set (':context', '[global]'): rename the tensors (e.g. with "
            "safetensors' save_file) so their paths do not end so"
        )


def check_part(info: TensorInfo, view: ConfigView, stack: str, module: str) -> None:
    """A projection weight surgeon can rewrite: a float, non-empty 2-D matrix (or a pointwise convolution)."""
    if not info.is_float:
        raise UnsupportedWeightsError(
            f"{info.name} is {info.dtype}, not a float matrix: it looks quantized or integer; "
            "surgeon rewrites float16/bfloat16/float32 projections only",
            tensor=info.name,
        )
    if len(info.shape) != 2 and not pointwise(info, view, stack, module):
        raise LayoutError(
            f"{info.name} has shape {list(info.shape)}; a projection weight must be 2-D", tensor=info.name
        )
    if 0 in info.shape:
        raise LayoutError(
            f"{info.name} has shape {list(info.shape)}: an empty projection has no heads to re-initialize; "
            "the checkpoint is damaged or not a model surgeon can rewrite",
            tensor=info.name,
        )


def refuse_shared_rows(blocks: Sequence[AttentionBlock]) -> None:
    """Every tensor's rows play at most one role in one block: q, k and v of a block are distinct tensors, or
    distinct row ranges of one packed tensor. A layout that names one tensor for two roles (q and v) would write the
    value identity into the query and report all three re-initialized: refused, naming both."""
    claimed: dict[tuple[str, str], list[tuple[int, int, str]]] = {}  # (tensor, weight/bias) -> (start, end, who)
    for block in blocks:
        for p in block.projections:
            for part, rows in (("weight", p.weight), ("bias", p.bias)):
                if rows is None:
                    continue
                who = f"the {p.role} {part} of {block.module}"
                spans = claimed.setdefault((rows.tensor, part), [])
                for start in sorted(set(rows.offsets)):
                    spans.append((start, start + rows.size, who))
    for (tensor, _), spans in claimed.items():
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end and a != b:
                raise LayoutError(
                    f"{tensor} is both {a} and {b}: a tensor's rows play one role in one block; fix the layout "
                    f"(a layout file's rules, or {opt('num_heads')} and its kin) so each role names its own tensor or rows",
                    tensor=tensor,
                )


def refuse_rules_on_one_module(matches: Mapping[str, Rule], rules: Sequence[Rule], tensors: Mapping[str, Any]) -> None:
    """Two rules of a layout file that both match one attention module: which one the file means is not known."""
    for module, rule in matches.items():
        if rule not in rules:
            continue
        for other in rules:
            if other is not rule and all(join(module, p.weight) in tensors for p in other.parts):
                raise LayoutError(
                    f"layout rules {rule.name!r} and {other.name!r} both match {module or '(top level)'}: one rule per "
                    "attention module; make one rule's tensor names more specific, or drop one"
                )
