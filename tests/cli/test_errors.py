"""Every bad input: one line on stderr, a non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from helpers.cli import expect_cli_error as expect_error
from helpers.tiny import tiny_llama


def test_no_attention_found(cli, tmp_path):
    save_file({"mlp.fc1.weight": torch.randn(8, 4), "mlp.fc2.weight": torch.randn(4, 8)}, tmp_path / "mlp.safetensors")
    msg = expect_error(cli, tmp_path, "reinit", tmp_path / "mlp.safetensors", match="no attention found")
    assert "none of its 2 tensors" in msg and "mlp.fc1.weight" in msg
    assert "`surgeon inspect --list-names` lists them" in msg and "query_key_value" not in msg  # not the 40 names
    assert len(msg.replace(str(tmp_path), "")) < 250, msg  # was ~950 characters with the 40 names
    listed = cli("inspect", "--list-names").stdout.splitlines()
    assert "q_proj/k_proj/v_proj" in listed and "query_key_value" in listed and len(listed) > 20
    expect_error(cli, tmp_path, "inspect", tmp_path / "mlp.safetensors", match="no attention found")


def test_no_attention_found_names_the_near_miss(cli, tmp_path):
    save_file(
        {"layers.0.attn.q_proj.weight": torch.randn(8, 8), "layers.0.attn.k_proj.weight": torch.randn(8, 8)},
        tmp_path / "m.safetensors",
    )
    expect_error(
        cli,
        tmp_path,
        "inspect",
        tmp_path / "m.safetensors",
        "--num-heads",
        2,
        match="has q_proj.weight, k_proj.weight but no v_proj.weight",
    )


@pytest.mark.parametrize(
    "args,match",
    [
        (["--layers", "3"], "layer 3 is out of range: model.layers has layers 0-2"),
        (["--layers", "0-1,x"], "cannot read layer spec item 'x'"),
        (["--heads", "8"], "head 8 is out of range"),
        (["--heads", "0-2"], "splits key/value head 0"),
        (["--targets", "q,o"], "unknown target 'o'"),
        (["--attention", "cross"], "no cross-attention blocks"),
        (["--stack", "encoder"], "no stack named 'encoder'"),
        (["--strength", "0"], "--strength 0 changes nothing"),
        (["--mode", "polar", "--strength", "1.5"], "--strength must be in (0, 1]"),
        (["--device", "cuda:7"], "--device cuda:7"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--device", "meta"], "unsupported device"),
        (["--in-place", "-o", "x"], "either -o/--output or --in-place"),
    ],
)
def test_bad_selection_and_options(cli, tmp_path, args, match):
    src = tmp_path / "llama"
    tiny_llama().save_pretrained(src)
    if args[:2] == ["--device", "cuda:7"] and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    expect_error(cli, tmp_path, "reinit", src, *args, match=match)


_NO_MODEL_NEEDED = [
    (["--layers", "0-x"], "cannot read layer spec item '0-x' in '0-x'"),
    (["--layers", "5-3"], "layer range '5-3' is empty"),
    (["--heads", "0,y"], "cannot read head spec item 'y'"),
    (["--targets", "qk"], "unknown target 'qk': write q,k, comma-separated"),
    (["--strength", "0"], "--strength 0 changes nothing"),
    (["--strength", "0.2:0"], "--strength 0.2:0 changes nothing"),
    (["--strength", "0.2-1"], "cannot read --strength 0.2-1"),
    (["--mode", "polar", "--strength", "1.5"], "--strength must be in (0, 1]"),
    (["--mode", "redraw", "--std", "0"], "--std must be a finite number above 0"),
    (["--gain", "2", "--keep-scale"], "--gain and --keep-scale both set the scale"),
]


@pytest.mark.parametrize("args,match", _NO_MODEL_NEEDED)
def test_an_option_no_model_can_use_is_refused_before_the_model_is_opened(cli, tmp_path, args, match):
    """The options are read and checked when made: a path that does not exist gets the option's error, not a
    not-found error (nothing was opened)."""
    expect_error(cli, tmp_path, "reinit", tmp_path / "missing", *args, match=match)


def test_the_api_refuses_a_malformed_selection_before_the_model_is_opened(tmp_path):
    import surgeon

    with pytest.raises(surgeon.SelectionError, match="cannot read layer spec item '0-x'"):
        surgeon.reinit_checkpoint(tmp_path / "missing", layers="0-x")


def test_a_malformed_selection_sends_no_request_to_the_hub(hub, tmp_path):
    """``surgeon reinit ORG/NAME --layers 0-x``: one line, and the Hub is never asked (nothing fetched)."""
    from helpers.hub import Surgeon

    run = Surgeon(tmp_path, hub.url)("reinit", "org/M", "--layers", "0-x", ok=False)
    assert run.error == (
        "surgeon: error: cannot read layer spec item '0-x' in '0-x': use N, A-B, A- or all, e.g. '0-3,7' "
        "(negative counts from the end)"
    )
    assert hub.requests == []
    assert not (tmp_path / "hf-home").exists()


def test_output_exists(cli, tmp_path):
    src = tmp_path / "llama"
    tiny_llama().save_pretrained(src)
    (tmp_path / "llama-reinit").mkdir()
    expect_error(cli, tmp_path, "reinit", src, match="already exists; pass --overwrite")
    expect_error(cli, tmp_path, "reinit", src, "-o", src, match="is the input")
    expect_error(cli, tmp_path, "reinit", src, "-o", src / "inside", match="inside the input folder")


def test_quantized_and_integer_projections(cli, tmp_path):
    save_file(
        {
            "layers.0.attn.q_proj.qweight": torch.zeros(8, 32, dtype=torch.int32),
            "layers.0.attn.q_proj.scales": torch.ones(1, 64).half(),
            "layers.0.attn.k_proj.weight": torch.randn(64, 64),
            "layers.0.attn.v_proj.weight": torch.randn(64, 64),
        },
        tmp_path / "gptq.safetensors",
    )
    expect_error(
        cli, tmp_path, "inspect", tmp_path / "gptq.safetensors", "--num-heads", 4, match="is quantized (qweight I32)"
    )
    save_file(
        {f"layers.0.attn.{p}_proj.weight": torch.zeros(64, 64, dtype=torch.int8) for p in "qkv"},
        tmp_path / "int8.safetensors",
    )
    expect_error(
        cli, tmp_path, "reinit", tmp_path / "int8.safetensors", "--num-heads", 4, match="is I8, not a float matrix"
    )


def test_heads_unknown_without_config(cli, tmp_path):
    save_file({f"layers.0.attn.{p}_proj.weight": torch.randn(64, 64) for p in "qkv"}, tmp_path / "m.safetensors")
    expect_error(cli, tmp_path, "reinit", tmp_path / "m.safetensors", match="pass --num-heads N")
    msg = expect_error(
        cli, tmp_path, "reinit", tmp_path / "m.safetensors", "--num-heads", 5, match="64 is not divisible by 5"
    )
    assert msg.startswith("surgeon: error: --num-heads 5 cannot split") and "pass a --num-heads that divides 64" in msg
    assert "pass --num-heads N" not in msg


def test_head_counts_that_do_not_divide_name_the_flag_at_fault(cli, tmp_path):
    save_file({f"layers.0.attn.{p}_proj.weight": torch.randn(384, 384) for p in "qkv"}, tmp_path / "m.safetensors")
    m = tmp_path / "m.safetensors"
    msg = expect_error(cli, tmp_path, "reinit", m, "--num-heads", 5, match="384 is not divisible by 5")
    assert "(3, 4 or 6)" in msg  # divisors of 384, the nearest to 5
    msg = expect_error(
        cli, tmp_path, "reinit", m, "--num-heads", 8, "--num-kv-heads", 3, match="8 is not divisible by 3"
    )
    assert msg.startswith("surgeon: error: --num-kv-heads 3 does not divide the 8 query heads")
    assert "pass a --num-kv-heads that divides 8 (1, 2 or 4)" in msg


def test_missing_shard_and_index_entry(cli, tmp_path):
    src = tmp_path / "sharded"
    tiny_llama().save_pretrained(src, max_shard_size="40KB")
    shards = sorted(src.glob("*.safetensors"))
    broken = tmp_path / "missing"
    shutil.copytree(src, broken)
    (broken / shards[1].name).unlink()
    expect_error(cli, tmp_path, "reinit", broken, match=f"missing shard {shards[1].name}")
    wrong = tmp_path / "wrong"
    shutil.copytree(src, wrong)
    index = json.loads((wrong / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.ghost.weight"] = shards[0].name
    (wrong / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(cli, tmp_path, "reinit", wrong, match="says tensor 'model.ghost.weight' is in")


def test_corrupt_and_truncated_safetensors(cli, tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({f"layers.0.attn.{p}_proj.weight": torch.randn(64, 64) for p in "qkv"}, good)
    data = good.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    # (a header of n '{' is refused as nested too deeply: tests/open/test_input_caps.py)
    (tmp_path / "garbage.safetensors").write_bytes(data[:8] + b"{{{" + b"!" * (n - 3) + data[8 + n :])
    expect_error(
        cli,
        tmp_path,
        "reinit",
        tmp_path / "garbage.safetensors",
        "--num-heads",
        4,
        match="corrupt safetensors header (not valid JSON)",
    )
    (tmp_path / "short.safetensors").write_bytes(data[:-100])
    expect_error(cli, tmp_path, "reinit", tmp_path / "short.safetensors", "--num-heads", 4, match="is truncated")
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02")
    expect_error(cli, tmp_path, "inspect", tmp_path / "tiny.safetensors", match="only 2 bytes long")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    expect_error(
        cli, tmp_path, "inspect", tmp_path / "huge.safetensors", match="corrupt or truncated safetensors header"
    )


class NotAllowed:
    """A pickle that would need code execution to load."""


def test_unsafe_and_unreadable_pickles(cli, tmp_path):
    torch.save({"model": NotAllowed()}, tmp_path / "evil.pt")
    expect_error(cli, tmp_path, "reinit", tmp_path / "evil.pt", match="cannot be loaded safely")
    good = tmp_path / "good.bin"
    torch.save(tiny_llama().state_dict(), good)
    (tmp_path / "cut.bin").write_bytes(good.read_bytes()[:2000])
    expect_error(cli, tmp_path, "reinit", tmp_path / "cut.bin", match="is not a readable PyTorch checkpoint")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    expect_error(cli, tmp_path, "inspect", tmp_path / "list.pt", match="holds a list, not a state dict")


def test_missing_input_and_unknown_type(cli, tmp_path):
    expect_error(cli, tmp_path, "inspect", tmp_path / "nope.safetensors", match="no such file or folder")
    (tmp_path / "model.h5").write_bytes(b"x")
    expect_error(cli, tmp_path, "inspect", tmp_path / "model.h5", match="unknown checkpoint type .h5")
    (tmp_path / "empty").mkdir()
    expect_error(cli, tmp_path, "inspect", tmp_path / "empty", match="no weights in folder")


def test_usage_errors_exit_2(cli, tmp_path):
    result = cli("reinit", ok=False)
    assert (
        result.exit_code == 2
        and result.stderr == "surgeon: error: missing argument 'MODEL' (see surgeon reinit --help)\n"
    )


def test_index_cannot_point_outside_the_checkpoint(cli, tmp_path):
    repo = tmp_path / "repo"
    tiny_llama().save_pretrained(repo, max_shard_size="40KB")
    index_path = repo / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = tmp_path / "victim.safetensors"
    first = sorted(repo.glob("*.safetensors"))[0]
    shutil.move(first, victim)
    index["weight_map"] = {
        k: ("../victim.safetensors" if v == first.name else v) for k, v in index["weight_map"].items()
    }
    index_path.write_text(json.dumps(index))
    expect_error(cli, tmp_path, "reinit", repo, "-o", tmp_path / "out", match="which is not a file beside the index")


def test_output_that_holds_the_input_is_refused(cli, tmp_path):
    src = tmp_path / "models" / "llama"
    tiny_llama().save_pretrained(src)
    expect_error(cli, tmp_path, "reinit", src, "-o", tmp_path / "models", "--overwrite", match="holds the input")


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [4, 4], "data_offsets": ["0", "64"]},
        {"dtype": "F32", "shape": [4, 4], "data_offsets": [None, 64]},
        {"dtype": "F32", "shape": [-1, 4], "data_offsets": [16, 0]},
        {"dtype": "F32", "shape": [4, 4]},
        "not an object",
    ],
)
def test_malformed_header_entries(cli, tmp_path, entry):
    header = json.dumps({"x.weight": entry}).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    expect_error(
        cli, tmp_path, "inspect", tmp_path / "bad.safetensors", match="corrupt header entry for tensor 'x.weight'"
    )


def test_errors_live_in_one_module_and_carry_fields(tmp_path):
    """Every public error is defined in surgeon.errors; options are named by field, spelt by who shows them."""
    import surgeon
    from surgeon.cli.commands import cli_spelling
    from surgeon.errors import SurgeonError

    errors = [getattr(surgeon, n) for n in surgeon.__all__ if n.endswith("Error")]
    assert errors and all(e.__module__ == "surgeon.errors" and issubclass(e, SurgeonError) for e in errors)
    with pytest.raises(surgeon.OptionError) as err:  # a Python caller is told about the keyword, not --gain
        surgeon.ReinitOptions(mode="polar", gain=0.5)
    assert str(err.value) == "gain applies to mode=conditioned only"
    assert err.value.options == ("gain", "mode") and err.value.option == "gain"
    assert err.value.describe(cli_spelling) == "--gain applies to --mode conditioned only"
    exc = surgeon.HubError("boom")
    exc.context = "wrote out, but the push failed: "
    assert str(exc) == "wrote out, but the push failed: boom" and exc.args == ("boom",)


def test_every_surgeon_error_class_is_defined_in_errors():
    """Every subclass of SurgeonError, public or raised inside one stage, is a class of surgeon.errors."""
    import importlib
    import pkgutil

    import surgeon
    from surgeon.errors import SurgeonError

    for mod in pkgutil.walk_packages(surgeon.__path__, "surgeon."):
        if mod.name.endswith("__main__"):  # runs the CLI on import
            continue
        try:
            importlib.import_module(mod.name)
        except ImportError:  # a module of an optional dependency not installed here
            continue
    found, todo = set(), [SurgeonError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    names = {e.__name__ for e in found}
    assert {"TensorParallelError", "DerivedMismatch", "RankFailed", "HalfPatchedError"} <= names
    assert sorted(f"{e.__module__}.{e.__name__}" for e in found if e.__module__ != "surgeon.errors") == []
    assert all(e.__doc__ for e in found)


def test_errors_name_the_tensor_and_the_file(tmp_path):
    """Fields beside the message: what a program needs without parsing the text."""
    import struct

    from surgeon.errors import CheckpointError
    from surgeon.formats.safetensors import SafetensorsWeights

    header = b'{"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}'
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError) as err:
        SafetensorsWeights(tmp_path, ["bad.safetensors"])
    assert err.value.path == str(bad) and err.value.tensor == "w"
