"""No number or size in a file sets surgeon's memory, and input faults are one line (issue 27, items 3 and 5).

Every file surgeon parses from an input has a size cap (checked before it is read) and a nesting cap (checked
before json.loads recurses); numbers from a config are checked against the checkpoint's own tensors before
anything is allocated from them. Memory is asserted as bytes allocated: Python's by tracemalloc, torch's by
counting the storage of every tensor its dispatcher creates (tracemalloc does not see those).
"""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tracemalloc
import unittest.mock
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from surgeon.files import bounded
from surgeon.files.bounded import MAX_DEPTH, too_deep

from helpers.cli import expect_cli_error
from helpers.paths import ROOT
from helpers.tiny import tiny_llama

MiB = 1 << 20


def one_line_error(result, match: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1, result.stderr + result.output
    assert len(lines) == 1 and lines[0].startswith("surgeon: error: "), result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr + result.output
    assert match in lines[0], lines[0]
    return lines[0]


def python_peak(run):
    """``run()``'s result and the peak of Python allocations while it ran (bytes)."""
    tracemalloc.start()
    try:
        result = run()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class TorchAllocations(TorchDispatchMode):
    """The bytes of every tensor storage that torch ops create off the meta device (``largest``, ``total``)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                size = t.untyped_storage().nbytes()
                self.largest, self.total = max(self.largest, size), self.total + size
        return out


@pytest.fixture
def llama64(tmp_path) -> Path:
    """A tiny Llama whose embedding has 64 rows, with token ids for --jacobian --inputs."""
    path = tmp_path / "llama"
    tiny_llama(vocab_size=64).save_pretrained(path)
    torch.save(torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]]), tmp_path / "ids.pt")
    return path


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


# --- size caps --------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "reinit"])
def test_an_oversized_config_is_refused_before_it_is_read(cli, llama_dir, tmp_path, command):
    config = llama_dir / "config.json"
    with open(config, "w") as f:  # sparse: 768 MiB that cost no disk
        f.write("{")
        f.truncate(768 * MiB)
    out = tmp_path / "out"
    args = ["inspect", llama_dir] if command == "inspect" else ["reinit", llama_dir, "-o", out]
    before = {p.name: p.stat().st_mtime_ns for p in llama_dir.iterdir()}
    result, peak = python_peak(lambda: cli(*args, ok=False))
    assert peak < 32 * MiB, peak  # the file was never read
    one_line_error(result, f"config {config} is {768 * MiB} bytes: too large (surgeon reads at most 16 MiB of it)")
    assert {p.name: p.stat().st_mtime_ns for p in llama_dir.iterdir()} == before and not out.exists()


def test_a_small_file_costs_its_size_not_the_cap(llama_dir):
    config, peak = python_peak(lambda: bounded.read_json(llama_dir / "config.json"))
    assert config == json.loads((llama_dir / "config.json").read_text())
    assert peak < MiB, peak  # the cap is 16 MiB: reading must not ask the kernel for that much


def test_an_oversized_index_is_refused_before_it_is_read(cli, tmp_path):
    shards = tmp_path / "sharded"
    tiny_llama().save_pretrained(shards, max_shard_size="100KB")
    index = shards / "model.safetensors.index.json"
    assert index.is_file()
    with open(index, "w") as f:
        f.write('{"weight_map": {')
        f.truncate(80 * MiB)
    result, peak = python_peak(lambda: cli("inspect", index, ok=False))
    assert peak < 32 * MiB, peak
    one_line_error(result, f"index {index} is {80 * MiB} bytes: too large (surgeon reads at most 64 MiB of it)")


@pytest.mark.parametrize(
    "args, said",
    [
        (("inspect", "{model}", "--config", "{fifo}"), "cannot read config {fifo}: it is a FIFO, not a regular file"),
        (
            ("inspect", "{model}", "--layout", "{fifo}"),
            "cannot read layout file {fifo}: it is a FIFO, not a regular file",
        ),
        (("inspect", "{model}", "--emit-layout", "{fifo}"), "--emit-layout {fifo} is a FIFO"),
        (("inspect", "{model}", "--jacobian", "--inputs", "{fifo}"), "cannot read inputs {fifo}: it is a FIFO"),
        (("inspect", "{fifo}"), "model {fifo} is a FIFO"),
        (("reinit", "{model}", "-o", "{fifo}", "--overwrite"), "-o/--output {fifo} is a FIFO"),
        (("verify", "{model}", "{fifo}"), "{fifo} is a FIFO"),
    ],
    ids=["config", "layout", "emit-layout", "inputs", "model", "output", "verify-output"],
)
def test_a_fifo_for_any_path_is_refused_without_waiting_for_a_writer(llama_dir, tmp_path, args, said):
    """Every path a user names goes through one non-blocking opener (or, where it may be a folder, one check of
    its kind): a FIFO is refused in one line, never opened to wait for a writer, never replaced."""
    fifo = tmp_path / "named.json"
    os.mkfifo(fifo)
    before = sorted(p.name for p in tmp_path.iterdir())
    run = subprocess.run(
        [sys.executable, "-m", "surgeon", *(a.format(model=llama_dir, fifo=fifo) for a in args)],
        capture_output=True,
        text=True,
        timeout=120,  # a guard against a hang only: opening a FIFO to read blocks until a writer comes
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert lines[0].startswith("surgeon: error: ") and said.format(fifo=fifo) in lines[0], lines[0]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("command", ["reinit", "push"])
def test_an_oversized_model_card_is_refused(cli, llama_dir, tmp_path, monkeypatch, command):
    card = llama_dir / "README.md"
    with open(card, "w") as f:
        f.write("---\nlicense: mit\n---\n")
        f.truncate(256 * MiB)
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 34)  # push checks the card before it talks to any Hub
    args = ["reinit", llama_dir, "-o", tmp_path / "out"] if command == "reinit" else ["push", llama_dir, "me/model"]
    result, peak = python_peak(lambda: cli(*args, ok=False))
    assert peak < 64 * MiB, peak
    one_line_error(result, f"model card {card} is {256 * MiB} bytes: too large (surgeon reads at most 16 MiB of it)")
    assert not (tmp_path / "out").exists()


def test_the_model_card_is_read_before_anything_is_written(cli, llama_dir, tmp_path):
    """Its cap refuses before the output is staged: where staging would fail (the output's parent is a file),
    the card's refusal is what the user sees."""
    with open(llama_dir / "README.md", "w") as f:
        f.write("---\nlicense: mit\n---\n")
        f.truncate(32 * MiB)
    (tmp_path / "a-file").write_text("")
    result = cli("reinit", llama_dir, "-o", tmp_path / "a-file" / "out", ok=False)
    one_line_error(result, "bytes: too large (surgeon reads at most 16 MiB of it)")


# --- config numbers against the tensors ---------------------------------------------------------------


@pytest.mark.parametrize("vocab", [5_000_000, 10**8])
@pytest.mark.parametrize("flag", ["--verify-layout", "--jacobian"])
def test_an_absurd_vocab_is_refused_before_anything_is_allocated(cli, llama64, vocab, flag):
    edit_config(llama64, vocab_size=vocab)
    extra = ["--inputs", llama64.parent / "ids.pt"] if flag == "--jacobian" else []
    with TorchAllocations() as torch_bytes:
        result, peak = python_peak(lambda: cli("inspect", llama64, flag, *extra, ok=False))
    # the embedding alone would be vocab x 64 float32 (1.28 GB for 5M rows); the checkpoint is 0.4 MB
    assert torch_bytes.largest < MiB and torch_bytes.total < 8 * MiB, (torch_bytes.largest, torch_bytes.total)
    assert peak < 256 * MiB, peak  # Python's own: transformers' import and the meta model
    line = one_line_error(
        result, f"config.json says vocab_size={vocab}, but the checkpoint's model.embed_tokens.weight"
    )
    assert "is [64, 64]" in line and f"needs [{vocab}, 64]" in line


@pytest.mark.parametrize("flag", ["--verify-layout", "--jacobian"])
def test_a_config_that_fits_the_tensors_still_builds(cli, llama64, flag):
    extra = ["--inputs", llama64.parent / "ids.pt"] if flag == "--jacobian" else []
    with TorchAllocations() as torch_bytes:
        result = cli("inspect", llama64, flag, *extra, "--json")
    notes = json.loads(result.stdout)["notes"]
    if flag == "--verify-layout":
        assert any(n.startswith("layout verified: the 3 attention blocks") for n in notes), notes
    else:
        assert len(json.loads(result.stdout)["jacobian"]["rows"]) == 3 * 8  # 3 layers x 8 heads, one input
    # the counter sees the real model: at least the checkpoint's own float32 weights
    weights = sum(t.numel() * 4 for t in load_file(llama64 / "model.safetensors").values())
    assert torch_bytes.total >= weights


def test_tensors_the_checkpoint_lacks_are_bounded_too(cli, llama64):
    """Embeddings under names the architecture does not use are not compared by shape: their bytes count."""
    weights = load_file(llama64 / "model.safetensors")
    weights["embedding.weight"] = weights.pop("model.embed_tokens.weight")
    weights["output.weight"] = weights.pop("lm_head.weight")
    save_file(weights, llama64 / "model.safetensors", metadata={"format": "pt"})
    edit_config(llama64, vocab_size=5_000_000)
    with TorchAllocations() as torch_bytes:
        result = cli("inspect", llama64, "--verify-layout", ok=False)
    assert torch_bytes.largest < MiB, torch_bytes.largest
    one_line_error(
        result, "config.json says vocab_size=5000000, and the architecture built from config.json would hold"
    )
    assert "(the largest model.embed_tokens.weight [5000000, 64])" in result.stderr


def test_a_layer_count_no_tensor_supports_names_the_field(cli, llama64):
    edit_config(llama64, num_hidden_layers=10**9)
    with TorchAllocations() as torch_bytes:
        result, peak = python_peak(lambda: cli("inspect", llama64, "--verify-layout", ok=False))
    assert peak < 64 * MiB and torch_bytes.total < MiB, (peak, torch_bytes.total)
    one_line_error(result, "config.json says num_hidden_layers=1000000000, but the checkpoint has 30 tensors")


def test_a_count_that_makes_millions_of_modules_is_refused(cli, llama64):
    """switch_transformers keeps its experts as modules: num_experts from the config sets how many."""
    (llama64 / "config.json").write_text(
        json.dumps(
            {
                "model_type": "switch_transformers",
                "architectures": ["SwitchTransformersModel"],
                "num_experts": 10**6,
                "num_layers": 2,
                "num_decoder_layers": 2,
                "num_sparse_encoder_layers": 2,
                "num_sparse_decoder_layers": 2,
                "vocab_size": 64,
            }
        )
    )
    args = ("inspect", llama64, "--verify-layout", "--num-heads", 8, "--num-kv-heads", 2)
    result, peak = python_peak(lambda: cli(*args, ok=False))
    assert peak < 256 * MiB, peak  # a million experts as modules: gigabytes
    one_line_error(result, "SwitchTransformersModel as configured would have more than 6016 modules")
    assert "(num_experts=1000000 is more than any tensor supports)" in result.stderr


def test_a_head_count_no_tensor_supports_is_refused_in_bounded_memory(cli, llama_dir):
    edit_config(llama_dir, num_attention_heads=10**7)
    result, peak = python_peak(lambda: cli("inspect", llama_dir, ok=False))
    assert peak < 64 * MiB, peak  # a slot listed per head: over a gigabyte
    one_line_error(result, "do not fit 10000000 heads from config.json")


def test_a_probe_image_is_capped(cli, tmp_path):
    from helpers.families import FAMILIES

    FAMILIES["swin"].make().save_pretrained(tmp_path / "swin")
    edit_config(tmp_path / "swin", image_size=100_000)  # no Swin tensor holds it: only the probe input would
    result = cli("inspect", tmp_path / "swin", "--verify-layout", ok=False)
    one_line_error(result, "its config's image_size is 100000, where surgeon probes images of 1 to 4096 pixels a side")


# --- nesting ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "deep", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000, b"[" * 100_000]
)
def test_a_deeply_nested_config_is_one_line(cli, llama_dir, deep):
    (llama_dir / "config.json").write_bytes(deep)
    result = cli("inspect", llama_dir, ok=False)
    one_line_error(result, "config.json is not valid JSON (nested too deeply): it may nest 64 levels at most")


def test_nesting_up_to_the_cap_is_read(cli, llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    for depth, ok in ((MAX_DEPTH, True), (MAX_DEPTH + 1, False)):
        value: object = 1
        for _ in range(depth - 1):  # the config object itself is the first level
            value = [value]
        (llama_dir / "config.json").write_text(json.dumps({**config, "surgeon_test": value}))
        result = cli("inspect", llama_dir, ok=ok)
        if not ok:
            one_line_error(result, "nested too deeply")


def test_a_deeply_nested_record_in_safetensors_metadata(cli, llama_dir, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    weights = llama_dir / "model.safetensors"
    save_file(load_file(weights), weights, metadata={"format": "pt", "surgeon": deep})
    result = cli("verify", llama_dir, llama_dir, ok=False)
    one_line_error(result, "surgeon's record is not valid JSON (nested too deeply): it may nest 64 levels at most")
    # reinit keeps a record it cannot read as the text it is, before its own
    cli("reinit", weights, "--layers", "1", "-o", tmp_path / "out.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        history = json.loads(f.metadata()["surgeon"])
    assert history[0] == deep and history[1]["tool"] == "surgeon"


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


_text = st.text(alphabet='[]{}"\\ax,', max_size=4)
_json = st.recursive(
    st.none() | st.integers() | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=200,
)


@settings(max_examples=300, deadline=None)
@given(value=_json, limit=st.integers(0, 12), chunk=st.sampled_from([1, 3, 7, 1 << 20]), numpy=st.booleans())
def test_nesting_scan_agrees_with_the_parsed_depth(value, limit, chunk, numpy):
    """The scan's verdict is the depth json.loads finds, brackets and escapes inside strings included, in
    both of its paths (the numpy one chunk by chunk)."""
    data = json.dumps(value).encode()
    with unittest.mock.patch.object(bounded, "_NUMPY_FROM", chunk if numpy else 1 << 30):
        assert too_deep(data, limit) == (_depth(value) > limit), (data, limit)


# --- library configs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [3, None, [], ["CrossAttnDownBlock2D", 1], "CrossAttnDownBlock2D"])
def test_diffusers_down_block_types_of_the_wrong_type(cli, tmp_path, value):
    from helpers.diffusers_models import unet  # the tiny UNet those tests judge through its own forward

    unet().save_pretrained(tmp_path / "unet")
    edit_config(tmp_path / "unet", down_block_types=value)
    expect_cli_error(
        cli, tmp_path, "inspect", tmp_path / "unet", match=f"the config's down_block_types is {json.dumps(value)}"
    )


@pytest.mark.parametrize("model_type", [["llama"], {"a": 1}, 3])
def test_a_model_type_that_is_not_a_name_is_ignored(cli, llama_dir, model_type):
    edit_config(llama_dir, model_type=model_type)
    blocks = json.loads(cli("inspect", llama_dir, "--json").stdout)["blocks"]
    assert [(b["module"], b["heads"], b["kv_heads"]) for b in blocks] == [
        (f"model.layers.{i}.self_attn", 8, 2) for i in range(3)
    ]


# --- --jacobian --inputs --------------------------------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_jacobian_inputs_that_are_not_token_ids(cli, llama64, tmp_path):
    marker = tmp_path / "payload-ran"
    torch.save({"ids": _Payload(marker)}, tmp_path / "pickle.pt")
    (tmp_path / "junk.pt").write_bytes(b"\x80\x02" + os.urandom(4096))
    torch.save({"ids": torch.tensor([1, 2])}, tmp_path / "dict.pt")
    must = "a .pt file must hold a 1-D or 2-D integer tensor of token ids, saved with torch.save"
    for name in ("pickle.pt", "junk.pt"):
        one_line_error(
            cli("inspect", llama64, "--jacobian", "--inputs", tmp_path / name, ok=False),
            f"--inputs {tmp_path / name} is not a file torch.load reads with weights_only=True",
        )
    assert not marker.exists()
    one_line_error(cli("inspect", llama64, "--jacobian", "--inputs", tmp_path / "dict.pt", ok=False), must)
    with open(tmp_path / "huge.pt", "wb") as f:
        f.truncate(1 << 30)
    result, peak = python_peak(
        lambda: cli("inspect", llama64, "--jacobian", "--inputs", tmp_path / "huge.pt", ok=False)
    )
    assert peak < 32 * MiB, peak
    one_line_error(
        result, f"inputs {tmp_path / 'huge.pt'} is {1 << 30} bytes: too large (surgeon reads at most 64 MiB of it)"
    )


def test_jacobian_inputs_that_unpack_past_the_cap(cli, llama64, tmp_path):
    """torch.load reads deflated zip members: 400 KiB on disk can hold a 400 MB tensor."""
    saved = io.BytesIO()
    torch.save(torch.zeros(100 * MiB // 4), saved)
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(tmp_path / "bomb.pt", "w", zipfile.ZIP_DEFLATED) as out:
        for member in src.infolist():
            out.writestr(member.filename, src.read(member.filename))
    assert (tmp_path / "bomb.pt").stat().st_size < MiB
    result = cli("inspect", llama64, "--jacobian", "--inputs", tmp_path / "bomb.pt", ok=False)
    one_line_error(result, f"--inputs {tmp_path / 'bomb.pt'} is a zip that unpacks past 64 MiB")


def test_jacobian_token_ids_outside_the_embedding(cli, llama64, tmp_path):
    torch.save(torch.tensor([[1, 2, 300, 4]]), tmp_path / "far.pt")
    with TorchAllocations() as torch_bytes:
        result = cli("inspect", llama64, "--jacobian", "--inputs", tmp_path / "far.pt", ok=False)
    one_line_error(result, "holds token id 300, and the model's embedding has ids 0 to 63")
    assert torch_bytes.total > 0  # the model was built: the ids are checked against its own embedding
