"""safetensors files are patched at the byte level: only re-initialized tensors and the metadata change."""

from __future__ import annotations

import json
import struct

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from surgeon.formats.safetensors import SafetensorsWeights, write_patched
from surgeon.formats.safetensors_header import read_header, records


def raw_tensors(path):
    """name -> (dtype, shape, raw bytes), read independently of surgeon's reader."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        b, e = entry["data_offsets"]
        out[name] = (entry["dtype"], entry["shape"], data[8 + n + b : 8 + n + e])
    return header, out


def test_unchanged_write_is_byte_identical(tmp_path):
    tensors = {
        "b": torch.randn(3, 5),
        "a": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 2).to(torch.bfloat16),
    }
    src = tmp_path / "in.safetensors"
    save_file(tensors, src, metadata={"format": "pt"})
    out = tmp_path / "out.safetensors"
    write_patched(read_header(src), out, {}, None)
    assert out.read_bytes() == src.read_bytes()


def test_patch_changes_only_updated_bytes_and_metadata(tmp_path):
    tensors = {"w": torch.randn(4, 6), "x": torch.randn(10), "h": torch.randn(3, 3).to(torch.float16)}
    src = tmp_path / "in.safetensors"
    save_file(tensors, src, metadata={"format": "pt", "author": "someone"})
    new_w = torch.ones(4, 6)
    out = tmp_path / "out.safetensors"
    write_patched(read_header(src), out, {"w": new_w}, {"tool": "surgeon", "n": 1})
    in_header, in_raw = raw_tensors(src)
    out_header, out_raw = raw_tensors(out)
    assert [k for k in out_header if k != "__metadata__"] == [k for k in in_header if k != "__metadata__"]
    assert out_raw["x"] == in_raw["x"] and out_raw["h"] == in_raw["h"]
    assert out_raw["w"] != in_raw["w"]
    loaded = load_file(out)  # the reference reader accepts it
    assert torch.equal(loaded["w"], new_w) and torch.equal(loaded["h"], tensors["h"])
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["author"] == "someone"
    assert records(meta) == [{"tool": "surgeon", "n": 1}]
    # A second run appends to the history instead of replacing it.
    out2 = tmp_path / "out2.safetensors"
    write_patched(read_header(out), out2, {}, {"tool": "surgeon", "n": 2})
    with safe_open(out2, "pt") as f:
        assert [r["n"] for r in records(f.metadata())] == [1, 2]
    (n,) = struct.unpack("<Q", out.read_bytes()[:8])
    assert n % 8 == 0  # header padded to 8 bytes like the reference writer


def test_reader_matches_reference_for_every_float_dtype(tmp_path):
    tensors = {
        "f32": torch.randn(3, 4),
        "f16": torch.randn(3, 4).half(),
        "bf16": torch.randn(3, 4).bfloat16(),
        "f64": torch.randn(2, 2).double(),
        "i8": torch.randint(-5, 5, (6,), dtype=torch.int8),
        "empty": torch.zeros(0, 3),
    }
    src = tmp_path / "x.safetensors"
    save_file(tensors, src)
    weights = SafetensorsWeights(tmp_path, ["x.safetensors"])
    for name, t in tensors.items():
        got = weights.read(name)
        assert got.dtype == t.dtype and torch.equal(got, t)
    assert weights.tensors["bf16"].dtype == "BF16" and weights.tensors["i8"].torch_dtype == torch.int8


def test_newer_dtypes_in_untouched_tensors_are_carried_over(tmp_path):
    from surgeon import reinit_checkpoint

    tensors = {f"layers.0.attn.{p}_proj.weight": torch.randn(16, 16) for p in "qkv"}
    tensors["scales"] = torch.ones(8).to(torch.float8_e8m0fnu)
    tensors["phase"] = torch.randn(4, dtype=torch.complex64)
    src = tmp_path / "m.safetensors"
    save_file(tensors, src)
    reinit_checkpoint(src, output=tmp_path / "o.safetensors", num_heads=2)
    _, before = raw_tensors(src)
    _, after = raw_tensors(tmp_path / "o.safetensors")
    assert after["scales"] == before["scales"] and after["phase"] == before["phase"]
    assert after["layers.0.attn.q_proj.weight"] != before["layers.0.attn.q_proj.weight"]
