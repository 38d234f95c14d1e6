"""Bad inputs that used to end in a traceback, a misleading message or an unreadable output (issue 10).

Each one: one line on stderr, a non-zero exit, no traceback, nothing written.
"""

from __future__ import annotations

import json
import struct

import onnx
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from helpers.cli import expect_cli_error as expect_error
from helpers.onnx_graphs import tiny_attention
from helpers.paths import ROOT
from helpers.tiny import tiny_llama


def _raw_safetensors(path, header: bytes | dict, data: bytes = b""):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _f32(begin: int, n: int = 2, dtype: str = "F32") -> dict:
    return {"dtype": dtype, "shape": [n], "data_offsets": [begin, begin + 4 * n]}


# --- tracebacks -----------------------------------------------------------------------------------


def test_deeply_nested_header_is_one_line(cli, tmp_path):
    path = _raw_safetensors(tmp_path / "deep.safetensors", b"[" * 100_000 + b"]" * 100_000)
    expect_error(cli, tmp_path, "inspect", path, match="JSON nested too deeply")
    path = _raw_safetensors(tmp_path / "deep2.safetensors", b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    expect_error(cli, tmp_path, "reinit", path, match="JSON nested too deeply")


def _bert_tensors(old: str, new: str) -> dict:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
    tensors = {k.replace(old, new): v.contiguous() for k, v in BertModel(cfg).state_dict().items()}
    assert any(new in k for k in tensors)
    return tensors


@pytest.mark.parametrize(
    "old, new", [("attention.self.", "attention.self:context."), ("attention.self.", "attention.self[global].")]
)
def test_attention_under_a_path_ending_like_a_marker_is_refused(cli, tmp_path, old, new):
    """surgeon names a joint attention's second stream "x:context" and a second set "x[global]": a real path
    ending so would read as one (and its tensors be looked up under another module)."""
    save_file(_bert_tensors(old, new), tmp_path / "model.safetensors")
    for command in ("inspect", "reinit"):
        expect_error(
            cli, tmp_path, command, tmp_path / "model.safetensors", "--num-heads", "4", match="ends like the name"
        )


@pytest.mark.parametrize(
    "old, new",
    [
        ("encoder.layer", "enc\x1b[2Koder.layer"),  # an ANSI erase-line in a stack's path
        ("attention.self.", "attention.se[lf."),
        ("encoder.layer", "enc[oder:layer"),
    ],
)
def test_attention_under_a_path_holding_brackets_or_colons_is_read(cli, tmp_path, old, new):
    """'[' and ':' inside a path were an internal error (a KeyError: the path was cut at the first '[')."""
    tensors = _bert_tensors(old, new)
    save_file(tensors, tmp_path / "model.safetensors")
    out = tmp_path / "out.safetensors"
    cli("reinit", tmp_path / "model.safetensors", "--num-heads", "4", "--layers", "0", "-o", out)
    after = load_file(out)
    changed = {k for k in tensors if not torch.equal(tensors[k], after[k])}
    layer0 = "encoder.layer.0.".replace(old, new)
    assert changed == {
        k for k in tensors if k.startswith(layer0) and k.endswith(("query.weight", "key.weight", "value.weight"))
    }
    for name in (k for k in changed if k.endswith("query.weight")):  # conditioned: each head's rows orthonormal
        w = after[name].double().reshape(4, 8, 32)
        assert torch.allclose(w @ w.transpose(1, 2), torch.eye(8, dtype=torch.float64).expand(4, 8, 8), atol=1e-5)


def test_zero_size_projection_is_one_line(cli, tmp_path):
    save_file({f"layers.0.attn.{p}_proj.weight": torch.zeros(0, 32) for p in "qkv"}, tmp_path / "empty.safetensors")
    expect_error(
        cli,
        tmp_path,
        "inspect",
        tmp_path / "empty.safetensors",
        "--num-heads",
        4,
        match="layers.0.attn.q_proj.weight has shape [0, 32]: an empty projection has no heads",
    )
    save_file(
        {
            "layers.0.attn.q_proj.weight": torch.zeros(32, 0),
            **{f"layers.0.attn.{p}_proj.weight": torch.randn(32, 32) for p in "kv"},
        },
        tmp_path / "empty_in.safetensors",
    )
    expect_error(
        cli, tmp_path, "reinit", tmp_path / "empty_in.safetensors", "--num-heads", 4, match="has shape [32, 0]"
    )


@pytest.mark.parametrize("scopes", ["5", "{'a': 1}", "'encoder.layer.0'", "[1, 2, 3]", "[[[[", "None"])
def test_onnx_name_scopes_that_are_not_a_list_of_names(cli, tmp_path, scopes):
    model = tiny_attention(layers=1)
    for node in model.graph.node:
        node.metadata_props.append(onnx.StringStringEntryProto(key="pkg.torch.onnx.name_scopes", value=scopes))
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "model.onnx"
    onnx.save_model(model, str(path))
    # the bad metadata is ignored (scopes then come from node names), never a TypeError
    result = cli("inspect", path, "--json")
    assert [b["module"] for b in json.loads(result.stdout)["blocks"]] == ["layers.0.attn"]


# --- headers the reference reader refuses -----------------------------------------------------------


_DUP = b'{"a":' + json.dumps(_f32(0)).encode() + b',"a":' + json.dumps(_f32(8)).encode() + b"}"
_DUP_SAME = b'{"a":' + json.dumps(_f32(0)).encode() + b',"a":' + json.dumps(_f32(0)).encode() + b"}"


@pytest.mark.parametrize(
    "header,data,match,reference_refuses",
    [
        ({"a": _f32(0), "b": _f32(16)}, bytes(24), "data bytes 8-15 before tensor 'b' belong to no tensor", True),
        ({"a": _f32(8)}, bytes(16), "data bytes 0-7 before tensor 'a' belong to no tensor", True),
        ({"a": _f32(0)}, bytes(12), "has 4 trailing bytes after the last tensor", True),
        ({}, bytes(8), "has 8 trailing bytes after the last tensor", True),
        ({"a": _f32(0, dtype="F33")}, bytes(8), "tensor 'a' has unknown dtype 'F33'", True),
        ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2), "has 2 bytes for shape [3] F4", True),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}},
            bytes(12),
            "has 12 bytes for shape [2] F32",
            True,
        ),
        ({"a": _f32(0), "b": _f32(0)}, bytes(8), "overlaps another tensor's bytes", True),
        (_DUP, bytes(16), "'a' is listed twice", True),
        # the reference reader keeps the last of two identical entries; which one is meant is still undefined
        (_DUP_SAME, bytes(8), "'a' is listed twice", False),
    ],
    ids=[
        "hole",
        "leading-hole",
        "trailing",
        "empty-trailing",
        "unknown-dtype",
        "sub-byte",
        "length",
        "overlap",
        "duplicate",
        "duplicate-same",
    ],
)
def test_headers_the_reference_reader_refuses(cli, tmp_path, header, data, match, reference_refuses):
    path = _raw_safetensors(tmp_path / "bad.safetensors", header, data)
    if reference_refuses:
        with pytest.raises(SafetensorError):
            load_file(path)
    msg = expect_error(cli, tmp_path, "inspect", path, match=match)
    assert "corrupt" in msg


def test_a_valid_file_with_empty_tensors_is_still_accepted(cli, tmp_path):
    tensors = {f"layers.0.attn.{p}_proj.weight": torch.randn(32, 32) for p in "qkv"}
    tensors["layers.0.attn.empty"] = torch.zeros(0, 4)
    save_file(tensors, tmp_path / "m.safetensors")
    before = load_file(tmp_path / "m.safetensors")
    cli("reinit", tmp_path / "m.safetensors", "--num-heads", 4, "-o", tmp_path / "out.safetensors")
    after = load_file(tmp_path / "out.safetensors")  # the reference reader takes it
    assert after.keys() == before.keys()
    assert after["layers.0.attn.empty"].shape == (0, 4) and after["layers.0.attn.empty"].dtype == torch.float32
    assert torch.equal(
        load_file(tmp_path / "m.safetensors")["layers.0.attn.q_proj.weight"], tensors["layers.0.attn.q_proj.weight"]
    )
    for role in "qk":  # 4 heads of 8 rows each, drawn head by head
        heads = after[f"layers.0.attn.{role}_proj.weight"].double().view(4, 8, 32)
        assert torch.allclose(heads @ heads.mT, torch.eye(8, dtype=torch.float64).expand(4, 8, 8), atol=1e-5), (
            f"{role}: heads of 8 rows not semi-orthogonal"
        )
        assert (heads[0] @ heads[1].T).abs().max() > 1e-3, role
    assert torch.equal(after["layers.0.attn.v_proj.weight"], torch.eye(32))


# --- usage errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,match",
    [
        (
            ["reinit", "MODEL", "--seed", "abc"],
            "surgeon: error: invalid value for '--seed': 'abc' is not a valid integer (see surgeon reinit --help)",
        ),
        (
            ["reinit", "MODEL", "--mode", "fast"],
            "invalid value for '--mode': 'fast' is not one of 'conditioned', 'polar'",
        ),
        (["reinit", "MODEL", "--zzz"], "no such option '--zzz' (see surgeon reinit --help)"),
        (["inspect"], "missing argument 'MODEL' (see surgeon inspect --help)"),
        (["inspect", "MODEL", "--num-heads", "0"], "invalid value for '--num-heads'"),
        (["push", "MODEL"], "missing argument 'ORG/NAME' (see surgeon push --help)"),
        (["verify", "MODEL"], "missing argument 'OUTPUT' (see surgeon verify --help)"),
        (["frob"], "no such command 'frob' (see surgeon --help)"),
    ],
)
def test_usage_errors_are_one_line(cli, tmp_path, args, match):
    (tmp_path / "MODEL").mkdir()
    args = [tmp_path / "MODEL" if a == "MODEL" else a for a in args]
    msg = expect_error(cli, tmp_path, *args, match=match)
    assert "Usage:" not in msg
    assert cli(*args, ok=False).exit_code == 2


@pytest.mark.parametrize(
    "targets,match",
    [
        ("qk", "unknown target 'qk': write q,k"),
        ("query", "unknown target 'query': write q"),
        ("q,k,o", "unknown target 'o'"),
    ],
)
def test_targets_only_q_k_v(cli, llama_dir, tmp_path, targets, match):
    expect_error(cli, tmp_path, "reinit", llama_dir, "--targets", targets, match=match)


def test_a_hint_that_contradicts_the_config_is_refused(cli, llama_dir, tmp_path):
    # tiny Llama: 8 heads, 2 key/value heads, head_dim 8 in config.json
    expect_error(
        cli,
        tmp_path,
        "reinit",
        llama_dir,
        "--num-heads",
        4,
        match="--num-heads 4 contradicts config.json, which says 8",
    )
    expect_error(
        cli,
        tmp_path,
        "inspect",
        llama_dir,
        "--num-kv-heads",
        4,
        match="--num-kv-heads 4 contradicts config.json, which says 2",
    )
    expect_error(cli, tmp_path, "inspect", llama_dir, "--num-heads", 4, match="or pass --force-hints")
    # agreeing hints are fine; --force-hints makes the hints win (here: 4 heads of 16, one key/value head)
    cli("inspect", llama_dir, "--num-heads", 8, "--num-kv-heads", 2)
    report = json.loads(
        cli(
            "inspect", llama_dir, "--num-heads", 4, "--num-kv-heads", 1, "--head-dim", 16, "--force-hints", "--json"
        ).stdout
    )
    assert {(b["heads"], b["kv_heads"], b["head_dim"]) for b in report["blocks"]} == {(4, 1, 16)}


def test_a_bin_that_is_not_a_pickle(cli, tmp_path):
    # a CTranslate2 model.bin starts with a little-endian version number, not a pickle or a zip archive
    (tmp_path / "model.bin").write_bytes(struct.pack("<I", 6) + b"\x00" * 60)
    msg = expect_error(
        cli,
        tmp_path,
        "inspect",
        tmp_path / "model.bin",
        match="is not a PyTorch checkpoint: it is neither a zip archive nor a pickle",
    )
    assert "safely" not in msg and "unsafe" not in msg
    # a real (legacy, non-zip) pickle that is cut short is still "not readable", not "not a pickle"
    torch.save(tiny_llama().state_dict(), tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    (tmp_path / "cut.bin").write_bytes((tmp_path / "legacy.bin").read_bytes()[:3000])
    expect_error(cli, tmp_path, "inspect", tmp_path / "cut.bin", match="is not a readable PyTorch checkpoint")


# --- messages that misled or added noise -----------------------------------------------------------


def test_the_readme_first_command_has_no_hub_note(cli, tmp_path, monkeypatch):

    monkeypatch.chdir(ROOT)  # the repo root, as in the README
    report = json.loads(cli("reinit", "examples/tiny-bert", "--layers", "all", "-o", tmp_path / "out", "--json").stdout)
    assert not [n for n in report["notes"] if "hf://" in n or "local folder" in n], report["notes"]


def test_dry_run_json_lists_selected_heads_and_dtype(cli, llama_dir):
    report = json.loads(cli("reinit", llama_dir, "--dry-run", "--json", "--layers", "0", "--heads", "0-3").stdout)
    rows = {p["role"]: p for p in report["projections"]}
    assert (
        rows["q"]["heads_changed"] == [0, 1, 2, 3]
        and rows["k"]["heads_changed"] == [0]
        and rows["v"]["heads_changed"] == [0]
    )
    assert {p["dtype"] for p in report["projections"]} == {"float32"}


def test_one_block_is_singular(cli, tmp_path):
    from surgeon.audit.layout import LayoutCheck

    src = tmp_path / "one"
    tiny_llama(num_hidden_layers=1).save_pretrained(src)
    cli("reinit", src, "-o", tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "1 of its 1 attention block re-initialized" in card and "1 attention blocks" not in card
    assert "the attention block found by name is the one the forward" in LayoutCheck("x", "LlamaModel", 1).summary()


def test_no_config_json_is_said_as_such(cli, tmp_path):
    save_file({f"layers.0.attn.{p}_proj.weight": torch.randn(64, 64) for p in "qkv"}, tmp_path / "m.safetensors")
    msg = expect_error(
        cli,
        tmp_path,
        "inspect",
        tmp_path / "m.safetensors",
        match="there is no config.json beside the weights; pass --num-heads N",
    )
    assert "does not say" not in msg


@pytest.mark.parametrize("name", ["out.bin", "out.safetensors", "model.onnx"])
def test_a_folder_input_needs_a_folder_output(cli, llama_dir, tmp_path, name):
    expect_error(
        cli,
        tmp_path,
        "reinit",
        llama_dir,
        "-o",
        tmp_path / name,
        match=f"names a {name[name.index('.') :]} file, but the output of a folder input is a folder",
    )
