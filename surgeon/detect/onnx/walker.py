"""Attention cores (Softmax, fused attention ops) and their Q, K, V operands."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ...vocab.blocks import slot_offsets
from .found import Core, Proj
from .graph import CORES, MS, PROB_FORWARD, PRODUCTS, SCORE_BACK, WALK_DEPTH, WALK_STEPS, Fail, Graph, data_inputs
from .projection import ProjectionWalk


# --- the walker --------------------------------------------------------------------------------
class Walker(ProjectionWalk):
    def __init__(self, graph: Graph) -> None:
        self.g = graph

    def cores(self) -> list[int]:
        """Where attention is computed: Softmax nodes and the fused attention ops, in graph order."""
        return [n for n in range(len(self.g.nodes)) if self.g.op(n) in CORES]

    def resolve(self, n: int) -> Core:
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
    def _softmax(self, n: int) -> Core:
        g = self.g
        self.cut_short = False
        qk = self._find_back(g.nodes[n].input[0], SCORE_BACK, lambda m: g.nodes[m].op_type in PRODUCTS)
        if qk is None:
            raise Fail("no Q·Kᵀ product (MatMul of two computed tensors) feeds it" + self._near())
        self.cut_short = False
        pv = self._probs_times_v(g.nodes[n].output[0])
        if pv is None:
            raise Fail("its output reaches no probabilities·V MatMul" + self._near())
        q_in, k_in = g.nodes[qk].input[0], g.nodes[qk].input[1]
        v_in = g.nodes[pv].input[1]
        return Core(n, "", self._projection(q_in, "Q"), self._projection(k_in, "K"), self._projection(v_in, "V"))

    def _find_back(self, tensor: str, ops: dict[str, tuple[int, ...] | str], stop: Callable[[int], bool]) -> int | None:
        """Breadth-first from ``tensor`` toward the inputs, through ``ops``, to the first node that is ``stop``
        (within WALK_DEPTH ops and WALK_STEPS inputs looked at; ``self.cut_short`` says if a bound was hit)."""
        g = self.g
        seen, queue, steps = {tensor}, deque([(tensor, 0)]), 0
        while queue:
            t, depth = queue.popleft()
            n = g.producer.get(t)
            if n is None:
                continue
            node = g.nodes[n]
            if stop(n) and all(not g.is_const(i) for i in node.input[:2]):
                return n
            which = ops.get(node.op_type) if node.domain in ("", "ai.onnx") else None
            steps += len(node.input)
            if which is not None and (depth >= WALK_DEPTH or steps > WALK_STEPS):
                self.cut_short = True
                continue
            for i in data_inputs(g, node, which):
                if i not in seen:
                    seen.add(i)
                    queue.append((i, depth + 1))
        return None

    def _probs_times_v(self, tensor: str) -> int | None:
        g = self.g
        seen, queue, steps = {tensor}, deque([(tensor, 0)]), 0
        while queue:
            t, depth = queue.popleft()
            users = g.consumers.get(t, [])
            steps += len(users)
            if depth >= WALK_DEPTH or steps > WALK_STEPS:
                self.cut_short = True
                continue
            for m in users:
                node = g.nodes[m]
                if (
                    node.op_type in PRODUCTS
                    and node.input[0] == t
                    and len(node.input) > 1
                    and not g.is_const(node.input[1])
                ):
                    return m
                if node.op_type in PROB_FORWARD and node.domain in ("", "ai.onnx"):
                    for out in node.output:
                        if out and out not in seen:
                            seen.add(out)
                            queue.append((out, depth + 1))
        return None

    # com.microsoft Attention: one packed (in, Dq + Dk + Dv) weight, stacked per row as [Q | K | V]
    def _packed_attention(self, n: int) -> Core:
        g = self.g
        node = g.nodes[n]
        heads = g.attr(n, "num_heads")
        weight, via = self._weight_initializer(
            node.input[1] if len(node.input) > 1 else "", n, "Q/K/V", transpose=False
        )
        dims = list(g.inits[weight].dims)
        if len(dims) != 2:
            raise Fail(f"its packed weight {weight} has shape {dims}, expected (in, 3*out)")
        sizes = g.attr(n, "qkv_hidden_sizes")
        sizes = [int(s) for s in sizes] if sizes else [dims[1] // 3] * 3
        if sum(sizes) != dims[1]:
            raise Fail(f"qkv_hidden_sizes {sizes} do not add up to the {dims[1]} columns of {weight}")
        bias, bias_via = g.initializer(node.input[2] if len(node.input) > 2 else "")
        projs, base = [], 0
        for size in sizes:
            p = Proj(n, "packed", weight, 1, dims[0], base, size, node.input[0], weight_nodes={n, *via})
            if bias is not None and list(g.inits[bias].dims) == [dims[1]]:
                p.bias, p.bias_base, p.bias_nodes = bias, 0, {n, *bias_via}
            projs.append(p)
            base += size
        q, k, v = projs
        return Core(n, "com.microsoft.Attention", q, k, v, num_heads=heads, kv_heads=heads)

    # MultiHeadAttention / standard Attention: already-projected Q, K, V as inputs
    def _separate_inputs(self, n: int, label: str, packed_bias: int | None) -> Core:
        g = self.g
        node = g.nodes[n]
        ins = list(node.input) + [""] * 3
        if not ins[1] or not ins[2]:
            raise Fail("packed QKV/KV inputs (no separate key and value) are not supported")
        if packed_bias is not None and (g.rank(ins[0]) == 5 or g.rank(ins[1]) == 5):
            raise Fail("packed QKV/KV inputs (5-D query or key) are not supported")
        q, k, v = (self._projection(ins[i], role) for i, role in enumerate("QKV"))
        bias, via = g.initializer(
            node.input[packed_bias] if packed_bias is not None and len(node.input) > packed_bias else ""
        )
        if bias is not None and list(g.inits[bias].dims) == [q.width + k.width + v.width]:
            for p, start in ((q, 0), (k, q.width), (v, q.width + k.width)):
                if p.bias is None:  # the packed bias of MultiHeadAttention: [q | k | v]
                    p.bias, p.bias_base, p.bias_nodes = bias, p.base - start, {n, *via}
        heads = g.attr(n, "num_heads") or g.attr(n, "q_num_heads")
        kv = g.attr(n, "kv_num_heads") or (heads if label.startswith("com.microsoft") else None)
        return Core(n, label, q, k, v, num_heads=heads, kv_heads=kv)

    # GroupQueryAttention: separate Q, K, V, or one packed [Q | K | V] query input
    def _group_query(self, n: int) -> Core:
        g = self.g
        node = g.nodes[n]
        if len(node.input) > 2 and node.input[1] and node.input[2]:
            return self._separate_inputs(n, "com.microsoft.GroupQueryAttention", packed_bias=None)
        heads, kv = g.attr(n, "num_heads"), g.attr(n, "kv_num_heads")
        if not heads or not kv:
            raise Fail("its packed query needs the num_heads and kv_num_heads attributes to be cut into Q, K and V")
        p = self._projection(node.input[0], "packed QKV")
        slots = heads + 2 * kv
        if p.width % slots:
            raise Fail(
                f"its packed query has {p.width} features, not a multiple of num_heads + 2 * kv_num_heads = {slots}"
            )
        d = p.width // slots
        offsets = slot_offsets("qkv", heads, kv, d)  # the packed query is [Q | K | V] (blocks.PACKINGS)
        q, k, v = (
            Proj(
                **{
                    **p.__dict__,
                    "base": p.base + offsets[r][0],
                    "width": len(offsets[r]) * d,
                    "head_dim": d,
                    "heads": len(offsets[r]),
                }
            )
            for r in "qkv"
        )
        return Core(n, "com.microsoft.GroupQueryAttention", q, k, v, num_heads=heads, kv_heads=kv)
