"""litgpt 0.5.13's own checkpoints (issue 30), built with litgpt's own code and judged through litgpt's own
CausalSelfAttention forward after litgpt's own loader (GPT.load_state_dict, its legacy hook, its HF converters)
took the result back: lit_model.pth with model_config.yaml beside it (heads, query groups and head size read from
it), the fused attn.qkv ([Q | K | V]), the older attn.attn (per query group), the HF-named model.pth that
convert_lit_checkpoint writes, and a GPT in memory without example inputs.

Runs in litgpt's venv (scripts/frameworks_check.sh, SURGEON_FRAMEWORK=litgpt); skips where litgpt is not importable.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from surgeon.api import inspect_checkpoint, reinit_checkpoint
from surgeon.errors import LayoutError

from helpers.frameworks import framework
from helpers.modules import Maps, _solve, assert_conditioned, assert_same, probe, randomize_biases

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def litgpt():
    return framework("litgpt")  # skips (fails under SURGEON_FRAMEWORK=litgpt) before any litgpt import


HEADS, GROUPS, WIDTH = 4, 2, 32  # grouped-query attention: 2 query heads per key/value head, head size 8


TINY = dict(name="surgeon-tiny", block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=2, bias=True)
TINY |= dict(n_head=HEADS, n_query_groups=GROUPS, n_embd=WIDTH)


def lit_config(**overrides):
    return framework("litgpt").Config(**TINY | overrides)


LLAMA = dict(mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", intermediate_size=64, bias=False)


def lit_gpt(seed=0, **overrides):
    litgpt = framework("litgpt")
    torch.manual_seed(seed)
    return randomize_biases(litgpt.GPT(lit_config(**overrides)), seed=seed).eval()


def save_lit(model, folder):
    """As litgpt's finetune/pretrain save: Fabric.save of {"model": model} and utils.save_config beside it."""
    import lightning as L
    from litgpt.utils import save_config

    folder.mkdir(parents=True, exist_ok=True)
    L.Fabric(accelerator="cpu", devices=1).save(folder / "lit_model.pth", {"model": model})
    save_config(model.config, folder)
    return folder


def attention_inputs(attn, x, rope_n_elem: int) -> dict:
    """The q, k, v litgpt's attention module hands its own scaled_dot_product_attention for input ``x``
    (rotary angle 0: cos 1, sin 0)."""
    seen: dict = {}
    own = attn.scaled_dot_product_attention

    def capture(q, k, v, mask=None):
        seen.update(q=q, k=k, v=v)
        return own(q, k, v, mask)

    attn.scaled_dot_product_attention = capture
    try:
        with torch.no_grad():
            attn(x, torch.ones(1, x.shape[1], rope_n_elem), torch.zeros(1, x.shape[1], rope_n_elem))
    finally:
        del attn.scaled_dot_product_attention
    return seen


def lit_maps(model, layer):
    """Per-head maps of layer ``layer`` from litgpt's own forward: its qkv, split, view and repeat of the key/value
    heads, captured where it hands them to its scaled_dot_product_attention (rotary angle 0: cos 1, sin 0)."""
    attn = model.transformer.h[layer].attn
    x = probe(WIDTH)
    seen = attention_inputs(attn, x, model.config.rope_n_elem)
    (qw, qb), (kw, kb), (vw, vb) = (_solve(x, seen[r].float()) for r in "qkv")  # (B, heads, T, d)
    return Maps(qw, qb, kw, kb, vw, vb), model.config.n_head // model.config.n_query_groups


def changed(before: dict, after: dict) -> set[str]:
    return {k for k, v in before.items() if not torch.equal(v, after[k])}


def judged(written: dict, before: list[Maps], layer: int, **overrides) -> None:
    """litgpt's own load_state_dict of a fresh GPT takes ``written``; layer ``layer`` is conditioned, the other
    layer's maps are the original ones."""
    fresh = lit_gpt(seed=1, **overrides)
    fresh.load_state_dict(written)
    maps, groups = lit_maps(fresh, layer)
    assert groups == HEADS // GROUPS
    assert_conditioned(maps, kv_groups=groups)
    assert_same(lit_maps(fresh, 1 - layer)[0], before[1 - layer])


QKV = {f"transformer.h.1.attn.qkv.{p}" for p in ("weight", "bias")}


@pytest.mark.parametrize("target", ["folder", "lit_model.pth"])
def test_lit_model_pth_heads_from_model_config_yaml(tmp_path, cli, target):
    model = lit_gpt()
    before = [lit_maps(model, i)[0] for i in range(2)]
    folder = save_lit(model, tmp_path / "ckpt")
    src = folder if target == "folder" else folder / "lit_model.pth"
    found = inspect_checkpoint(src)  # no hints: model_config.yaml says n_head 4, n_query_groups 2, head_size 8
    assert [(b.module, b.heads, b.kv_heads, b.head_dim, b.layout) for b in found.blocks] == [
        (f"transformer.h.{i}.attn", HEADS, GROUPS, 8, "fused qkv") for i in range(2)
    ]
    assert "head counts from model_config.yaml beside the weights" in found.notes
    assert "2 attention blocks" in cli("inspect", src).output
    out = tmp_path / ("out" if target == "folder" else "out.pth")
    cli("reinit", src, "--layers", "1", "--seed", "3", "-o", out)
    written = torch.load(out / "lit_model.pth" if target == "folder" else out, weights_only=True)["model"]
    assert changed(model.state_dict(), written) == QKV
    judged(written, before, 1)


def test_lit_model_pth_model_config_yaml_wins_over_an_hf_config_json(tmp_path):
    """A litgpt download keeps Hugging Face's config.json beside lit_model.pth; litgpt's own file describes it,
    and a hint that contradicts it is refused naming it."""
    folder = save_lit(lit_gpt(), tmp_path / "ckpt")
    (folder / "config.json").write_text('{"model_type": "llama", "num_attention_heads": 8}')
    found = inspect_checkpoint(folder / "lit_model.pth")
    assert {(b.heads, b.kv_heads) for b in found.blocks} == {(HEADS, GROUPS)}
    with pytest.raises(LayoutError, match="num_heads=8 contradicts model_config.yaml, which says 4"):
        inspect_checkpoint(folder / "lit_model.pth", num_heads=8)


def legacy_state(model):
    """litgpt < 0.5's names and packing: attn.attn per query group [its query heads | key | value], written by
    litgpt's own convert_lit_checkpoint.qkv_reassemble (the inverse of what its 0.5 loader undoes)."""
    from litgpt.scripts.convert_lit_checkpoint import qkv_reassemble

    return {
        k.replace(".attn.qkv.", ".attn.attn."): qkv_reassemble(v, model.config) if ".attn.qkv." in k else v
        for k, v in model.state_dict().items()
    }


def test_legacy_attn_attn_per_query_group_through_litgpt_s_own_legacy_loader(tmp_path):
    model = lit_gpt()
    before = [lit_maps(model, i)[0] for i in range(2)]
    state = legacy_state(model)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save(state, folder / "lit_model.pth")
    from litgpt.utils import save_config

    save_config(model.config, folder)
    found = inspect_checkpoint(folder)
    assert [(b.heads, b.kv_heads, b.head_dim, b.layout) for b in found.blocks] == [(HEADS, GROUPS, 8, "fused attn")] * 2
    reinit_checkpoint(folder, output=tmp_path / "out", layers="0", seed=2)
    written = torch.load(tmp_path / "out" / "lit_model.pth", weights_only=True)
    assert changed(state, written) == {f"transformer.h.0.attn.attn.{p}" for p in ("weight", "bias")}
    judged(written, before, 0)  # CausalSelfAttention._load_from_state_dict regroups attn.attn into qkv


def test_legacy_attn_attn_without_model_config_yaml_is_refused_naming_config(tmp_path):
    model = lit_gpt()
    lone = tmp_path / "weights" / "lit_model.pth"
    lone.parent.mkdir()
    torch.save(legacy_state(model), lone)
    with pytest.raises(
        LayoutError, match=r"litgpt before 0\.5 groups it per query group.*model_config\.yaml.*config=PATH"
    ):
        inspect_checkpoint(lone, num_heads=HEADS, num_kv_heads=GROUPS)
    assert sorted(p.name for p in lone.parent.iterdir()) == ["lit_model.pth"]
    from litgpt.utils import save_config

    save_config(model.config, tmp_path)  # elsewhere, named by --config: it settles the packing
    found = inspect_checkpoint(lone, config=tmp_path / "model_config.yaml")
    assert "head counts from model_config.yaml given as the config" in found.notes
    assert {(b.heads, b.kv_heads, b.layout) for b in found.blocks} == {(HEADS, GROUPS, "fused attn")}


@pytest.mark.parametrize(
    "text, says",
    [
        ('!!python/object/apply:os.system ["echo hi"]', "is not valid YAML (could not determine a constructor"),
        ("- 1\n", "is not a YAML mapping"),
        ("[" * 5000, "is not valid YAML"),
    ],
)
def test_a_hostile_model_config_yaml_is_one_line_and_nothing_written(tmp_path, cli, text, says):
    """No litgpt needed: a tensor shaped as litgpt's, a model_config.yaml that yaml.safe_load refuses to build."""
    from helpers.cli import expect_cli_error

    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save({"transformer.h.0.attn.qkv.weight": torch.zeros(64, 32)}, folder / "lit_model.pth")
    (folder / "model_config.yaml").write_text(text)
    expect_cli_error(cli, tmp_path, "reinit", folder, "-o", tmp_path / "out", match=says)


HF_BACK = {"llama": "copy_weights_hf_llama", "gpt_neox": "copy_weights_gpt_neox"}


@pytest.mark.parametrize("heads_from", ["hints", "model_config.yaml"])
@pytest.mark.parametrize("export", sorted(HF_BACK))
def test_hf_named_export_and_back_through_litgpt_s_converters(tmp_path, litgpt, export, heads_from):
    """convert_lit_checkpoint writes model.pth with HF names (Llama: q_proj/k_proj/v_proj; GPT-NeoX:
    query_key_value, regrouped per query group); litgpt's convert_hf_checkpoint functions take the result back."""
    from litgpt.scripts import convert_hf_checkpoint as back
    from litgpt.scripts.convert_lit_checkpoint import convert_lit_checkpoint

    overrides = LLAMA if export == "llama" else {}
    model = lit_gpt(**overrides)
    before = [lit_maps(model, i)[0] for i in range(2)]
    convert_lit_checkpoint(save_lit(model, tmp_path / "ckpt"), tmp_path / "hf")
    src = tmp_path / "hf" / "model.pth"
    hints = {"num_heads": HEADS, "num_kv_heads": GROUPS} if heads_from == "hints" else {}
    if heads_from == "model_config.yaml":
        shutil.copy(tmp_path / "ckpt" / "model_config.yaml", tmp_path / "hf")
    if export == "gpt_neox" and heads_from == "hints":  # its packing is litgpt's, which only its config says
        with pytest.raises(LayoutError, match="GPT-NeoX.*model_config.yaml.*config=PATH"):
            inspect_checkpoint(src, **hints)
        return
    state = torch.load(src, weights_only=True)
    reinit_checkpoint(src, output=tmp_path / "out.pth", layers="1", seed=4, **hints)
    written = torch.load(tmp_path / "out.pth", weights_only=True)
    attn = "model.layers.1.self_attn" if export == "llama" else "gpt_neox.layers.1.attention"
    tensors = (
        {f"{attn}.{p}_proj.weight" for p in "qkv"}
        if export == "llama"
        else {f"{attn}.query_key_value.{p}" for p in ("weight", "bias")}
    )
    assert changed(state, written) == tensors
    lit_state: dict = {}
    copy = getattr(back, HF_BACK[export])
    (copy(model.config, {}, lit_state, written) if export == "llama" else copy(model.config, lit_state, written))
    judged(lit_state, before, 1, **overrides)


def test_gpt_in_memory_without_example_inputs_agrees_with_the_checkpoint_route(tmp_path):
    from surgeon import inspect, reinit_

    model = lit_gpt()
    before = [lit_maps(model, i)[0] for i in range(2)]
    found = inspect(model)  # heads from gpt.config (a litgpt.Config), no forward needed
    assert [(b.module, b.heads, b.kv_heads, b.head_dim) for b in found.blocks] == [
        (f"transformer.h.{i}.attn", HEADS, GROUPS, 8) for i in range(2)
    ]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    reinit_checkpoint(save_lit(model, tmp_path / "ckpt"), output=tmp_path / "out", layers="1", seed=6)
    reinit_(model, layers="1", seed=6)
    after = model.state_dict()
    assert changed(original, after) == QKV
    maps, groups = lit_maps(model, 1)
    assert_conditioned(maps, kv_groups=groups)
    assert_same(lit_maps(model, 0)[0], before[0])
    written = torch.load(tmp_path / "out" / "lit_model.pth", weights_only=True)["model"]
    assert all(torch.equal(after[k], written[k]) for k in QKV)  # the same draw, byte for byte


LATENT = dict(
    latent_attention=dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8),
    n_query_groups=HEADS,  # litgpt's latent attention has as many key/value heads as query heads (config.py)
    **LLAMA | dict(bias=True),
)


def latent_maps(model, layer):
    """litgpt's MultiheadLatentAttention forward, captured at its scaled_dot_product_attention (rotary angle 0):
    per head the query over q_b_proj's input, the key without its rotary part and the value over kv_b_proj's
    input (the normed latents: its own down-projections and norms before them are not linear maps of x)."""
    attn = model.transformer.h[layer].attn
    x, rope = probe(WIDTH), model.config.rope_n_elem
    seen: dict = {}
    hooks = [
        getattr(attn, m).register_forward_pre_hook(lambda _, args, m=m: seen.update({m: args[0]}))
        for m in ("q_b_proj", "kv_b_proj")
    ]
    try:
        seen.update(attention_inputs(attn, x, rope))
    finally:
        for hook in hooks:
            hook.remove()
    nope = model.config.qk_nope_head_dim
    (qw, qb), (kw, kb), (vw, vb) = (
        _solve(seen[src], state)
        for src, state in (("q_b_proj", seen["q"]), ("kv_b_proj", seen["k"][..., :nope]), ("kv_b_proj", seen["v"]))
    )
    return Maps(qw, qb, kw, kb, vw, vb)


def test_latent_attention_sizes_from_model_config_yaml_through_litgpt_s_own_forward(tmp_path):
    """Each head's query, key (less its rotary part) and value over the latents conditioned, the value heads
    tiling the 16 latents (head h reads the features of head h mod 2); kv_b_proj's bias rows zeroed with them."""
    from surgeon import reinit_

    model = lit_gpt(**LATENT)
    before = latent_maps(model, 1)
    folder = save_lit(model, tmp_path / "ckpt")
    found = inspect_checkpoint(folder)
    assert [(b.heads, b.head_dim, b.layout) for b in found.blocks] == [(HEADS, 12, "latent (MLA)")] * 2
    reinit_checkpoint(folder, output=tmp_path / "out", layers="0", seed=7)
    written = torch.load(tmp_path / "out" / "lit_model.pth", weights_only=True)["model"]
    assert changed(model.state_dict(), written) == {
        f"transformer.h.0.attn.{m}.{p}" for m in ("q_b_proj", "kv_b_proj") for p in ("weight", "bias")
    }
    fresh = lit_gpt(seed=1, **LATENT)
    fresh.load_state_dict(written)
    maps = latent_maps(fresh, 0)
    assert_conditioned(replace(maps, v=maps.v[:2]))
    assert torch.allclose(maps.v[2:], maps.v[:2], atol=1e-5)  # heads 2 and 3 tile the latents again
    assert_same(latent_maps(fresh, 1), before)
    reinit_(model, layers="0", seed=7)  # in memory, heads and sizes from gpt.config: the same bytes
    assert all(torch.equal(model.state_dict()[k], written[k]) for k in written)


def test_lora_is_refused_naming_merge_lora_on_disk_and_in_memory(tmp_path, cli, litgpt):
    """litgpt's LoRA qkv (the frozen base in qkv.linear, lora_A/lora_B beside it): one line naming merge_lora,
    nothing written, nothing changed in memory."""
    from litgpt.lora import GPT, Config

    from surgeon import reinit_
    from surgeon.errors import UnsupportedWeightsError

    from helpers.cli import expect_cli_error

    config = Config(**TINY | dict(lora_r=4, lora_alpha=8, lora_query=True, lora_value=True))
    model = GPT(config)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "lit_model.pth")
    from litgpt.utils import save_config

    save_config(config, folder)
    expect_cli_error(cli, tmp_path, "reinit", folder, "-o", tmp_path / "out", match="litgpt merge_lora")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedWeightsError, match="litgpt LoRA"):
        reinit_(model)
    assert changed(before, model.state_dict()) == set()
