"""What docs/ARCHITECTURE.md promises about adding a family, a fused layout or a format, as far as a test can hold it."""

from __future__ import annotations

import pytest

from surgeon.detect.by_name import detect
from surgeon.detect.families import KV_SLOTS, RULES, projection_names
from surgeon.errors import NoAttentionFoundError
from surgeon.formats.base import TensorInfo
from surgeon.formats.registry import FORMATS, WEIGHT_SUFFIXES, format_of
from surgeon.vocab.blocks import PACKINGS


def test_every_packing_has_a_kv_slot_rule():
    assert set(KV_SLOTS) == set(PACKINGS)


def test_every_rule_names_known_packings():
    for rule in RULES:
        for part in rule.parts:
            assert part.packing in PACKINGS or part.packing == "auto", (rule.name, part.packing)
            assert part.bias_packing is None or part.bias_packing in PACKINGS


def test_nothing_found_points_at_the_list_of_the_families_from_the_table():
    from click.testing import CliRunner

    from surgeon.cli.commands import main

    tensors = {"mlp.weight": TensorInfo("mlp.weight", (4, 4), "F32", "float32", "model.safetensors", 64)}
    with pytest.raises(NoAttentionFoundError) as err:
        detect(tensors)
    assert "`surgeon inspect --list-names` lists them" in str(err.value)
    listed = CliRunner().invoke(main, ["inspect", "--list-names"]).output.splitlines()
    assert listed == list(projection_names())
    assert len(projection_names()) == len({"/".join(p.weight.removesuffix(".weight") for p in r.parts) for r in RULES})


def test_every_format_is_found_by_its_suffixes():
    for fmt in FORMATS:
        for suffix in fmt.suffixes:
            assert format_of(f"model{suffix}") is fmt and suffix in WEIGHT_SUFFIXES
        for suffix in fmt.index_suffixes:
            assert format_of(f"model{suffix}") is fmt


def test_options_are_spelt_once():
    """Every ReinitOptions field is a `surgeon reinit` flag and part of the card's reproduce command."""
    from click.testing import CliRunner

    from surgeon.cli.commands import main
    from surgeon.detect.hints import Hints
    from surgeon.options import ReinitOptions, option_infos
    from surgeon.report.card import reproduce_command

    help_text = CliRunner().invoke(main, ["reinit", "--help"]).output
    for name, _ in option_infos():
        assert f"--{name.replace('_', '-')}" in help_text, name
    polar = ReinitOptions.build(mode="polar", strength=0.5, keep_scale=True, stack="encoder", seed=3)
    command = reproduce_command("m", revision=None, options=polar.to_dict(), hints=Hints(), output="out")
    for flag in (
        "--layers=all",
        "--targets q,k,v",
        "--heads=all",
        "--attention all",
        "--stack encoder",
        "--mode polar",
        "--strength 0.5",
        "--keep-scale",
        "--bias keep",
        "--seed 3",
    ):
        assert flag in command, flag
    assert "--value-identity" not in command  # not part of a polar run
    with pytest.raises(TypeError, match="unexpected keyword argument 'sed'"):
        ReinitOptions.build(sed=3)
