"""One placement rule for every route: stack, layer, stage and kind from module paths."""

from __future__ import annotations

import transformers

from surgeon.detect.placement import Place, kind, place

from helpers.block_maps import match_blocks
from helpers.families import _swin
from helpers.observe import observe


def test_layers_vary_stages_come_from_the_path():
    paths = [f"encoder.layers.{s}.blocks.{b}.attention.self" for s, depth in enumerate([2, 1]) for b in range(depth)]
    assert place(paths) == {
        "encoder.layers.0.blocks.0.attention.self": Place("encoder.layers", 0, 0),
        "encoder.layers.0.blocks.1.attention.self": Place("encoder.layers", 1, 0),
        "encoder.layers.1.blocks.0.attention.self": Place("encoder.layers", 2, 1),
    }
    # one block per stage: only the stage number varies, and it is still the stage
    one = [f"encoder.layers.{s}.blocks.0.attention.self" for s in range(2)]
    assert [p.stage for p in place(one).values()] == [0, 1]
    # a layer is the model's own number (a hybrid's attention in layers 3 and 7 only), not a rank
    assert place(["model.layers.3.self_attn", "model.layers.7.self_attn"])["model.layers.7.self_attn"] == Place(
        "model.layers", 7, None
    )
    assert place(["head.attention"]) == {"head.attention": Place("head.attention", 0, None)}
    assert place(["head.attention"], lone="top") == {"head.attention": Place("", 0, None)}
    assert (
        kind("decoder.block.0.layer.1.EncDecAttention") == "cross"
        and kind("decoder.block.0.layer.0.SelfAttention") == "self"
    )


def test_swin_with_one_block_per_stage(tmp_path):
    """depths [1, 1]: each stage's head count (num_heads [2, 4]) is read from its own stage."""
    model = _swin(depths=(1, 1))
    model.save_pretrained(tmp_path)
    report, pairs = match_blocks(tmp_path, observe(transformers.SwinModel.from_pretrained(tmp_path)))
    assert [b.heads for b in report.blocks] == [2, 4]
    assert len(pairs) == 2
