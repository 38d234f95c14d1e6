"""Projections written as 1x1 convolutions (``Conv`` with a weight of shape (out, in, 1[, 1])): VITS /
Piper TTS (``conv_q``/``conv_k``/``conv_v``, Conv1d with kernel 1) and timm's NCHW attention.

Their features are on the channel axis 1, not the last axis, so the walk from the Conv to the
attention core reads only what that layout allows: the Conv's own bias, then the Reshape that splits
the channels into (heads, head_dim) as (batch, heads, head_dim, ...). Anything else on the way (a
Split, Slice or Transpose of the channels) is not followed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .graph import Fail, Graph

if TYPE_CHECKING:
    from .found import Proj


def is_pointwise_conv(g: Graph, n: int) -> bool:
    """A plain (group 1) Conv whose weight is a constant (out, in, 1, ...)."""
    node = g.nodes[n]
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return False
    weight, _ = g.initializer(node.input[1])
    if weight is None:
        return False
    dims = list(g.inits[weight].dims)
    return len(dims) >= 3 and all(d == 1 for d in dims[2:]) and g.attr(n, "group", 1) == 1


def read_channels(g: Graph, p: Proj, path: list[tuple[int, str, str]], role: str) -> None:
    """Bias and (heads, head_dim) of a 1x1-conv projection, from the Conv to the attention core."""
    node = g.nodes[p.node]
    bias, via = g.initializer(node.input[2] if len(node.input) > 2 else "")
    if bias is not None and list(g.inits[bias].dims) == [p.width]:
        p.bias, p.bias_nodes = bias, {p.node, *via}
    what = f"{role} ({g.describe(p.node)}, a 1x1 convolution)"
    for i, (n, _, _) in enumerate(path):
        op = g.nodes[n].op_type
        if op == "Reshape":
            found = g.target_shape(g.nodes[n].input[1])
            shape = found[0] if found else []
            if not (
                len(shape) >= 3
                and isinstance(shape[1], int)
                and isinstance(shape[2], int)
                and shape[1] * shape[2] == p.width
            ):
                raise Fail(f"{what} is reshaped by {g.describe(n)} in a way surgeon does not follow")
            # a cut after the split would take q, k or v out of each head's slot (a fused per-head qkv)
            cut = next((m for m, _, _ in path[i + 1 :] if g.nodes[m].op_type in ("Split", "Slice", "Gather")), None)
            if cut is not None:
                raise Fail(
                    f"{what} is cut by {g.describe(cut)} after its head split, a fused packing surgeon does not follow"
                )
            p.heads, p.head_dim = shape[1], shape[2]
            return
        if op in ("Split", "Slice", "Gather", "Transpose", "Add"):
            raise Fail(f"{what} goes through {g.describe(n)} before its head split")
    raise Fail(f"{what} reaches the attention without a head split")
