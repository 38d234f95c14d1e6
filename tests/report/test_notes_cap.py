"""One cap on the notes one stage adds to a report, and a line that counts what it leaves out."""

from __future__ import annotations

from surgeon.text.notes import NOTE_CAP, capped


def test_notes_up_to_the_cap_are_kept_as_they_are():
    lines = [f"note {i}" for i in range(NOTE_CAP)]
    assert capped(lines, "detection notes") == lines


def test_notes_past_the_cap_are_counted_never_dropped_unsaid():
    lines = [f"note {i}" for i in range(NOTE_CAP + 2)]
    assert capped(lines, "detection notes") == [*lines[:NOTE_CAP], "and 2 more detection notes"]
