"""Find attention in an ONNX graph by walking it.

Initializer names after export carry no meaning (``onnx::MatMul_123``, ``val_55``), so the
structure is all there is. Like ONNX Runtime's transformer optimizer, the walk starts from each
attention core and follows the data back to the projections, but it accepts any chain of the
reshaping, scaling, masking, rotary and bias ops that exporters put in between instead of a fixed
pattern:

* core: a ``Softmax`` whose input comes from a Q·Kᵀ product; ``com.microsoft`` ``Attention``,
  ``MultiHeadAttention`` or ``GroupQueryAttention``; the standard ``Attention`` op (opset 23).
* Q and K are the two operands of the Q·Kᵀ product, V the second operand of the
  probabilities·V product after the Softmax (fused ops name them as inputs).
* each of them is followed back to the first ``MatMul``/``Gemm`` with a constant weight. On the
  way from that projection to the core, a ``Split``/``Slice`` of the feature axis, or a ``Gather``
  of an unflattened (3, E) axis, selects the columns that belong to the role (fused QKV), an
  ``Add`` of a 1-D initializer is the bias, and the ``Reshape`` that splits the feature axis
  gives (heads, head_dim).

Blocks are numbered in graph order; their module path comes from the exporter's scopes (the
legacy exporter's node names ``/encoder/layer.0/attention/self/Softmax``, the dynamo exporter's
``pkg.torch.onnx.name_scopes`` / ``namespace`` metadata), which also gives stacks and layer numbers.
"""

from __future__ import annotations

import ast
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx

from ..errors import LayoutError, NoAttentionFoundError, UnsupportedWeightsError, opt
from ..spec import AttentionBlock, Projection, Rows
from . import Detection
from .config import ConfigView, Hints
from .placement import place

MS = "com.microsoft"
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}

# Ops between a projection and the attention core, and which inputs carry the data
# ("*": every input that is not a constant).
_PASS_BACK: dict[str, tuple[int, ...] | str] = {
    **{op: (0,) for op in ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Tile", "Flatten", "Cast", "CastLike",
                           "Identity", "Dropout", "Slice", "Split", "Gather", "Neg", "RotaryEmbedding", "LayerNormalization",
                           "SimplifiedLayerNormalization", "RMSNormalization")},
    **{op: "*" for op in ("Concat", "Add", "Sub", "Mul", "Div")},
    "Where": (1, 2),
}
# Between the Q·Kᵀ product and the Softmax: scale, mask, softcap, casts.
_SCORE_BACK: dict[str, tuple[int, ...] | str] = {
    **{op: (0,) for op in ("Cast", "Identity", "Reshape", "Tanh", "Clip", "Dropout")},
    **{op: "*" for op in ("Add", "Sub", "Mul", "Div", "Min", "Max")},
    "Where": (1, 2),
}
# Between the Softmax and the probabilities·V product.
_PROB_FORWARD = {"Cast", "Identity", "Dropout", "Where", "Mul", "Div", "Reshape"}
_CORES = {"Softmax", "Attention", f"{MS}.Attention", f"{MS}.MultiHeadAttention", f"{MS}.GroupQueryAttention"}
_PRODUCTS = {"MatMul", "Einsum", "FusedMatMul"}  # data x data products (Q·Kᵀ, P·V)
_QUANTIZED = {"MatMulNBits", "MatMulInteger", "QLinearMatMul", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QAttention", "QGemm"}
# Ops a source tensor passes through unchanged in content (for self/cross: do Q and K read the same input?)
_SAME_DATA = {"Reshape", "Flatten", "Cast", "Identity", "Squeeze", "Unsqueeze"}


def _axes(g: Graph, n: int, args) -> list[int]:
    node = g.nodes[n]
    if len(node.input) > 1 and args[1] is not None:
        return [int(a) for a in np.atleast_1d(args[1])]
    return list(g.attr(n, "axes", []))


# Integer ops folded when reading small constants: op -> f(graph, node, *input values)
_FOLD: dict[str, Callable] = {
    "Identity": lambda g, n, x: x,
    "Cast": lambda g, n, x: x.astype(onnx.helper.tensor_dtype_to_np_dtype(g.attr(n, "to"))),
    "Add": lambda g, n, a, b: a + b,
    "Sub": lambda g, n, a, b: a - b,
    "Mul": lambda g, n, a, b: a * b,
    "Div": lambda g, n, a, b: a // b if a.dtype.kind in "iu" else a / b,
    "Mod": lambda g, n, a, b: np.mod(a, b),
    "Neg": lambda g, n, a: -a,
    "Reshape": lambda g, n, x, shape: x.reshape([int(d) for d in shape]),
    "Unsqueeze": lambda g, n, x, *rest: np.expand_dims(x, tuple(_axes(g, n, (x, *rest)))),
    "Squeeze": lambda g, n, x, *rest: np.squeeze(x, tuple(_axes(g, n, (x, *rest)))) if _axes(g, n, (x, *rest)) else np.squeeze(x),
    "Concat": lambda g, n, *xs: np.concatenate([np.atleast_1d(x) for x in xs], axis=g.attr(n, "axis", 0)),
    "Gather": lambda g, n, x, i: np.take(x, i, axis=g.attr(n, "axis", 0)),
}


class _Fail(Exception):
    """One attention core could not be resolved; the message names the step."""


# --- the graph, indexed ------------------------------------------------------------------------
class Graph:
    """Nodes by index, who produces and who consumes each tensor, small constant values."""

    def __init__(self, model: onnx.ModelProto, const: Callable[[str], np.ndarray | None]) -> None:
        g = model.graph
        self.nodes = list(g.node)
        self.const = const
        self.inits: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
        self.inputs = {i.name for i in g.input} - set(self.inits)
        self.outputs = {o.name for o in g.output}
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = defaultdict(list)
        for i, node in enumerate(self.nodes):
            for out in node.output:
                if out:
                    self.producer[out] = i
            for name in dict.fromkeys(list(node.input) + _subgraph_inputs(node)):
                if name:
                    self.consumers[name].append(i)
        self.ranks = _infer_ranks(model)
        self._values: dict[str, np.ndarray | None] = {}
        self._const_memo: dict[str, bool] = {}

    def describe(self, n: int) -> str:
        node = self.nodes[n]
        domain = f"{node.domain}." if node.domain not in ("", "ai.onnx") else ""
        return f"{domain}{node.op_type} {node.name or '#' + str(n)}"

    def op(self, n: int) -> str:
        node = self.nodes[n]
        return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"

    def attr(self, n: int, name: str, default=None):
        for a in self.nodes[n].attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    def is_const(self, tensor: str, depth: int = 0) -> bool:
        """An initializer, a Constant, or computed from those only (no graph input upstream)."""
        if not tensor or tensor in self.inits:
            return True
        if tensor in self._const_memo:
            return self._const_memo[tensor]
        n = self.producer.get(tensor)
        if n is None or depth > 16:
            return False  # a graph input, or too deep to tell: treat it as data
        result = all(self.is_const(i, depth + 1) for i in self.nodes[n].input if i)
        self._const_memo[tensor] = result
        return result

    def value(self, tensor: str) -> np.ndarray | None:
        """The value of a small constant tensor (shapes, axes, split sizes), or None.

        Folds the few integer ops exporters use to compute such constants (the legacy exporter's
        ``unflatten`` computes its Reshape shape from Mod/Add of constants)."""
        if tensor in self._values:
            return self._values[tensor]
        out = None
        if tensor in self.inits:
            out = self.const(tensor)
        elif tensor in self.producer:
            n = self.producer[tensor]
            node = self.nodes[n]
            if node.op_type == "Constant" and node.attribute:
                a = node.attribute[0]
                out = onnx.numpy_helper.to_array(a.t) if a.name == "value" else np.array(onnx.helper.get_attribute_value(a))
            elif node.op_type in _FOLD and node.domain in ("", "ai.onnx") and len(node.output) == 1:
                args = [self.value(i) for i in node.input if i]
                if all(a is not None for a in args):
                    try:
                        out = np.asarray(_FOLD[node.op_type](self, n, *args))
                    except (ValueError, TypeError, IndexError, ZeroDivisionError):
                        out = None
        self._values[tensor] = out
        return out

    def ints(self, tensor: str) -> list[int] | None:
        v = self.value(tensor) if tensor else None
        if v is None or v.dtype.kind not in "iu":
            return None
        return [int(x) for x in np.atleast_1d(v)]

    def target_shape(self, tensor: str) -> tuple[list[int | None], bool] | None:
        """A Reshape's shape input as far as it can be read: (entries, whether that is all of them).

        Entries are None where computed at run time (batch and sequence lengths); the legacy
        exporter with dynamic axes builds the shape with Concat of such pieces and constants."""
        whole = self.ints(tensor)
        if whole is not None:
            return list(whole), True
        n = self.producer.get(tensor)
        if n is None or self.nodes[n].op_type != "Concat":
            return None
        pieces: list[list[int | None] | None] = [self._shape_piece(i) for i in self.nodes[n].input]
        tail: list[int | None] = []
        for piece in reversed(pieces):
            if piece is None:
                return (tail, False) if tail else None
            tail = piece + tail
        return tail, True

    def _shape_piece(self, tensor: str) -> list[int | None] | None:
        vals = self.ints(tensor)
        if vals is not None:
            return list(vals)
        n = self.producer.get(tensor)
        if n is None:
            return None
        node = self.nodes[n]
        if node.op_type == "Unsqueeze":  # one computed entry (batch or sequence length)
            return [None]
        if node.op_type == "Slice" and node.input[0] in self.producer and self.nodes[self.producer[node.input[0]]].op_type == "Shape":
            rank = self.rank(self.nodes[self.producer[node.input[0]]].input[0])
            starts, ends = self.ints(node.input[1]), self.ints(node.input[2])
            if rank is None or not starts or not ends:
                return None
            start, end = (max(0, min(rank, v + rank if v < 0 else v)) for v in (starts[0], ends[0]))
            return [None] * max(0, end - start)
        return None

    def shape_tail(self, tensor: str) -> list[int | None] | None:
        found = self.target_shape(tensor)
        return found[0] if found else None

    def initializer(self, tensor: str) -> tuple[str | None, list[int]]:
        """The initializer a tensor is, through Identity nodes (the legacy exporter's way of sharing
        one initializer between equal parameters), and those nodes; (None, []) if it is not one."""
        via: list[int] = []
        while tensor and tensor not in self.inits and tensor in self.producer and self.nodes[self.producer[tensor]].op_type == "Identity":
            via.append(self.producer[tensor])
            tensor = self.nodes[self.producer[tensor]].input[0]
        return (tensor, via) if tensor in self.inits else (None, [])

    def rank(self, tensor: str) -> int | None:
        return self.ranks.get(tensor)

    def scope(self, n: int) -> str | None:
        """The module path the exporter recorded for a node, e.g. ``encoder.layer.0.attention.self``."""
        node = self.nodes[n]
        meta = {p.key: p.value for p in node.metadata_props}
        scopes = meta.get("pkg.torch.onnx.name_scopes")
        if scopes:
            try:
                value = ast.literal_eval(scopes)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                value = None
            # a list of module paths; anything else (a number, a dict, a string) is ignored, not trusted
            names = [s for s in value[:-1] if s] if isinstance(value, list) and all(isinstance(s, str) for s in value) else []
            if names:
                return names[-1]
        namespace = meta.get("namespace")
        if namespace:
            paths = [entry.split(":")[0].strip() for entry in namespace.split("/")[:-1]]
            paths = [p for p in paths if p]
            if paths:
                return paths[-1]
        if node.name.startswith("/") and node.name.count("/") >= 2:
            return ".".join(p for p in node.name.strip("/").split("/")[:-1] if p)
        return None


def _subgraph_inputs(node: onnx.NodeProto) -> list[str]:
    """Outer-scope tensors read inside If/Loop/Scan bodies (they are users too)."""
    names: list[str] = []
    for a in node.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []
        for sub in graphs:
            for inner in sub.node:
                names += list(inner.input) + _subgraph_inputs(inner)
    return names


def _infer_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor ranks from ONNX shape inference on a copy of the graph without the weights' data."""
    g = model.graph
    stubs = []
    for t in g.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL and int(np.prod(t.dims)) <= 64:
            stubs.append(t)  # small constants (shapes, axes) keep their values
        else:
            stubs.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    inits = [t for t in stubs if isinstance(t, onnx.TensorProto)]
    listed = {i.name for i in g.input}
    extra_inputs = [t for t in stubs if not isinstance(t, onnx.TensorProto) and t.name not in listed]
    lite = onnx.helper.make_graph(list(g.node), g.name or "g", list(g.input) + extra_inputs, list(g.output), inits, value_info=list(g.value_info))
    lite_model = onnx.helper.make_model(lite, opset_imports=list(model.opset_import), functions=list(model.functions))
    lite_model.ir_version = model.ir_version
    ranks: dict[str, int] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(lite_model, check_type=False, strict_mode=False, data_prop=True).graph
        infos = list(inferred.value_info) + list(inferred.input) + list(inferred.output)
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        infos = list(g.value_info) + list(g.input) + list(g.output)
    for vi in infos:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            ranks[vi.name] = len(t.shape.dim)
    for t in g.initializer:
        ranks[t.name] = len(t.dims)
    return ranks


# --- what the walk finds -----------------------------------------------------------------------
@dataclass
class _Proj:
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
class _Pending:
    """A Reshape that split a projection's features into (..., a, b), followed forward."""

    shape: list[int | None]  # its target shape, as far as known
    axis: int | None  # where the ``a`` axis is now (None: lost track)
    rank: int | None


@dataclass
class _Core:
    node: int
    label: str  # layout prefix for fused cores ("" for Softmax)
    q: _Proj
    k: _Proj
    v: _Proj
    num_heads: int | None = None
    kv_heads: int | None = None


@dataclass
class OnnxDetection:
    detection: Detection
    graph: Graph
    # (module, role) -> {"weight": node indices, "bias": node indices} that read its initializers
    users: dict[tuple[str, str], dict[str, set[int]]]
    # node index -> (block label, role) for every projection node, to name other users in messages
    owners: dict[int, tuple[str, str]]


# --- the walker --------------------------------------------------------------------------------
class Walker:
    def __init__(self, graph: Graph) -> None:
        self.g = graph

    def cores(self) -> list[int]:
        """Where attention is computed: Softmax nodes and the fused attention ops, in graph order."""
        return [n for n in range(len(self.g.nodes)) if self.g.op(n) in _CORES]

    def resolve(self, n: int) -> _Core:
        op = self.g.op(n)
        if op == "Softmax":
            return self._softmax(n)
        if op == f"{MS}.Attention":
            return self._packed_attention(n)
        if op == f"{MS}.MultiHeadAttention":
            return self._separate_inputs(n, "com.microsoft.MultiHeadAttention", packed_bias=3)
        if op == f"{MS}.GroupQueryAttention":
            return self._group_query(n)
        return self._separate_inputs(n, "Attention (opset 23)", packed_bias=None)

    # Softmax(Q·Kᵀ ...)·V
    def _softmax(self, n: int) -> _Core:
        g = self.g
        qk = self._find_back(g.nodes[n].input[0], _SCORE_BACK, lambda m: g.nodes[m].op_type in _PRODUCTS)
        if qk is None:
            raise _Fail("no Q·Kᵀ product (MatMul of two computed tensors) feeds it")
        pv = self._probs_times_v(g.nodes[n].output[0])
        if pv is None:
            raise _Fail("its output reaches no probabilities·V MatMul")
        q_in, k_in = g.nodes[qk].input[0], g.nodes[qk].input[1]
        v_in = g.nodes[pv].input[1]
        return _Core(n, "", self._projection(q_in, "Q"), self._projection(k_in, "K"), self._projection(v_in, "V"))

    def _find_back(self, tensor: str, ops, stop: Callable[[int], bool]) -> int | None:
        """Breadth-first from ``tensor`` toward the inputs, through ``ops``, to the first node that is ``stop``."""
        g = self.g
        seen, queue = {tensor}, deque([tensor])
        while queue:
            t = queue.popleft()
            n = g.producer.get(t)
            if n is None:
                continue
            node = g.nodes[n]
            if stop(n) and all(not g.is_const(i) for i in node.input[:2]):
                return n
            which = ops.get(node.op_type) if node.domain in ("", "ai.onnx") else None
            for i in _data_inputs(g, node, which):
                if i not in seen:
                    seen.add(i)
                    queue.append(i)
        return None

    def _probs_times_v(self, tensor: str) -> int | None:
        g = self.g
        seen, queue = {tensor}, deque([tensor])
        while queue:
            t = queue.popleft()
            for m in g.consumers.get(t, []):
                node = g.nodes[m]
                if node.op_type in _PRODUCTS and node.input[0] == t and len(node.input) > 1 and not g.is_const(node.input[1]):
                    return m
                if node.op_type in _PROB_FORWARD and node.domain in ("", "ai.onnx"):
                    for out in node.output:
                        if out and out not in seen:
                            seen.add(out)
                            queue.append(out)
        return None

    # com.microsoft Attention: one packed (in, Dq + Dk + Dv) weight, stacked per row as [Q | K | V]
    def _packed_attention(self, n: int) -> _Core:
        g = self.g
        node = g.nodes[n]
        heads = g.attr(n, "num_heads")
        weight, via = self._weight_initializer(node.input[1] if len(node.input) > 1 else "", n, "Q/K/V", transpose=False)
        dims = list(g.inits[weight].dims)
        if len(dims) != 2:
            raise _Fail(f"its packed weight {weight} has shape {dims}, expected (in, 3*out)")
        sizes = g.attr(n, "qkv_hidden_sizes")
        sizes = [int(s) for s in sizes] if sizes else [dims[1] // 3] * 3
        if sum(sizes) != dims[1]:
            raise _Fail(f"qkv_hidden_sizes {sizes} do not add up to the {dims[1]} columns of {weight}")
        bias, bias_via = g.initializer(node.input[2] if len(node.input) > 2 else "")
        projs, base = [], 0
        for size in sizes:
            p = _Proj(n, "packed", weight, 1, dims[0], base, size, node.input[0], weight_nodes={n, *via})
            if bias is not None and list(g.inits[bias].dims) == [dims[1]]:
                p.bias, p.bias_base, p.bias_nodes = bias, 0, {n, *bias_via}
            projs.append(p)
            base += size
        q, k, v = projs
        return _Core(n, "com.microsoft.Attention", q, k, v, num_heads=heads, kv_heads=heads)

    # MultiHeadAttention / standard Attention: already-projected Q, K, V as inputs
    def _separate_inputs(self, n: int, label: str, packed_bias: int | None) -> _Core:
        g = self.g
        node = g.nodes[n]
        ins = list(node.input) + [""] * 3
        if not ins[1] or not ins[2]:
            raise _Fail("packed QKV/KV inputs (no separate key and value) are not supported")
        if packed_bias is not None and (g.rank(ins[0]) == 5 or g.rank(ins[1]) == 5):
            raise _Fail("packed QKV/KV inputs (5-D query or key) are not supported")
        q, k, v = (self._projection(ins[i], role) for i, role in enumerate("QKV"))
        bias, via = g.initializer(node.input[packed_bias] if packed_bias is not None and len(node.input) > packed_bias else "")
        if bias is not None and list(g.inits[bias].dims) == [q.width + k.width + v.width]:
            for p, start in ((q, 0), (k, q.width), (v, q.width + k.width)):
                if p.bias is None:  # the packed bias of MultiHeadAttention: [q | k | v]
                    p.bias, p.bias_base, p.bias_nodes = bias, p.base - start, {n, *via}
        heads = g.attr(n, "num_heads") or g.attr(n, "q_num_heads")
        kv = g.attr(n, "kv_num_heads") or (heads if label.startswith("com.microsoft") else None)
        return _Core(n, label, q, k, v, num_heads=heads, kv_heads=kv)

    # GroupQueryAttention: separate Q, K, V, or one packed [Q | K | V] query input
    def _group_query(self, n: int) -> _Core:
        g = self.g
        node = g.nodes[n]
        if len(node.input) > 2 and node.input[1] and node.input[2]:
            return self._separate_inputs(n, "com.microsoft.GroupQueryAttention", packed_bias=None)
        heads, kv = g.attr(n, "num_heads"), g.attr(n, "kv_num_heads")
        if not heads or not kv:
            raise _Fail("its packed query needs the num_heads and kv_num_heads attributes to be cut into Q, K and V")
        p = self._projection(node.input[0], "packed QKV")
        slots = heads + 2 * kv
        if p.width % slots:
            raise _Fail(f"its packed query has {p.width} features, not a multiple of num_heads + 2 * kv_num_heads = {slots}")
        d = p.width // slots
        parts = []
        for start, count in ((0, heads), (heads, kv), (heads + kv, kv)):
            part = _Proj(**{**p.__dict__, "base": p.base + start * d, "width": count * d, "head_dim": d, "heads": count})
            parts.append(part)
        q, k, v = parts
        return _Core(n, "com.microsoft.GroupQueryAttention", q, k, v, num_heads=heads, kv_heads=kv)

    # --- from an operand of the core back to its projection ------------------------------------
    def _projection(self, tensor: str, role: str) -> _Proj:
        g = self.g
        parent: dict[str, tuple[int, str]] = {}  # tensor -> (node that consumes it on the way, that node's output)
        seen, queue = {tensor}, deque([tensor])
        found: list[tuple[int, str]] = []  # (projection node, its output tensor)
        dead: list[str] = []
        while queue:
            t = queue.popleft()
            n = g.producer.get(t)
            if n is None:
                if t in g.inputs:
                    dead.append(f"graph input {t}")
                continue
            node = g.nodes[n]
            op = g.op(n)
            if node.op_type in _QUANTIZED or op.split(".")[-1] in _QUANTIZED:
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
            which = _PASS_BACK.get(node.op_type) if node.domain in ("", "ai.onnx") or node.op_type == "RotaryEmbedding" else None
            if which is None:
                dead.append(g.describe(n))
                continue
            for i in _data_inputs(g, node, which):
                if i not in seen:
                    seen.add(i)
                    parent[i] = (n, t)
                    queue.append(i)
        projections = list(dict.fromkeys(n for n, _ in found))
        if not projections:
            stops = ", ".join(list(dict.fromkeys(dead))[:3]) or "nothing"
            raise _Fail(f"{role} reaches no MatMul/Gemm with a constant weight (the walk stops at {stops})")
        if len(projections) > 1:
            raise _Fail(f"{role} comes from {len(projections)} projections ({', '.join(g.describe(p) for p in projections[:3])})")
        n, out = found[0]
        path = []  # (node, tensor entering it, tensor leaving it), from the projection toward the core
        t = out
        while t in parent:
            m, t_out = parent[t]
            path.append((m, t, t_out))
            t = t_out
        return self._read_projection(n, path, role)

    def _read_projection(self, n: int, path, role: str) -> _Proj:
        g = self.g
        node = g.nodes[n]
        transposed = False
        if node.op_type == "Gemm":
            if g.attr(n, "transA", 0):
                raise _Fail(f"{g.describe(n)} has transA=1, which surgeon does not follow")
            transposed = bool(g.attr(n, "transB", 0))
        weight, extra_nodes = self._weight_initializer(node.input[1], n, role)
        flip = any(g.nodes[m].op_type == "Transpose" for m in extra_nodes)
        dims = list(g.inits[weight].dims)
        if len(dims) != 2:
            raise _Fail(f"{role} weight {weight} has shape {dims}; a projection weight must be 2-D")
        axis = (0 if transposed else 1) ^ int(flip)
        out_features, in_features = dims[axis], dims[1 - axis]
        p = _Proj(n, node.op_type, weight, axis, in_features, 0, out_features, _same_data_source(g, node.input[0]), weight_nodes={n, *extra_nodes})
        bias, via = g.initializer(node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 else "")
        if bias is not None and list(g.inits[bias].dims) == [out_features]:
            p.bias, p.bias_nodes = bias, {n, *via}
        self._window(p, path, role)
        return p

    def _weight_initializer(self, tensor: str, user: int, role: str, transpose: bool = True) -> tuple[str, list[int]]:
        """The initializer behind a projection weight, through Identity nodes (shared initializers)
        and one 2-D Transpose (the axes swap); also returns the nodes passed."""
        g = self.g
        via: list[int] = []
        while tensor not in g.inits and tensor in g.producer:
            n = g.producer[tensor]
            node = g.nodes[n]
            flips = node.op_type == "Transpose" and g.attr(n, "perm") in (None, [1, 0])
            if node.op_type != "Identity" and not (transpose and flips and not any(g.nodes[m].op_type == "Transpose" for m in via)):
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
            raise _Fail(f"{where} has no weight input")
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
            fix = "turn Constant nodes into initializers (e.g. onnxscript's optimizer or onnxsim) and run surgeon on that"
        elif tensor in g.producer:
            origin = f"computed by {g.describe(g.producer[tensor])}"
            fix = "fold it into an initializer first (e.g. onnxscript's optimizer or onnxsim), or re-initialize the source model"
        else:
            origin = "not produced by any node"
            fix = "check that the model is valid (onnx.checker)"
        raise UnsupportedWeightsError(f"{where} reads weight {tensor}, which is {origin}, not a constant initializer; {fix}")

    def _window(self, p: _Proj, path, role: str) -> None:
        """Walk forward from the projection to the core and read what the ops say about its output.

        While the last axis holds the projection's features: a Split/Slice of it narrows the
        columns of this role (fused QKV), an Add of a 1-D initializer is the bias. The first
        Reshape that splits the features into (a, b) is either the head split (heads, head_dim),
        or, when a Gather/Split later picks one index of ``a`` (``unflatten(-1, (3, E))`` of
        nn.MultiheadAttention's packed projection), a choice of one chunk of b features; the
        axis of ``a`` is followed through Unsqueeze/Transpose/Squeeze to tell which.
        """
        g = self.g
        pending: _Pending | None = None  # a Reshape that split the features, not yet explained
        heads_shape: list[int | None] | None = None
        for n, t_in, t_out in path:
            node = g.nodes[n]
            op = node.op_type
            if heads_shape is not None:
                # after the head split, only the head_dim axis may be cut (rotary halves)
                if op in ("Split", "Slice", "Gather") and not self._cuts_last_axis(n, t_in):
                    raise _Fail(f"{role} is cut by {g.describe(n)} after its head split, a QKV packing surgeon does not follow")
                continue
            if pending is not None:
                if op == "Reshape":
                    heads_shape = pending.shape
                elif self._pending_step(pending, p, n, t_in, t_out, role):
                    pending = None  # a chunk was chosen: the last axis holds features again
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
                raise _Fail(f"{role} is selected by {g.describe(n)}, a QKV packing surgeon does not follow")
            elif op == "Reshape":
                found = g.target_shape(node.input[1])
                shape, complete = found if found else ([], False)
                if shape and shape[-1] == p.width:
                    continue  # merges or splits leading axes only
                rank = len(shape) if complete else g.rank(t_out)
                pending = _Pending(shape, rank - 2 if rank else None, rank)
            elif op == "Transpose":
                perm = g.attr(n, "perm")
                if perm is None or perm[-1] != len(perm) - 1:
                    raise _Fail(f"{role} has its feature axis moved by {g.describe(n)} before any head split")
        if pending is not None:
            heads_shape = pending.shape
        if heads_shape is not None:
            shape = heads_shape
            d = shape[-1] if shape and isinstance(shape[-1], int) and shape[-1] > 0 else None
            h = shape[-2] if len(shape) > 1 and isinstance(shape[-2], int) and shape[-2] > 0 else None
            if d and p.width % d == 0:
                p.head_dim, p.heads = d, p.width // d
                if h and h != p.heads:
                    raise _Fail(f"{role} has {p.width} features but is reshaped to (..., {h}, {d})")
            elif h and p.width % h == 0 and not d:
                p.heads, p.head_dim = h, p.width // h

    def _pending_step(self, pending: _Pending, p: _Proj, n: int, t_in: str, t_out: str, role: str) -> bool:
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
            if on_pending and op != "Slice":
                return self._pick_chunk(pending, p, n, t_out, role)
            if on_pending or (op != "Slice" and not self._cuts_last_axis(n, t_in)):
                raise _Fail(f"{role} is cut by {g.describe(n)}, a QKV packing surgeon does not follow")
        return False

    def _pick_chunk(self, pending: _Pending, p: _Proj, n: int, t_out: str, role: str) -> bool:
        """A Gather of one index, or a Split into ones, of the first axis of a feature split."""
        g = self.g
        node = g.nodes[n]
        count, size = pending.shape[-2:] if len(pending.shape) > 1 else (None, None)
        if node.op_type == "Gather":
            index = g.value(node.input[1])
            picked = int(index) if index is not None and index.ndim == 0 else None
        else:
            sizes = g.ints(node.input[1]) if len(node.input) > 1 and node.input[1] else g.attr(n, "split")
            picked = list(node.output).index(t_out) if not sizes or set(sizes) == {1} else None
        if picked is None or not isinstance(size, int) or not isinstance(count, int) or count * size != p.width:
            raise _Fail(f"{role} is selected by {g.describe(n)} in a way surgeon does not follow")
        p.base += (picked % count) * size
        p.width = size
        return True

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

    def _split(self, p: _Proj, n: int, t_in: str, t_out: str, role: str) -> None:
        g = self.g
        node = g.nodes[n]
        axis = g.attr(n, "axis", 0)
        sizes = g.ints(node.input[1]) if len(node.input) > 1 and node.input[1] else g.attr(n, "split")
        if not sizes:
            count = g.attr(n, "num_outputs") or len(node.output)
            sizes = [p.width // count] * count if p.width % count == 0 else None
        rank = g.rank(t_in)
        on_features = axis == -1 or (rank is not None and axis == rank - 1) or (rank is None and sizes is not None and sum(sizes) == p.width)
        if not on_features:
            raise _Fail(f"{role} goes through {g.describe(n)}, which splits an axis other than the features")
        if not sizes or sum(sizes) != p.width:
            raise _Fail(f"cannot read the split sizes of {g.describe(n)} for the {p.width} features of {role}")
        k = list(node.output).index(t_out)
        p.base += sum(sizes[:k])
        p.width = sizes[k]

    def _slice(self, p: _Proj, n: int, t_in: str, role: str) -> None:
        g = self.g
        node = g.nodes[n]
        starts, ends = g.ints(node.input[1]), g.ints(node.input[2])
        axes = g.ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        steps = g.ints(node.input[4]) if len(node.input) > 4 and node.input[4] else None
        if starts is None or ends is None:
            raise _Fail(f"{role} goes through {g.describe(n)} whose bounds are not constant")
        rank = g.rank(t_in)
        axes = axes if axes is not None else list(range(len(starts)))
        last = [i for i, a in enumerate(axes) if a == -1 or (rank is not None and a == rank - 1)]
        if not last:
            if rank is None:
                raise _Fail(f"cannot tell which axis {g.describe(n)} cuts on the way to {role}")
            return  # cuts batch or sequence: the projection's columns are unchanged
        i = last[0]
        if steps and steps[i] != 1:
            raise _Fail(f"{role} goes through {g.describe(n)} with step {steps[i]}")
        start, end = starts[i], ends[i]
        start = max(0, start + p.width if start < 0 else start)
        end = min(p.width, end + p.width if end < 0 else end)
        p.base += start
        p.width = end - start


def _data_inputs(g: Graph, node: onnx.NodeProto, which) -> list[str]:
    if which is None:
        return []
    if which == "*":
        return [i for i in node.input if i and not g.is_const(i)]
    return [node.input[i] for i in which if i < len(node.input) and node.input[i] and not g.is_const(node.input[i])]


def _same_data_source(g: Graph, tensor: str) -> str:
    """Follow a projection's input back through reshapes and casts, so two views of one tensor compare equal."""
    for _ in range(16):
        n = g.producer.get(tensor)
        if n is None or g.nodes[n].op_type not in _SAME_DATA:
            return tensor
        tensor = g.nodes[n].input[0]
    return tensor


# --- from resolved cores to blocks ----------------------------------------------------------------
def find_attention(model: onnx.ModelProto, const: Callable[[str], np.ndarray | None], config: dict | None = None,
                   hints: Hints | None = None, *, source: str = "the model") -> OnnxDetection:
    """Every attention block of an ONNX model, in graph order. Raises NoAttentionFoundError if none."""
    graph = Graph(model, const)
    walker = Walker(graph)
    resolved: list[_Core] = []
    failures: list[str] = []
    cores = walker.cores()
    for n in cores:
        try:
            resolved.append(walker.resolve(n))
        except _Fail as exc:
            failures.append(f"{graph.describe(n)}: {exc}")
    if not resolved:
        raise NoAttentionFoundError(_nothing_found(graph, cores, failures, source))
    fallback = [graph.nodes[c.node].name or f"{graph.nodes[c.node].op_type}_{c.node}" for c in resolved]
    placed = _place_cores(_scopes(graph, resolved), fallback)
    view = ConfigView(config, hints)
    blocks, notes = [], [f"skipped {f}" for f in failures]
    users: dict[tuple[str, str], dict[str, set[int]]] = {}
    owners: dict[int, tuple[str, str]] = {}
    for core, (stack, layer, module) in zip(resolved, placed):
        block, note = _block(graph, core, module, stack, layer, view)
        if note:
            notes.append(note)
        blocks.append(block)
        for role, p in zip("qkv", (core.q, core.k, core.v)):
            users[(module, role)] = {"weight": set(p.weight_nodes), "bias": set(p.bias_nodes)}
            for m in p.weight_nodes | p.bias_nodes:
                owners.setdefault(m, (block.label, role))
    return OnnxDetection(Detection(blocks, len(graph.inits), notes), graph, users, owners)


def _block(graph: Graph, core: _Core, module: str, stack: str, layer: int, view: ConfigView) -> tuple[AttentionBlock, str | None]:
    q, k, v = core.q, core.k, core.v
    where = f"{module} ({graph.describe(core.node)})"
    d = q.head_dim or k.head_dim
    note = None
    if d is None and core.num_heads:
        d = q.width // core.num_heads if q.width % core.num_heads == 0 else None
    if d is None:
        facts = view.facts(stack)
        if facts.head_dim:
            d = facts.head_dim
        elif isinstance(facts.heads, int) and q.width % facts.heads == 0:
            d = q.width // facts.heads
    if d is None:
        raise LayoutError(
            f"cannot tell the heads of {where}: no Reshape splits its {q.width} query features and the op has no "
            f"num_heads attribute; pass {opt('num_heads', 'N')} (and {opt('num_kv_heads')}), or {opt('config', 'PATH')}"
        )
    for role, p in (("query", q), ("key", k), ("value", v)):
        if p.head_dim is not None and p.head_dim != d:
            raise LayoutError(f"{where}: the {role} heads are {p.head_dim} wide but the query heads {d}; surgeon needs one head size per block")
        if p.width % d:
            raise LayoutError(f"{where}: the {role} projection has {p.width} features, not a multiple of the head size {d}")
    heads, kv_heads = q.width // d, k.width // d
    if v.width // d != kv_heads or heads % kv_heads:
        raise LayoutError(f"{where}: {heads} query, {kv_heads} key and {v.width // d} value heads of size {d} do not form grouped attention")
    if core.num_heads and core.num_heads != heads:
        raise LayoutError(f"{where}: num_heads={core.num_heads} but its {q.width} query features are {heads} heads of {d}")
    hinted = view.hints.num_heads
    if hinted and hinted != heads:
        note = f"{opt('num_heads', hinted)} ignored for {module}: the graph splits it into {heads} heads of {d}"
    projections = {}
    for role, p, count in (("q", q, heads), ("k", k, kv_heads), ("v", v, kv_heads)):
        offsets = tuple(p.base + h * d for h in range(count))
        bias = Rows(p.bias, 0, tuple(o - p.bias_base for o in offsets), d) if p.bias else None
        projections[role] = Projection(role, Rows(p.weight, p.axis, offsets, d), bias, p.in_features)  # type: ignore[arg-type]
    layout = _layout(q, k, v)
    if core.label:
        layout = f"{core.label}: {layout}"
    kind = "self" if q.source == k.source or core.label in ("com.microsoft.Attention",) else "cross"
    block = AttentionBlock(stack, layer, kind, module, layout, heads, kv_heads, d, projections["q"], projections["k"], projections["v"])  # type: ignore[arg-type]
    return block, note


def _layout(q: _Proj, k: _Proj, v: _Proj) -> str:
    op = q.op if q.op == k.op == v.op else "/".join(dict.fromkeys((q.op, k.op, v.op)))
    if q.weight == k.weight == v.weight:
        return "packed qkv" if op == "packed" else f"{op} qkv (fused)"
    if k.weight == v.weight:
        return f"{op} q + kv (fused)"
    return f"{op} q/k/v"


def _scopes(graph: Graph, cores: list[_Core]) -> list[str | None]:
    """The module path of each core: its own scope, else the common scope of its projections."""
    out: list[str | None] = []
    for core in cores:
        scope = graph.scope(core.node)
        if not scope:
            parents = []
            for p in (core.q, core.k, core.v):
                s = graph.scope(p.node)
                parents.append(s.rsplit(".", 1)[0] if s and "." in s else None)
            if all(parents):
                common = _common_prefix([s.split(".") for s in parents])  # type: ignore[union-attr]
                scope = ".".join(common) or None
        out.append(scope)
    return out


def _common_prefix(paths: list[list[str]]) -> list[str]:
    prefix = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    return prefix


def _place_cores(scopes: list[str | None], fallback: list[str]) -> list[tuple[str, int, str]]:
    """(stack, layer, module) for each block, in the order given.

    Module paths that differ only in numbers form a group (``encoder.layer.#.attention.self``); the
    numbers that vary inside a group index the layers and the stack is the path before the first of
    them, as for named checkpoints. A module called several times (shared weights) becomes its own
    stack, numbered by call; blocks without any scope are numbered in graph order at the top level
    and named after their core node.
    """
    counts: dict[str, int] = defaultdict(int)
    for s in scopes:
        if s:
            counts[s] += 1
    placed: dict[int, tuple[str, int, str]] = {}
    calls: dict[str, int] = defaultdict(int)
    grouped: list[int] = []
    unnamed, used = 0, set(s for s in scopes if s)
    for i, s in enumerate(scopes):
        if not s:
            name = fallback[i] if fallback[i] not in used else f"{fallback[i]}.{i}"
            used.add(name)
            placed[i] = ("", unnamed, name)
            unnamed += 1
        elif counts[s] > 1:
            placed[i] = (s, calls[s], f"{s}[{calls[s]}]")
            calls[s] += 1
        else:
            grouped.append(i)
    places = place((scopes[i] for i in grouped), lone="top")  # type: ignore[misc]
    for i in grouped:
        where = places[scopes[i]]  # type: ignore[index]
        placed[i] = (where.stack, where.layer, scopes[i])  # type: ignore[assignment]
    return [placed[i] for i in range(len(scopes))]


def _nothing_found(graph: Graph, cores: list[int], failures: list[str], source: str) -> str:
    if not cores:
        return (
            f"no attention found in {source}: its graph ({len(graph.nodes)} nodes) has no Softmax and no Attention, "
            "MultiHeadAttention or GroupQueryAttention node, which is where surgeon starts looking"
        )
    shown = "; ".join(failures[:4]) + (f"; and {len(failures) - 4} more" if len(failures) > 4 else "")
    return f"no attention found in {source}: looked at {len(cores)} Softmax/attention node{'s' if len(cores) > 1 else ''} and none led to Q/K/V projections ({shown})"
