"""`surgeon verify ORIGINAL OUTPUT` / `surgeon.verify`: outputs checked against the record surgeon wrote in them."""

from __future__ import annotations

import json
import shutil
import struct

import onnx
import pytest
import torch

import surgeon
from surgeon.formats.safetensors_header import encode_header, read_header, with_metadata

from helpers.cli import expect_cli_error
from helpers.onnx_graphs import tiny_attention
from helpers.tiny import tiny_llama


def _flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _data_offset(path, name) -> int:
    header = read_header(path)
    return header.data_start + header.entries[name]["data_offsets"][0]


def _rewrite_record(path, edit):
    """The same file with its surgeon record changed by ``edit(record)``."""
    header = read_header(path)
    meta = header.metadata
    records = json.loads(meta["surgeon"])
    edit(records[-1])
    raw = encode_header(with_metadata(header.entries, {**meta, "surgeon": json.dumps(records)}))
    data = path.read_bytes()[header.data_start :]
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.fixture
def llama_out(tmp_path, llama_dir, cli):
    out = tmp_path / "out"
    cli("reinit", llama_dir, "--layers", "1-", "--heads", "0-3", "--seed", "5", "-o", out)
    return llama_dir, out


def test_verifies_a_conditioned_output_byte_for_byte(cli, llama_out, tmp_path):
    from surgeon.audit.layout import (
        verify_layout,  # the --verify-layout module: importing it must not hide surgeon.verify()
    )

    assert callable(surgeon.verify) and callable(verify_layout)
    src, out = llama_out
    result = cli("verify", src, out)
    assert result.stdout.startswith(
        f"verified: {out} is {src} with 2 attention blocks re-initialized as recorded (mode conditioned, targets q,k,v, seed 5)"
    )
    assert "re-derived byte for byte" in result.stdout and result.stdout.count("\n") == 1
    v = surgeon.verify(src, out)
    assert sorted(v.changed) == sorted(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (1, 2) for p in "qkv")
    assert v.identical == len(surgeon.hub.read.open_model(src).primary.tensors) - 6


def test_a_changed_byte_anywhere_is_found(cli, llama_out, tmp_path):
    src, out = llama_out
    file = out / "model.safetensors"
    good = file.read_bytes()
    # outside the selection: layer 0's query is not re-initialized
    _flip_byte(file, _data_offset(file, "model.layers.0.self_attn.q_proj.weight") + 100)
    msg = expect_cli_error(
        cli,
        tmp_path / "out",
        "verify",
        src,
        out,
        match="tensor 'model.layers.0.self_attn.q_proj.weight' is not in the recorded selection, but its bytes differ",
    )
    assert cli("verify", src, out, ok=False).exit_code == 3
    # inside the selection: one element of a re-initialized head
    file.write_bytes(good)
    _flip_byte(file, _data_offset(file, "model.layers.2.self_attn.k_proj.weight") + 4)
    msg = expect_cli_error(
        cli,
        tmp_path / "out",
        "verify",
        src,
        out,
        match="tensor 'model.layers.2.self_attn.k_proj.weight': element [0, 1] is",
    )
    assert "the recipe re-derived from the record's seed gives other values" in msg
    # a record that lies about the seed
    file.write_bytes(good)
    _rewrite_record(file, lambda r: r["options"].update(seed=6))
    expect_cli_error(
        cli,
        tmp_path / "out",
        "verify",
        src,
        out,
        match="the recipe re-derived from the record's seed gives other values",
    )
    # a record that lies about the selection
    file.write_bytes(good)
    _rewrite_record(file, lambda r: r["options"].update(layers="2-"))
    expect_cli_error(
        cli,
        tmp_path / "out",
        "verify",
        src,
        out,
        match="its record lists re-initialized blocks that the recorded options do not select",
    )
    # the wrong original: same architecture, other weights
    other = tmp_path / "other"
    model = tiny_llama()
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    model.save_pretrained(other)
    file.write_bytes(good)
    with pytest.raises(
        surgeon.VerificationError,
        match="model.embed_tokens.weight' is not in the recorded selection, but its bytes differ",
    ):
        surgeon.verify(other, out)


def test_polar_output_is_checked_within_dtype_rounding(cli, tmp_path):
    src = tmp_path / "llama"
    model = tiny_llama()
    model.to(torch.bfloat16).save_pretrained(src)
    out = tmp_path / "polar"
    cli("reinit", src, "--mode", "polar", "--layers", "0", "-o", out)
    assert "semi-orthogonal/polar within the dtype's rounding" in cli("verify", src, out).stdout
    file = out / "model.safetensors"
    _flip_byte(file, _data_offset(file, "model.layers.0.self_attn.q_proj.weight") + 1)  # a high byte of a bf16: far off
    msg = expect_cli_error(cli, out, "verify", src, out, match="polar conditioning of the original gives")
    assert "beyond torch.bfloat16 rounding" in msg


def test_torch_folder_output_carries_its_record_in_the_card(cli, tmp_path):
    src = tmp_path / "bin"
    model = tiny_llama()
    model.config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    out = tmp_path / "bin-out"
    cli("reinit", src, "--targets", "q,k", "--layers", "0", "-o", out)
    assert "<!-- surgeon-record {" in (out / "README.md").read_text()
    assert cli("verify", src, out).stdout.startswith("verified:")
    # a single .bin file output has no record anywhere: refused, not guessed
    cli("reinit", src / "pytorch_model.bin", "-o", tmp_path / "one.bin")
    expect_cli_error(
        cli,
        tmp_path,
        "verify",
        src / "pytorch_model.bin",
        tmp_path / "one.bin",
        match="holds no surgeon record in the file (PyTorch files have no metadata slot) (a folder output carries it in its README.md",
    )


def test_onnx_output(cli, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    onnx.save_model(tiny_attention(layers=2), str(folder / "model.onnx"))
    cli("reinit", folder / "model.onnx", "--layers", "1", "-o", tmp_path / "out.onnx")
    assert cli("verify", folder / "model.onnx", tmp_path / "out.onnx").stdout.startswith("verified:")


def test_no_record_to_verify_against(cli, tmp_path, llama_dir):
    copy = tmp_path / "copy"
    shutil.copytree(llama_dir, copy)
    expect_cli_error(
        cli, tmp_path, "verify", llama_dir, copy, match="holds no surgeon record in its safetensors metadata"
    )
    assert cli("verify", llama_dir, copy, ok=False).exit_code == 1
    expect_cli_error(cli, tmp_path, "verify", llama_dir, tmp_path / "missing", match="no such file or folder")
