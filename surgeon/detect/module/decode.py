"""Reading the codes back into rows and heads, and running the probe over a module (probe_blocks)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import nn

from ...errors import LayoutError, opt
from ...vocab.blocks import KV_MAPS, ROLES, AttentionBlock, Projection, Role, Rows
from ..by_name import place_matches
from ..hints import Hints
from ..libraries import companion_block
from ..placement import join, kind
from .inputs import decoder_inputs, example_call, hf_inputs
from .probe import (
    FILLS,
    PROBE_TOKENS,
    Capture,
    Op,
    Targets,
    Unresolved,
    Watch,
    probing,
    stream_starts,
    watch_all,
)


def under(path: str, prefixes: list[str]) -> bool:
    return any(p == "" or path == p or path.startswith(p + ".") for p in prefixes)


def prefixed(block: AttentionBlock, prefix: str) -> AttentionBlock:
    if not prefix:
        return block

    def rows(r: Rows) -> Rows:
        return replace(r, tensor=f"{prefix}.{r.tensor}")

    q, k, v = (
        replace(p, weight=rows(p.weight), bias=None if p.bias is None else rows(p.bias)) for p in block.projections
    )
    return replace(
        block,
        stack=f"{prefix}.{block.stack}" if block.stack else prefix,
        module=f"{prefix}.{block.module}" if block.module else prefix,
        q=q,
        k=k,
        v=v,
    )


def placed(blocks: list[AttentionBlock]) -> list[AttentionBlock]:
    """Stack and layer numbers from the module paths, as name-based detection gives them."""
    by_module = {b.module: b for b in blocks}
    placed = place_matches(by_module)
    return [replace(block, stack=stack, layer=layer) for _, block, stack, layer, _ in placed]


# --- reading the codes back -----------------------------------------------------------------


def _captures(runs: Mapping[str, Watch], i: int, token: int = 0) -> dict[str, Capture]:
    """Attention product ``i`` as each coded forward caught it, with q/k/v at ``token`` (0, or the first token of a
    later stream, which the forwards kept: Capture.at)."""
    caps = {f: runs[f].captures[i] for f in FILLS}
    if token == 0:
        return caps
    if any(token not in c.at for c in caps.values()):
        raise Unresolved(f"its q/k/v at token {token} were not kept")
    return {f: replace(c, q=c.at[token][0], k=c.at[token][1], v=c.at[token][2]) for f, c in caps.items()}


def _decode(
    caps: Mapping[str, Capture], role: str, targets: Targets
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(param number, axis, row) of every entry of one captured q/k/v at its token."""
    ones, index, param, rand = (getattr(caps[f], role) for f in FILLS)
    if ones.shape != index.shape or ones.shape != param.shape or ones.shape != rand.shape:
        raise Unresolved(f"its {_ROLE[role]} changes shape between forwards")
    if not torch.isfinite(ones).all() or (ones.abs() < 1e-30).any():
        raise Unresolved(
            f"its {_ROLE[role]} is not a plain selection of projection outputs (zero or not finite where every projection "
            "output was 1): a normalization written as ops (a LayerNorm/RMSNorm module is read through), or values from "
            "outside the module's parameters"
        )
    rows, pids = index / ones, param / ones
    for ratio, what in ((rows, "row"), (pids, "parameter")):
        if ((ratio - ratio.round()).abs() > 1e-3 + 2e-7 * ratio.abs()).any() or (ratio.round() < 1).any():
            raise Unresolved(
                f"its {_ROLE[role]} is not a plain selection of projection outputs (the {what} codes do not come through): "
                "something mixes features between the projection and the attention product (a normalization written as ops? "
                "a bias or position "
                "term added after the projection?)"
            )
    code = pids.round().long() - 1
    pid, axis, row = code // 2, code % 2, rows.round().long() - 1
    if (pid >= len(targets.params)).any():
        raise Unresolved(f"its {_ROLE[role]} holds codes of no parameter")
    for p in pid.unique().tolist():
        for a in (0, 1):
            mask = (pid == p) & (axis == a)
            if not mask.any():
                continue
            size = targets.params[p].shape[a]
            if (row[mask] >= size).any():
                raise Unresolved(f"its {_ROLE[role]} holds row codes past the end of {targets.names[p]}")
            expected = ones[mask] * targets.random(p, a).double()[row[mask]]
            if not torch.allclose(rand[mask], expected, rtol=1e-4, atol=0.0):
                raise Unresolved(
                    f"its {_ROLE[role]} is not a linear selection of projection outputs (a random coding does not come through "
                    "unchanged): a non-linearity such as F.normalize or a clamp sits between the projection and the attention "
                    "product (LayerNorm/RMSNorm modules there are read through)"
                )
    return pid, axis, row


_ROLE = {"q": "query", "k": "key", "v": "value"}


def _decodes(caps: Mapping[str, Capture], role: str, targets: Targets) -> bool:
    try:
        _decode(caps, role, targets)
    except Unresolved:
        return False
    return True


def _head_rows(
    pid: torch.Tensor,
    axis: torch.Tensor,
    row: torch.Tensor,
    heads: int | None,
    sequences: int | None,
    role: str,
    names: list[str],
) -> list[tuple[int, int, int]]:
    """Per head: (param number, axis, first row), given the decoded entries (N, d) of one role."""
    n, d = row.shape
    if heads is None and sequences:
        if n % sequences:
            raise Unresolved(f"its {_ROLE[role]} has {n} head rows, not a multiple of {sequences} sequences")
        heads = n // sequences
    if heads is None:  # (batch * heads, L, d): the smallest period of the rows
        key = torch.stack([pid, axis, row], dim=-1)
        heads = next(p for p in range(1, n + 1) if n % p == 0 and torch.equal(key, key[:p].repeat(n // p, 1, 1)))
    if n % heads:
        raise Unresolved(f"its {_ROLE[role]} has {n} rows at the first token, not a multiple of {heads} heads")
    key = torch.stack([pid, axis, row], dim=-1)
    if not torch.equal(key, key[:heads].repeat(n // heads, 1, 1)):
        raise Unresolved(f"the {_ROLE[role]} heads of its batch entries come from different rows")
    out = []
    for h in range(heads):
        p, a, r = pid[h], axis[h], row[h]
        if not (p == p[0]).all() or not (a == a[0]).all():
            raise Unresolved(f"{_ROLE[role]} head {h} mixes features of several tensors")
        if not torch.equal(r, r[0] + torch.arange(d)):
            raise Unresolved(
                f"{_ROLE[role]} head {h} reads rows of {names[int(p[0])]} that are not consecutive; surgeon rewrites per-head blocks of consecutive rows"
            )
        out.append((int(p[0]), int(a[0]), int(r[0])))
    return out


def _resolve(caps: Mapping[str, Capture], targets: Targets, hints: Hints) -> dict:
    cap = caps["ones"]
    decoded = {role: _decode(caps, role, targets) for role in "qkv"}
    q_heads = _head_rows(*decoded["q"], cap.heads, None, "q", targets.names)
    heads = len(q_heads)
    sequences = cap.q.shape[0] // heads
    kv, maps = {}, set()
    for role, hint in (("k", cap.kv_heads), ("v", cap.kv_heads)):
        rows = _head_rows(*decoded[role], hint, sequences, role, targets.names)
        unique = list(dict.fromkeys(rows))
        if len(rows) == heads and len(unique) < heads:  # key/value heads repeated to the query heads
            found = [
                m
                for m, to in KV_MAPS.items()
                if heads % len(unique) == 0
                and all(unique.index(rows[h]) == to(h, heads, len(unique)) for h in range(heads))
            ]
            if not found:
                raise Unresolved(
                    f"its {_ROLE[role]} heads are shared by query heads in an order other than consecutive groups or h % key/value heads"
                )
            maps.add(found[0])  # "blocked" first where both read the same (one key/value head)
        elif len(unique) != len(rows) or heads % len(rows):
            raise Unresolved(f"it has {heads} query heads and {len(rows)} {_ROLE[role]} heads")
        kv[role] = unique
    if len(kv["k"]) != len(kv["v"]):
        raise Unresolved(f"it has {len(kv['k'])} key heads but {len(kv['v'])} value heads")
    hinted = hints.get("num_heads", cap.module)
    if hinted is not None and hinted != heads:
        raise LayoutError(
            f"{cap.module or 'the model'}: its forward uses {heads} query heads, not {hinted} ({opt('num_heads')})"
        )
    if len(maps) > 1:
        raise Unresolved("its key and value heads are shared by query heads in different orders")
    return {
        "q": q_heads,
        "k": kv["k"],
        "v": kv["v"],
        "dims": {r: decoded[r][2].shape[1] for r in "qkv"},
        "kv_map": maps.pop() if maps else "blocked",
    }


def _block_from(resolved: dict, cap: Capture, targets: Targets) -> AttentionBlock:
    projections = {}
    sources = {}
    for role in ROLES:
        heads = resolved[role]
        pids = {p for p, _, _ in heads}
        axes = {a for _, a, _ in heads}
        if len(pids) != 1 or len(axes) != 1:
            names = ", ".join(sorted(targets.names[p] for p in pids))
            raise Unresolved(
                f"its {_ROLE[role]} heads live in several tensors ({names}); surgeon rewrites one tensor per projection"
            )
        pid, axis = pids.pop(), axes.pop()
        name, size = targets.names[pid], resolved["dims"][role]
        offsets = tuple(r for _, _, r in heads)
        op = _covering(cap.ops, pid, axis, offsets[0])
        bias = None
        if op is not None and op.bias is not None and all(_covering(cap.ops, pid, axis, o) is op for o in offsets):
            bias = Rows(op.bias[0], 0, tuple(op.bias[1] + o - op.start for o in offsets), size)
        sources[role] = op.source if op is not None else None
        in_features = targets.params[pid].shape[1 - axis]
        projections[role] = Projection(role, Rows(name, axis, offsets, size), bias, in_features)
    _check_disjoint(projections)
    module = _common_module(cap.module, [projections[r].weight.tensor.rpartition(".")[0] for r in ROLES])
    tensors = [projections[r].weight.tensor for r in ROLES]
    leaf = lambda t: t.removeprefix(module + ".") if module else t  # noqa: E731
    if len(set(tensors)) == 1:
        layout = f"forward: fused {leaf(tensors[0]).removesuffix('.weight')}"
    else:
        layout = "forward: " + ", ".join(dict.fromkeys(leaf(t).removesuffix(".weight") for t in tensors))
    # what the forward did, unless the module's path says cross (the probe may have called it without its context)
    same = sources["q"] is not None and sources["q"] == sources["k"]
    observed: Literal["self", "cross"] = "self" if same and kind(module) == "self" else "cross"
    q = projections["q"]
    return AttentionBlock(
        "",
        0,
        observed,
        module,
        layout,
        q.heads,
        projections["k"].heads,
        q.head_dim,
        projections["q"],
        projections["k"],
        projections["v"],
        kv_map=resolved["kv_map"],
    )


def _call_block(runs: Mapping[str, Watch], i: int, targets: Targets, hints: Hints) -> AttentionBlock:
    """The block of attention product ``i``. Where its queries come from another projection from some token on
    (joint attention: Flux's [context | image] tokens, SD3's [image | context]), each stream is read at its own
    first token and the streams are one block and its context stream (COMPANION_STREAMS), as their names say and
    the forward shows; a later stream the codes do not reach leaves the product read at token 0 alone."""
    caps = _captures(runs, i)
    block = _block_from(_resolve(caps, targets, hints), caps["ones"], targets)
    starts = stream_starts(runs, i)
    if len(starts) == 1:
        return block
    streams = [block]
    for token in starts[1:]:
        try:
            later = _captures(runs, i, token)
            streams.append(_block_from(_resolve(later, targets, hints), later["ones"], targets))
        except Unresolved:
            return block  # as before streams were followed: the names route refuses a stream no product used
    return _joint(streams, targets)


def _joint(streams: list[AttentionBlock], targets: Targets) -> AttentionBlock:
    """The block of a joint attention product whose streams are ``streams``: the one whose context stream
    (surgeon.detect.libraries.companion_block, by its names) is the other, row for row as the forward read it."""
    shapes = {name: tuple(p.shape) for name, p in targets.root.named_parameters()}
    for main in streams:
        try:
            companion = companion_block(main, shapes)
        except LayoutError:
            companion = None
        others = [b for b in streams if b is not main]
        if (
            companion is not None
            and len(others) == 1
            and all(
                (getattr(companion, r).weight, getattr(companion, r).bias)
                == (getattr(others[0], r).weight, getattr(others[0], r).bias)
                for r in ROLES
            )
        ):
            return main
    read = ", ".join(b.q.weight.tensor for b in streams)
    raise Unresolved(
        f"its queries come from {len(streams)} projections token by token ({read}), which surgeon does not know as "
        "one block and its context stream"
    )


def _covering(ops: list[Op], pid: int, axis: int, row: int) -> Op | None:
    for op in reversed(ops):
        if op.pid == pid and op.axis == axis and op.start <= row < op.start + op.size:
            return op
    return None


def _check_disjoint(projs: dict[Role, Projection]) -> None:
    seen: dict[str, set[int]] = {}
    for role, p in projs.items():
        rows = {o + i for o in p.weight.offsets for i in range(p.weight.size)}
        key = f"{p.weight.tensor}@{p.weight.axis}"
        if seen.get(key, set()) & rows:
            raise Unresolved(f"its {_ROLE[role]} shares rows of {p.weight.tensor} with another projection")
        seen.setdefault(key, set()).update(rows)


def _common_module(start: str, owners: list[str]) -> str:
    """The innermost module at the attention call, widened until it holds every projection."""
    module = start
    while module and not all(o == module or o.startswith(module + ".") for o in owners):
        module = module.rpartition(".")[0]
    return module


def probe_blocks(
    module: nn.Module,
    *,
    example_inputs: Any = None,
    hints: Hints | None = None,
    prefix: str = "",
    skip: list[str] | None = None,
    notes: list[str] | None = None,
) -> list[AttentionBlock]:
    """Attention blocks of ``module`` read from its forward alone (no names, no config).

    ``example_inputs`` (a tensor, a tuple of positional arguments or a dict of keyword arguments) is
    what the module is called with; without it, a Hugging Face model gets token ids / pixels / audio
    features built from its config, anything else a float tensor (1, tokens, width) tried on the
    module and then on its submodules. ``prefix`` is prepended to every name (``module`` sits there
    inside a larger model); modules under ``skip`` (paths inside ``module``) are ignored. ``notes`` gets
    one line for the normalizations found between a block's projections and its attention (kept as they are).
    """
    hints = hints or Hints()
    with probing(module):
        targets = Targets(module)
        names = {m: n for n, m in module.named_modules()}
        blocks: dict[tuple, AttentionBlock] = {}
        norms: dict[str, str] = {}  # norm module -> the tensor whose codes it normalized
        for runs in _call_sites(module, example_inputs, names, targets, skip or []):
            norms.update((path, targets.names[pid]) for path, pid in runs["ones"].kept_norms)
            for i, cap in enumerate(runs["ones"].captures):
                if skip and under(cap.module, skip):
                    continue
                try:
                    block = _call_block(runs, i, targets, hints)
                except Unresolved as exc:
                    caps = _captures(runs, i)
                    if cap.via == "matmul" and not any(_decodes(caps, role, targets) for role in "qkv"):
                        continue  # products around a softmax that involve no projection: not attention
                    where = join(prefix, cap.module) or type(module).__name__
                    raise LayoutError(f"cannot resolve the attention in {where}: {exc}") from None
                if not (skip and under(block.module, skip)):
                    blocks.setdefault(tuple((p.weight.tensor, p.weight.offsets) for p in block.projections), block)
    found = [prefixed(b, prefix) for b in placed(list(blocks.values()))] if blocks else []
    if notes is not None:
        notes += kept_norms_note({join(prefix, m): join(prefix, t) for m, t in norms.items()}, found)
    return found


def kept_norms_note(norms: Mapping[str, str], blocks: list[AttentionBlock]) -> list[str]:
    """One line naming the normalizations (norm module -> the projection tensor it reads) that sit between
    a block's query/key projections and its attention: part of the model, kept as they are."""
    per_block: dict[str, list[str]] = {}
    for block in blocks:
        tensors = {p.weight.tensor for p in block.projections}
        owner = block.module + "." if block.module else ""
        leaves = [n.removeprefix(owner) for n, t in norms.items() if t in tensors]
        if leaves:
            per_block[block.module] = leaves
    if not per_block:
        return []
    first, leaves = next(iter(per_block.items()))
    more = len(per_block) - 1
    where = first + (f" and {more} more block{'s' if more > 1 else ''}" if more else "")
    return [
        f"{where}: {', '.join(leaves)} normalize{'s' if len(leaves) == 1 else ''} projection outputs before the "
        "attention; kept as they are (part of the model): surgeon conditions the q/k/v projections before them"
    ]


def _call_sites(
    module: nn.Module, example_inputs: Any, names: dict[nn.Module, str], targets: Targets, skip: list[str]
) -> list[dict[str, Watch]]:
    """Run the coded forwards where the module can be called; one entry per successful call."""
    if example_inputs is not None:
        call, failure = example_call(module, example_inputs), "{} fails on the example inputs given: {}"
    else:
        hf = any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)
        inputs = hf_inputs(module) if hf else decoder_inputs(module)
        if inputs is None:  # no input of its own: try the module, then its submodules, on a float probe
            sites: list[dict[str, Watch]] = []
            _try_calls(module, "", names, targets, skip, sites)
            return sites
        call = lambda: module(**inputs)  # noqa: E731
        failure = "cannot run {} on a probe input ({}); pass example_inputs=... to observe its forward"
    runs = watch_all(module, call, names, targets)
    if runs is None:  # the coded forward failed: run it plainly for the model's own error
        try:
            call()
        except Exception as exc:
            raise LayoutError(failure.format(type(module).__name__, _short(exc))) from None
    return [runs] if runs else []


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def _try_calls(
    module: nn.Module,
    path: str,
    names: dict[nn.Module, str],
    targets: Targets,
    skip: list[str],
    sites: list[dict[str, Watch]],
) -> None:
    """Call ``module`` on a float (1, tokens, width) probe; where it fails, try its children."""
    if under(path, skip) and skip:
        return
    own = [
        (n, p)
        for n, p in module.named_parameters()
        if p.dim() == 2 and p.is_floating_point() and not under(join(path, n), skip)
    ]
    if not own:
        return
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is not nn.Module.forward:
        device = own[0][1].device
        widths = Counter(p.shape[1] for _, p in own).most_common(2) + Counter(p.shape[0] for _, p in own).most_common(1)
        for width in dict.fromkeys(w for w, _ in widths):
            x = torch.randn(1, PROBE_TOKENS, width, generator=torch.Generator().manual_seed(0)).to(device)
            runs = watch_all(module, functools.partial(module, x), names, targets)
            if runs is not None:
                sites.append(runs)
                return
    for name, child in module.named_children():
        _try_calls(child, join(path, name), names, targets, skip, sites)
