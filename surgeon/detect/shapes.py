"""From a matched rule's tensor shapes to heads, head size and packing (detect.by_name's arithmetic).

Every candidate layout is tried against every tensor's shape; one that fits all of them is taken, and
a fused tensor's packing comes from the family's data, never guessed from its shape alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import LayoutError, opt
from ..formats.base import TensorInfo
from ..vocab.blocks import packed_size
from ..vocab.config_keys import AUTO_PACKING_WHY
from .config import ConfigView
from .families import KV_SLOTS, RULES, Part, Rule
from .placement import join


def heads_from_head_dim(
    module: str, rule: Rule, tensors: Mapping[str, TensorInfo], view: ConfigView, stack: str, head_dim: int
) -> int | None:
    """Query heads from the first projection's output features and the head size, where the packing
    says how many head-sized slots a query head takes (None where it cannot tell)."""
    part = rule.parts[0]
    info = tensors[join(module, part.weight)]
    if part.orientation == "shape" or len(info.shape) < 2 or any(n != 1 for n in info.shape[2:]):
        return None
    out = info.shape[0 if part.orientation == "linear" else 1]
    packing = (
        part.packing
        if part.packing in ("q", "k", "v")
        else view.fused_packing(part.weight.rsplit(".", 1)[0], stack, module)
    )
    per_head = {"q": 1, "qkv": 3, "interleaved": 3}.get(packing or part.packing)
    if per_head is None or out % (per_head * head_dim) or view.hints.num_kv_heads is not None:
        return None
    return out // (per_head * head_dim)


def pointwise(info: TensorInfo, view: ConfigView, stack: str, module: str) -> bool:
    """A 1x1 convolution's weight (out, in, 1[, 1]): a linear map, taken where its packing is known.
    A fused one (timm CoAtNet/MaxViT Attention2d) packs per head or not by model: the config must say."""
    if len(info.shape) < 3 or any(n != 1 for n in info.shape[2:]):
        return False
    tensor = info.name.removeprefix(module + ".").rsplit(".", 1)[0] if module else info.name.rsplit(".", 1)[0]
    fused = not any(
        part.packing in ("q", "k", "v") and join(module, part.weight) == info.name
        for rule in RULES
        for part in rule.parts
    )
    if fused and view.fused_packing(tensor, stack, module) is None:
        raise LayoutError(
            f"{info.name} is a fused 1x1-convolution projection {list(info.shape)} whose packing surgeon cannot tell: timm packs "
            f"these per head ([q_h | k_h | v_h], CoAtNet/MaxViT Attention2d) or as [Q | K | V] by model; for a timm model pass "
            f"{opt('config', 'PATH')} with the timm config.json that names its architecture",
            tensor=info.name,
        )
    return True


def packing(part: Part, view: ConfigView, stack: str, module: str, where: str) -> str:
    if part.packing in ("q", "k", "v"):  # a family may pack more into it (gated attention's q_proj)
        return view.fused_packing(part.weight.rsplit(".", 1)[0], stack, module) or part.packing
    packing = view.fused_packing(part.weight.rsplit(".", 1)[0], stack, module) or (
        None if part.packing == "auto" else part.packing
    )
    if packing is None:
        raise LayoutError(
            f"cannot tell how {join(where, part.weight)} packs query/key/value ("
            + AUTO_PACKING_WHY.get(part.weight.rsplit(".", 1)[0], "its name alone does not say")
            + "): "
            + (
                "config.json (model_type) does not say"
                if view.has_config
                else "there is no config.json (or litgpt's model_config.yaml) beside the weights"
            )
            + f"; pass {opt('config', 'PATH')}"
        )
    return packing


def solve(
    parts: list[tuple[Part, TensorInfo]],
    packings: list[str],
    heads: int,
    kv_hint: int | None,
    head_dim_hint: int | None,
    hidden: int | None,
    where: str,
    source: str,
    v_head_dim: int | None = None,
    hinted: tuple[str, ...] = (),
) -> tuple[int, int, tuple[int, ...]]:
    """Find (head_dim, kv_heads, output axis per part) that fit every tensor's shape; a separate value
    projection has heads of ``v_head_dim`` where that is given. ``hinted``: the counts the user passed (a
    refusal names the one at fault, with the arithmetic)."""
    _refuse_indivisible(parts, packings, heads, kv_hint, head_dim_hint, hidden, where, source, hinted)
    tried = []
    for orientations in _orientation_choices(parts):
        outs = [info.shape[axis] for (_, info), axis in zip(parts, orientations)]
        ins = [info.shape[1 - axis] for (_, info), axis in zip(parts, orientations)]
        for head_dim in _head_dim_candidates(parts, packings, outs, ins, heads, head_dim_hint, hidden):
            for kv_heads in _kv_candidates(packings, outs, heads, head_dim, kv_hint):
                if heads % kv_heads:
                    continue
                if heads * head_dim > sum(outs):  # before slots are listed per head: a config's count may be absurd
                    tried.append(
                        f"{heads} heads x {head_dim} need {heads * head_dim} output features, more than all {sum(outs)}"
                    )
                    continue
                try:
                    sizes = [
                        packed_size(p, heads, kv_heads, v_head_dim if p == "v" and v_head_dim else head_dim)
                        for p in packings
                    ]
                except ValueError:
                    continue
                if sizes == outs:
                    return head_dim, kv_heads, orientations
                tried.append(f"{heads} heads x {head_dim} (kv {kv_heads}) needs {sizes} output features")
    shapes = ", ".join(
        f"{info.name.rsplit('.', 2)[-2] if '.' in info.name else info.name} {list(info.shape)}" for _, info in parts
    )
    given = [opt(name, value) for name, value in zip(_HINTS, (heads, kv_hint, head_dim_hint)) if name in hinted]
    advice = (
        f"check {' and '.join(given)}"
        if given
        else f"check the config or pass {opt('num_heads')}/{opt('num_kv_heads')}/{opt('head_dim')}"
    )
    raise LayoutError(
        f"the shapes of {where} ({shapes}) do not fit {heads} heads from {source}"
        f"{' (' + tried[0] + ')' if tried else ''}; {advice}"
    )


_HINTS = ("num_heads", "num_kv_heads", "head_dim")


def _refuse_indivisible(
    parts: list[tuple[Part, TensorInfo]],
    packings: list[str],
    heads: int,
    kv_heads: int | None,
    head_dim: int | None,
    hidden: int | None,
    where: str,
    source: str,
    hinted: tuple[str, ...],
) -> None:
    """The counts that cannot divide what they must, refused with the arithmetic and the flag at fault."""
    if kv_heads and heads % kv_heads:
        if "num_kv_heads" in hinted:
            raise LayoutError(
                f"{opt('num_kv_heads', kv_heads)} does not divide the {heads} query heads of {where} (from {source}): "
                f"{heads} is not divisible by {kv_heads}; pass a {opt('num_kv_heads')} that divides {heads} "
                f"({_near(heads, kv_heads)})"
            )
        culprit = opt("num_heads", heads) if "num_heads" in hinted else f"the {heads} query heads {source} says"
        raise LayoutError(
            f"{culprit} cannot share {kv_heads} key/value heads in {where}: {heads} is not divisible by {kv_heads}"
        )
    linear_q = [info.shape[0] for (part, info), p in zip(parts, packings) if p == "q" and part.orientation == "linear"]
    width = hidden or (parts[0][1].shape[1] if parts and len(parts[0][1].shape) == 2 else None)
    if head_dim or not linear_q or linear_q[0] % heads == 0 or (width and width % heads == 0):
        return
    out = linear_q[0]
    name = parts[packings.index("q")][1].name.rsplit(".", 2)[-2]
    fix = (
        f"pass a {opt('num_heads')} that divides {out} ({_near(out, heads)})"
        if "num_heads" in hinted
        else f"check {source}, or pass {opt('num_heads')} (one that divides {out}: {_near(out, heads)})"
    )
    what = opt("num_heads", heads) if "num_heads" in hinted else f"{heads} heads from {source}"
    raise LayoutError(
        f"{what} cannot split {where}'s {name} ({out} output features) into heads: {out} is not divisible by {heads}; {fix}"
    )


def _near(n: int, wanted: int) -> str:
    """The three divisors of ``n`` nearest ``wanted``, for an error's suggestion: ``4, 6 or 8``."""
    divisors = sorted(sorted((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - wanted), d))[:3])
    return ", ".join(map(str, divisors[:-1])) + f" or {divisors[-1]}" if len(divisors) > 1 else str(divisors[0])


def _orientation_choices(parts: list[tuple[Part, TensorInfo]]) -> list[tuple[int, ...]]:
    choices: list[list[int]] = [[]]
    for part, _ in parts:
        axes = {"linear": [0], "conv1d": [1], "shape": [0, 1]}[part.orientation]
        choices = [c + [a] for c in choices for a in axes]
    return [tuple(c) for c in choices]


def _head_dim_candidates(
    parts: list[tuple[Part, TensorInfo]],
    packings: list[str],
    outs: list[int],
    ins: list[int],
    heads: int,
    hint: int | None,
    hidden: int | None,
) -> list[int]:
    if hint:
        return [hint]
    cands = []
    for (part, _), packing, out in zip(parts, packings, outs):
        per_head = 2 if packing == "gated" else 1  # gated: a query and a gate block per head
        if packing in ("q", "gated") and out % (heads * per_head) == 0:
            cands.append(out // (heads * per_head))
        # [Q | K | V] of as many heads each (a config without key/value heads means as many), where the
        # output axis is known (a guessed one would fit a Conv1D read the wrong way round); before the
        # width, which would read a pyramid stage (Hiera: 3 x heads x d, d not width / heads) as grouped
        if packing == "qkv" and part.orientation == "linear" and out % (3 * heads) == 0:
            cands.append(out // (3 * heads))
    # the width: the config's, then the tensor's own (a stage of a pyramid transformer is narrower)
    for width in (hidden, ins[0]):
        if width and width % heads == 0:
            cands.append(width // heads)
    return list(dict.fromkeys(cands))


def _kv_candidates(packings: list[str], outs: list[int], heads: int, head_dim: int, hint: int | None) -> list[int]:
    if hint:
        return [hint]
    cands = []
    for packing, out in zip(packings, outs):
        if out % head_dim == 0:
            kv = KV_SLOTS[packing](out // head_dim, heads)
            if kv is not None:
                cands.append(kv)
    cands.append(heads)
    return [c for c in dict.fromkeys(cands) if c > 0]
