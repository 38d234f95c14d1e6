"""From an operand of an attention core back to its projection: what the walk finds (Proj, Core) and how."""

from __future__ import annotations

from collections import deque

import onnx

from ...errors import UnsupportedWeightsError
from .found import Proj
from .graph import FLOAT_TYPES, PASS_BACK, QUANTIZED, WALK_DEPTH, WALK_STEPS, Fail, Graph, data_inputs, same_data_source
from .pointwise import is_pointwise_conv, read_channels
from .window import WindowWalk


class ProjectionWalk(WindowWalk):
    """Following one operand of a core back to the MatMul/Gemm that projects it (Walker's second half)."""

    g: Graph
    cut_short = False  # a walk stopped at WALK_DEPTH or WALK_STEPS (the graph module says why there are bounds)

    def _near(self) -> str:
        return f" within {WALK_DEPTH} ops" if self.cut_short else ""

    # --- from an operand of the core back to its projection ------------------------------------
    def _projection(self, tensor: str, role: str) -> Proj:
        g = self.g
        found, parent, dead = self._walk_back(tensor, role)
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

    def _walk_back(self, tensor: str, role: str) -> tuple[list[tuple[int, str]], dict[str, tuple[int, str]], list[str]]:
        """Breadth-first from ``tensor`` back through the ops that pass data (within the walk's bounds):
        the projections reached (node, its output), each tensor's way back toward ``tensor``, and where it stopped."""
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
            which = self._visit(n, t, role, found, dead)
            if which is None:
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
        return found, parent, dead

    def _visit(
        self, n: int, t: str, role: str, found: list[tuple[int, str]], dead: list[str]
    ) -> tuple[int, ...] | str | None:
        """What node ``n`` (producing ``t``) is to the walk: a projection (added to ``found``), a dead end
        (added to ``dead``), both None; else the inputs it passes data back through (PASS_BACK)."""
        g = self.g
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
                return None
            if (n, t) not in found:
                found.append((n, t))
            return None
        if is_pointwise_conv(g, n):  # a 1x1 convolution is a projection too (VITS conv_q/conv_k/conv_v)
            if (n, t) not in found:
                found.append((n, t))
            return None
        which = (
            PASS_BACK.get(node.op_type) if node.domain in ("", "ai.onnx") or node.op_type == "RotaryEmbedding" else None
        )
        if which is None:
            dead.append(g.describe(n))
        return which

    def _read_projection(self, n: int, path: list[tuple[int, str, str]], role: str) -> Proj:
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

    def _read_conv(self, n: int, path: list[tuple[int, str, str]], role: str) -> Proj:
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
