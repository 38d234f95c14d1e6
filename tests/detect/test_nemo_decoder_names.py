"""Attention stored under names of another library: Cohere ASR checkpoints keep the decoder as NeMo writes it
(``transf_decoder._decoder.layers.N.first_sub_layer.query_net`` / ``key_net`` / ``value_net``, the cross-attention
in ``second_sub_layer``), which transformers' conversion mapping renames to ``decoder.layers.N.self_attn`` /
``encoder_attn`` at load. The decoder is re-initialized in the heads its modules were built with; and attention
surgeon cannot read is never skipped silently: named in the report, the card and --json, and refused when selected."""

from __future__ import annotations

import json
import re

import pytest

import surgeon
from surgeon.errors import SurgeonError

from helpers.census import build
from helpers.cli import Cli
from helpers.owned import changed, head_problems

DECODER = "transf_decoder._decoder.layers"
# the decoder's own heads, apart from the encoder's (4 of 16 after the census shrink)
SETTINGS = {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32}


@pytest.fixture(scope="module")
def asr(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cohere_asr") / "model"
    model, config = build("cohere_asr", folder, **SETTINGS)
    return model, config, folder


def test_the_checkpoint_keeps_nemos_names(asr):
    from safetensors import safe_open

    _, config, folder = asr
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    for sub in ("first_sub_layer", "second_sub_layer"):
        assert all(f"{DECODER}.0.{sub}.{p}.weight" in keys for p in ("query_net", "key_net", "value_net"))
    assert config.encoder_config.num_attention_heads != config.num_attention_heads


def test_the_decoders_attention_is_reset_in_its_own_heads(asr, tmp_path):
    model, _, folder = asr
    report = surgeon.reinit_checkpoint(folder, layers="all", output=tmp_path / "out", seed=0)
    assert {b.kind for b in report.blocks if b.stack == DECODER} == {"self", "cross"}
    loaded = type(model).from_pretrained(tmp_path / "out")
    attentions = [
        (n, m) for n, m in loaded.named_modules() if re.search(r"decoder\.layers\.\d+\.(self_attn|encoder_attn)$", n)
    ]
    assert len(attentions) == 2 * len(loaded.decoder.layers)
    problems = []
    for name, m in attentions:
        heads, kv_heads = m.q_proj.out_features // m.head_dim, m.k_proj.out_features // m.head_dim
        assert heads == 2 and heads // kv_heads == m.num_key_value_groups  # the module's own construction
        problems += head_problems(f"{name}.q_proj", m.q_proj.weight, heads, m.head_dim)
        problems += head_problems(f"{name}.k_proj", m.k_proj.weight, kv_heads, m.head_dim)
        problems += head_problems(f"{name}.v_proj", m.v_proj.weight, kv_heads, m.head_dim, drawn=False)
    assert not problems, problems[:4]
    touched = {n.rpartition(".")[0].rpartition(".")[0] for n in changed(model.state_dict(), loaded.state_dict())}
    assert {n for n, _ in attentions} <= touched


@pytest.fixture
def without_nemo_rule(monkeypatch):
    """surgeon as it was before it knew NeMo's names: the query_net rule taken out of the family table."""
    from surgeon.detect import by_name, families

    rules = tuple(r for r in families.RULES if not any(p.weight == "query_net.weight" for p in r.parts))
    assert len(rules) == len(families.RULES) - 1
    monkeypatch.setattr(families, "RULES", rules)
    monkeypatch.setattr(by_name, "RULES", rules)


def test_attention_no_rule_reads_is_named_under_the_checkpoints_names(asr, tmp_path, without_nemo_rule):
    _, _, folder = asr
    sub_layers = [f"{DECODER}.{i}.{s}" for i in range(2) for s in ("first_sub_layer", "second_sub_layer")]
    with pytest.raises(SurgeonError, match=re.escape(f"{DECODER}.") + r"\d\.(first|second)_sub_layer looks like"):
        surgeon.reinit_checkpoint(folder, layers="all", output=tmp_path / "all", seed=0)
    assert not (tmp_path / "all").exists()
    cli = Cli()
    out = cli("reinit", str(folder), "-o", str(tmp_path / "out"), "--stack", "encoder.layers", "--json")
    notes = " ".join(json.loads(out.stdout)["notes"])
    card = (tmp_path / "out" / "README.md").read_text()
    for module in sub_layers:  # every one, by the checkpoint's own key names
        assert module in notes, notes
        assert module in card
    text = cli("inspect", str(folder)).stdout
    assert all(module in text for module in sub_layers)
