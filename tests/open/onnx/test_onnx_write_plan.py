"""The write plan is the only place a format's decisions about its writes live: a frozen value made by
``WeightSet.write_plan``, handed to the saves and to verify; the weight set itself keeps nothing of it."""

from __future__ import annotations

import dataclasses

import onnx
import pytest

from surgeon.compute.per_file import Compute
from surgeon.detect import detect_source
from surgeon.formats.write_plan import SharedCopy, WritePlan
from surgeon.open.source import open_source
from surgeon.options import ReinitOptions
from surgeon.plan.planner import prepare_checkpoint
from surgeon.vocab.detection import GraphFacts

from helpers.onnx_graphs import tiny_attention


@pytest.fixture
def shared(tmp_path):
    """A two-layer graph whose layers read one query weight, its detection, and a plan for layer 0 alone."""
    path = tmp_path / "m" / "model.onnx"
    path.parent.mkdir()
    onnx.save_model(tiny_attention(layers=2, share_q=True), str(path))
    source = open_source(path)
    detection = detect_source(source)
    return source, detection, prepare_checkpoint(source, detection, ReinitOptions(layers="0"))


def _saved(source, plan, write_plan, dest):
    run = Compute(plan, "cpu", whole=False, progress=False, total=len(plan.tensors()))
    dest.mkdir()
    source.primary.save(dest, run.updates_for(source.primary, True), plan.record(), write_plan)
    return onnx.load(str(dest / "model.onnx"))


def test_the_copies_come_from_the_write_plan(shared, tmp_path):
    source, detection, plan = shared
    weights = source.primary
    assert weights.names  # a cache of what the file holds, filled on first use
    before = dict(vars(weights))
    write_plan = weights.write_plan(plan, detection)
    assert vars(weights).keys() == before.keys()  # nothing kept on the weight set for a later stage
    (copy,) = write_plan.copies
    readers = [n for n, node in enumerate(weights.model.graph.node) if node.name == "/layers.0/attn/q_proj/MatMul"]
    assert copy == SharedCopy("q_shared", "q_shared.surgeon_copy", tuple(readers))
    assert write_plan.copy_names == {"q_shared": "q_shared.surgeon_copy"}
    assert any("read a new copy of it, 'q_shared.surgeon_copy'" in note for note in write_plan.notes)
    assert weights.write_plan(plan, detection) == write_plan  # made again (verify), the same decisions

    out = _saved(source, plan, write_plan, tmp_path / "with")
    assert [t.name for t in out.graph.initializer][-1] == "q_shared.surgeon_copy"
    assert [node.input[1] for node in out.graph.node if node.name.endswith("q_proj/MatMul")] == [
        "q_shared.surgeon_copy",
        "q_shared",
    ]
    # the same weight set saved with a write plan without copies writes none: no hidden state decides
    out = _saved(source, plan, WritePlan(), tmp_path / "without")
    assert "q_shared.surgeon_copy" not in {t.name for t in out.graph.initializer}


def test_a_write_plan_is_frozen_and_every_save_needs_one(shared, tmp_path):
    source, detection, plan = shared
    write_plan = source.primary.write_plan(plan, detection)
    with pytest.raises(dataclasses.FrozenInstanceError):
        write_plan.copies = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        write_plan.copies[0].readers = ()  # type: ignore[misc]
    updates = Compute(plan, "cpu", whole=False, progress=False, total=1).updates_for(source.primary, True)
    for save in (
        lambda: source.primary.save(tmp_path, updates, {}),  # type: ignore[call-arg]
        lambda: source.primary.save_as(tmp_path, "out.onnx", updates, {}),  # type: ignore[call-arg]
    ):
        with pytest.raises(TypeError, match="write_plan"):
            save()
    assert not list(tmp_path.glob("*.onnx"))


def test_an_onnx_detection_is_frozen_and_carries_the_graph_facts(shared):
    _, detection, plan = shared
    assert isinstance(detection.graph, GraphFacts)
    q = plan.changes[0].block.q.weight.tensor
    assert q == "q_shared"
    assert detection.graph.graph.consumers[q] == [
        n for n, node in enumerate(detection.graph.graph.nodes) if q in node.input
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        detection.graph = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.outputs = {}  # type: ignore[misc]
