"""A user's layout file (--layout FILE) and inspect --emit-layout (issue 30, item 2).

A tiny model whose projection names no built-in table knows (``attn.my_q/my_k/my_v`` in one layer, a
fused ``attn.packed`` holding [Q | K | V] in the other) is re-initialized through a layout file and
judged through its own forward (``helpers.modules.observe``); without the file it is "no attention found".
The layout that inspect emits for every family of tests/helpers/families.py, fed back, gives the same blocks and plan;
every built-in rule is an instance of the file's schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from helpers.cli import expect_cli_error
from helpers.modules import assert_conditioned, observe

WIDTH, HEADS = 16, 2


class SeparateAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.my_q, self.my_k, self.my_v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = nn.Linear(WIDTH, WIDTH)

    def qkv(self, x):
        return self.my_q(x), self.my_k(x), self.my_v(x)

    def forward(self, x):
        B, N, _ = x.shape
        q, k, v = (t.view(B, N, HEADS, -1).transpose(1, 2) for t in self.qkv(x))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, WIDTH))


class PackedAttn(SeparateAttn):
    """One Linear whose output rows are [Q | K | V], each HEADS blocks of the head size."""

    def __init__(self):
        nn.Module.__init__(self)
        self.packed = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def qkv(self, x):
        return self.packed(x).split(WIDTH, dim=-1)


class Block(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(WIDTH), attn

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, WIDTH)
        self.blocks = nn.ModuleList([Block(SeparateAttn()), Block(PackedAttn())])

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x


LAYOUT = {
    "rules": [
        {
            "name": "mine",
            "parts": [
                {"weight": f"my_{r}.weight", "bias": f"my_{r}.bias", "packing": r, "orientation": "linear"}
                for r in "qkv"
            ],
        },
        {"name": "mine fused", "parts": [{"weight": "packed.weight", "bias": "packed.bias", "packing": "qkv"}]},
    ],
    "heads": "my_heads",  # read from config.json
}


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    """(folder with model.safetensors and config.json, layout file, the model) of a Net no table knows."""
    root = tmp_path_factory.mktemp("custom")
    torch.manual_seed(0)
    net = Net().eval()
    for p in net.parameters():  # biases away from zero, so that zeroing them shows
        nn.init.normal_(p, std=0.3)
    folder = root / "model"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"my_heads": HEADS}))
    layout = root / "layout.json"
    layout.write_text(json.dumps(LAYOUT))
    return folder, layout, net


def test_reinit_through_a_layout_file(custom, cli, tmp_path):
    folder, layout, net = custom
    expect_cli_error(cli, folder, "reinit", folder, "-o", tmp_path / "none", match="no attention found")
    out = tmp_path / "out"
    cli("reinit", folder, "--layout", layout, "-o", out)
    before = load_file(folder / "model.safetensors")
    after = load_file(out / "model.safetensors")
    changed = {f"blocks.0.attn.my_{r}.{p}" for r in "qkv" for p in ("weight", "bias")}
    changed |= {"blocks.1.attn.packed.weight", "blocks.1.attn.packed.bias"}
    assert set(after) == set(before)
    for name in before:  # everything else byte for byte as it was; every projection rewritten
        same = before[name].numpy().tobytes() == after[name].numpy().tobytes()
        assert same == (name not in changed), name
    assert "--layout layout.json" in (out / "README.md").read_text()  # the card's command, the file by name
    cli("verify", folder, out, "--layout", layout)  # the audit reads the same layout
    expect_cli_error(cli, folder, "verify", folder, out, match="no attention found")
    reset = Net().eval()
    reset.load_state_dict(after)
    for block in reset.blocks:  # judged through the model's own forward
        assert_conditioned(observe(block.attn, WIDTH))
    # the original's maps are not conditioned (the check can fail)
    with pytest.raises(AssertionError):
        assert_conditioned(observe(net.blocks[1].attn, WIDTH))


def test_layout_from_the_api_and_heads_as_numbers(custom, tmp_path):
    from surgeon.api import inspect_checkpoint

    folder, _, _ = custom
    numbers = tmp_path / "numbers.json"
    numbers.write_text(json.dumps({**LAYOUT, "heads": 4}))  # 4 heads of 4 where config.json is silent
    only = tmp_path / "only"
    only.mkdir()
    (only / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    report = inspect_checkpoint(only, layout=numbers, device="cpu")
    assert [(b.module, b.heads, b.head_dim, b.layout) for b in report.blocks] == [
        ("blocks.0.attn", 4, 4, "mine"),
        ("blocks.1.attn", 4, 4, "mine fused"),
    ]


def _bad(tmp_path, text: str) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, match",
    [
        ("rules: []", "is not valid JSON"),
        ("[" * 100_000, "is not valid JSON (nested too deeply)"),
        (json.dumps({**LAYOUT, "head": 2}), "unknown key 'head'; the keys are rules, heads, kv_heads, head_dim"),
        (json.dumps({"rules": [{"parts": [{"weight": "w.weight", "packing": "qvk"}]}]}), "one of q, k, v, qkv, kv"),
        (json.dumps({"rules": [{"parts": [{"weight": "w.weight", "packing": "q"}]}]}), "0 k projections"),
        (json.dumps({"rules": [{"parts": [{"weight": "w.weight", "packing": "qkv", "orientation": "up"}]}]}), "linear"),
        (json.dumps({**LAYOUT, "heads": 0}), "heads is 0; it must be a count of 1 or more"),
        (json.dumps({**LAYOUT, "heads": "n_head"}), "heads names config field 'n_head'"),
    ],
)
def test_bad_layout_files(custom, cli, tmp_path, text, match):
    folder, _, _ = custom
    expect_cli_error(cli, folder, "reinit", folder, "--layout", _bad(tmp_path, text), "-o", tmp_path / "o", match=match)


def _family_names():
    from helpers.families import FAMILIES

    return list(FAMILIES)


@pytest.mark.parametrize("name", _family_names())
def test_emitted_layout_round_trips(name, cli, tmp_path):
    """The emitted file, fed back, gives the same blocks and the same plan (its rules matched first)."""
    from surgeon.detect import detect_source
    from surgeon.detect.hints import Hints
    from surgeon.hub.read import open_model as load
    from surgeon.options import ReinitOptions
    from surgeon.plan.planner import prepare_checkpoint

    from helpers.families import FAMILIES

    path = tmp_path / name
    FAMILIES[name].make().save_pretrained(path)
    layout = tmp_path / "layout.json"
    cli("inspect", path, "--emit-layout", layout)
    cli("inspect", path, "--emit-layout", layout)  # a layout file may be written over, nothing else
    expect_cli_error(
        cli, path, "inspect", path, "--emit-layout", path / "config.json", match="exists and is not a layout file"
    )
    emitted = json.loads(layout.read_text())
    source = load(path)
    plain = detect_source(source)
    # heads written where each stack's blocks agree (Swin's stages differ: left to its config)
    one_count = all(len({b.heads for b in plain.blocks if b.stack == s}) == 1 for s in {b.stack for b in plain.blocks})
    assert emitted["rules"] and ("heads" in emitted) == one_count
    given = detect_source(source, Hints(layout=layout))
    assert given.blocks == plain.blocks
    options = ReinitOptions()
    assert prepare_checkpoint(source, given, options).changes == prepare_checkpoint(source, plain, options).changes
    # the emitted rules are the ones read: renamed, the blocks say so
    emitted["rules"] = [{**r, "name": f"mine {i}"} for i, r in enumerate(emitted["rules"])]
    layout.write_text(json.dumps(emitted))
    assert {b.layout.startswith("mine") for b in detect_source(source, Hints(layout=layout)).blocks} == {True}
    if not isinstance(emitted.get("heads"), int):
        return
    # heads that config.json contradicts: refused naming the file's field
    layout.write_text(json.dumps({**emitted, "heads": emitted["heads"] + 1}))
    match = f"heads {emitted['heads'] + 1} contradicts config.json"
    expect_cli_error(cli, path, "reinit", path, "--layout", layout, "-o", tmp_path / "o", match=match)


def test_onnx_graphs_take_no_layout_file(custom, cli, tmp_path):
    """A layout file names tensors; an ONNX graph's attention is found by walking it: refused, not ignored."""
    import onnx

    from helpers.onnx_graphs import tiny_attention

    _, layout, _ = custom
    folder = tmp_path / "onnx"
    folder.mkdir()
    onnx.save_model(tiny_attention(), str(folder / "model.onnx"))
    cli("inspect", folder / "model.onnx")  # readable without one
    for args in (["--layout", layout], ["--emit-layout", tmp_path / "layout.json"]):
        expect_cli_error(cli, folder, "inspect", folder / "model.onnx", *args, match="walking the graph")
    assert not (tmp_path / "layout.json").exists()


def test_every_built_in_rule_is_an_instance_of_the_layout_schema(tmp_path):
    """The built-in tables are written in the layout file's schema: each rule, written as --emit-layout writes
    it and read back by the layout reader, is the same rule. Only packing "auto" (a fused tensor whose layout
    the model type decides: query_key_value, litgpt's attn) has no spelling in a file: a user states the
    packing itself, and each such rule has its refusal's reason in the table."""
    from surgeon.detect.families import RULES, SECOND_SETS
    from surgeon.detect.layout_emit import _rule_json
    from surgeon.detect.layout_file import read_layout
    from surgeon.vocab.config_keys import AUTO_PACKING_WHY

    built_in = list(RULES) + [rule for _, rule in SECOND_SETS]
    auto = [r.name for r in built_in if any(p.packing == "auto" for p in r.parts)]
    auto_tensors = {p.weight.removesuffix(".weight") for r in built_in for p in r.parts if p.packing == "auto"}
    assert auto and auto_tensors == set(AUTO_PACKING_WHY)
    layout = tmp_path / "layout.json"
    for rule in built_in:
        if rule.name in auto:
            continue
        layout.write_text(json.dumps({"rules": [_rule_json(rule)]}))
        assert read_layout(layout).rules == (rule,), rule.name


def _write(path: Path, layout: dict) -> Path:
    path.write_text(json.dumps(layout))
    return path


def test_one_tensor_in_two_roles_is_refused(custom, cli, tmp_path):
    """A layout that names my_q for both the query and the value would write the value identity into the query and
    leave the value as it was, reporting q, k and v re-initialized: refused in one line naming both, nothing
    written, whether the two roles are parts of one rule or blocks of two rules that share tensors."""
    folder, _, _ = custom
    same = json.loads(json.dumps(LAYOUT))
    same["rules"][0]["parts"][2] = {"weight": "my_q.weight", "packing": "v"}
    nested = json.loads(json.dumps(LAYOUT))  # a second rule, one module up, reading the same tensors as q, k, v
    nested["rules"].append(
        {"name": "up", "parts": [{"weight": f"attn.my_{r}.weight", "packing": p} for r, p in zip("qkv", "vkq")]}
    )
    for layout, match in (
        (_write(tmp_path / "same.json", same), "parts[0] and parts[2] both name my_q.weight"),
        (_write(tmp_path / "nested.json", nested), "weight of blocks.0 and the "),
    ):
        for command in ("inspect", "reinit"):
            args = (command, folder, "--layout", layout) + (("-o", tmp_path / "out") if command == "reinit" else ())
            said = expect_cli_error(cli, tmp_path, *args, match=match)
        assert not (tmp_path / "out").exists(), said
    assert said.split("error: ")[1].startswith("blocks.0.attn.my_") and "weight of blocks.0.attn" in said


def test_two_keys_on_one_stack_are_refused(cli, tmp_path):
    """encoder.layer is named by "encoder" and by "layer": which count is meant is not known, so neither is taken."""
    from helpers.tiny import tiny_bert

    folder = tmp_path / "bert"
    tiny_bert().save_pretrained(folder)
    expect_cli_error(cli, tmp_path, "inspect", folder, "--num-heads", "encoder=4,layer=2", match="names the stack")
    rule = {
        "name": "bert",
        "parts": [{"weight": f"{r}.weight", "packing": r[0]} for r in ("query", "key", "value")],
    }
    layout = _write(tmp_path / "layout.json", {"rules": [rule], "heads": {"encoder": 4, "layer": 2}})
    said = expect_cli_error(
        cli, tmp_path, "inspect", folder, "--layout", layout, match="names the stack encoder.layer twice"
    )
    assert "'encoder' and 'layer'" in said
    _write(layout, {"rules": [rule], "heads": {"encoder": 4}})  # one key per stack: read as said
    assert "2 attention blocks" in cli("inspect", folder, "--layout", layout).stdout


def test_verify_uses_the_layout_the_record_keeps(custom, cli, tmp_path):
    """The record keeps the layout file's name and the sha256 of its bytes; verify with another layout (the same
    rules with the roles of my_q and my_v swapped: a different reading of the same tensors) is refused, not
    trusted; the same bytes under another name verify."""
    import hashlib

    from surgeon.report.record import card_records

    folder, layout, _ = custom
    out = tmp_path / "out"
    cli("reinit", folder, "--layout", layout, "-o", out)
    (record,) = card_records((out / "README.md").read_text())[:1]
    assert record["layout"] == {"file": "layout.json", "sha256": hashlib.sha256(layout.read_bytes()).hexdigest()}
    swapped = json.loads(layout.read_text())
    swapped["rules"][0]["parts"][0]["packing"], swapped["rules"][0]["parts"][2]["packing"] = "v", "q"
    other = _write(tmp_path / "other.json", swapped)
    expect_cli_error(cli, tmp_path, "verify", folder, out, "--layout", other, match="is another layout")
    renamed = tmp_path / "renamed.json"
    renamed.write_bytes(layout.read_bytes())
    assert cli("verify", folder, out, "--layout", renamed).stdout.startswith("verified:")
    plain = tmp_path / "plain"  # a model no layout made: verify given one refuses it too
    from helpers.tiny import tiny_bert

    tiny_bert().save_pretrained(plain)
    cli("reinit", plain, "-o", tmp_path / "plain-out")
    rule = {
        "name": "bert",
        "parts": [{"weight": f"{r}.weight", "packing": r[0]} for r in ("query", "key", "value")],
    }
    bert_layout = _write(tmp_path / "bert.json", {"rules": [rule]})
    expect_cli_error(
        cli,
        tmp_path,
        "verify",
        plain,
        tmp_path / "plain-out",
        "--layout",
        bert_layout,
        match="made without a layout file",
    )
