"""A Report is a frozen value, made once from the results: a note added (the CLI's plot) makes a new one, and its
JSON and table are the same as a report made with that note."""

from __future__ import annotations

import dataclasses
import json

import pytest

import surgeon
from surgeon.report.report import Report

from helpers.tiny import tiny_llama


def test_a_report_cannot_be_changed_after_it_is_made():
    report = surgeon.inspect(tiny_llama())
    assert isinstance(report, Report) and report.rows and report.blocks
    for field in dataclasses.fields(Report):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(report, field.name, getattr(report, field.name))
    for name in ("blocks", "rows", "notes"):
        assert isinstance(getattr(report, name), tuple), name  # not a list a later stage could append to


def test_a_note_added_makes_a_new_report_with_the_same_output():
    report = surgeon.inspect(tiny_llama())
    noted = dataclasses.replace(report, notes=(*report.notes, "wrote plot.png"))
    assert "wrote plot.png" not in report.notes and noted.notes[-1] == "wrote plot.png"
    data = json.loads(noted.to_json())
    assert data["notes"] == [*report.to_dict()["notes"], "wrote plot.png"]
    assert noted.render().endswith("note: wrote plot.png")
    # made from lists (as a caller of the API may): the same value, tuples inside, the same JSON and table
    fields = {f.name: getattr(noted, f.name) for f in dataclasses.fields(Report)}
    listed = Report(**{**fields, **{name: list(fields[name]) for name in ("blocks", "rows", "notes")}})
    assert listed == noted and isinstance(listed.notes, tuple)
    assert listed.to_json() == noted.to_json() and listed.render() == noted.render()
