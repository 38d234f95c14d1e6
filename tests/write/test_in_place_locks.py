"""In place, with others around: one lock per checkpoint (a shard and its index exclude each other),
copies that wait for a patch to finish, shared bytes refused, and faults while journaling or undoing.

Real `surgeon` processes are paused at a chosen point (holding the lock, before or after the journal is
written) with a hook that waits for a file; the other command runs meanwhile.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from surgeon.formats.journal_file import SUFFIX, journal_path

from helpers.cli import expect_cli_error
from helpers.digests import sha256, tree_digest
from helpers.journals import kill_half_way, tensor_range
from helpers.kill import PAUSE_AFTER_FIRST_TENSOR, RUN_SURGEON, Interruptible
from helpers.tiny import tiny_llama

Q0 = "model.layers.0.self_attn.q_proj.weight"

# `surgeon ARGS...` that stops at WHERE ("before-journal": lock held, nothing written; "after-first": the
# journal written and one tensor patched), touches PAUSED, and goes on once GO exists.
PAUSE = textwrap.dedent(
    """
    import os, sys, time
    import surgeon.write.journal as journal
    where, paused, go = sys.argv[1:4]

    def wait():
        open(paused, "w").close()
        while not os.path.exists(go):
            time.sleep(0.05)

    if where == "before-journal":
        real_write = journal.jf.write
        def write(*args):
            wait()
            return real_write(*args)
        journal.jf.write = write
    else:
        real, state = journal.patch, {}
        def patch(header, path, start, updates):
            if state:
                return real(header, path, start, updates)
            items = iter(updates)
            done = real(header, path, start, [next(items)])
            state["paused"] = True
            wait()
            return done + real(header, path, start, items)
        journal.patch = patch
    from surgeon.cli.commands import main
    sys.argv = ["surgeon", *sys.argv[4:]]
    main()
    """
)


class Paused:
    """A real surgeon process held at a point; ``go()`` lets it finish and returns its exit code."""

    def __init__(self, tmp_path, where: str, *args) -> None:
        self.paused, self.flag = tmp_path / f"paused-{where}", tmp_path / f"go-{where}"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PAUSE, where, str(self.paused), str(self.flag), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6000):  # up to 5 minutes on a loaded machine; a sequencing wait, not a timing check
            if self.paused.exists() or self.proc.poll() is not None:
                break
            time.sleep(0.05)
        assert self.paused.exists(), self.proc.communicate()[1][-2000:]

    def go(self) -> int:
        self.flag.touch()
        out, err = self.proc.communicate(timeout=300)
        assert self.proc.returncode == 0, err[-2000:]
        return self.proc.returncode


def sharded(tmp_path, name="sharded"):
    folder = tmp_path / name
    tiny_llama().save_pretrained(folder, max_shard_size="100KB")  # shard 1 holds layer 0's attention
    return folder


@pytest.mark.parametrize("where", ["before-journal", "after-first"])
@pytest.mark.parametrize("first", ["index", "shard"])
def test_a_shard_run_and_an_index_run_exclude_each_other(tmp_path, cli, first, where):
    folder = sharded(tmp_path)
    ref = tmp_path / "ref"
    shutil.copytree(folder, ref)
    index, shard = "model.safetensors.index.json", "model-00001-of-00005.safetensors"
    one, other = (index, shard) if first == "index" else (shard, index)
    run = Paused(tmp_path, where, "reinit", folder / one, "--in-place", "--layers", "0")
    try:
        line = expect_cli_error(
            cli,
            tmp_path / "sharded",
            "reinit",
            folder / other,
            "--in-place",
            "--layers",
            "0",
            "--seed",
            "9",
            match="patching",
        )
        assert "another surgeon run is patching" in line or "right now" in line
        if where == "after-first":  # recover leaves a live run alone
            assert "in progress" in cli("recover", folder).output
    finally:
        run.go()
    assert not list(folder.glob(f".*{SUFFIX}*"))
    cli("reinit", ref / one, "--in-place", "--layers", "0")
    assert tree_digest(folder) == tree_digest(ref)  # exactly the first run's result, nothing of the refused one


def test_a_copy_refuses_while_a_patch_is_half_way(tmp_path, cli):
    folder = sharded(tmp_path)
    run = Paused(tmp_path, "after-first", "reinit", folder, "--in-place", "--layers", "all")
    try:
        expect_cli_error(cli, tmp_path / "sharded", "reinit", folder, "-o", tmp_path / "out", match="right now")
        expect_cli_error(cli, tmp_path / "sharded", "inspect", folder, match="right now")
        assert not (tmp_path / "out").exists()
    finally:
        run.go()


# `surgeon ARGS...` that touches WAITING the first time it finds the checkpoint's lock taken (and waits).
SAYS_WHEN_WAITING = textwrap.dedent(
    """
    import sys, time
    import surgeon.files.locks as locks
    waiting, said = sys.argv[1], []

    class Clock:
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds):
            if not said:
                open(waiting, "w").close()
                said.append(True)
            time.sleep(seconds)

    locks.time = Clock
    from surgeon.cli.commands import main
    sys.argv = ["surgeon", *sys.argv[2:]]
    main()
    """
)


def test_a_copy_waits_for_an_in_place_run_then_copies_its_result(tmp_path, cli):
    folder = sharded(tmp_path)
    run = Paused(tmp_path, "before-journal", "reinit", folder, "--in-place", "--layers", "all")
    (tmp_path / "a").mkdir()
    waiting = tmp_path / "waiting"
    copy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SAYS_WHEN_WAITING,
            str(waiting),
            "reinit",
            str(folder),
            "-o",
            str(tmp_path / "a" / "out"),
            "--seed",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for _ in range(6000):  # sequencing: until the copy is waiting on the in-place run's lock
        if waiting.exists() or copy.poll() is not None:
            break
        time.sleep(0.05)
    assert waiting.exists(), copy.communicate()[1][-2000:]
    run.go()
    _, err = copy.communicate(timeout=300)
    assert copy.returncode == 0, err
    (tmp_path / "b").mkdir()
    cli("reinit", folder, "-o", tmp_path / "b" / "out", "--seed", "5")  # a copy of the finished patch
    assert tree_digest(tmp_path / "a" / "out") == tree_digest(tmp_path / "b" / "out")


def hub_cache_like(tmp_path, *, shard: str | None = None):
    """A snapshot folder whose files are links to content-named blobs, as in the Hugging Face cache."""
    src = tmp_path / "src"
    tiny_llama().save_pretrained(src, **({"max_shard_size": shard} if shard else {}))
    repo = tmp_path / "hub" / "models--org--tiny"  # the cache's own layout: only these links are followed
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for p in src.iterdir():
        blob = blobs / sha256(p)
        shutil.copyfile(p, blob)
        (snap / p.name).symlink_to(os.path.relpath(blob, snap))
    return snap


@pytest.mark.parametrize("shard", [None, "100KB"])
def test_in_place_through_hub_cache_links_is_refused(tmp_path, cli, shard):
    snap = hub_cache_like(tmp_path, shard=shard)
    target = snap / ("model.safetensors.index.json" if shard else "model.safetensors")
    for what in (snap, target):
        line = expect_cli_error(cli, tmp_path / "hub", "reinit", what, "--in-place", match="is a symbolic link")
        assert "-o/--output" in line
    # a copy is fine, and leaves the blobs alone
    before = tree_digest(tmp_path / "hub")
    cli("reinit", snap, "-o", tmp_path / "out")
    assert tree_digest(tmp_path / "hub") == before


def test_in_place_on_a_hard_linked_file_is_refused(llama_dir, tmp_path, cli):
    os.link(llama_dir / "model.safetensors", tmp_path / "twin.safetensors")
    expect_cli_error(cli, tmp_path, "reinit", llama_dir, "--in-place", match="has 2 hard links")


def test_in_place_on_a_dual_format_folder_is_refused_before_any_write(llama_dir, cli):
    torch.save(tiny_llama().state_dict(), llama_dir / "pytorch_model.bin")  # the same weights beside model.safetensors
    assert (llama_dir / "pytorch_model.bin").is_file() and (llama_dir / "model.safetensors").is_file()
    for target in (llama_dir, llama_dir / "model.safetensors"):  # the folder, or its safetensors file alone
        expect_cli_error(cli, llama_dir, "reinit", target, "--in-place", match="holds the weights twice")


def _fsize_limit(limit):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # writes past it fail (EFBIG), like a full disk

    return apply


def test_disk_full_while_journaling_leaves_no_temporary_journal(llama_dir):
    src = llama_dir / "model.safetensors"
    before = sha256(src)
    run = subprocess.run(
        [sys.executable, "-m", "surgeon", "reinit", str(src), "--in-place", "--layers", "all"],
        capture_output=True,
        text=True,
        preexec_fn=_fsize_limit(32 << 10),
        timeout=300,
    )
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and "File too large" in lines[0], run.stderr
    assert sha256(src) == before
    assert sorted(p.name for p in llama_dir.iterdir() if p.name.startswith(".")) == []  # no journal, no .tmp


# Ctrl-C (from the test) after one tensor is patched; with "twice", a second one as the rollback starts.
CTRL_C = (
    PAUSE_AFTER_FIRST_TENSOR
    + """
real_restore, times = journal.jf.restore, sys.argv.pop(1)

def restore(*args):
    if times == "twice" and "restoring" not in state:
        state["restoring"] = True
        paused("restoring")
    return real_restore(*args)

journal.jf.restore = restore
"""
    + RUN_SURGEON
)


@pytest.mark.parametrize("times", ["once", "twice"])
def test_ctrl_c_while_patching_says_what_is_true(llama_dir, cli, times):
    src = llama_dir / "model.safetensors"
    original = sha256(src)
    child = Interruptible(CTRL_C, times, "reinit", src, "--in-place", "--layers", "all")
    child.wait_for("patching")
    child.send(signal.SIGINT)
    if times == "twice":
        child.wait_for("restoring")
        child.send(signal.SIGINT)
    run = child.finish()
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 130 and len(lines) == 1, run.stderr
    if times == "once":  # rolled back at once: the input is as it was
        assert "nothing was written" in lines[0] and sha256(src) == original
        assert not journal_path(llama_dir, "model.safetensors").exists()
        return
    assert (
        "nothing was written" not in lines[0]
        and f"run `surgeon recover {src}`" in lines[0]
        and "half-patched" in lines[0]
    )
    assert sha256(src) != original and journal_path(llama_dir, "model.safetensors").exists()
    cli("recover", src)
    assert sha256(src) == original


def _tear(path, original: bytes, offset: int, cut: int) -> None:
    """Make bytes ``cut``.. of the range at ``offset`` old again, as a write killed there leaves them (same inode)."""
    with open(path, "r+b") as f:
        f.seek(cut)
        f.write(original[cut : offset + tensor_range(path, Q0)[1]])


@pytest.mark.parametrize("aligned", [True, False])
def test_a_write_torn_by_a_kill_is_rolled_back_block_by_block(llama_dir, tmp_path, cli, aligned):
    src = llama_dir / "model.safetensors"
    original = src.read_bytes()
    kill_half_way(src, "--layers", "0")
    offset, length = tensor_range(src, Q0)
    assert (
        src.read_bytes()[offset : offset + length] != original[offset : offset + length]
    )  # the first tensor: q of layer 0
    cut = (offset // 4096 + 2) * 4096 + (0 if aligned else 100)  # the kernel stops a killed write at a 4 KiB boundary
    assert cut < offset + length
    _tear(src, original, offset, cut)
    if aligned:
        cli("recover", src)
        assert src.read_bytes() == original
    else:  # half of a block new, half old: no write of surgeon's leaves that
        expect_cli_error(
            cli, llama_dir, "recover", src, match="hold neither the bytes it saved nor those its run wrote"
        )


# Dies (kill -9) right after the new header (with surgeon's record) is written.
KILL_AFTER_HEADER = textwrap.dedent(
    """
    import os, signal, sys
    real = os.pwrite
    def pwrite(fd, data, offset):
        n = real(fd, data, offset)
        if offset == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return n
    os.pwrite = pwrite
    from surgeon.cli.commands import main
    sys.argv = ["surgeon", *sys.argv[1:]]
    main()
    """
)


def test_a_patched_header_is_rolled_back_with_the_tensors(tmp_path, cli):
    import struct

    from surgeon.formats.safetensors_header import read_header, records

    folder = tmp_path / "padded"
    tiny_llama().save_pretrained(folder)
    src = folder / "model.safetensors"
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].rstrip() + b" " * (n - len(raw[8 : 8 + n].rstrip()) + 4096)  # room for the record
    src.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])
    original = sha256(src)
    run = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_HEADER, "reinit", str(src), "--in-place", "--layers", "0"],
        capture_output=True,
    )
    assert run.returncode == -signal.SIGKILL
    assert records(read_header(src).metadata)  # the record is in the header: the whole patch was written
    cli("recover", src)
    assert sha256(src) == original and not records(read_header(src).metadata)


def test_recovered_weights_load_and_run(llama_dir, cli):
    """Through the model's own forward: after kill -9 and recover, the model computes what it did before."""
    from transformers import LlamaForCausalLM

    ids = torch.arange(12).view(1, 12)
    before = LlamaForCausalLM.from_pretrained(llama_dir)(ids).logits
    kill_half_way(llama_dir / "model.safetensors", "--layers", "all")
    cli("recover", llama_dir)
    after = LlamaForCausalLM.from_pretrained(llama_dir)(ids).logits
    assert torch.equal(before, after)


def test_verify_waits_for_an_in_place_run_on_the_output(tmp_path, cli):
    """verify reads under the checkpoints' shared lock: it never reads an output half-way through a patch."""
    folder = sharded(tmp_path)
    out = tmp_path / "out"
    cli("reinit", folder, "-o", out, "--layers", "0")
    run = Paused(tmp_path, "before-journal", "reinit", out, "--in-place", "--layers", "1", "--seed", "3")
    waiting = tmp_path / "waiting"
    check = subprocess.Popen(
        [sys.executable, "-c", SAYS_WHEN_WAITING, str(waiting), "verify", str(folder), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for _ in range(6000):  # sequencing: until verify is waiting on the in-place run's lock
        if waiting.exists() or check.poll() is not None:
            break
        time.sleep(0.05)
    assert waiting.exists(), check.communicate()
    run.go()
    _, stderr = check.communicate(timeout=300)
    # it read the finished patch: layer 1 changed outside the recorded selection (layer 0), so exit 3
    assert check.returncode == 3 and stderr.count("\n") == 1, stderr
    assert "model.layers.1.self_attn" in stderr and "is not in the recorded selection" in stderr


# `surgeon ARGS` (a reinit --in-place) that patches every tensor, then dies as kill -9 does: a real journal
# whose every range holds new bytes.
KILL_AFTER_ALL = textwrap.dedent(
    """
    import os, signal, sys
    import surgeon.write.journal as journal
    real = journal.patch

    def patch(header, path, start, updates):
        real(header, path, start, updates)
        os.kill(os.getpid(), signal.SIGKILL)

    journal.patch = patch
    from surgeon.cli.commands import main
    sys.argv = ["surgeon", *sys.argv[1:]]
    main()
    """
)

# `surgeon recover ARGS` with a Ctrl-C (from the test) right after the first tensor is written back.
CTRL_C_IN_RECOVER = (
    """
import sys
import surgeon.formats.journal_file as jf
real, state = jf.restore, {}

def restore(*args):
    done = real(*args)
    if not state:
        state["restored"] = True
        paused("restored one")
    return done

jf.restore = restore
"""
    + RUN_SURGEON
)


def test_ctrl_c_during_recover_says_what_was_restored(llama_dir, cli):
    src = llama_dir / "model.safetensors"
    original = src.read_bytes()
    run = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_ALL, "reinit", str(src), "--in-place", "--layers", "all"],
        capture_output=True,
        timeout=300,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    patched = src.read_bytes()
    changed = [n for n in tree_names(src) if _bytes_of(original, src, n) != _bytes_of(patched, src, n)]
    assert len(changed) == 9  # q, k and v of 3 layers

    child = Interruptible(CTRL_C_IN_RECOVER, "recover", src)
    child.wait_for("restored one")
    child.send(signal.SIGINT)
    run = child.finish()
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 130 and len(lines) == 1, run.stderr
    now = src.read_bytes()
    back = [n for n in changed if _bytes_of(now, src, n) == _bytes_of(original, src, n)]
    assert len(back) == 1  # the first restoring write happened, the rest did not
    assert "nothing was written" not in lines[0], lines[0]
    assert f"1 of {len(changed)} changed tensors are restored" in lines[0], lines[0]
    assert f"{journal_path(llama_dir, 'model.safetensors').name} (kept)" in lines[0], lines[0]
    assert f"run `surgeon recover {src}` again" in lines[0], lines[0]
    assert journal_path(llama_dir, "model.safetensors").exists()
    cli("recover", src)  # the second one finishes the job
    assert src.read_bytes() == original and not journal_path(llama_dir, "model.safetensors").exists()


def tree_names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return list(f.keys())


def _bytes_of(content: bytes, path, name: str) -> bytes:
    offset, length = tensor_range(path, name)
    return content[offset : offset + length]
