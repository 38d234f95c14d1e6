"""A Perceiver-style resampler inside a multimodal model runs heads of its own: Evolla's protein resampler
(modeling_evolla.py EvollaSequenceCompressorAttention) is built with config.resampler_heads heads of
config.resampler_dim_head, not its protein encoder's num_attention_heads. Judged by the numbers the model's own
modules were built with: each module's ``heads`` and the head size its ``scale`` (dim_head ** -0.5) was made of."""

from __future__ import annotations

import pytest

import surgeon
from surgeon.errors import SurgeonError

from helpers.census import build
from helpers.owned import changed, head_problems

RESAMPLER = "protein_encoder.sequence_compressor_resampler.layers"


def _resamplers(model):
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == "EvollaSequenceCompressorAttention"]


def test_the_resampler_is_reset_in_the_heads_it_was_built_with(tmp_path):
    model, config = build("evolla", tmp_path / "model")
    attentions = _resamplers(model)
    assert attentions
    heads = {m.heads for _, m in attentions}
    assert heads != {config.protein_encoder_config.num_attention_heads}  # else the test could not tell them apart
    surgeon.reinit_checkpoint(tmp_path / "model", layers="all", stack=RESAMPLER, output=tmp_path / "out", seed=0)
    loaded = type(model).from_pretrained(tmp_path / "out")
    problems = []
    for name, m in _resamplers(loaded):
        dim_head = round(m.scale**-2)  # the constructor's dim_head, as the module kept it
        assert m.heads * dim_head == m.to_q.out_features
        problems += head_problems(f"{name}.to_q", m.to_q.weight, m.heads, dim_head)
        keys, _ = m.to_kv.weight.chunk(2)  # its forward: self.to_kv(kv_input).chunk(2, dim=-1)
        problems += head_problems(f"{name}.to_kv (keys)", keys, m.heads, dim_head)
    assert not problems, problems[:4]
    touched = changed(model.state_dict(), loaded.state_dict())
    assert touched and all(n.startswith(RESAMPLER) for n in touched)


def test_a_resampler_whose_config_surgeon_cannot_tell_is_refused_by_name(tmp_path, monkeypatch):
    """Without the family row that says where Evolla's resampler heads live, two configs on its path say two
    head counts: the block is named and a selection that holds it is refused, nothing written."""
    from surgeon.vocab import config_keys

    build("evolla", tmp_path / "model")
    rows = {k: v for k, v in config_keys.SUBCONFIG_BY_PATH.items() if k != "evolla"}
    monkeypatch.setattr(config_keys, "SUBCONFIG_BY_PATH", rows)
    monkeypatch.setattr("surgeon.detect.config.SUBCONFIG_BY_PATH", rows)
    report = surgeon.inspect_checkpoint(tmp_path / "model")
    assert not any(b.stack == RESAMPLER for b in report.blocks)
    named = [n for n in report.notes if "cannot tell which config" in n]
    assert any(f"{RESAMPLER}.0.0" in n and "resampler_heads" in n for n in named), report.notes
    with pytest.raises(SurgeonError, match="cannot tell which config"):
        surgeon.reinit_checkpoint(tmp_path / "model", layers="all", stack=RESAMPLER, output=tmp_path / "out", seed=0)
    assert not (tmp_path / "out").exists()
