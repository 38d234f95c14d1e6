"""Edits of the surgeon record in a safetensors header: what tamper tests write."""

from __future__ import annotations

import json
import struct

from surgeon.formats.safetensors import encode_header, read_header, with_metadata

# The options a record and a report hold for a run with every default, written out here (not read from surgeon):
# the CLI's defaults, which the Python API mirrors.
DEFAULT_OPTIONS = {
    "layers": "all",
    "targets": ["q", "k", "v"],
    "heads": "all",
    "attention": "all",
    "stack": None,
    "mode": "conditioned",
    "strength": None,
    "value_identity": "block",
    "keep_scale": False,
    "bias": "zero",
    "seed": 0,
}


def rewrite_record(path, edit):
    """The safetensors file with its surgeon metadata replaced by ``edit(records)`` (a string: stored as it is)."""
    header = read_header(path)
    meta = header.metadata
    value = edit(json.loads(meta["surgeon"]))
    text = value if isinstance(value, str) else json.dumps(value)
    raw = encode_header(with_metadata(header.entries, {**meta, "surgeon": text}))
    data = path.read_bytes()[header.data_start :]
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def edit_last(change):
    def edit(records):
        change(records[-1])
        return records

    return edit
