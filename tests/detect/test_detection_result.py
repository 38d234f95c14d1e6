"""A Detection is a frozen value handed from detection to planning, the format's write plan and verify."""

from __future__ import annotations

import dataclasses

import pytest

from surgeon.detect import Detection, detect_source
from surgeon.open.source import open_source


def test_a_detection_is_frozen_and_a_route_by_names_has_no_graph(llama_dir):
    detection = detect_source(open_source(llama_dir))
    assert isinstance(detection, Detection) and detection.blocks and detection.graph is None
    for field in dataclasses.fields(Detection):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(detection, field.name, getattr(detection, field.name))
    again = dataclasses.replace(detection, notes=["a note", *detection.notes])
    assert again.notes[0] == "a note" and detection.notes[:1] != ["a note"]
