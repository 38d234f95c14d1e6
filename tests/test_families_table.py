"""What docs/ARCHITECTURE.md promises about adding a family, a fused layout or a format, as far as a test can hold it."""

from __future__ import annotations

import pytest

from surgeon.detect.by_name import detect
from surgeon.detect.families import KV_SLOTS, RULES, projection_names
from surgeon.errors import NoAttentionFoundError
from surgeon.formats.base import TensorInfo
from surgeon.formats.registry import FORMATS, WEIGHT_SUFFIXES, format_of
from surgeon.spec import PACKINGS


def test_every_packing_has_a_kv_slot_rule():
    assert set(KV_SLOTS) == set(PACKINGS)


def test_every_rule_names_known_packings():
    for rule in RULES:
        for part in rule.parts:
            assert part.packing in PACKINGS or part.packing == "auto", (rule.name, part.packing)
            assert part.bias_packing is None or part.bias_packing in PACKINGS


def test_nothing_found_lists_the_families_from_the_table():
    tensors = {"mlp.weight": TensorInfo("mlp.weight", (4, 4), "F32", "float32", "model.safetensors", 64)}
    with pytest.raises(NoAttentionFoundError) as err:
        detect(tensors)
    for names in projection_names():
        assert names in str(err.value)
    assert len(projection_names()) == len({"/".join(p.weight.removesuffix(".weight") for p in r.parts) for r in RULES})


def test_every_format_is_found_by_its_suffixes():
    for fmt in FORMATS:
        for suffix in fmt.suffixes:
            assert format_of(f"model{suffix}") is fmt and suffix in WEIGHT_SUFFIXES
        for suffix in fmt.index_suffixes:
            assert format_of(f"model{suffix}") is fmt
