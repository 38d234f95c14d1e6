"""A Detection is a frozen value handed from detection to planning, the format's write plan and verify; so are the
module route's ModuleDetection and the Plan made from either. Frozen all the way down: the sequences they hold are
tuples, so no later stage can append to what an earlier one found."""

from __future__ import annotations

import dataclasses

import pytest

from surgeon.detect import detect_source
from surgeon.detect.module import ModuleDetection, detect_module
from surgeon.open.source import open_source
from surgeon.options import ReinitOptions
from surgeon.plan.planner import Plan, prepare, prepare_checkpoint
from surgeon.vocab.detection import Detection

from helpers.tiny import tiny_llama


def _assert_frozen(value, cls, sequences):
    for field in dataclasses.fields(cls):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field.name, getattr(value, field.name))
    for name in sequences:
        assert isinstance(getattr(value, name), tuple), name  # not a list another stage could append to


def test_a_detection_is_frozen_and_a_route_by_names_has_no_graph(llama_dir):
    detection = detect_source(open_source(llama_dir))
    assert isinstance(detection, Detection) and detection.blocks and detection.graph is None
    _assert_frozen(detection, Detection, ("blocks", "notes", "unreadable", "left_alone"))
    again = dataclasses.replace(detection, notes=("a note", *detection.notes))
    assert again.notes[0] == "a note" and "a note" not in detection.notes


def test_a_plan_is_frozen_and_holds_the_chosen_changes(llama_dir):
    source = open_source(llama_dir)
    plan = prepare_checkpoint(source, detect_source(source), ReinitOptions(layers="1", targets="q"))
    _assert_frozen(plan, Plan, ("blocks", "changes", "notes"))
    assert [(c.block.layer, c.role, c.heads) for c in plan.changes] == [(1, "q", tuple(range(8)))]


def test_the_module_route_hands_on_a_frozen_detection():
    model = tiny_llama()
    found = detect_module(model)
    _assert_frozen(found, ModuleDetection, ("blocks", "notes"))
    assert [b.layer for b in found.blocks] == [0, 1, 2]
    assert all(
        found.params[b.q.weight.tensor] is model.model.layers[b.layer].self_attn.q_proj.weight for b in found.blocks
    )
    plan = prepare(found.blocks, ReinitOptions(layers="-1"), depths=found.depths)
    _assert_frozen(plan, Plan, ("blocks", "changes", "notes"))
    assert {c.block.layer for c in plan.changes} == {2}
