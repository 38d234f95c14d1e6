"""Fuzzing the journal reader: a real journal from a killed run, mutated at random (bytes, and the JSON
range list re-checksummed so the checks behind the checksum are reached). Every outcome is either a
one-line CheckpointError that leaves the file and the journal as they were, or the exact original file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from surgeon import CheckpointError
from surgeon.formats import journal_file as jf
from surgeon.formats.journal_file import journal_path
from surgeon.open.recovery import recover

from helpers.journals import kill_half_way
from helpers.tiny import tiny_llama

FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True
)


class Killed(tuple):
    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example: not megabytes of them
        return f"Killed({self[0]})"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """(checkpoint, original bytes, half-patched bytes, the real journal's bytes)."""
    folder = tmp_path_factory.mktemp("fuzz") / "llama"
    tiny_llama().save_pretrained(folder)
    src = folder / "model.safetensors"
    original = src.read_bytes()
    kill_half_way(src, "--layers", "all")
    journal = journal_path(folder, "model.safetensors")
    return Killed((src, original, src.read_bytes(), journal.read_bytes()))


def attempt(killed, journal_bytes: bytes) -> None:
    src, original, half, _ = killed
    with open(src, "r+b") as f:  # back to the half-patched state, same inode (the journal is tied to it)
        f.write(half)
    journal = journal_path(src.parent, src.name)
    journal.write_bytes(journal_bytes)
    try:
        recover(src)
    except CheckpointError as exc:
        assert "\n" not in str(exc) and str(journal) in str(exc)
        assert src.read_bytes() == half and journal.read_bytes() == journal_bytes  # nothing applied, nothing deleted
        return
    assert src.read_bytes() == original and not journal.exists()


def test_the_real_journal_rolls_back(killed):
    attempt(killed, killed[3])


mutation = st.one_of(
    st.tuples(
        st.just("flip"), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), min_size=1, max_size=4)
    ),
    st.tuples(st.just("cut"), st.integers(0, 1 << 20)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=200)),
    st.tuples(st.just("replace"), st.binary(max_size=400)),
)


@FUZZ
@given(mutation)
def test_mutated_bytes_are_refused_or_exact(killed, change):
    real = bytearray(killed[3])
    kind, arg = change
    if kind == "flip":
        for pos, xor in arg:
            real[pos % len(real)] ^= xor
    elif kind == "cut":
        del real[arg % len(real) :]
    elif kind == "append":
        real += arg
    else:
        real = bytearray(jf.MAGIC + arg) if arg[:1] == b"\0" else bytearray(arg)
    attempt(killed, bytes(real))


def _split(data: bytes) -> tuple[dict, bytes, bytes]:
    """meta, the bytes after it up to the checksum, and the records after the checksum."""
    (n,) = struct.unpack_from("<Q", data, len(jf.MAGIC))
    start = len(jf.MAGIC) + 8
    meta = json.loads(data[start : start + n])
    fixed = start + n + sum(r[2] for r in meta["ranges"]) + 32 * len(meta["ranges"])
    return meta, data[start + n : fixed], data[fixed + 32 :]


def _rebuild(meta_raw: bytes, rest: bytes, records: bytes) -> bytes:
    body = jf.MAGIC + struct.pack("<Q", len(meta_raw)) + meta_raw + rest
    return body + hashlib.sha256(body).digest() + records


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 64), 1 << 64) | st.text(max_size=20) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


@FUZZ
@given(st.data())
def test_mutated_range_lists_behind_a_valid_checksum_are_refused_or_exact(killed, data):
    meta, rest, records = _split(killed[3])
    paths = list(_paths(meta))
    path = data.draw(st.sampled_from(paths[1:]))
    value = data.draw(json_values | st.integers(0, 1 << 40))
    target = meta
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    attempt(killed, _rebuild(json.dumps(meta).encode(), rest, records))


def test_the_fuzz_can_tell_a_bad_outcome(killed, tmp_path):
    """The harness fails when a journal is applied to a file it does not match (a copy: another inode)."""
    src, original, half, real = killed
    copy = tmp_path / "llama"
    shutil.copytree(src.parent, copy)
    journal_path(copy, src.name).write_bytes(real)
    with pytest.raises(CheckpointError, match="is not the file it was written for"):
        recover(copy / src.name)
