"""ONNX graphs built with onnx.helper: ONNX Runtime's fused attention ops, and small hand-made
attention graphs for the error paths.

The fused graphs are built from the weights of a tiny PyTorch model exactly the way ONNX Runtime's
transformer tools emit them (onnxruntime/transformers/fusion_attention.py ``create_attention_node``,
convert_generation.py for GroupQueryAttention): ``com.microsoft.Attention`` with one packed weight
``np.stack((Wq, Wk, Wv), axis=1).reshape(in, 3 * out)`` (per input row [Q | K | V]) and a packed
bias, named ``Attention_<i>``; ``MultiHeadAttention`` fed by the original q/k/v MatMuls with the
packed bias as its fourth input; ``GroupQueryAttention`` fed by one packed QKV MatMul + Add.
Each builder also returns, per layer and role, where the PyTorch weight sits in the graph, so the
tests can read re-initialized values back in PyTorch orientation.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().astype(np.float32)


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        outs = [f"{name}_output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain, **attrs))
        return outs

    def model(self, inputs, output: str, opset: int = 17) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, "g", inputs, [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)], self.inits
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
        model.ir_version = 8 if opset <= 17 else 10
        return model


def bert_fused(model, op: str = "Attention", seq: int = 7):
    """A BERT encoder (PyTorch ``BertModel``'s layers) with ORT's fused attention.

    Input ``hidden`` is the embeddings' output (and ``mask_index`` for ``Attention``); output the
    last hidden state. Returns (ModelProto, where) with ``where[(layer, role)] = (weight, weight
    columns, bias, bias columns)``: where the role's (in, out) weight columns and bias are.
    """
    cfg = model.config
    b = _Builder()
    x = "hidden"
    where = {}
    for i, layer in enumerate(model.encoder.layer):
        att, scope = layer.attention.self, f"/encoder/layer.{i}"
        width = att.query.weight.shape[0]
        qw, kw, vw = (_np(m.weight.T) for m in (att.query, att.key, att.value))
        qb, kb, vb = (_np(m.bias) for m in (att.query, att.key, att.value))
        bias = b.init(f"Attention_{i}_qkv_bias", np.stack((qb, kb, vb), axis=0).reshape(3 * width))
        if op == "Attention":
            weight = b.init(f"Attention_{i}_qkv_weight", np.stack((qw, kw, vw), axis=1).reshape(qw.shape[0], 3 * width))
            [a] = b.node(
                "Attention",
                [x, weight, bias, "mask_index"],
                f"Attention_{i}",
                domain=MS,
                num_heads=cfg.num_attention_heads,
            )
            for j, role in enumerate("qkv"):
                cols = slice(j * width, (j + 1) * width)
                where[(i, role)] = (weight, cols, bias, cols)
        else:  # MultiHeadAttention keeps the exporter's q/k/v MatMuls and takes the packed bias
            outs = []
            for j, (role, w, leaf) in enumerate((("q", qw, "query"), ("k", kw, "key"), ("v", vw, "value"))):
                name = b.init(f"onnx::MatMul_{100 * i + j}", w)
                outs += b.node("MatMul", [x, name], f"{scope}/attention/self/{leaf}/MatMul")
                where[(i, role)] = (name, slice(None), bias, slice(j * width, (j + 1) * width))
            [a] = b.node(
                "MultiHeadAttention", [*outs, bias], f"Attention_{i}", domain=MS, num_heads=cfg.num_attention_heads
            )
        out = layer.attention.output
        [h] = b.node(
            "MatMul",
            [a, b.init(f"onnx::MatMul_o{i}", _np(out.dense.weight.T))],
            f"{scope}/attention/output/dense/MatMul",
        )
        [h] = b.node(
            "Add",
            [b.init(f"encoder.layer.{i}.attention.output.dense.bias", _np(out.dense.bias)), h],
            f"{scope}/attention/output/dense/Add",
        )
        [h] = b.node("Add", [h, x], f"{scope}/attention/output/Add")
        [x] = b.node(
            "LayerNormalization",
            [h, b.init(f"ln1_w{i}", _np(out.LayerNorm.weight)), b.init(f"ln1_b{i}", _np(out.LayerNorm.bias))],
            f"{scope}/attention/output/LayerNorm/LayerNormalization",
            axis=-1,
            epsilon=cfg.layer_norm_eps,
        )
        [h] = b.node(
            "MatMul",
            [x, b.init(f"onnx::MatMul_i{i}", _np(layer.intermediate.dense.weight.T))],
            f"{scope}/intermediate/dense/MatMul",
        )
        [h] = b.node(
            "Add",
            [h, b.init(f"encoder.layer.{i}.intermediate.dense.bias", _np(layer.intermediate.dense.bias))],
            f"{scope}/intermediate/dense/Add",
        )
        [h] = b.node("Gelu", [h], f"Gelu_{i}", domain=MS)
        [h] = b.node(
            "MatMul",
            [h, b.init(f"onnx::MatMul_f{i}", _np(layer.output.dense.weight.T))],
            f"{scope}/output/dense/MatMul",
        )
        [h] = b.node(
            "Add",
            [h, b.init(f"encoder.layer.{i}.output.dense.bias", _np(layer.output.dense.bias))],
            f"{scope}/output/dense/Add",
        )
        [h] = b.node("Add", [h, x], f"{scope}/output/Add")
        [x] = b.node(
            "LayerNormalization",
            [
                h,
                b.init(f"ln2_w{i}", _np(layer.output.LayerNorm.weight)),
                b.init(f"ln2_b{i}", _np(layer.output.LayerNorm.bias)),
            ],
            f"{scope}/output/LayerNorm/LayerNormalization",
            axis=-1,
            epsilon=cfg.layer_norm_eps,
        )
    b.nodes.append(helper.make_node("Identity", [x], ["out"], name="output"))
    inputs = [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, seq, cfg.hidden_size])]
    if op == "Attention":
        inputs.append(helper.make_tensor_value_info("mask_index", TensorProto.INT32, [1, seq]))
    return b.model(inputs, "out"), where


def llama_group_query(model, seq: int = 7):
    """A Llama decoder with ORT's GroupQueryAttention fed by one packed [Q | K | V] MatMul + Add.

    Input ``hidden`` is the token embeddings, plus ``seqlens_k`` and ``total_sequence_length``; the
    rotary caches are initializers. Returns (ModelProto, where) like :func:`bert_fused`.
    """
    cfg = model.config
    d = cfg.head_dim
    b = _Builder()
    x = "hidden"
    where = {}
    inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d))
    freqs = np.outer(np.arange(128, dtype=np.float64), inv_freq)
    cos = b.init("cos_cache", np.cos(freqs).astype(np.float32))
    sin = b.init("sin_cache", np.sin(freqs).astype(np.float32))
    eps = cfg.rms_norm_eps
    for i, layer in enumerate(model.model.layers):
        att, scope = layer.self_attn, f"/model/layers.{i}"
        ws = [_np(m.weight.T) for m in (att.q_proj, att.k_proj, att.v_proj)]
        bs = [_np(m.bias) for m in (att.q_proj, att.k_proj, att.v_proj)]
        weight = b.init(f"QKV_Weight_{i}", np.concatenate(ws, axis=1))
        bias = b.init(f"QKV_Bias_{i}", np.concatenate(bs))
        start = 0
        for role, w in zip("qkv", ws):
            cols = slice(start, start + w.shape[1])
            where[(i, role)] = (weight, cols, bias, cols)
            start += w.shape[1]
        [h] = b.node(
            "RMSNormalization",
            [x, b.init(f"norm1_{i}", _np(layer.input_layernorm.weight))],
            f"{scope}/input_layernorm/RMSNormalization",
            axis=-1,
            epsilon=eps,
        )
        [h] = b.node("MatMul", [h, weight], f"MatMul_{i}")
        [h] = b.node("Add", [h, bias], f"Add_{i}")
        [a, _, _] = b.node(
            "GroupQueryAttention",
            [h, "", "", "", "", "seqlens_k", "total_sequence_length", cos, sin],
            f"GroupQueryAttention_{i}",
            outputs=3,
            domain=MS,
            num_heads=cfg.num_attention_heads,
            kv_num_heads=cfg.num_key_value_heads,
            do_rotary=1,
            rotary_interleaved=0,
        )
        [a] = b.node("MatMul", [a, b.init(f"o_w{i}", _np(att.o_proj.weight.T))], f"{scope}/self_attn/o_proj/MatMul")
        [a] = b.node("Add", [a, b.init(f"o_b{i}", _np(att.o_proj.bias))], f"{scope}/self_attn/o_proj/Add")
        [x] = b.node("Add", [x, a], f"{scope}/Add")
        [h] = b.node(
            "RMSNormalization",
            [x, b.init(f"norm2_{i}", _np(layer.post_attention_layernorm.weight))],
            f"{scope}/post_attention_layernorm/RMSNormalization",
            axis=-1,
            epsilon=eps,
        )
        [g] = b.node(
            "MatMul", [h, b.init(f"gate_{i}", _np(layer.mlp.gate_proj.weight.T))], f"{scope}/mlp/gate_proj/MatMul"
        )
        [s] = b.node("Sigmoid", [g], f"{scope}/mlp/act_fn/Sigmoid")
        [g] = b.node("Mul", [g, s], f"{scope}/mlp/act_fn/Mul")
        [u] = b.node("MatMul", [h, b.init(f"up_{i}", _np(layer.mlp.up_proj.weight.T))], f"{scope}/mlp/up_proj/MatMul")
        [g] = b.node("Mul", [g, u], f"{scope}/mlp/Mul")
        [g] = b.node(
            "MatMul", [g, b.init(f"down_{i}", _np(layer.mlp.down_proj.weight.T))], f"{scope}/mlp/down_proj/MatMul"
        )
        [x] = b.node("Add", [x, g], f"{scope}/Add_1")
    b.node(
        "RMSNormalization",
        [x, b.init("norm_f", _np(model.model.norm.weight))],
        "/model/norm/RMSNormalization",
        axis=-1,
        epsilon=eps,
    )
    b.nodes[-1].output[0] = "out"
    inputs = [
        helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, seq, cfg.hidden_size]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    return b.model(inputs, "out", opset=23), where


def tiny_attention(
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 4,
    width: int = 8,
    seq: int = 5,
    *,
    share_q: bool = False,
    q_weight: str = "initializer",
    float_data: bool = False,
    packed: str | None = None,
    seed: int = 0,
):
    """A small attention stack in the legacy exporter's style (node names carry module scopes).

    ``q_weight``: "initializer", "input" (a graph input), "computed" (Mul of an initializer) or
    "quantized" (DequantizeLinear of int8); ``share_q``: every layer reads one query weight;
    ``float_data``: initializers stored as ``float_data`` instead of ``raw_data``; ``packed``:
    one (width, 3 * out) weight per layer, [Q | K | V], cut by a "split" or by three "slice"s,
    each part with its own bias after the cut.
    """
    rng = np.random.default_rng(seed)
    b = _Builder()
    out_width = heads * head_dim
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, width])]

    def weight(name, shape):
        value = rng.standard_normal(shape).astype(np.float32) * 0.3
        if float_data:
            b.inits.append(helper.make_tensor(name, TensorProto.FLOAT, shape, value.flatten().tolist()))
            return name
        return b.init(name, value)

    shape4 = b.init("shape4", np.array([1, seq, heads, head_dim], dtype=np.int64))
    shape3 = b.init("shape3", np.array([1, seq, out_width], dtype=np.int64))
    scale = b.init("scale", np.array(math.sqrt(head_dim), dtype=np.float32))
    x = "x"
    shared = weight("q_shared", (width, out_width)) if share_q else None
    for i in range(layers):
        s = f"/layers.{i}/attn"
        proj = {}
        parts = {}
        if packed:
            [h] = b.node("MatMul", [x, weight(f"onnx::MatMul_{i}qkv", (width, 3 * out_width))], f"{s}/qkv_proj/MatMul")
            if packed == "split":
                sizes = b.init(f"split_{i}", np.array([out_width] * 3, dtype=np.int64))
                parts = dict(zip("qkv", b.node("Split", [h, sizes], f"{s}/Split", outputs=3, axis=-1)))
            else:
                axes = b.init(f"axes_{i}", np.array([-1], dtype=np.int64))
                for j, role in enumerate("qkv"):
                    bounds = [
                        b.init(f"{role}_{edge}_{i}", np.array([v], dtype=np.int64))
                        for edge, v in (("start", j * out_width), ("end", (j + 1) * out_width))
                    ]
                    [parts[role]] = b.node("Slice", [h, *bounds, axes], f"{s}/Slice_{role}")
        for role in "qkv":
            w = (
                shared
                if role == "q" and shared
                else weight(f"onnx::MatMul_{i}{role}", (width, out_width))
                if not packed
                else None
            )
            if role == "q" and q_weight == "input":
                w = f"q_weight_{i}"
                inputs.append(helper.make_tensor_value_info(w, TensorProto.FLOAT, [width, out_width]))
            elif role == "q" and q_weight == "computed":
                [w] = b.node("Mul", [w, scale], f"{s}/q_scale/Mul")
            elif role == "q" and q_weight == "quantized":
                q8 = b.init(f"q_int8_{i}", rng.integers(-127, 127, (width, out_width)).astype(np.int8))
                [w] = b.node(
                    "DequantizeLinear",
                    [q8, b.init(f"q_scale_{i}", np.array(0.01, dtype=np.float32))],
                    f"{s}/q_proj/DequantizeLinear",
                )
            if packed:
                h = parts[role]
            else:
                [h] = b.node("MatMul", [x, w], f"{s}/{role}_proj/MatMul")
            [h] = b.node("Add", [weight(f"layers.{i}.attn.{role}_proj.bias", (out_width,)), h], f"{s}/{role}_proj/Add")
            [h] = b.node("Reshape", [h, shape4], f"{s}/Reshape_{role}")
            [h] = b.node("Transpose", [h], f"{s}/Transpose_{role}", perm=[0, 2, 3, 1] if role == "k" else [0, 2, 1, 3])
            proj[role] = h
        [sc] = b.node("MatMul", [proj["q"], proj["k"]], f"{s}/MatMul")
        [sc] = b.node("Div", [sc, scale], f"{s}/Div")
        [p] = b.node("Softmax", [sc], f"{s}/Softmax", axis=-1)
        [o] = b.node("MatMul", [p, proj["v"]], f"{s}/MatMul_1")
        [o] = b.node("Transpose", [o], f"{s}/Transpose_o", perm=[0, 2, 1, 3])
        [o] = b.node("Reshape", [o, shape3], f"{s}/Reshape_o")
        [o] = b.node("MatMul", [o, weight(f"onnx::MatMul_{i}o", (out_width, width))], f"{s}/o_proj/MatMul")
        [x] = b.node("Add", [x, o], f"/layers.{i}/Add")
    b.nodes.append(helper.make_node("Identity", [x], ["out"], name="output"))
    return b.model(inputs, "out")


def mlp_only(width: int = 8, softmax: bool = False) -> onnx.ModelProto:
    """No attention at all: MatMul -> Relu -> MatMul (-> Softmax, a classifier head)."""
    rng = np.random.default_rng(0)
    b = _Builder()
    [h] = b.node("MatMul", ["x", b.init("fc1", rng.standard_normal((width, 16)).astype(np.float32))], "/mlp/fc1/MatMul")
    [h] = b.node("Relu", [h], "/mlp/Relu")
    [h] = b.node("MatMul", [h, b.init("fc2", rng.standard_normal((16, 3)).astype(np.float32))], "/mlp/fc2/MatMul")
    if softmax:
        [h] = b.node("Softmax", [h], "/head/Softmax", axis=-1)
    b.nodes.append(helper.make_node("Identity", [h], ["out"], name="output"))
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])], "out")
