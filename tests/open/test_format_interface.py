"""Every registered format implements the weight-set interface the rest of surgeon asks.

surgeon never asks a format's name: it asks the WeightSet (``read``, ``save``, ``check_non_tensor``, the
capability flags, ...). A new format is a module and a registry row; this table test over the registry
fails when its WeightSet class leaves a required method unimplemented or a capability undecided.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from surgeon.formats.base import UpdatesFn, WeightSet
from surgeon.formats.registry import FORMATS, Format


def problems(fmt: Format, cls: type) -> list[str]:
    """What ``cls``, the WeightSet of registry row ``fmt``, lacks."""
    found = []
    if not issubclass(cls, WeightSet):
        return [f"{cls.__name__} is not a WeightSet"]
    if inspect.isabstract(cls):
        found += [f"implement {m}" for m in sorted(getattr(cls, "__abstractmethods__", ()))]
    if getattr(cls, "format", None) != fmt.name:
        found.append(f"set format = {fmt.name!r} (the registry's name for it)")
    own = [vars(c) for c in cls.__mro__ if c is not WeightSet and issubclass(c, WeightSet)]
    for flag in WeightSet.CAPABILITIES:
        if not any(flag in d for d in own):
            found.append(f"declare {flag} (even where the default fits)")
    if cls.record_slot and cls.record_texts is WeightSet.record_texts:
        found.append("implement record_texts (record_slot: verify reads the record through it)")
    if cls.graph and cls.save_as is WeightSet.save_as:
        found.append("implement save_as (graph: an output named like the model is written through it)")
    if cls.graph and cls.files_as is WeightSet.files_as:
        found.append("implement files_as (graph: the output's files beside it are checked before the run)")
    if fmt.index_suffixes and not (cls.shard_suffix and cls.shard_suffix in fmt.suffixes):
        found.append("set shard_suffix to one of its suffixes (from_index checks the index's shard names)")
    return found


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_registered_format_implements_the_interface(fmt):
    assert problems(fmt, fmt.weight_set()) == []


def test_a_format_that_skips_a_method_or_a_flag_is_caught():
    class Half(WeightSet):  # what a new format might forget: check_non_tensor, three flags, record_texts
        format = "half"
        record_slot = True

        def read(self, name: str):
            raise NotImplementedError

        def save(self, dest: Path, updates: UpdatesFn, record: dict) -> None:
            raise NotImplementedError

    fmt = Format("half", "x:Half", (".half",), (".half.index.json",), lambda top: [])
    assert problems(fmt, Half) == [
        "implement check_non_tensor",
        "declare patches_in_place (even where the default fits)",
        "declare rewrites_whole_tensors (even where the default fits)",
        "declare graph (even where the default fits)",
        "implement record_texts (record_slot: verify reads the record through it)",
        "set shard_suffix to one of its suffixes (from_index checks the index's shard names)",
    ]
