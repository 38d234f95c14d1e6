from __future__ import annotations

import pytest

from surgeon.errors import SelectionError
from surgeon.vocab.selection import format_indices, parse_attention, parse_targets, resolve_indices


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("all", list(range(12))),
        (None, list(range(12))),
        ("0-11", list(range(12))),
        ("0,3,5-7", [0, 3, 5, 6, 7]),
        ("8-", [8, 9, 10, 11]),
        ("-1", [11]),
        ("-4-", [8, 9, 10, 11]),
        ("-4--2", [8, 9, 10]),
        (" 1 , 1, 2 ", [1, 2]),
        (5, [5]),
        ([0, -1], [0, 11]),
        (range(2), [0, 1]),
    ],
)
def test_resolve_indices(spec, expected):
    assert resolve_indices(spec, 12, what="layer", where="model.layers") == expected


@pytest.mark.parametrize("spec", ["12", "0-12", "-13", "x", "1-2-3", "3-1", "", "1,,2", True])
def test_resolve_indices_errors(spec):
    with pytest.raises(SelectionError) as err:
        resolve_indices(spec, 12, what="layer", where="model.layers")
    assert "\n" not in str(err.value)


def test_out_of_range_message_names_the_range():
    with pytest.raises(SelectionError, match=r"layer 12 is out of range: model.layers has layers 0-11"):
        resolve_indices("0-12", 12, what="layer", where="model.layers")


def test_format_indices_round_trips():
    for indices in ([0, 1, 2, 5], [3], [0, 2, 4], list(range(10))):
        assert resolve_indices(format_indices(indices), 12, what="x", where="y") == indices


def test_targets():
    assert parse_targets("q,k") == ("q", "k")
    assert parse_targets("v,q") == ("q", "v")
    assert parse_targets(["v", "q"]) == ("q", "v")
    for bad in ("x", "q,o", ""):
        with pytest.raises(SelectionError):
            parse_targets(bad)
    # only q, k and v: run-together and spelled-out names are refused with the spelling to use
    for bad, hint in (
        ("qk", "write q,k, comma-separated"),
        ("qkv", "write q,k,v"),
        ("query", "write q"),
        (["value"], "write v"),
    ):
        with pytest.raises(SelectionError, match=f"unknown target .*: {hint}"):
            parse_targets(bad)


def test_attention_kinds():
    assert parse_attention("all") == ("self", "cross")
    assert parse_attention("cross") == ("cross",)
    with pytest.raises(SelectionError):
        parse_attention("both")


def test_options_are_a_frozen_hashable_value_read_when_made():
    from surgeon.options import ReinitOptions
    from surgeon.vocab.selection import IndexSelection

    a = ReinitOptions.build(layers=[0, 2], targets=["v", "q"], stack="encoder, decoder", heads="-1")
    b = ReinitOptions.build(layers=(0, 2), targets="q,v", stack=["encoder", "decoder"], heads="-1")
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert isinstance(a.layers, IndexSelection) and a.layers.items == ((0, 0), (2, 2))
    assert a.targets == ("q", "v") and a.stack == ("encoder", "decoder")
    assert a.to_dict()["layers"] == [0, 2] and a.to_dict()["heads"] == "-1"
    assert ReinitOptions.build(a) == a  # replace() hands the read form back: kept as it is
    with pytest.raises(SelectionError, match="layer 2 is out of range: the model has layers 0-1"):
        a.layers.resolve(2, where="the model")  # what needs the model is checked against it
