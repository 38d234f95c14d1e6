"""kill -9 during a write (not --in-place): the input is untouched, the destination is absent or complete,
and the next run to the same destination removes what the killed one left.

The real ``surgeon`` command runs in a child process that SIGKILLs itself at the K-th write event
(entering or leaving a file write, a byte-range copy, a rename, a temporary-folder creation or
removal), for K spread over every event of a full run. And `surgeon` is killed from outside: at a point it
reports (helpers/kill.py's Interruptible), and at times spread over a run, where only what holds wherever a
kill lands is asserted.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from surgeon.write.staging import STAGING_SUFFIX, _owner_prefix

from helpers.digests import tree_digest
from helpers.kill import RUN_SURGEON, Interruptible, duration, kill_at
from helpers.tiny import tiny_llama

pytestmark = pytest.mark.slow

# Runs `surgeon ARGS` and SIGKILLs itself at write event number K (-1: never); prints the event count.
_CHILD = r"""
import builtins, io, os, shutil, signal, sys, tempfile
K, args = int(sys.argv[1]), sys.argv[2:]
count = 0
def hit():
    global count
    if count == K:
        os.kill(os.getpid(), signal.SIGKILL)
    count += 1
def wrap(owner, name):
    real = getattr(owner, name)
    def hooked(*a, **kw):
        hit()
        try:
            return real(*a, **kw)
        finally:
            hit()
    setattr(owner, name, hooked)
class Writer:
    def __init__(self, f): self._f = f
    def write(self, data):
        hit(); n = self._f.write(data); self._f.flush(); hit(); return n
    def __enter__(self): return self
    def __exit__(self, *exc): return self._f.__exit__(*exc)
    def __getattr__(self, name): return getattr(self._f, name)
real_open = builtins.open
def hooked_open(file, mode="r", *a, **kw):
    f = real_open(file, mode, *a, **kw)
    return Writer(f) if any(c in mode for c in "wax+") else f
import torch
import surgeon.formats.safetensors as st, surgeon.formats.torchfile as tf
for owner, name in [(os, "replace"), (os, "rename"), (shutil, "rmtree"), (shutil, "copyfile"), (tempfile, "mkdtemp"),
                    (st, "copy_range"), (st, "write_patched"), (torch, "save")]:
    wrap(owner, name)
from surgeon.cli.commands import main
builtins.open = hooked_open
try:
    main.main(args, prog_name="surgeon", standalone_mode=True)
except SystemExit as exc:
    builtins.open = real_open
    sys.stderr.write(f"\nEVENTS {count}\n")
    raise
"""


def _run(k: int, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", _CHILD, str(k), *map(str, args)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _events(done: subprocess.CompletedProcess) -> int:
    assert done.returncode == 0, done.stderr
    return int(done.stderr.rsplit("EVENTS ", 1)[1].split()[0])


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".surgeon-" in p.name)


def _check_kills(tmp_path, cli, src: Path, dest: Path, extra: tuple = (), *, n: int = 5, seed: int = 0) -> None:
    """A file output that does not exist yet: after each kill it is absent or complete."""
    before = tree_digest(src.parent)
    ref = tmp_path / "reference"
    ref.mkdir()
    total = _events(_run(-1, "reinit", src, "-o", ref / dest.name, *extra))
    expected = (ref / dest.name).read_bytes()
    rng = random.Random(seed)
    for k in sorted(set(rng.sample(range(total), min(n, total)) + [0, total - 1])):
        done = _run(k, "reinit", src, "-o", dest, *extra)
        assert done.returncode == -signal.SIGKILL, (k, done.returncode, done.stderr[-2000:])
        assert tree_digest(src.parent) == before, f"input changed (kill at event {k})"
        assert not dest.exists() or dest.read_bytes() == expected, f"partial destination after a kill at event {k}"
        # the next run to this destination removes what the killed one left, and completes
        cli("reinit", src, "-o", dest, "--overwrite", *extra)
        assert _leftovers(dest.parent) == []
        assert dest.read_bytes() == expected
        dest.unlink()


def test_kill_during_a_single_file_write(tmp_path, cli):
    src = tmp_path / "in" / "model.safetensors"
    src.parent.mkdir()
    tiny_llama().save_pretrained(tmp_path / "llama")
    shutil.copyfile(tmp_path / "llama" / "model.safetensors", src)
    (tmp_path / "out").mkdir()
    _check_kills(
        tmp_path, cli, src, tmp_path / "out" / "model.reinit.safetensors", ("--num-heads", "8", "--num-kv-heads", "2")
    )


def test_kill_while_replacing_an_existing_output_folder(tmp_path, cli):
    """A sharded folder output replacing an earlier one (--overwrite): after each kill it is the old
    output or the new one, whole, never a mix."""
    src = tmp_path / "llama"
    tiny_llama().save_pretrained(src, max_shard_size="40KB")  # several shards and an index
    before = tree_digest(src)
    (tmp_path / "out").mkdir()
    dest = tmp_path / "out" / "llama-reset"
    cli("reinit", src, "-o", dest, "--layers", "0")  # the earlier output
    shutil.copytree(dest, tmp_path / "keep")
    ref = tmp_path / "reference"
    ref.mkdir()
    total = _events(_run(-1, "reinit", src, "-o", ref / dest.name, "--overwrite"))
    # the card names the output only by its folder name, so a complete output is byte-identical to this
    expected, old = tree_digest(ref / dest.name), tree_digest(dest)
    rng = random.Random(1)
    # every event of the last steps (the renames that swap the folders), a sample of the writes before
    commit = max(total - 8, 0)
    for k in sorted(set(rng.sample(range(commit), min(5, commit)) + list(range(commit, total)))):
        done = _run(k, "reinit", src, "-o", dest, "--overwrite")
        assert done.returncode == -signal.SIGKILL, (k, done.stderr[-2000:])
        assert tree_digest(src) == before
        assert not dest.exists() or tree_digest(dest) in (expected, old), (
            f"partial destination after a kill at event {k}"
        )
        cli("reinit", src, "-o", dest, "--overwrite")
        assert _leftovers(dest.parent) == []
        assert tree_digest(dest) == expected
        shutil.rmtree(dest)
        shutil.copytree(tmp_path / "keep", dest)


def _staging(folder: Path, name: str) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(f".{name}.") and p.name.endswith(STAGING_SUFFIX)]


# `surgeon ARGS` that writes the first output file's new tensors, then tells the test and waits for its kill -9.
PAUSE_AFTER_FIRST_FILE = (
    """
import sys
import surgeon.formats.safetensors as st
real, state = st.patch, {}

def patch(header, path, start, updates):
    done = real(header, path, start, updates)
    if not state:
        state["paused"] = True
        paused("one file written")
    return done

st.patch = patch
"""
    + RUN_SURGEON
)


def _sharded_llama(tmp_path) -> Path:
    src = tmp_path / "llama"
    tiny_llama(
        hidden_size=256, intermediate_size=256, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=6
    ).save_pretrained(src, max_shard_size="300KB")  # several shards: several writes
    return src


def test_kill_in_the_middle_of_writing_an_output_folder(tmp_path, cli):
    """kill -9 from outside while the output folder is being written (one file's new tensors written, the
    others not): nothing at the destination, the input as it was, and what the kill left is only in a staging
    folder beside it, which the next run to the destination removes."""
    src = _sharded_llama(tmp_path)
    before = tree_digest(src)
    dest = tmp_path / "out" / "llama-reinit"
    dest.parent.mkdir()
    cli("reinit", src, "-o", dest)
    expected = tree_digest(dest)
    shutil.rmtree(dest)

    child = Interruptible(PAUSE_AFTER_FIRST_FILE, "reinit", src, "-o", dest)
    child.wait_for("one file written")
    child.send(signal.SIGKILL)
    assert child.finish().returncode == -signal.SIGKILL
    assert tree_digest(src) == before and not dest.exists()
    (left,) = _staging(dest.parent, dest.name)
    staged = tree_digest(left)
    assert staged and staged != expected  # part of the output, in the staging folder only
    cli("reinit", src, "-o", dest, "--overwrite")
    assert _leftovers(dest.parent) == [] and tree_digest(dest) == expected


def test_kill_at_random_times(tmp_path, cli):
    """kill -9 from outside at times spread over a whole run on this machine: wherever each kill lands, the
    input is as it was, the destination is absent or complete, and the next run to it removes what the killed
    one left. (Where a kill lands depends on the machine; a kill at a known point is the test above.)"""
    src = _sharded_llama(tmp_path)
    before = tree_digest(src)
    dest = tmp_path / "out" / "llama-reinit"
    dest.parent.mkdir()
    whole = duration(["reinit", str(src), "-o", str(dest)])
    expected = tree_digest(dest)
    shutil.rmtree(dest)
    for fraction in (0.3, 0.5, 0.7, 0.8, 0.9):
        killed = kill_at(["reinit", str(src), "-o", str(dest)], fraction * whole)
        assert tree_digest(src) == before, f"input changed (kill at {fraction} of the run, killed: {killed})"
        assert not dest.exists() or tree_digest(dest) == expected, f"partial destination (kill at {fraction})"
        # the next run to this destination removes what the killed one left, and completes
        cli("reinit", src, "-o", dest, "--overwrite")
        assert _leftovers(dest.parent) == [], f"leftovers after a kill at {fraction} of the run"
        assert tree_digest(dest) == expected
        shutil.rmtree(dest)


def test_leftovers_of_live_or_foreign_runs_are_named_not_removed(tmp_path, cli, llama_dir):
    dest = tmp_path / "out"
    mine_dead = (
        tmp_path / f".out.pid{2**22 + 12345}@{_owner_prefix('x').split('@', 1)[1].rstrip('.')}.abcd1234.surgeon-tmp"
    )
    live = tmp_path / f"{_owner_prefix('out')}abcd1234.surgeon-tmp"  # this very process: still running
    foreign = tmp_path / ".out.pid1@elsewhere.abcd1234.surgeon-tmp"
    legacy = tmp_path / ".out.k2j4h5g6.surgeon-tmp"
    other_dest = tmp_path / ".other.pid1@x.abcd1234.surgeon-tmp"
    for p in (mine_dead, live, foreign, legacy, other_dest):
        (p / "partial").mkdir(parents=True)
    report = cli("reinit", llama_dir, "-o", dest, "--json")
    import json

    notes = json.loads(report.stdout)["notes"]
    assert not mine_dead.exists()  # its process is gone: removed
    for p, why in ((live, "is still running"), (foreign, "on host elsewhere"), (legacy, "an older surgeon made it")):
        assert p.exists()
        assert any(str(p) in n and why in n for n in notes), (p, notes)
    assert other_dest.exists() and not any(
        str(other_dest) in n for n in notes
    )  # another destination's: not ours to judge
