"""Property tests (hypothesis, bounded): the safetensors header reader, the ONNX external-data resolver and
the --layers/--heads spec parser never end in a traceback, never write outside the destination, and never
accept a file the reference reader (the `safetensors` package) refuses."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import onnx
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from surgeon.errors import SelectionError, SurgeonError
from surgeon.formats.safetensors_header import DTYPES, read_header
from surgeon.vocab.selection import resolve_indices

from helpers.digests import tree_digest
from helpers.paths import ROOT

FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)

# --- safetensors headers ---------------------------------------------------------------------------

_dtype = st.sampled_from([*DTYPES, "F33", "f32", "", "BOOL "])
_shape = st.lists(st.integers(0, 5), max_size=3)


@st.composite
def safetensors_files(draw) -> tuple[bytes, str]:
    """Mostly-valid files with one or more things wrong: offsets, lengths, holes, trailing bytes,
    duplicate names, unknown dtypes, odd JSON."""
    n = draw(st.integers(0, 4))
    entries, cursor = [], 0
    for i in range(n):
        dtype = draw(_dtype)
        shape = draw(_shape)
        bits = DTYPES.get(dtype, (None, 8))[1]
        size = (int(np.prod(shape)) * bits + 7) // 8
        begin = cursor + draw(st.sampled_from([0, 0, 0, 1, -1, 4]))
        end = begin + size + draw(st.sampled_from([0, 0, 0, 1, -1]))
        cursor = max(cursor, end)
        name = draw(st.sampled_from([f"t{i}", "t0", "__metadata__", f"layers.{i}.attn.q_proj.weight"]))
        entries.append((name, {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}))
    meta = draw(st.sampled_from([None, {}, {"a": "b"}, {"a": 1}, "x", {"surgeon": "[]"}]))
    parts = ([f'"__metadata__":{json.dumps(meta)}'] if meta is not None else []) + [
        f"{json.dumps(k)}:{json.dumps(v)}" for k, v in entries
    ]
    header = ("{" + ",".join(parts) + "}").encode()
    header = draw(
        st.sampled_from([header, header, header, header + b"   ", header[:-1], b"[" + header + b"]", header + b"\x00"])
    )
    data = bytes(max(cursor, 0) + draw(st.sampled_from([0, 0, 0, 1, 8])))
    return struct.pack("<Q", len(header)) + header + data, ""


def _reference_accepts(path: Path) -> bool:
    """The safetensors library reads the file: its header, and every tensor torch has a dtype for (sub-byte
    dtypes such as F6_E2M3 and F4 are valid safetensors that torch cannot decode: the library opens them and
    says "Dtype not understood" only when one is converted, which is not a verdict on the file)."""
    try:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                try:
                    f.get_tensor(name)
                except Exception as exc:
                    if "Dtype not understood" not in str(exc):
                        raise
        return True
    except Exception:
        return False


@FUZZ
@given(safetensors_files())
def test_header_reader_is_at_least_as_strict_as_the_reference(tmp_path_factory, case):
    blob, _ = case
    path = tmp_path_factory.mktemp("st") / "m.safetensors"
    path.write_bytes(blob)
    try:
        read_header(path)
        ours = True
    except SurgeonError as exc:
        assert "\n" not in str(exc)
        ours = False
    if ours:
        assert _reference_accepts(path), blob[:300]


@FUZZ
@given(st.binary(max_size=200), st.integers(0, 300))
def test_header_reader_on_random_bytes(tmp_path_factory, raw, claimed):
    path = tmp_path_factory.mktemp("raw") / "m.safetensors"
    path.write_bytes(struct.pack("<Q", claimed) + raw)
    try:
        read_header(path)
    except SurgeonError:
        return
    assert _reference_accepts(path)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(safetensors_files())
def test_cli_on_fuzzed_safetensors_never_tracebacks_or_writes(cli, tmp_path_factory, case):
    blob, _ = case
    folder = tmp_path_factory.mktemp("cli")
    (folder / "m.safetensors").write_bytes(blob)
    before = tree_digest(folder)
    result = cli("reinit", folder / "m.safetensors", "--num-heads", 1, "-o", folder / "out" / "o.safetensors", ok=False)
    assert "Traceback" not in result.stderr + result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    if result.exit_code == 0:
        assert _reference_accepts(folder / "m.safetensors") and _reference_accepts(folder / "out" / "o.safetensors")
    else:
        assert result.stderr.count("\n") == 1 and tree_digest(folder) == before


# --- ONNX external data ----------------------------------------------------------------------------

_locations = st.one_of(
    st.sampled_from(
        [
            "weights.bin",
            "./weights.bin",
            "../weights.bin",
            "/etc/passwd",
            "sub/../weights.bin",
            "sub/w.bin",
            "",
            "weights.bin\x00x",
            "model.onnx",
            "..",
            ".",
            "sub",
            "C:\\x",
            "\\\\host\\share",
            "link.bin",
        ]
    ),
    st.text(st.characters(codec="utf-8", exclude_characters="\n"), max_size=20),
)


@FUZZ
@example("link.bin", 0, None, None)  # found by this test: a link inside the folder that leads out of it
@example("weights.bin\x00x", 0, None, None)
@given(
    _locations, st.integers(-8, 80), st.one_of(st.none(), st.integers(-4, 80)), st.sampled_from(["0", "x", "1e3", None])
)
def test_onnx_external_data_resolver(cli, tmp_path_factory, location, offset, length, bad):
    base = tmp_path_factory.mktemp("onnx")
    folder = base / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "weights.bin").write_bytes(np.arange(16, dtype=np.float32).tobytes())
    (folder / "sub" / "w.bin").write_bytes(bytes(64))
    (base / "weights.bin").write_bytes(bytes(64))  # outside the model's folder: must never be read
    os.symlink(base / "weights.bin", folder / "link.bin")  # a link out of the folder
    tensor = onnx.TensorProto(
        name="w", data_type=onnx.TensorProto.FLOAT, dims=[4, 4], data_location=onnx.TensorProto.EXTERNAL
    )
    for key, value in (
        ("location", location),
        ("offset", str(offset)),
        ("length", None if length is None else str(length)),
    ):
        if value is not None:
            tensor.external_data.append(onnx.StringStringEntryProto(key=key, value=value))
    if bad is not None:
        tensor.external_data.append(onnx.StringStringEntryProto(key="offset", value=bad))
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    graph = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [tensor])
    (folder / "model.onnx").write_bytes(onnx.helper.make_model(graph).SerializeToString())
    before = tree_digest(base)
    result = cli("reinit", folder / "model.onnx", "--num-heads", 1, "-o", base / "out", ok=False)
    assert "Traceback" not in result.stderr + result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code != 0 and result.stderr.count("\n") == 1  # no attention in a lone MatMul, at best
    assert tree_digest(base) == before  # nothing written, anywhere
    from surgeon.formats.onnx import OnnxWeights

    try:
        weights = OnnxWeights(folder / "model.onnx")
    except SurgeonError:
        return
    for name in weights.tensors:  # what it resolves to is inside the model's folder, links included
        stored = weights.stored[name]
        target = (folder / stored.file).resolve()
        assert folder.resolve() in target.parents or target == (folder / "model.onnx").resolve(), target
        weights.read(name)


# --- --layers / --heads specs -----------------------------------------------------------------------

_spec_text = st.one_of(
    st.from_regex(r"\A(all|-?\d{1,3}(-(-?\d{1,3})?)?)(,\s?(-?\d{1,3}(-(-?\d{1,3})?)?))*\Z"),
    st.text(st.sampled_from("0123456789-, allx\t"), max_size=12),
    st.text(max_size=8),
)


@FUZZ
@given(_spec_text, st.integers(1, 40))
def test_spec_parser(spec, count):
    try:
        got = resolve_indices(spec, count, what="layer", where="the model")
    except SelectionError as exc:
        assert "\n" not in str(exc)
        return
    assert got == sorted(set(got)) and all(0 <= i < count for i in got)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_spec_text, _spec_text)
def test_spec_options_on_the_cli(cli, tmp_path, spec, heads):
    assume(not spec.startswith("-") or "," in spec or spec[1:2].isdigit())
    src = ROOT / "examples" / "tiny-bert"
    out = Path(tempfile.mkdtemp(dir=tmp_path)) / "out"
    result = cli("reinit", src, f"--layers={spec}", f"--heads={heads}", "--dry-run", "-o", out, ok=False)
    assert "Traceback" not in result.stderr + result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 0 or result.stderr.count("\n") == 1
    assert not out.exists()
