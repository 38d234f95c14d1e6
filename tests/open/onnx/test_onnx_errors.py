"""Every ONNX error: one line on stderr, a non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from surgeon import reinit_checkpoint
from surgeon.errors import NoAttentionFoundError

from helpers.cli import expect_cli_error
from helpers.onnx_graphs import mlp_only, tiny_attention
from helpers.onnx_helpers import initializers, ort_run


def _save(model: onnx.ModelProto, folder, name: str = "model.onnx", **kwargs):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    onnx.save_model(model, str(path), **kwargs)
    return path


def _rows(inits: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A MatMul weight (in, out) of tiny_attention as PyTorch-style rows (out, in), float64."""
    return inits[name].T.astype(np.float64)


def _assert_heads_semi_orthogonal(rows: np.ndarray, head_dim: int, what: str) -> None:
    """Each head (head_dim rows) has orthonormal rows, and two heads are not orthogonal to each other:
    the heads were drawn one by one at this size, not as one orthogonal matrix (a wrong head count)."""
    heads = rows.reshape(-1, head_dim, rows.shape[1])
    for h, head in enumerate(heads):
        assert np.allclose(head @ head.T, np.eye(head_dim), atol=1e-5), (
            f"{what} head {h} of {head_dim} rows is not semi-orthogonal"
        )
    assert np.abs(heads[0] @ heads[1].T).max() > 1e-3, (
        f"{what}: the heads are orthogonal to each other, as one head of {rows.shape[0]} rows"
    )


def _forward(
    inits: dict[str, np.ndarray], x: np.ndarray, *, layers: int, heads: int = 2, q_names: list[str] | None = None
) -> np.ndarray:
    """tiny_attention's forward written out in numpy from initializer values (by the names the test graph gives them)."""
    for i in range(layers):
        proj = {}
        for role in "qkv":
            w = q_names[i] if q_names and role == "q" else f"onnx::MatMul_{i}{role}"
            h = x @ inits[w] + inits[f"layers.{i}.attn.{role}_proj.bias"]
            proj[role] = h.reshape(x.shape[0], x.shape[1], heads, -1).transpose(0, 2, 1, 3)
        scores = proj["q"] @ proj["k"].transpose(0, 1, 3, 2) / np.sqrt(proj["q"].shape[-1])
        p = np.exp(scores - scores.max(-1, keepdims=True))
        o = (p / p.sum(-1, keepdims=True)) @ proj["v"]
        x = x + o.transpose(0, 2, 1, 3).reshape(x.shape) @ inits[f"onnx::MatMul_{i}o"]
    return x


def test_no_attention_in_an_mlp(cli, tmp_path):
    path = _save(mlp_only(), tmp_path / "m")
    expect_cli_error(cli, tmp_path, "inspect", path, match="no attention found")
    msg = expect_cli_error(
        cli,
        tmp_path,
        "reinit",
        path,
        match="has no Softmax and no Attention, MultiHeadAttention or GroupQueryAttention node",
    )
    assert "(4 nodes)" in msg


def test_no_attention_lists_each_softmax_and_where_the_walk_failed(cli, tmp_path):
    path = _save(mlp_only(softmax=True), tmp_path / "m")
    msg = expect_cli_error(cli, tmp_path, "reinit", path, match="looked at 1 Softmax/attention node")
    assert "Softmax /head/Softmax: no Q·Kᵀ product (MatMul of two computed tensors) feeds it" in msg


def test_a_walk_that_reaches_no_projection_is_named(cli, tmp_path):
    # Q read straight from the model input: the Q·Kᵀ product is found, the Q projection is not
    model = tiny_attention(layers=1)
    q_matmul = next(n for n in model.graph.node if n.name == "/layers.0/attn/q_proj/MatMul")
    q_matmul.op_type, q_matmul.input[:] = "Identity", [q_matmul.input[0]]
    path = _save(model, tmp_path / "m")
    with pytest.raises(NoAttentionFoundError) as err:
        reinit_checkpoint(path, device="cpu")
    assert (
        "Softmax /layers.0/attn/Softmax: Q reaches no MatMul/Gemm with a constant weight (the walk stops at graph input x)"
        in str(err.value)
    )
    expect_cli_error(cli, tmp_path, "inspect", path, match="no attention found")


@pytest.mark.parametrize(
    "source,match",
    [
        (
            "input",
            "reads weight q_weight_0, which is a graph input, not a constant initializer; export the model with its weights as initializers",
        ),
        (
            "computed",
            "reads weight /layers.0/attn/q_scale/Mul_output_0, which is computed by Mul /layers.0/attn/q_scale/Mul, not a constant initializer",
        ),
        (
            "quantized",
            "reads a quantized weight (DequantizeLinear /layers.0/attn/q_proj/DequantizeLinear): surgeon rewrites float weights only",
        ),
    ],
)
def test_projection_weight_that_is_not_an_initializer(cli, tmp_path, source, match):
    path = _save(tiny_attention(q_weight=source), tmp_path / "m")
    expect_cli_error(cli, tmp_path, "reinit", path, match=match)
    expect_cli_error(cli, tmp_path, "inspect", path, match="the Q projection MatMul /layers.0/attn/q_proj/MatMul")


def test_corrupt_and_unsupported_files(cli, tmp_path):
    good = _save(tiny_attention(), tmp_path / "good")
    raw = good.read_bytes()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "truncated.onnx").write_bytes(raw[: len(raw) // 2])
    (bad / "text.onnx").write_text("this is not a model\n" * 20)
    (bad / "empty.onnx").write_bytes(b"")
    expect_cli_error(cli, tmp_path, "reinit", bad / "truncated.onnx", match="is not a readable ONNX model")
    expect_cli_error(cli, tmp_path, "inspect", bad / "text.onnx", match="text.onnx is not")
    expect_cli_error(cli, tmp_path, "reinit", bad / "empty.onnx", match="is not an ONNX model (it has no graph)")


def test_missing_and_truncated_external_data(cli, tmp_path):
    path = _save(tiny_attention(), tmp_path / "m", save_as_external_data=True, location="weights.bin", size_threshold=0)
    data = tmp_path / "m" / "weights.bin"
    blob = data.read_bytes()
    data.write_bytes(blob[: len(blob) // 2])
    expect_cli_error(cli, tmp_path, "reinit", path, match="external data file weights.bin is truncated: initializer")
    data.unlink()
    expect_cli_error(cli, tmp_path, "reinit", path, match="missing external data file weights.bin (initializer")
    expect_cli_error(cli, tmp_path, "inspect", tmp_path / "m", match="missing external data file weights.bin")


def test_shared_initializer_gets_a_copy_for_the_chosen_projections(cli, tmp_path):
    path = _save(tiny_attention(layers=2, share_q=True), tmp_path / "m")
    feeds = {"x": np.linspace(-1, 1, 40, dtype=np.float32).reshape(1, 5, 8)}
    before = initializers(path)
    out = tmp_path / "one.onnx"
    report = reinit_checkpoint(path, output=out, layers="0", device="cpu")
    assert any(
        "'q_shared' is shared with block layers.1 (q): the chosen projections read a new copy of it, 'q_shared.surgeon_copy'"
        in n
        for n in report.notes
    )
    after = initializers(out)
    assert after.keys() == before.keys() | {"q_shared.surgeon_copy"}
    changed = {"onnx::MatMul_0k", "onnx::MatMul_0v"} | {f"layers.0.attn.{r}_proj.bias" for r in "qkv"}
    assert all(after[n].tobytes() == v.tobytes() for n, v in before.items() if n not in changed)  # q_shared as it was
    w = after["q_shared.surgeon_copy"].T.astype(np.float64)
    assert np.allclose(w[:4] @ w[:4].T, np.eye(4), atol=1e-6)
    model = onnx.load(str(out))
    readers = [n.name for n in model.graph.node if "q_shared.surgeon_copy" in n.input]
    assert readers and all(r.startswith("/layers.0/") for r in readers)
    assert all(n.name.startswith("/layers.1/") for n in model.graph.node if "q_shared" in n.input)
    # the same model written by onnx itself: layer 0 reads its own copy, layer 1 the original
    by_onnx = onnx.load(str(path))
    by_onnx.graph.initializer.append(
        onnx.numpy_helper.from_array(after["q_shared.surgeon_copy"], "q_shared.surgeon_copy")
    )
    for t in by_onnx.graph.initializer:
        if t.name in changed:
            t.CopyFrom(onnx.numpy_helper.from_array(after[t.name], t.name))
    for node in by_onnx.graph.node:
        if node.name in readers:
            node.input[:] = ["q_shared.surgeon_copy" if i == "q_shared" else i for i in node.input]
    expected = _save(by_onnx, tmp_path / "by-onnx")
    np.testing.assert_allclose(ort_run(out, feeds), ort_run(expected, feeds), atol=1e-6)
    assert not np.allclose(ort_run(out, feeds), ort_run(path, feeds), atol=1e-4)
    assert "verified" in cli("verify", path, out).output  # surgeon verify knows the copy
    # the same with external data: the copy is embedded in the new .onnx, the data file patched as before
    ext = _save(
        tiny_attention(layers=2, share_q=True),
        tmp_path / "ext",
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=256,
    )
    reinit_checkpoint(ext, output=tmp_path / "ext-out.onnx", layers="0", device="cpu")
    again = initializers(tmp_path / "ext-out.onnx")
    assert again.keys() == after.keys() and all(again[n].tobytes() == v.tobytes() for n, v in after.items())
    np.testing.assert_array_equal(ort_run(tmp_path / "ext-out.onnx", feeds), ort_run(out, feeds))
    # every user chosen: the shared weight changes once, for both layers, and needs no copy
    both = tmp_path / "both.onnx"
    cli("reinit", path, "-o", both)
    after = initializers(both)
    assert "q_shared.surgeon_copy" not in after
    w = after["q_shared"].T.astype(np.float64)
    assert np.allclose(w[:4] @ w[:4].T, np.eye(4), atol=1e-6)
    ort_run(both, feeds)


def test_shared_initializer_passed_on_to_others_is_refused(cli, tmp_path):
    """One Identity node passes the shared weight to both layers: a copy behind it would reach
    layer 1 too, so only both layers together can change it."""
    model = tiny_attention(layers=2, share_q=True)
    model.graph.node.insert(0, onnx.helper.make_node("Identity", ["q_shared"], ["q_shared_id"], name="shared_identity"))
    for node in model.graph.node[1:]:
        node.input[:] = ["q_shared_id" if i == "q_shared" else i for i in node.input]
    path = _save(model, tmp_path / "m")
    expect_cli_error(
        cli,
        tmp_path,
        "reinit",
        path,
        "--layers",
        "0",
        match="initializer 'q_shared' is shared: besides the projections chosen, block layers.1 (q) reads it, so changing it would change them too, "
        "and the chosen ones cannot have a copy of their own (Identity shared_identity passes it on to",
    )
    cli("reinit", path, "-o", tmp_path / "both.onnx")
    before, after = initializers(path), initializers(tmp_path / "both.onnx")
    assert after.keys() == before.keys()  # changed once, for both layers: no copy
    for name in ("q_shared", "onnx::MatMul_0k", "onnx::MatMul_1k"):
        _assert_heads_semi_orthogonal(_rows(after, name), 4, name)
    assert all(np.array_equal(_rows(after, f"onnx::MatMul_{i}v"), np.eye(8)) for i in range(2))
    assert all(after[f"onnx::MatMul_{i}o"].tobytes() == before[f"onnx::MatMul_{i}o"].tobytes() for i in range(2))
    assert [n.name for n in onnx.load(str(tmp_path / "both.onnx")).graph.node if "q_shared" in n.input] == [
        "shared_identity"
    ]
    x = np.random.default_rng(1).standard_normal((1, 5, 8)).astype(np.float32)
    shared = dict(layers=2, q_names=["q_shared"] * 2)
    np.testing.assert_allclose(
        ort_run(path, {"x": x}), _forward(before, x.astype(np.float64), **shared), atol=1e-5
    )  # the oracle
    np.testing.assert_allclose(
        ort_run(tmp_path / "both.onnx", {"x": x}), _forward(after, x.astype(np.float64), **shared), atol=1e-5
    )


def test_shared_bias_gets_a_copy(cli, tmp_path):
    model = tiny_attention(layers=2)
    # the dynamo exporter merges equal initializers: two layers' query biases become one
    for node in model.graph.node:
        if node.name == "/layers.1/attn/q_proj/Add":
            node.input[0] = "layers.0.attn.q_proj.bias"
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "layers.1.attn.q_proj.bias"))
    path = _save(model, tmp_path / "m")
    out = tmp_path / "out.onnx"
    cli("reinit", path, "--layers", "0", "-o", out)
    before, after = initializers(path), initializers(out)
    assert not after["layers.0.attn.q_proj.bias.surgeon_copy"].any()
    assert after["layers.0.attn.q_proj.bias"].tobytes() == before["layers.0.attn.q_proj.bias"].tobytes()
    ort_run(out, {"x": np.ones((1, 5, 8), np.float32)})


def test_output_errors_leave_nothing_behind(cli, tmp_path):
    path = _save(
        tiny_attention(), tmp_path / "m", save_as_external_data=True, location="model.onnx.data", size_threshold=0
    )
    expect_cli_error(cli, tmp_path, "reinit", path, "-o", tmp_path / "m" / "inside", match="is inside the input folder")
    (tmp_path / "taken").mkdir()
    expect_cli_error(cli, tmp_path, "reinit", path, "-o", tmp_path / "taken", match="already exists")
    shutil.rmtree(tmp_path / "taken")
    expect_cli_error(
        cli, tmp_path, "reinit", path, "--layers", "5", match="layer 5 is out of range: layers has layers 0-1"
    )


def test_heads_from_the_user_when_the_graph_does_not_say(cli, tmp_path):
    model = tiny_attention(layers=1)
    # the head split's shape arrives at run time: nothing in the graph tells the heads
    model.graph.input.append(onnx.helper.make_tensor_value_info("split_shape", onnx.TensorProto.INT64, [4]))
    for node in model.graph.node:
        if node.op_type == "Reshape" and node.input[1] == "shape4":
            node.input[1] = "split_shape"
    path = _save(model, tmp_path / "m")
    expect_cli_error(
        cli,
        tmp_path,
        "inspect",
        path,
        match="cannot tell the heads of layers.0.attn (Softmax /layers.0/attn/Softmax): no Reshape splits its 8 query features",
    )
    result = cli("inspect", path, "--num-heads", "2", "--json")
    import json

    [block] = json.loads(result.output)["blocks"]
    assert (block["heads"], block["head_dim"]) == (2, 4)
    feeds = {"x": np.ones((1, 5, 8), np.float32), "split_shape": np.array([1, 5, 2, 4], np.int64)}
    out = tmp_path / "out.onnx"
    cli("reinit", path, "--num-heads", "2", "-o", out)
    before, after = initializers(path), initializers(out)
    for role in "qk":  # heads of the size given (2 heads of 4 features), read back by the graph's own names
        _assert_heads_semi_orthogonal(_rows(after, f"onnx::MatMul_0{role}"), 4, role)
    assert np.array_equal(_rows(after, "onnx::MatMul_0v"), np.eye(8))
    assert not any(after[f"layers.0.attn.{r}_proj.bias"].any() for r in "qkv")
    reset = {f"onnx::MatMul_0{r}" for r in "qkv"} | {f"layers.0.attn.{r}_proj.bias" for r in "qkv"}
    assert after.keys() == before.keys() and all(
        after[n].tobytes() == v.tobytes() for n, v in before.items() if n not in reset
    )
    x = np.random.default_rng(1).standard_normal((1, 5, 8)).astype(np.float32)
    np.testing.assert_allclose(
        ort_run(path, {**feeds, "x": x}), _forward(before, x.astype(np.float64), layers=1), atol=1e-5
    )  # the oracle
    np.testing.assert_allclose(
        ort_run(out, {**feeds, "x": x}), _forward(after, x.astype(np.float64), layers=1), atol=1e-5
    )


def test_weight_passed_on_to_another_op_is_refused(cli, tmp_path):
    """An Identity between a query weight and its MatMul also feeds another op: changing the weight
    would change that op's output too, and a copy behind the Identity would as well."""
    model = tiny_attention(layers=2)
    model.graph.node.insert(0, onnx.helper.make_node("Identity", ["onnx::MatMul_0q"], ["q0_id"], name="q0_identity"))
    model.graph.node.append(onnx.helper.make_node("ReduceSum", ["q0_id"], ["q0_sum"], name="q0_sum", keepdims=0))
    model.graph.output.append(onnx.helper.make_tensor_value_info("q0_sum", onnx.TensorProto.FLOAT, []))
    for node in model.graph.node:
        if node.name == "/layers.0/attn/q_proj/MatMul":
            node.input[1] = "q0_id"
    path = _save(model, tmp_path / "m")
    expect_cli_error(
        cli,
        tmp_path,
        "reinit",
        path,
        "--layers",
        "0",
        match="initializer 'onnx::MatMul_0q' is read through nodes that feed more than the projections chosen "
        "(Identity q0_identity passes it on to ReduceSum q0_sum too)",
    )
    cli("reinit", path, "--layers", "0", "--targets", "k,v", "-o", tmp_path / "kv.onnx")
    before, after = initializers(path), initializers(tmp_path / "kv.onnx")
    reset = {"onnx::MatMul_0k", "onnx::MatMul_0v", "layers.0.attn.k_proj.bias", "layers.0.attn.v_proj.bias"}
    assert after.keys() == before.keys()
    moved = {n for n, v in before.items() if after[n].tobytes() != v.tobytes()}
    assert moved == reset, f"changed {sorted(moved)}, not k and v of layer 0"  # q and layer 1 as they were
    _assert_heads_semi_orthogonal(_rows(after, "onnx::MatMul_0k"), 4, "k")
    assert np.array_equal(_rows(after, "onnx::MatMul_0v"), np.eye(8))
    x = np.random.default_rng(1).standard_normal((1, 5, 8)).astype(np.float32)
    np.testing.assert_allclose(
        ort_run(tmp_path / "kv.onnx", {"x": x}), _forward(after, x.astype(np.float64), layers=2), atol=1e-5
    )
