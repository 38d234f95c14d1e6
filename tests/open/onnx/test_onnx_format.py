"""The ONNX format: embedded and external data (one file, several files, one file per tensor),
byte-range patching, folders, in-place runs, the metadata record, other tensor encodings, data
beyond 2 GiB, and the CLI."""

from __future__ import annotations

import copy
import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from surgeon import inspect_checkpoint, reinit_checkpoint
from surgeon.formats.onnx import open_onnx, surgeon_records

from helpers.digests import sha256, tree_digest
from helpers.families import FAMILIES
from helpers.onnx_graphs import tiny_attention
from helpers.onnx_helpers import (
    assert_semi_orthogonal,
    assert_value_identity,
    changed_byte_ranges,
    export,
    initializers,
    ort_run,
    save_variant,
    tensor_ranges,
)

VARIANTS = ("embedded", "one-file", "split", "per-tensor")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny BERT exported by the legacy exporter (all initializers embedded), with its inputs."""
    path = tmp_path_factory.mktemp("bert") / "model.onnx"
    feeds = export(FAMILIES["bert"].make(), "bert", path, dynamo=False)
    return path, feeds


@pytest.fixture(scope="module")
def reference(bert, tmp_path_factory):
    """The embedded model re-initialized: every other variant must give the same values."""
    out = tmp_path_factory.mktemp("reference") / "out.onnx"
    reinit_checkpoint(bert[0], output=out, layers="0", device="cpu")
    return initializers(out)


@pytest.mark.parametrize("kind", VARIANTS)
def test_external_data_round_trip(bert, reference, tmp_path, kind):
    src = save_variant(bert[0], tmp_path / "src", kind)
    weights = open_onnx(src)
    data_files = sorted(
        p.relative_to(src.parent).as_posix() for p in src.parent.rglob("*") if p.is_file() and p.name != "model.onnx"
    )
    assert sorted(weights.files[1:]) == data_files
    if kind == "split":
        assert data_files == ["weights/part0.bin", "weights/part1.bin", "weights/part2.bin"]
    before = tree_digest(src.parent)
    out = tmp_path / "out"
    report = reinit_checkpoint(src, output=out, layers="0", device="cpu")
    assert tree_digest(src.parent) == before  # the input is never modified
    new_path = out / "model.onnx" if data_files else out
    if data_files:  # external data: the output is a folder holding the same file names
        assert {"model.onnx", *data_files} <= {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    else:
        assert out.is_file()
    # the same values whatever the storage (draws are keyed by initializer name, not by file)
    new = initializers(new_path)
    assert new.keys() == reference.keys()
    for name, value in reference.items():
        assert new[name].tobytes() == value.tobytes(), name
    # data files: same size, only the re-initialized tensors' byte ranges rewritten, same offsets
    changed = {r.block.projection(r.role).weight.tensor for r in report.rows} | {
        r.block.projection(r.role).bias.tensor for r in report.rows if r.bias_zeroed
    }
    ranges = tensor_ranges(src)
    for file in data_files:
        old, fresh = (src.parent / file).read_bytes(), (out / file).read_bytes()
        assert len(old) == len(fresh)
        allowed = np.zeros(len(old), dtype=bool)
        for name, (f, start, end) in ranges.items():
            if f == file and name in changed:
                allowed[start:end] = True
        for start, end in changed_byte_ranges(old, fresh):
            assert allowed[start:end].all(), f"{file}: bytes {start}-{end} changed outside the re-initialized tensors"
    # onnxruntime reads the output as it reads the same values written by onnx itself
    np.testing.assert_array_equal(ort_run(new_path, bert[1]), ort_run(_embedded(bert[0], reference, tmp_path), bert[1]))


def _embedded(source: Path, values: dict[str, np.ndarray], tmp_path: Path) -> Path:
    """``source`` with ``values`` put in by onnx itself, as an independent writer to compare with."""
    model = onnx.load(str(source))
    for t in model.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
    path = tmp_path / "by-onnx.onnx"
    onnx.save_model(model, str(path))
    return path


def test_output_keeps_everything_but_the_changed_bytes(bert, tmp_path):
    src = bert[0]
    out = tmp_path / "out.onnx"
    report = reinit_checkpoint(src, output=out, layers="1", targets="q,k", bias="keep", device="cpu")
    old, new = src.read_bytes(), out.read_bytes()
    entry = onnx.ModelProto.FromString(new[len(old) :])  # the appended bytes are one metadata_props field
    assert [p.key for p in entry.metadata_props] == ["surgeon"] and not entry.HasField("graph")
    ranges = tensor_ranges(src)
    touched = {r.block.projection(r.role).weight.tensor for r in report.rows}
    assert len(touched) == 2
    runs = changed_byte_ranges(old, new[: len(old)])
    assert runs and all(any(ranges[t][1] <= s and e <= ranges[t][2] for t in touched) for s, e in runs)
    record = surgeon_records(onnx.load(str(out)))[0]
    assert record["options"]["targets"] == ["q", "k"] and record["options"]["bias"] == "keep"
    assert [(b["layer"], b["targets"]) for b in record["blocks"]] == [(1, {"q": "all", "k": "all"})]
    onnx.checker.check_model(str(out), full_check=True)


def test_record_history_across_runs(bert, tmp_path):
    first, second = tmp_path / "first.onnx", tmp_path / "second.onnx"
    reinit_checkpoint(bert[0], output=first, layers="0", device="cpu")
    reinit_checkpoint(first, output=second, layers="1", seed=7, device="cpu")
    model = onnx.load(str(second))
    assert [p.key for p in model.metadata_props].count("surgeon") == 1  # the old entry is replaced, not repeated
    records = surgeon_records(model)
    assert [r["options"]["layers"] for r in records] == ["0", "1"] and records[1]["options"]["seed"] == 7
    onnx.checker.check_model(model)
    ort_run(second, bert[1])


def test_folder_input_and_in_place(bert, tmp_path):
    src = tmp_path / "model"
    save_variant(bert[0], src, "one-file")
    (src / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (src / "tokenizer.json").write_text('{"untouched": true}')
    out_of_place = tmp_path / "model-reinit"
    reinit_checkpoint(src, layers="0", device="cpu")  # default output: beside the folder
    assert {"config.json", "model.onnx", "model.onnx.data", "tokenizer.json"} <= {
        p.name for p in out_of_place.iterdir()
    }
    assert sha256(out_of_place / "tokenizer.json") == sha256(src / "tokenizer.json")
    # in place, given the .onnx file: the .onnx and its data file are each replaced atomically
    untouched = sha256(src / "tokenizer.json")
    reinit_checkpoint(src / "model.onnx", in_place=True, layers="0", device="cpu")
    for name in ("model.onnx", "model.onnx.data"):
        assert sha256(src / name) == sha256(out_of_place / name), name
    assert sha256(src / "tokenizer.json") == untouched
    assert not list(src.glob(".*surgeon-tmp"))


def test_float_data_and_int32_data_encodings(tmp_path):
    """Initializers stored as float_data are patched in place; float16 stored as int32_data
    (varints) is rewritten as raw_data, and the graph's length prefix follows."""
    graph = tiny_attention(float_data=True)
    src = tmp_path / "float_data.onnx"
    onnx.save_model(graph, str(src))
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 5, 8)).astype(np.float32)}
    out = tmp_path / "float_data.reinit.onnx"
    reinit_checkpoint(src, output=out, layers="1", device="cpu")
    before, after = initializers(src), initializers(out)
    assert len(out.read_bytes()) - len(src.read_bytes()) < 1000  # patched in place + the record
    _check_tiny(before, after, layer=1)
    ort_run(out, feeds)

    half = copy.deepcopy(graph)
    from onnxruntime.transformers.float16 import convert_float_to_float16

    half = convert_float_to_float16(half, keep_io_types=False)
    for t in half.graph.initializer:  # re-encode the float16 projection weights as onnx.helper does by default
        if t.name.startswith("onnx::MatMul_1"):
            value = numpy_helper.to_array(t)
            t.CopyFrom(helper.make_tensor(t.name, onnx.TensorProto.FLOAT16, value.shape, value))
            assert t.int32_data and not t.raw_data
    src16, out16 = tmp_path / "half.onnx", tmp_path / "half.reinit.onnx"
    onnx.save_model(half, str(src16))
    reinit_checkpoint(src16, output=out16, layers="1", device="cpu")
    onnx.checker.check_model(str(out16), full_check=True)
    _check_tiny(initializers(src16), initializers(out16), layer=1, atol=2e-3)
    assert np.isfinite(ort_run(out16, {"x": feeds["x"].astype(np.float16)})).all()


def _check_tiny(before, after, layer: int, atol: float = 1e-5) -> None:
    for role in "qkv":
        name = f"onnx::MatMul_{layer}{role}"
        rows = torch.from_numpy(after[name].T.astype(np.float64))
        if role == "v":
            assert_value_identity(rows, name)
        else:
            for h in range(2):
                head = rows[h * 4 : (h + 1) * 4]
                assert torch.allclose(head @ head.T, torch.eye(4, dtype=torch.float64), atol=atol), name
    changed = {f"onnx::MatMul_{layer}{r}" for r in "qkv"} | {f"layers.{layer}.attn.{r}_proj.bias" for r in "qkv"}
    for name, value in before.items():
        if name not in changed:
            assert after[name].tobytes() == value.tobytes(), name


def test_data_beyond_2_gib(bert, tmp_path):
    """External data at offsets past 2**31 in a (sparse) data file: read by byte range, never loaded
    whole, written back at the same offsets, and onnxruntime runs the result."""
    src = save_variant(bert[0], tmp_path / "src", "one-file")
    model = onnx.load(str(src), load_external_data=False)
    hole = 3 << 30
    data = (src.parent / "model.onnx.data").read_bytes()
    with open(src.parent / "model.onnx.data", "wb") as f:
        f.seek(hole)
        f.write(data)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "offset":
                e.value = str(int(e.value) + hole)
    onnx.save_model(model, str(src))
    assert (src.parent / "model.onnx.data").stat().st_size > 3 << 30
    tracemalloc.start()
    report = inspect_checkpoint(src, device="cpu")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(report.blocks) == 2 and peak < 64 << 20
    out = tmp_path / "out"
    reinit_checkpoint(src, output=out, layers="0", device="cpu")
    assert (out / "model.onnx.data").stat().st_size == (src.parent / "model.onnx.data").stat().st_size
    assert (out / "model.onnx.data").stat().st_blocks * 512 < 64 << 20  # the hole stayed a hole
    weights = open_onnx(out / "model.onnx")
    block = report.blocks[0]
    q = weights.read(block.q.weight.tensor).double()
    assert weights.stored[block.q.weight.tensor].offset > 1 << 31
    assert_semi_orthogonal(q.T, block.head_dim, "q")
    assert_value_identity(weights.read(block.v.weight.tensor).T, "v")
    ort_run(out / "model.onnx", bert[1])


def test_cli_inspect_and_reinit(bert, cli, tmp_path):
    src = bert[0]
    result = cli("inspect", src)
    assert "model.encoder.layer" in result.output and "MatMul q/k/v" in result.output
    data = json.loads(cli("inspect", src, "--json").output)
    assert data["format"] == "onnx (model.onnx)" and len(data["blocks"]) == 2 and len(data["projections"]) == 6
    out = tmp_path / "cli.onnx"
    result = cli("reinit", src, "--layers", "-1", "--targets", "q,k", "--seed", "3", "-o", out)
    assert f"wrote {out}" in result.output
    before, after = initializers(src), initializers(out)
    changed = [n for n in before if before[n].tobytes() != after[n].tobytes()]
    blocks = inspect_checkpoint(src, device="cpu").blocks
    assert sorted(changed) == sorted(
        {blocks[1].q.weight.tensor, blocks[1].k.weight.tensor, blocks[1].q.bias.tensor, blocks[1].k.bias.tensor}
    )
    ort_run(out, bert[1])
    dry = cli("reinit", src, "--dry-run", "--attention", "self", "-o", tmp_path / "never.onnx")
    assert "plan (dry run" in dry.output and not (tmp_path / "never.onnx").exists()


def test_folder_with_several_models_is_refused(bert, cli, tmp_path):
    from helpers.cli import expect_cli_error

    folder = tmp_path / "optimum"
    folder.mkdir()
    for name in ("encoder_model.onnx", "decoder_model.onnx"):
        shutil.copyfile(bert[0], folder / name)
    expect_cli_error(
        cli,
        tmp_path,
        "reinit",
        folder,
        match="holds 2 ONNX models (decoder_model.onnx, encoder_model.onnx); point surgeon at one .onnx file",
    )
    cli("inspect", folder / "encoder_model.onnx")
