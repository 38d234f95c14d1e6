"""The ONNX graph, indexed: producers, consumers, scopes, ranks and small constants folded; the op tables of the walk."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx

from .protos import constant_value, infer_ranks, subgraph_inputs

MS = "com.microsoft"
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}

# Ops between a projection and the attention core, and which inputs carry the data
# ("*": every input that is not a constant).
PASS_BACK: dict[str, tuple[int, ...] | str] = {
    **{
        op: (0,)
        for op in (
            "Reshape",
            "Transpose",
            "Squeeze",
            "Unsqueeze",
            "Expand",
            "Tile",
            "Flatten",
            "Cast",
            "CastLike",
            "Identity",
            "Dropout",
            "Slice",
            "Split",
            "Gather",
            "Neg",
            "RotaryEmbedding",
            "LayerNormalization",
            "SimplifiedLayerNormalization",
            "RMSNormalization",
        )
    },
    **{op: "*" for op in ("Concat", "Add", "Sub", "Mul", "Div")},
    "Where": (1, 2),
}
# Between the Q·Kᵀ product and the Softmax: scale, mask, softcap, casts.
SCORE_BACK: dict[str, tuple[int, ...] | str] = {
    **{op: (0,) for op in ("Cast", "Identity", "Reshape", "Tanh", "Clip", "Dropout")},
    **{op: "*" for op in ("Add", "Sub", "Mul", "Div", "Min", "Max")},
    "Where": (1, 2),
}
# Between the Softmax and the probabilities·V product.
PROB_FORWARD = {"Cast", "Identity", "Dropout", "Where", "Mul", "Div", "Reshape"}
CORES = {"Softmax", "Attention", f"{MS}.Attention", f"{MS}.MultiHeadAttention", f"{MS}.GroupQueryAttention"}
PRODUCTS = {"MatMul", "Einsum", "FusedMatMul"}  # data x data products (Q·Kᵀ, P·V)
QUANTIZED = {
    "MatMulNBits",
    "MatMulInteger",
    "QLinearMatMul",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "QAttention",
    "QGemm",
}
# Between a projection and its core, or a Q·Kᵀ product and its Softmax, exporters put a handful of ops
# (reshapes, scale, mask, rotary, norms, casts). Each walk from a core goes at most WALK_DEPTH ops deep
# and looks at most at WALK_STEPS node inputs or consumers, so a graph with N cores costs O(N) however
# it is wired (a chain of thousands of Softmax nodes, each of which could otherwise walk the whole chain).
WALK_DEPTH = 32
WALK_STEPS = 2048
# Ops a source tensor passes through unchanged in content (for self/cross: do Q and K read the same input?)
SAME_DATA = {"Reshape", "Flatten", "Cast", "Identity", "Squeeze", "Unsqueeze"}


def _axes(g: Graph, n: int, args: tuple[Any, ...]) -> list[int]:
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
    "Squeeze": lambda g, n, x, *rest: (
        np.squeeze(x, tuple(_axes(g, n, (x, *rest)))) if _axes(g, n, (x, *rest)) else np.squeeze(x)
    ),
    "Concat": lambda g, n, *xs: np.concatenate([np.atleast_1d(x) for x in xs], axis=g.attr(n, "axis", 0)),
    "Gather": lambda g, n, x, i: np.take(x, i, axis=g.attr(n, "axis", 0)),
}


class Fail(Exception):
    """One attention core could not be resolved; the message names the step."""


# --- the graph, indexed ------------------------------------------------------------------------
class Graph:
    """Nodes by index, who produces and who consumes each tensor, small constant values."""

    def __init__(
        self,
        model: onnx.ModelProto,
        const: Callable[[str], np.ndarray | None],
        constants: dict[str, onnx.TensorProto] | None = None,
    ) -> None:
        g = model.graph
        self.nodes = list(g.node)
        self.const = const
        self.inits: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
        for name, t in (constants or {}).items():  # weights in Constant nodes: their output is the weight's name
            self.inits.setdefault(name, t)
        self.inputs = {i.name for i in g.input} - set(self.inits)
        self.outputs = {o.name for o in g.output}
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = defaultdict(list)
        for i, node in enumerate(self.nodes):
            for out in node.output:
                if out:
                    self.producer[out] = i
            for name in dict.fromkeys(list(node.input) + subgraph_inputs(node)):
                if name:
                    self.consumers[name].append(i)
        self.dims: dict[str, list[int | None]] = {}  # static shapes from shape inference (None: computed at run time)
        self.ranks = infer_ranks(model, self.dims)
        self._values: dict[str, np.ndarray | None] = {}
        self._const_memo: dict[str, bool] = {}

    def describe(self, n: int) -> str:
        node = self.nodes[n]
        domain = f"{node.domain}." if node.domain not in ("", "ai.onnx") else ""
        return f"{domain}{node.op_type} {node.name or '#' + str(n)}"

    def op(self, n: int) -> str:
        node = self.nodes[n]
        return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"

    def attr(self, n: int, name: str, default: Any = None) -> Any:
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

    def value(self, tensor: str, depth: int = 0) -> np.ndarray | None:
        """The value of a small constant tensor (shapes, axes, split sizes), or None.

        Folds the few integer ops exporters use to compute such constants (the legacy exporter's
        ``unflatten`` computes its Reshape shape from Mod/Add of constants)."""
        if tensor in self._values:
            return self._values[tensor]
        if depth > WALK_DEPTH:  # computed from further back than any shape an exporter writes
            return None
        out = None
        if tensor in self.inits:
            out = self.const(tensor)
        elif tensor in self.producer:
            n = self.producer[tensor]
            node = self.nodes[n]
            if node.op_type == "Constant" and node.attribute:
                out = constant_value(self.describe(n), node.attribute[0])
            elif node.op_type in ("Shape", "Gather") and node.domain in ("", "ai.onnx"):
                out = self._static_shape_entries(n, depth)
            if out is None and node.op_type in _FOLD and node.domain in ("", "ai.onnx") and len(node.output) == 1:
                args = [self.value(i, depth + 1) for i in node.input if i]
                if all(a is not None for a in args):
                    try:
                        out = np.asarray(_FOLD[node.op_type](self, n, *args))
                    except (ValueError, TypeError, IndexError, ZeroDivisionError):
                        out = None
        self._values[tensor] = out
        return out

    def _static_shape_entries(self, n: int, depth: int = 0) -> np.ndarray | None:
        """Shape of a tensor whose static shape is known, or a Gather of such entries from a Shape
        (``x.shape[-1] // 3``: a slice bound computed in the graph); None where any is computed at run time."""
        node = self.nodes[n]
        shape_node = n if node.op_type == "Shape" else self.producer.get(node.input[0])
        if shape_node is None or self.nodes[shape_node].op_type != "Shape":
            return None
        dims = self.dims.get(self.nodes[shape_node].input[0])
        if dims is None:
            return None
        start, end = self.attr(shape_node, "start", 0), self.attr(shape_node, "end", None)
        dims = dims[start:end] if end is not None else dims[start:]
        if node.op_type == "Gather":
            index = self.value(node.input[1], depth + 1) if len(node.input) > 1 else None
            if index is None or index.dtype.kind not in "iu":
                return None
            try:
                picked = np.take(np.arange(len(dims)), index)
            except IndexError:
                return None
            values = [dims[int(i)] for i in np.atleast_1d(picked)]
            if any(v is None for v in values):
                return None
            return np.asarray(values, dtype=np.int64).reshape(np.shape(picked))
        if any(d is None for d in dims):
            return None
        return np.asarray(dims, dtype=np.int64)

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
        if (
            node.op_type == "Slice"
            and node.input[0] in self.producer
            and self.nodes[self.producer[node.input[0]]].op_type == "Shape"
        ):
            rank = self.rank(self.nodes[self.producer[node.input[0]]].input[0])
            starts, ends = self.ints(node.input[1]), self.ints(node.input[2])
            if rank is None or not starts or not ends:
                return None
            start, end = (max(0, min(rank, v + rank if v < 0 else v)) for v in (starts[0], ends[0]))
            return [None] * max(0, end - start)
        return None

    def initializer(self, tensor: str) -> tuple[str | None, list[int]]:
        """The initializer a tensor is, through Identity nodes (the legacy exporter's way of sharing
        one initializer between equal parameters), and those nodes; (None, []) if it is not one."""
        via: list[int] = []
        while (  # at most WALK_DEPTH of them: a crafted graph may loop (Identity a -> b -> a)
            len(via) < WALK_DEPTH
            and tensor
            and tensor not in self.inits
            and tensor in self.producer
            and self.nodes[self.producer[tensor]].op_type == "Identity"
        ):
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
            names = (
                [s for s in value[:-1] if s]
                if isinstance(value, list) and all(isinstance(s, str) for s in value)
                else []
            )
            if names:
                return names[-1]
        namespace = meta.get("namespace")
        if namespace:
            paths = [entry.split(":")[0].strip() for entry in namespace.split("/")[:-1]]
            paths = [p for p in paths if p]
            if paths:
                return paths[-1]
        if node.name.startswith("/") and node.name.count("/") >= 2:
            parts = [p for p in node.name.strip("/").split("/")[:-1] if p]
            # a called container and its child: /blocks/blocks.0/attn is the module blocks.0.attn
            return ".".join(p for p, after in zip(parts, parts[1:] + [""]) if not after.startswith(p + "."))
        return None


def data_inputs(g: Graph, node: onnx.NodeProto, which: tuple[int, ...] | str | None) -> list[str]:
    if which is None:
        return []
    if isinstance(which, str):  # "*", the tables' one string: every input
        return [i for i in node.input if i and not g.is_const(i)]
    return [node.input[i] for i in which if i < len(node.input) and node.input[i] and not g.is_const(node.input[i])]


def same_data_source(g: Graph, tensor: str) -> str:
    """Follow a projection's input back through reshapes and casts, so two views of one tensor compare equal."""
    for _ in range(16):
        n = g.producer.get(tensor)
        if n is None or g.nodes[n].op_type not in SAME_DATA:
            return tensor
        tensor = g.nodes[n].input[0]
    return tensor
