"""The kind of each block (self or cross) is what the library's own forward does with it (issue 28, item 5),
and selecting by kind never touches another kind: vit-pytorch CrossViT (tests/helpers/libraries.py, after
cross_vit.py) and diffusers' SD3.5 dual attention (the real library).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import surgeon
from surgeon.api import inspect_checkpoint, reinit_checkpoint

from helpers.diffusers_models import sd3
from helpers.libraries import CrossViT, CrossVitAttention, changed, save

pytestmark = pytest.mark.usefixtures("one_thread")


def kinds_in_forward(model, call, is_attention, reads_other) -> dict[str, str]:
    """Each attention module's kind as its model's forward calls it: "cross" where the call hands it tokens
    other than its queries' (``reads_other(module, kwargs)``)."""
    seen: dict[str, str] = {}
    names = {m: n for n, m in model.named_modules()}

    def hook(module, args, kwargs):
        seen[names[module]] = "cross" if reads_other(module, kwargs) else "self"

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules() if is_attention(m)]
    try:
        with torch.no_grad():
            call()
    finally:
        for h in handles:
            h.remove()
    return seen


def owner(tensor: str) -> str:
    return tensor.rsplit(".", 2)[0]  # "<module>.to_q.weight" -> "<module>"


# --------------------------------------------------------------------------- vit-pytorch CrossViT


def crossvit_kinds(model):
    return kinds_in_forward(
        model,
        lambda: model(torch.randn(1, 3, 8, 8)),
        lambda m: isinstance(m, CrossVitAttention),
        lambda m, kw: kw.get("context") is not None,  # CrossTransformer: attend(cls, context=other branch's tokens)
    )


def test_crossvit_cross_attention_is_cross_and_self_selection_leaves_it(tmp_path):
    torch.manual_seed(0)
    model = CrossViT()
    truth = crossvit_kinds(model)
    assert sorted(truth.values()) == ["cross", "cross", "self", "self", "self"]
    src = save(model, tmp_path / "src")
    found = inspect_checkpoint(src, head_dim=8)
    assert {b.module: b.kind for b in found.blocks} == truth
    reinit_checkpoint(src, output=tmp_path / "out", head_dim=8, attention="self")
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert {owner(n) for n in changed(before, after)} == {m for m, k in truth.items() if k == "self"}


def test_crossvit_in_memory_agrees_without_example_inputs():
    # the probe calls each ProjectInOut on one tensor (no context): the path, not that call, says cross
    torch.manual_seed(0)
    model = CrossViT()
    truth = crossvit_kinds(model)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    report = surgeon.reinit_(model, attention="self")
    assert {b.module: b.kind for b in report.blocks} == truth
    moved = {owner(n) for n, t in model.state_dict().items() if not torch.equal(t, state[n])}
    assert moved == {m for m, k in truth.items() if k == "self"}
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 3)


# --------------------------------------------------------------------------- diffusers SD3.5 dual attention

diffusers = pytest.importorskip("diffusers")


def sd35():
    return sd3(dual_attention_layers=(0,))


SD3_INPUTS = dict(
    hidden_states=torch.randn(1, 4, 8, 8),
    encoder_hidden_states=torch.randn(1, 5, 16),
    pooled_projections=torch.randn(1, 8),
    timestep=torch.tensor([1]),
)


def sd35_kinds(model):
    # attention_processor.py: a call with encoder_hidden_states reads them as keys; joint attention
    # (added_kv_proj_dim) also reads them as queries, so its keys are its queries' tokens: self
    return kinds_in_forward(
        model,
        lambda: model(**SD3_INPUTS),
        lambda m: isinstance(m, diffusers.models.attention_processor.Attention),
        lambda m, kw: kw.get("encoder_hidden_states") is not None and m.added_kv_proj_dim is None,
    )


def test_sd35_dual_attention_attn2_is_self_attention(tmp_path):
    model = sd35()
    truth = sd35_kinds(model)
    assert truth["transformer_blocks.0.attn2"] == "self" and set(truth.values()) == {"self"}
    model.save_pretrained(tmp_path / "src")
    found = inspect_checkpoint(tmp_path / "src")
    assert {b.module: b.kind for b in found.blocks if ":" not in b.module} == truth
    reinit_checkpoint(tmp_path / "src", output=tmp_path / "out", attention="self", layers="0")
    weights = "diffusion_pytorch_model.safetensors"
    before, after = load_file(tmp_path / "src" / weights), load_file(tmp_path / "out" / weights)
    assert {owner(n) for n in changed(before, after)} == {"transformer_blocks.0.attn", "transformer_blocks.0.attn2"}
    # the module route reads the same kinds
    report = surgeon.inspect(sd35(), example_inputs=SD3_INPUTS)
    assert {b.module: b.kind for b in report.blocks if ":" not in b.module} == truth


# --------------------------------------------------------------------------- joint attention: one block, two streams


def test_joint_attention_is_one_block_with_a_context_stream_in_table_json_card_and_verdict(tmp_path, cli):
    import json

    model = sd35()
    model.save_pretrained(tmp_path / "src")
    modules = {n: m for n, m in model.named_modules() if isinstance(m, diffusers.models.attention_processor.Attention)}
    joint = {n for n, m in modules.items() if m.add_q_proj is not None}  # attention_processor.py: added_kv_proj_dim
    assert joint and joint != set(modules)
    report = json.loads(cli("inspect", tmp_path / "src", "--json").stdout)
    assert [b["module"] for b in report["blocks"]] == list(modules)
    for b in report["blocks"]:
        streams = b.get("streams", {})
        assert set(streams) == ({"context"} if b["module"] in joint else set())
        if streams:
            context = streams["context"]
            assert [context[r]["weight"]["tensor"] for r in "qkv"] == [
                f"{b['module']}.add_{r}_proj.weight" for r in "qkv"
            ]
            assert context["heads"] == modules[b["module"]].heads
    context_rows = {(p["tensor"], p["stream"]) for p in report["projections"] if "stream" in p}
    assert context_rows == {(f"{n}.add_{r}_proj.weight", "context") for n in joint for r in "qkv"}
    table = cli("inspect", tmp_path / "src").stdout
    assert f"{len(modules)} attention blocks in 1 stack ({len(joint)} with a context stream)" in table.splitlines()[0]
    assert "joint context" not in table and "separate + context stream" in table
    cli("reinit", tmp_path / "src", "-o", tmp_path / "out", "--layers", "0")
    card = (tmp_path / "out" / "README.md").read_text()
    touched = [n for n in modules if n.startswith("transformer_blocks.0.")]
    assert f"of {len(touched)} of its {len(modules)} attention blocks" in card
    rows = [line for line in card.splitlines() if line.startswith("| `transformer_blocks.")]
    block_rows = [r for r in rows if r.count("|") == 6]  # | block | kind | q | k | v |
    assert [r.split("`")[1] for r in block_rows] == touched
    assert "(and its context stream)" in next(r for r in block_rows if "`transformer_blocks.0.attn`" in r)
    verdict = cli("verify", tmp_path / "src", tmp_path / "out").stdout
    assert f"with {len(touched)} attention blocks re-initialized" in verdict
