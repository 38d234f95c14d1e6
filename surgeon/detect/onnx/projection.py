"""From an operand of an attention core back to its projection: what the walk finds (Proj, Core) and how."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import onnx

from ...errors import UnsupportedWeightsError
from .graph import FLOAT_TYPES, PASS_BACK, QUANTIZED, WALK_DEPTH, WALK_STEPS, Fail, Graph, data_inputs, same_data_source
from .pointwise import is_pointwise_conv, read_channels


# --- what the walk finds -----------------------------------------------------------------------
@dataclass
class Proj:
    """One role's projection: the weight, the columns it owns, its bias, the head split seen."""

    node: int  # the MatMul/Gemm/fused core that reads the weight
    op: str
    weight: str
    axis: int  # output-feature axis of the weight initializer
    in_features: int
    base: int  # first output column of this role
    width: int  # number of output columns of this role
    source: str  # the data tensor the projection reads
    bias: str | None = None
    bias_base: int = 0  # projection column that bias element 0 belongs to
    head_dim: int | None = None
    heads: int | None = None
    weight_nodes: set[int] = field(default_factory=set)
    bias_nodes: set[int] = field(default_factory=set)


@dataclass
class Pending:
    """A Reshape that split a projection's features into (..., a, b), followed forward."""

    shape: list[int | None]  # its target shape, as far as known
    axis: int | None  # where the ``a`` axis is now (None: lost track)
    rank: int | None
    heads: list[int | None] | None = None  # (heads, head_dim) when the Reshape split (a, heads, head_dim) at once


@dataclass
class Core:
    node: int
    label: str  # layout prefix for fused cores ("" for Softmax)
    q: Proj
    k: Proj
    v: Proj
    num_heads: int | None = None
    kv_heads: int | None = None


class ProjectionWalk:
    """Following one operand of a core back to the MatMul/Gemm that projects it (Walker's second half)."""

    g: Graph
    cut_short = False  # a walk stopped at WALK_DEPTH or WALK_STEPS (the graph module says why there are bounds)

    def _near(self) -> str:
        return f" within {WALK_DEPTH} ops" if self.cut_short else ""

    # --- from an operand of the core back to its projection ------------------------------------
    def _projection(self, tensor: str, role: str) -> Proj:
        g = self.g
        self.cut_short = False
        parent: dict[str, tuple[int, str]] = {}  # tensor -> (node that consumes it on the way, that node's output)
        seen, queue, steps = {tensor}, deque([(tensor, 0)]), 0
        found: list[tuple[int, str]] = []  # (projection node, its output tensor)
        dead: list[str] = []
        while queue:
            t, depth = queue.popleft()
            n = g.producer.get(t)
            if n is None:
                if t in g.inputs:
                    dead.append(f"graph input {t}")
                continue
            node = g.nodes[n]
            op = g.op(n)
            if node.op_type in QUANTIZED or op.split(".")[-1] in QUANTIZED:
                raise UnsupportedWeightsError(
                    f"the {role} projection of this model is quantized ({g.describe(n)}): surgeon rewrites float weights only; "
                    "re-initialize the float model, then quantize"
                )
            if node.op_type in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx"):
                if node.op_type == "MatMul" and not g.is_const(node.input[1]) and node.input[1] not in g.inputs:
                    dead.append(f"{g.describe(n)} (two computed operands)")
                    continue
                if (n, t) not in found:
                    found.append((n, t))
                continue
            if is_pointwise_conv(g, n):  # a 1x1 convolution is a projection too (VITS conv_q/conv_k/conv_v)
                if (n, t) not in found:
                    found.append((n, t))
                continue
            which = (
                PASS_BACK.get(node.op_type)
                if node.domain in ("", "ai.onnx") or node.op_type == "RotaryEmbedding"
                else None
            )
            if which is None:
                dead.append(g.describe(n))
                continue
            steps += len(node.input)
            if depth >= WALK_DEPTH or steps > WALK_STEPS:
                self.cut_short = True
                continue
            for i in data_inputs(g, node, which):
                if i not in seen:
                    seen.add(i)
                    parent[i] = (n, t)
                    queue.append((i, depth + 1))
        projections = list(dict.fromkeys(n for n, _ in found))
        if not projections:
            stops = ", ".join(list(dict.fromkeys(dead))[:3]) or "nothing"
            raise Fail(
                f"{role} reaches no MatMul/Gemm with a constant weight{self._near()} (the walk stops at {stops})"
            )
        if len(projections) > 1:
            raise Fail(
                f"{role} comes from {len(projections)} projections ({', '.join(g.describe(p) for p in projections[:3])})"
            )
        n, out = found[0]
        path = []  # (node, tensor entering it, tensor leaving it), from the projection toward the core
        t = out
        while t in parent:
            m, t_out = parent[t]
            path.append((m, t, t_out))
            t = t_out
        return self._read_projection(n, path, role)

    def _read_projection(self, n: int, path, role: str) -> Proj:
        g = self.g
        node = g.nodes[n]
        if node.op_type == "Conv":
            return self._read_conv(n, path, role)
        transposed = False
        if node.op_type == "Gemm":
            if g.attr(n, "transA", 0):
                raise Fail(f"{g.describe(n)} has transA=1, which surgeon does not follow")
            transposed = bool(g.attr(n, "transB", 0))
        weight, extra_nodes = self._weight_initializer(node.input[1], n, role)
        flip = any(g.nodes[m].op_type == "Transpose" for m in extra_nodes)
        dims = list(g.inits[weight].dims)
        if len(dims) != 2:
            raise Fail(f"{role} weight {weight} has shape {dims}; a projection weight must be 2-D")
        axis = (0 if transposed else 1) ^ int(flip)
        out_features, in_features = dims[axis], dims[1 - axis]
        p = Proj(
            n,
            node.op_type,
            weight,
            axis,
            in_features,
            0,
            out_features,
            same_data_source(g, node.input[0]),
            weight_nodes={n, *extra_nodes},
        )
        bias, via = g.initializer(node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 else "")
        if bias is not None and list(g.inits[bias].dims) == [out_features]:
            p.bias, p.bias_nodes = bias, {n, *via}
        self._window(p, path, role)
        return p

    def _read_conv(self, n: int, path, role: str) -> Proj:
        g = self.g
        node = g.nodes[n]
        weight, extra_nodes = self._weight_initializer(node.input[1], n, role, transpose=False)
        dims = list(g.inits[weight].dims)
        p = Proj(
            n,
            "Conv",
            weight,
            0,
            dims[1],
            0,
            dims[0],
            same_data_source(g, node.input[0]),
            weight_nodes={n, *extra_nodes},
        )
        read_channels(g, p, path, role)
        return p

    def _weight_initializer(self, tensor: str, user: int, role: str, transpose: bool = True) -> tuple[str, list[int]]:
        """The initializer behind a projection weight, through Identity nodes (shared initializers)
        and one 2-D Transpose (the axes swap); also returns the nodes passed."""
        g = self.g
        via: list[int] = []
        while tensor not in g.inits and tensor in g.producer and len(via) < WALK_DEPTH:  # a crafted graph may loop
            n = g.producer[tensor]
            node = g.nodes[n]
            flips = node.op_type == "Transpose" and g.attr(n, "perm") in (None, [1, 0])
            if node.op_type != "Identity" and not (
                transpose and flips and not any(g.nodes[m].op_type == "Transpose" for m in via)
            ):
                break
            via.append(n)
            tensor = node.input[0]
        self._check_weight_source(tensor, user, role)  # raises unless it is a float initializer
        return tensor, via

    def _check_weight_source(self, tensor: str, user: int, role: str) -> None:
        g = self.g
        where = f"the {role} projection {g.describe(user)}"
        if tensor in g.inits:
            t = g.inits[tensor]
            if t.data_type not in FLOAT_TYPES:
                kind = onnx.TensorProto.DataType.Name(t.data_type)
                raise UnsupportedWeightsError(
                    f"{where} has weight {tensor} of type {kind}, not a float matrix: it looks quantized or integer; "
                    "surgeon rewrites float16/bfloat16/float32/float64 projections only"
                )
            return
        if not tensor:
            raise Fail(f"{where} has no weight input")
        if tensor in g.inputs:
            origin = "a graph input"
            fix = "export the model with its weights as initializers (torch.onnx.export(..., export_params=True))"
        elif tensor in g.producer and g.nodes[g.producer[tensor]].op_type == "DequantizeLinear":
            raise UnsupportedWeightsError(
                f"{where} reads a quantized weight ({g.describe(g.producer[tensor])}): surgeon rewrites float weights only; "
                "re-initialize the float model, then quantize"
            )
        elif tensor in g.producer and g.nodes[g.producer[tensor]].op_type == "Constant":
            origin = f"the Constant node {g.nodes[g.producer[tensor]].name or tensor}"
            fix = (
                "turn Constant nodes into initializers (e.g. onnxscript's optimizer or onnxsim) and run surgeon on that"
            )
        elif tensor in g.producer:
            origin = f"computed by {g.describe(g.producer[tensor])}"
            fix = "fold it into an initializer first (e.g. onnxscript's optimizer or onnxsim), or re-initialize the source model"
        else:
            origin = "not produced by any node"
            fix = "check that the model is valid (onnx.checker)"
        raise UnsupportedWeightsError(
            f"{where} reads weight {tensor}, which is {origin}, not a constant initializer; {fix}"
        )

    def _window(self, p: Proj, path, role: str) -> None:
        """Walk forward from the projection to the core and read what the ops say about its output.

        While the last axis holds the projection's features: a Split/Slice of it narrows the
        columns of this role (fused QKV), an Add of a 1-D initializer is the bias. The first
        Reshape that splits the features into (a, b) is either the head split (heads, head_dim),
        or, when a Gather/Split later picks one index of ``a`` (``unflatten(-1, (3, E))`` of
        nn.MultiheadAttention's packed projection), a choice of one chunk of b features; the
        axis of ``a`` is followed through Unsqueeze/Transpose/Squeeze to tell which.
        """
        g = self.g
        pending: Pending | None = None  # a Reshape that split the features, not yet explained
        heads_shape: list[int | None] | None = None
        for n, t_in, t_out in path:
            node = g.nodes[n]
            op = node.op_type
            if heads_shape is not None:
                # after the head split, only the head_dim axis may be cut (rotary halves)
                if op in ("Split", "Slice", "Gather") and not self._cuts_last_axis(n, t_in):
                    raise Fail(
                        f"{role} is cut by {g.describe(n)} after its head split, a QKV packing surgeon does not follow"
                    )
                continue
            if pending is not None:
                if op == "Reshape":
                    heads_shape = pending.shape
                elif self._pending_step(pending, p, n, t_in, t_out, role):
                    # a chunk was chosen: the last axis holds features again, or (timm) the chunk's heads
                    heads_shape, pending = pending.heads, None
                continue
            if op == "Add" and p.bias is None:
                other = [i for i in node.input if i != t_in]
                bias, via = g.initializer(other[0] if other else "")
                if bias is not None and list(g.inits[bias].dims) == [p.width]:
                    p.bias, p.bias_base, p.bias_nodes = bias, p.base, {n, *via}
                continue
            if op == "Split":
                self._split(p, n, t_in, t_out, role)
            elif op == "Slice":
                self._slice(p, n, t_in, role)
            elif op == "Gather":
                raise Fail(f"{role} is selected by {g.describe(n)}, a QKV packing surgeon does not follow")
            elif op == "Reshape":
                found = g.target_shape(node.input[1])
                shape, complete = found if found else ([], False)
                if shape and shape[-1] == p.width:
                    continue  # merges or splits leading axes only
                pending = _feature_split(shape, len(shape) if complete else g.rank(t_out), p.width)
            elif op == "Transpose":
                perm = g.attr(n, "perm")
                if perm is None or perm[-1] != len(perm) - 1:
                    raise Fail(f"{role} has its feature axis moved by {g.describe(n)} before any head split")
        if pending is not None:
            heads_shape = pending.shape
        if heads_shape is not None:
            _read_head_split(p, heads_shape, role)

    def _pending_step(self, pending: Pending, p: Proj, n: int, t_in: str, t_out: str, role: str) -> bool:
        """Follow the first axis of a feature split through one op; True when it picked one chunk."""
        g = self.g
        node = g.nodes[n]
        op = node.op_type
        axis, rank = pending.axis, pending.rank
        if op in ("Unsqueeze", "Squeeze"):
            axes = g.ints(node.input[1]) if len(node.input) > 1 and node.input[1] else list(g.attr(n, "axes", []))
            if axis is None or rank is None or not axes:
                pending.axis = pending.rank = None
                return False
            if op == "Unsqueeze":
                rank += len(axes)
                for a in sorted(a % rank for a in axes):
                    axis += a <= axis
            else:
                norm = [a % rank for a in axes]
                if axis in norm:  # a split into (1, features): nothing to choose
                    pending.axis = None
                axis -= sum(a < axis for a in norm)
                rank -= len(axes)
            pending.axis, pending.rank = (axis if pending.axis is not None else None), rank
        elif op == "Transpose" and axis is not None:
            perm = g.attr(n, "perm") or list(range(rank or 0))[::-1]
            pending.axis = perm.index(axis) if axis < len(perm) else None
        elif op in ("Gather", "Split", "Slice"):
            if op == "Slice":
                cut = g.ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            else:
                cut = [g.attr(n, "axis", 0)]
            on_pending = axis is not None and rank is not None and cut is not None and axis in [a % rank for a in cut]
            if on_pending:
                return self._pick_chunk(pending, p, n, t_out, role)
            if on_pending or (op != "Slice" and not self._cuts_last_axis(n, t_in)):
                raise Fail(f"{role} is cut by {g.describe(n)}, a QKV packing surgeon does not follow")
        return False

    def _pick_chunk(self, pending: Pending, p: Proj, n: int, t_out: str, role: str) -> bool:
        """A Gather of one index, or a Split into ones, of the first axis of a feature split."""
        g = self.g
        node = g.nodes[n]
        count, size = pending.shape[-2:] if len(pending.shape) > 1 else (None, None)
        if node.op_type == "Gather":
            index = g.value(node.input[1])
            picked = int(index) if index is not None and index.ndim == 0 else None
        elif node.op_type == "Slice":  # one index of the chunk axis, [i, i + 1) (unbind by the dynamo exporter)
            picked = self._slice_one(pending, n, count)
        else:
            sizes = g.ints(node.input[1]) if len(node.input) > 1 and node.input[1] else g.attr(n, "split")
            picked = list(node.output).index(t_out) if not sizes or set(sizes) == {1} else None
        if picked is None or not isinstance(size, int) or not isinstance(count, int) or count * size != p.width:
            raise Fail(f"{role} is selected by {g.describe(n)} in a way surgeon does not follow")
        p.base += (picked % count) * size
        p.width = size
        return True

    def _slice_one(self, pending: Pending, n: int, count: int | None) -> int | None:
        g = self.g
        node = g.nodes[n]
        starts, ends, axes = g.ints(node.input[1]), g.ints(node.input[2]), g.ints(node.input[3])
        steps = g.ints(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if (
            starts is None
            or ends is None
            or axes is None
            or pending.rank is None
            or pending.axis is None
            or not isinstance(count, int)
        ):
            return None
        i = [a % pending.rank for a in axes].index(pending.axis)
        if steps and steps[i] != 1:
            return None
        start = starts[i] + count if starts[i] < 0 else starts[i]
        end = min(count, ends[i] + count if ends[i] < 0 else ends[i])
        return start if 0 <= start and end - start == 1 else None

    def _cuts_last_axis(self, n: int, t_in: str) -> bool:
        g = self.g
        node = g.nodes[n]
        if node.op_type == "Slice":
            axes = g.ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            if axes is None:
                return False
        else:
            axes = [g.attr(n, "axis", 0)]
        rank = g.rank(t_in)
        return all(a == -1 or (rank is not None and a == rank - 1) for a in axes)

    def _split(self, p: Proj, n: int, t_in: str, t_out: str, role: str) -> None:
        g = self.g
        node = g.nodes[n]
        axis = g.attr(n, "axis", 0)
        sizes = g.ints(node.input[1]) if len(node.input) > 1 and node.input[1] else g.attr(n, "split")
        if not sizes:
            count = g.attr(n, "num_outputs") or len(node.output)
            sizes = [p.width // count] * count if p.width % count == 0 else None
        rank = g.rank(t_in)
        on_features = (
            axis == -1
            or (rank is not None and axis == rank - 1)
            or (rank is None and sizes is not None and sum(sizes) == p.width)
        )
        if not on_features:
            raise Fail(f"{role} goes through {g.describe(n)}, which splits an axis other than the features")
        if not sizes or sum(sizes) != p.width:
            raise Fail(f"cannot read the split sizes of {g.describe(n)} for the {p.width} features of {role}")
        k = list(node.output).index(t_out)
        p.base += sum(sizes[:k])
        p.width = sizes[k]

    def _slice(self, p: Proj, n: int, t_in: str, role: str) -> None:
        g = self.g
        node = g.nodes[n]
        starts, ends = g.ints(node.input[1]), g.ints(node.input[2])
        axes = g.ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        steps = g.ints(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if starts is None or ends is None:
            raise Fail(f"{role} goes through {g.describe(n)} whose bounds are not constant")
        rank = g.rank(t_in)
        axes = axes if axes is not None else list(range(len(starts)))
        last = [i for i, a in enumerate(axes) if a == -1 or (rank is not None and a == rank - 1)]
        if not last:
            if rank is None:
                raise Fail(f"cannot tell which axis {g.describe(n)} cuts on the way to {role}")
            return  # cuts batch or sequence: the projection's columns are unchanged
        i = last[0]
        if steps and steps[i] != 1:
            raise Fail(f"{role} goes through {g.describe(n)} with step {steps[i]}")
        start, end = starts[i], ends[i]
        start = max(0, start + p.width if start < 0 else start)
        end = min(p.width, end + p.width if end < 0 else end)
        p.base += start
        p.width = end - start


def _feature_split(shape: list[int | None], rank: int | None, width: int) -> Pending:
    """The Reshape that splits a projection's ``width`` features into (..., a, b), or at once into
    (..., 3, heads, head_dim) (timm's fused qkv: a chunk of 3 is picked later, its heads split already)."""
    last3 = shape[-3:] if len(shape) >= 3 else []
    if len(last3) == 3 and all(isinstance(x, int) and x > 1 for x in last3) and last3[0] * last3[1] * last3[2] == width:  # type: ignore[operator]
        return Pending([*shape[:-3], last3[0], last3[1] * last3[2]], rank - 3 if rank else None, rank, last3[1:])  # type: ignore[operator]
    return Pending(shape, rank - 2 if rank else None, rank)


def _read_head_split(p: Proj, shape: list[int | None], role: str) -> None:
    """(heads, head_dim) of a projection from the shape of the Reshape that splits its features."""
    d = shape[-1] if shape and isinstance(shape[-1], int) and shape[-1] > 0 else None
    h = shape[-2] if len(shape) > 1 and isinstance(shape[-2], int) and shape[-2] > 0 else None
    if d and p.width % d == 0:
        p.head_dim, p.heads = d, p.width // d
        if h and h != p.heads:
            raise Fail(f"{role} has {p.width} features but is reshaped to (..., {h}, {d})")
    elif h and p.width % h == 0 and not d:
        p.heads, p.head_dim = h, p.width // h
