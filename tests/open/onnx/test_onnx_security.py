"""An .onnx from a stranger: external data kept in the model file itself, two initializers aliasing the
same bytes, names already taken by a copy surgeon makes, absurd shapes, and graphs wired so that a walk
from every core could cover the whole graph. Each is one line and nothing written, or handled right."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgeon import inspect_checkpoint, reinit_checkpoint
from surgeon.detect.onnx import graph as graph_module
from surgeon.errors import LayoutError, NoAttentionFoundError

from helpers.cli import expect_cli_error
from helpers.onnx_graphs import tiny_attention
from helpers.onnx_helpers import initializers, ort_run
from helpers.paths import ROOT

FEEDS = {"x": np.linspace(-1, 1, 40, dtype=np.float32).reshape(1, 5, 8)}


def _external(folder: Path, model: onnx.ModelProto | None = None) -> tuple[Path, onnx.ModelProto]:
    """tiny_attention with every initializer in model.onnx.data; returns the path and the graph (no data)."""
    folder.mkdir(parents=True)
    path = folder / "model.onnx"
    onnx.save_model(
        model or tiny_attention(), str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0
    )
    return path, onnx.load(str(path), load_external_data=False)


def _place(model: onnx.ModelProto, name: str, **where) -> None:
    t = next(t for t in model.graph.initializer if t.name == name)
    entries = {e.key: e.value for e in t.external_data} | {k: str(v) for k, v in where.items()}
    del t.external_data[:]
    for key, value in entries.items():
        t.external_data.add(key=key, value=value)


def _entry(model: onnx.ModelProto, name: str) -> dict[str, str]:
    return {e.key: e.value for e in next(t for t in model.graph.initializer if t.name == name).external_data}


@pytest.mark.parametrize("through", ["its own name", "a hard link"])
def test_external_data_in_the_model_file_itself_is_refused(cli, tmp_path, through):
    path, model = _external(tmp_path / "m")
    location = "model.onnx"
    if through == "a hard link":
        location = "weights.bin"
    _place(model, "onnx::MatMul_0q", location=location, offset=0)  # 256 bytes of the .onnx's own protobuf
    onnx.save_model(model, str(path))
    if through == "a hard link":
        os.link(path, path.parent / location)
    assert path.stat().st_size >= 256
    match = f"initializer 'onnx::MatMul_0q' keeps its external data in the model file itself ('{location}')"
    expect_cli_error(cli, tmp_path, "inspect", path, match=match)
    expect_cli_error(cli, tmp_path, "reinit", path, "--in-place", match=match)
    expect_cli_error(cli, tmp_path / "m", "reinit", path, "-o", tmp_path / "out.onnx", match=match)
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("overlap", ["the same bytes", "a partial overlap"])
def test_initializers_aliasing_the_same_bytes_are_refused_if_either_must_change(cli, tmp_path, overlap):
    path, model = _external(tmp_path / "m")
    q = _entry(model, "onnx::MatMul_0q")
    # layer 0's key weight reads layer 0's query bytes (from 64 bytes in, for a partial overlap)
    start = int(q.get("offset", 0)) + (0 if overlap == "the same bytes" else 64)
    _place(model, "onnx::MatMul_0k", offset=start)
    onnx.save_model(model, str(path))
    shared = f"{start}-{int(q.get('offset', 0)) + 256}"
    inspect_checkpoint(path)  # reading is fine
    for targets, layers in (("q", "0"), ("k", "0"), ("q,k,v", "all")):
        msg = expect_cli_error(
            cli,
            tmp_path,
            "reinit",
            path,
            "--targets",
            targets,
            "--layers",
            layers,
            "-o",
            tmp_path / "out.onnx",
            match="share bytes " + shared + " of model.onnx.data, so changing",
        )
        assert "'onnx::MatMul_0q'" in msg and "'onnx::MatMul_0k'" in msg
    expect_cli_error(
        cli, tmp_path, "reinit", path, "--targets", "q", "--layers", "0", "--in-place", match="share bytes " + shared
    )
    # neither aliased initializer changes: allowed, and only the chosen ones change
    out = tmp_path / "v.onnx"
    cli("reinit", path, "--targets", "v", "-o", out)
    before, after = initializers(path), initializers(out)
    changed = {n for n in before if before[n].tobytes() != after[n].tobytes()}
    assert changed == {"onnx::MatMul_0v", "onnx::MatMul_1v", "layers.0.attn.v_proj.bias", "layers.1.attn.v_proj.bias"}


def test_a_copy_gets_a_name_no_part_of_the_graph_uses(cli, tmp_path):
    model = tiny_attention(layers=2, share_q=True)
    # the names surgeon would give the copy, taken by an unused graph input and a value info of another type
    model.graph.input.append(helper.make_tensor_value_info("q_shared.surgeon_copy", TensorProto.INT64, [3]))
    model.graph.value_info.append(helper.make_tensor_value_info("q_shared.surgeon_copy2", TensorProto.INT64, [2, 2]))
    folder = tmp_path / "m"
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save_model(model, str(path))
    feeds = {**FEEDS, "q_shared.surgeon_copy": np.arange(3, dtype=np.int64)}
    out = tmp_path / "one.onnx"
    report = reinit_checkpoint(path, output=out, layers="0", device="cpu")
    assert any("the chosen projections read a new copy of it, 'q_shared.surgeon_copy3'" in n for n in report.notes), (
        report.notes
    )
    after = initializers(out)
    assert (
        "q_shared.surgeon_copy3" in after
        and "q_shared.surgeon_copy" not in after
        and "q_shared.surgeon_copy2" not in after
    )
    # what onnx itself writes for the same change: layer 0 reads the copy, layer 1 the original
    expected = onnx.load(str(path))
    expected.graph.initializer.append(
        numpy_helper.from_array(after["q_shared.surgeon_copy3"], "q_shared.surgeon_copy3")
    )
    for t in expected.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(after[t.name], t.name))
    for node in expected.graph.node:
        if node.name.startswith("/layers.0/"):
            node.input[:] = ["q_shared.surgeon_copy3" if i == "q_shared" else i for i in node.input]
    onnx.save_model(expected, str(tmp_path / "expected.onnx"))
    got = ort_run(out, feeds)  # loads in onnxruntime
    np.testing.assert_allclose(got, ort_run(tmp_path / "expected.onnx", feeds), atol=1e-6)
    assert not np.allclose(got, ort_run(path, feeds), atol=1e-4)
    assert "verified" in cli("verify", path, out).output


def _set(model: onnx.ModelProto, name: str, tensor: TensorProto) -> None:
    t = next(t for t in model.graph.initializer if t.name == name)
    t.CopyFrom(tensor)


def _constant_shape(model: onnx.ModelProto) -> None:
    """The head split's shape as a Constant node whose tensor claims 2**32 values and holds 4."""
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "shape4"))
    value = numpy_helper.from_array(np.array([1, 5, 2, 4], np.int64), "shape4_value")
    value.dims[:] = [2**32]
    model.graph.node.insert(0, helper.make_node("Constant", [], ["shape4"], name="shape4_const", value=value))


def _weight_without_data(model: onnx.ModelProto) -> None:
    """A query weight of 2**32 x 2**32 floats that holds no data (its size wraps to 0 in int64)."""
    t = next(t for t in model.graph.initializer if t.name == "onnx::MatMul_0q")
    t.dims[:] = [2**32, 2**32]
    t.ClearField("raw_data")


def _weight_with_too_few_bytes(model: onnx.ModelProto) -> None:
    t = next(t for t in model.graph.initializer if t.name == "onnx::MatMul_0q")
    t.dims[:] = [2**32, 8]


def _weight_varint_coded(model: onnx.ModelProto) -> None:
    """A float16 query weight in int32_data (varint-coded, decoded by onnx) that claims 2**32 rows."""
    t = next(t for t in model.graph.initializer if t.name == "onnx::MatMul_0q")
    values = numpy_helper.to_array(t).astype(np.float16)
    t.CopyFrom(
        helper.make_tensor(
            t.name, TensorProto.FLOAT16, [8, 8], values.view(np.uint16).astype(np.int32).ravel().tolist()
        )
    )
    t.dims[:] = [2**32, 8]


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            _constant_shape,
            "Constant shape4_const holds a tensor of shape [4294967296] whose data does not fill it: the model is corrupt",
        ),
        (
            _weight_without_data,
            "initializer 'onnx::MatMul_0q' holds no data for shape [4294967296, 4294967296]: the model is corrupt",
        ),
        (
            _weight_with_too_few_bytes,
            "initializer 'onnx::MatMul_0q' holds 256 bytes for shape [4294967296, 8]: the model is corrupt",
        ),
        (
            _weight_varint_coded,
            "initializer 'onnx::MatMul_0q' does not hold the values of its shape [4294967296, 8]: the model is corrupt",
        ),
    ],
)
def test_absurd_shapes_are_one_line(cli, tmp_path, edit, match):
    model = tiny_attention(layers=1)
    edit(model)
    folder = tmp_path / "m"
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save_model(model, str(path))
    expect_cli_error(cli, tmp_path, "inspect", path, match=match)
    expect_cli_error(cli, tmp_path, "reinit", path, "-o", tmp_path / "out.onnx", match=match)
    expect_cli_error(cli, tmp_path, "reinit", path, "--in-place", match=match)


def _shape_from_a_long_computation(model: onnx.ModelProto) -> None:
    """The head split's shape computed by 3,000 Adds of zero: folding it must not recurse 3,000 deep."""
    next(t for t in model.graph.initializer if t.name == "shape4").name = "shape4_base"
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(4, np.int64), "zero"))
    names = ["shape4_base"] + [f"shape4_{i}" for i in range(2999)] + ["shape4"]
    for i in range(3000):
        model.graph.node.insert(i, helper.make_node("Add", [names[i], "zero"], [names[i + 1]], name=f"add_{i}"))


def _identity_loops(model: onnx.ModelProto) -> None:
    """A query bias and a key weight that are Identity loops (a -> b -> a): no producer ends them."""
    for node in model.graph.node:
        if node.name == "/layers.0/attn/q_proj/Add":
            node.input[0] = "loop_a"
        if node.name == "/layers.0/attn/k_proj/MatMul":
            node.input[1] = "loop_c"
    for src, dst in (("loop_b", "loop_a"), ("loop_a", "loop_b"), ("loop_d", "loop_c"), ("loop_c", "loop_d")):
        model.graph.node.insert(0, helper.make_node("Identity", [src], [dst], name=f"{src}_to_{dst}"))


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            _shape_from_a_long_computation,
            "cannot tell the heads of layers.0.attn (Softmax /layers.0/attn/Softmax): no Reshape splits its 8 query features",
        ),
        (
            _identity_loops,
            "K reaches no MatMul/Gemm with a constant weight (the walk stops at MatMul /layers.0/attn/k_proj/MatMul (two computed operands))",
        ),
    ],
)
def test_graphs_that_loop_or_run_deep_end_in_one_line(tmp_path, edit, match):
    model = tiny_attention(layers=1)
    edit(model)
    folder = tmp_path / "m"
    folder.mkdir()
    onnx.save_model(model, str(folder / "model.onnx"))
    # a fresh process with a time limit: before, one hung and the other ended in a RecursionError
    proc = subprocess.run(
        [sys.executable, "-m", "surgeon", "inspect", str(folder / "model.onnx")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith("surgeon: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert match in proc.stderr


# --- the walker's work is linear in the graph's size ---------------------------------------------
def _bench():
    spec = importlib.util.spec_from_file_location("bench_onnx_walker", ROOT / "benchmarks" / "bench_onnx_walker.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class _Counted(dict):
    """A graph index that counts its look-ups: the walks' unit of work."""

    looks = 0

    def get(self, key, default=None):
        _Counted.looks += 1
        return super().get(key, default)


def _looks(monkeypatch, model: onnx.ModelProto, folder: Path) -> int:
    folder.mkdir()
    onnx.save_model(model, str(folder / "model.onnx"))
    init = graph_module.Graph.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.producer, self.consumers = _Counted(self.producer), _Counted(self.consumers)

    monkeypatch.setattr(graph_module.Graph, "__init__", counted)
    _Counted.looks = 0
    with pytest.raises((NoAttentionFoundError, LayoutError)):
        inspect_checkpoint(folder / "model.onnx")
    return _Counted.looks


@pytest.mark.parametrize("shape", ["ladder", "forward", "projection"])
def test_the_walk_does_work_linear_in_the_number_of_cores(monkeypatch, tmp_path, shape):
    # each shape makes every core's walk reach back (or forward) along the whole graph if nothing bounds it
    bench = _bench()
    small, large = (_looks(monkeypatch, bench.build(shape, n), tmp_path / f"{shape}{n}") for n in (200, 800))
    assert large < 4.5 * small, (small, large)  # 4x the cores, 4x the work (an unbounded walk: 16x)
    assert large < 200 * 800, large
