"""A Source is a frozen value: opening a checkpoint (and a Hub model) makes it once, and no later stage can change
what was opened, nor append to its sequences (tuples)."""

from __future__ import annotations

import dataclasses

import pytest

from surgeon.open.source import Source, open_source


def test_a_source_cannot_be_changed_after_it_is_opened(llama_dir):
    source = open_source(llama_dir)
    assert source.kind == "folder" and source.config is not None and source.config_path == llama_dir / "config.json"
    for field in dataclasses.fields(Source):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(source, field.name, getattr(source, field.name))
    for name in ("weights", "extra_files", "notes"):
        assert isinstance(getattr(source, name), tuple), name  # not a list a later stage could append to
    again = dataclasses.replace(source, notes=(*source.notes, "a note"))
    assert again.notes[-1] == "a note" and "a note" not in source.notes


def test_a_source_keeps_its_notes_in_order(llama_dir):
    """The folder's own notes first, then where the head counts came from, then the weight sets' notes: as before."""
    (llama_dir / "tf_model.h5").write_bytes(b"not read")
    source = open_source(llama_dir)
    assert source.notes == (
        "left out other copies of the weights that surgeon does not rewrite here: tf_model.h5 (re-export them from the output)",
    )
    assert "tf_model.h5" not in source.extra_files and "config.json" in source.extra_files
