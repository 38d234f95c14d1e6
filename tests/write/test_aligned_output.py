"""safetensors outputs keep every untouched byte where the source has it: the header is padded to the source's
length, or grown by whole 4 KiB blocks, so a copy-on-write file system shares every block no changed byte is in;
shards with no change are cloned whole, never read; the report counts what was written, shared and read.

The oracles are the reference readers (safetensors, transformers), the bytes of the source, and the file
system's own count of free blocks (on an XFS image with reflink, where this machine can mount one).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from surgeon import reinit_checkpoint

from helpers.tiny import tiny_llama

BLOCK = 4096
ATTN = ("q_proj", "k_proj", "v_proj")


def layout(path):
    """(header length N, header JSON text, data start, {name: (begin, end) absolute}), read by hand."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + n]
    header = json.loads(text)
    spans = {
        k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }
    return n, text, 8 + n, spans


def attention(layers):
    return {f"model.layers.{i}.self_attn.{p}.weight" for i in layers for p in ATTN}


def check_reference_rules(path):
    """What the Rust crate (and so every safetensors reader) asks of the header: it starts with '{', is
    followed only by spaces, and N + 8 + the data is the file; the data start 8-byte aligned, as its writer
    makes it."""
    raw = path.read_bytes()
    n, text, start, spans = layout(path)
    json_part = text.rstrip(b" ")
    assert text.startswith(b"{") and json.loads(json_part) == json.loads(text)
    assert set(text[len(json_part) :]) <= {ord(" ")}
    assert start % 8 == 0
    assert max(end for _, end in spans.values()) == len(raw)
    load_file(path)  # the reference reader takes it


def test_untouched_bytes_keep_their_place_when_the_header_grows(llama_dir, tmp_path, cli, one_thread):
    """A header saved by transformers has no room for the record: it grows by a whole block, every untouched
    byte is the source's, one block further; the rest of the output is the old writer's apart from the padding,
    and the readers (safetensors, transformers) and verify take it."""
    from transformers import LlamaForCausalLM

    src = llama_dir / "model.safetensors"
    out = tmp_path / "out"
    report = reinit_checkpoint(llama_dir, output=out, layers="-1")
    dst = out / "model.safetensors"
    n0, text0, start0, spans0 = layout(src)
    n1, text1, start1, spans1 = layout(dst)
    shift = start1 - start0
    assert shift > 0 and shift % BLOCK == 0  # grown by whole blocks, not by the record's own length
    changed = attention([2])
    source, output = src.read_bytes(), dst.read_bytes()
    for name, (begin, end) in spans0.items():
        assert spans1[name] == (begin + shift, end + shift)
        if name not in changed:
            assert output[begin + shift : end + shift] == source[begin:end], name
    assert all(output[spans1[n][0] : spans1[n][1]] != source[spans0[n][0] : spans0[n][1]] for n in changed)
    # apart from the padding, what the previous writer made: the same compact JSON, and the same data section
    assert text1.rstrip(b" ") == json.dumps(json.loads(text1), separators=(",", ":"), ensure_ascii=False).encode()
    check_reference_rules(dst)
    assert report.io is not None and report.io.kernel > 0
    assert cli("verify", llama_dir, out).stdout.startswith(f"verified: {out} is {llama_dir}")
    model = LlamaForCausalLM.from_pretrained(out).eval()
    stored = load_file(dst)
    assert all(torch.equal(tensor, stored[name]) for name, tensor in model.state_dict().items())
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(8)[None]).logits).all()


def test_a_header_with_room_keeps_the_source_data_start(llama_dir, tmp_path, cli):
    """A second run on surgeon's output: the grown header has room for another record, so the data start
    (and every tensor's offset) is the source's, and the file differs from it only in the header and the
    changed tensors."""
    first, second = tmp_path / "first", tmp_path / "second"
    reinit_checkpoint(llama_dir, output=first, layers="-1")
    reinit_checkpoint(first, output=second, layers="0", seed=3)
    a, b = first / "model.safetensors", second / "model.safetensors"
    n0, _, start0, spans0 = layout(a)
    n1, text1, start1, spans1 = layout(b)
    assert (n1, start1) == (n0, start0) and spans1 == spans0
    before, after = a.read_bytes(), b.read_bytes()
    assert len(after) == len(before)
    changed = [spans0[name] for name in attention([0])]
    mask = bytearray(len(before))
    mask[:start0] = b"\1" * start0
    for begin, end in changed:
        mask[begin:end] = b"\1" * (end - begin)
    assert [i for i in range(len(before)) if before[i] != after[i] and not mask[i]] == []
    with safe_open(b, "pt") as f:
        assert [len(r["blocks"]) for r in json.loads(f.metadata()["surgeon"])] == [1, 1]
    check_reference_rules(b)
    assert cli("verify", first, second).stdout.startswith(f"verified: {second} is {first}")


def test_in_place_after_a_copy_finds_room_and_gives_the_copys_tensors(llama_dir, tmp_path):
    """The block a copy's header grew by is room for the next in-place run's record (before, the header was
    packed and an in-place run could not add its record); the in-place run and a copy give the same tensors."""
    first = tmp_path / "first"
    reinit_checkpoint(llama_dir, output=first, layers="-1")
    copy = tmp_path / "copy"
    reinit_checkpoint(first, output=copy, layers="0", seed=5)
    report = reinit_checkpoint(first, in_place=True, layers="0", seed=5)
    assert not any("record was not added" in n for n in report.notes)
    a, b = load_file(copy / "model.safetensors"), load_file(first / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with safe_open(first / "model.safetensors", "pt") as f, safe_open(copy / "model.safetensors", "pt") as g:
        assert f.metadata() == g.metadata()  # the same record history, in place or copied
    assert layout(first / "model.safetensors")[2] == layout(copy / "model.safetensors")[2]


def test_unchanged_shards_are_cloned_never_read_and_the_report_counts_it(shards, tmp_path):
    """Only the changed tensors are read into memory; every other byte of the weights is a kernel copy, and the
    bytes written are the output's rest (headers, changed tensors, card, carried files)."""
    out = tmp_path / "out"
    report = reinit_checkpoint(shards, output=out, layers="-1")
    changed = attention([7])
    weights = sorted(p for p in shards.glob("*.safetensors"))
    changed_bytes = 0
    headers = 0
    for path in weights:
        n, _, start, spans = layout(out / path.name)
        mine = [spans[k] for k in spans if k in changed]
        changed_bytes += sum(end - begin for begin, end in mine)
        if mine:
            headers += start
    files = [p for p in out.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    weights_total = sum((out / p.name).stat().st_size for p in weights)
    # the files carried over (tokenizer, config; the source's card, which surgeon's then replaces) are cloned
    # too; the index is copied, the card written
    carried = sum(p.stat().st_size for p in shards.iterdir() if p.suffix == ".json" and "index" not in p.name)
    carried += (shards / "README.md").stat().st_size
    io = report.io
    assert io is not None and report.bytes_written == total
    assert io.read == changed_bytes  # the q/k/v of the last layer: read once, for the math
    assert io.kernel == weights_total - changed_bytes - headers + carried
    assert io.written == total - io.kernel
    assert report.to_dict()["io"] == {"written": io.written, "kernel": io.kernel, "read": io.read}
    assert "shared or copied by the kernel" in report.render()


# --- on a copy-on-write file system -------------------------------------------------------------------


@pytest.fixture(scope="module")
def xfs(tmp_path_factory):
    """An XFS file system with reflink, on a loop device (skipped where this machine cannot make one)."""
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None:
        pytest.skip("needs root and mkfs.xfs (xfsprogs) to mount an XFS image with reflink")
    root = tmp_path_factory.mktemp("xfs")
    image, mount = root / "image", root / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(320 << 20)  # sparse: XFS's smallest
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], check=True, capture_output=True)
    done = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        image.unlink()
        pytest.skip(f"cannot mount a loop device here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
        image.unlink()


def free_bytes(path) -> int:
    os.sync()
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


@pytest.mark.parametrize("layers,changed_layers", [("-1", [3]), ("all", [0, 1, 2, 3])])
def test_on_xfs_an_output_allocates_only_the_changed_blocks(xfs, layers, changed_layers):
    """One safetensors file of ~9 MB: the output allocates the changed tensors' blocks (and one per tensor
    edge), the header's block and the model card's; never the untouched tensors, nor the carried config files."""
    src = xfs / f"src-{layers}"
    tiny_llama(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=2048).to(torch.bfloat16).save_pretrained(src)  # fmt: skip
    weights = src / "model.safetensors"
    _, _, _, spans = layout(weights)
    changed = attention(changed_layers)
    changed_blocks = sum(-(-(e - b) // BLOCK) + 1 for k, (b, e) in spans.items() if k in changed) * BLOCK
    out = xfs / f"out-{layers}"
    before = free_bytes(xfs)
    report = reinit_checkpoint(src, output=out, layers=layers)
    allocated = before - free_bytes(xfs)
    card = -(-(out / "README.md").stat().st_size // BLOCK) * BLOCK
    slack = 16 * BLOCK  # the folder's directory and inode blocks
    assert allocated <= changed_blocks + BLOCK + card + slack, (allocated, changed_blocks)
    assert allocated < weights.stat().st_size / 4  # far from a copy
    assert report.io is not None and report.io.kernel >= weights.stat().st_size - changed_blocks - 2 * BLOCK
    stored, source = load_file(out / "model.safetensors"), load_file(weights)
    assert all(torch.equal(stored[k], source[k]) != (k in changed) for k in source)
