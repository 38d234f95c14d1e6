"""A journal is hostile until checked: only `surgeon recover` (or `--in-place` on the same checkpoint)
applies one, and only when it belongs to the files as they are now; every other command refuses a
checkpoint with a journal, writes nothing, and names `surgeon recover`.

Forged journals here are the best an attacker could write: they know the file's inode and header, and
claim that the file now holds their 'new' bytes, so only the check under test stands between them and
the file. A control test shows such a forgery on the checkpoint's own file would be applied (the
trust boundary: a journal can at most give a checkpoint's own tensor bytes back).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from surgeon import CheckpointError
from surgeon.formats.journal_file import journal_path
from surgeon.open.recovery import recover

from helpers.cli import expect_cli_error
from helpers.digests import sha256, tree_digest
from helpers.journals import best_forgery, craft, ident, kill_half_way, tensor_range
from helpers.tiny import tiny_llama

Q0 = "model.layers.0.self_attn.q_proj.weight"


def refused(cli, folder, *args, match):
    """One line, nothing written under ``folder`` (journal included: never deleted silently)."""
    return expect_cli_error(cli, folder, *args, match=match)


# --- forged journals -----------------------------------------------------------------------------------


def test_control_a_forgery_that_knows_everything_only_reaches_the_checkpoints_own_tensor(llama_dir, cli):
    src = llama_dir / "model.safetensors"
    journal, payload = best_forgery(llama_dir, "model.safetensors", Q0)
    before = src.read_bytes()
    cli("recover", src)
    offset, length = tensor_range(src, Q0)
    after = src.read_bytes()
    assert (
        after[offset : offset + length] == payload
        and after[:offset] + after[offset + length :] == before[:offset] + before[offset + length :]
    )
    assert not journal.exists()


def test_a_symlink_out_of_the_folder_is_never_written_through(tmp_path, cli):
    outside = tmp_path / "outside"
    tiny_llama().save_pretrained(outside)  # a safetensors file elsewhere (a ~/.bashrc would do as well)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
    # the forgery knows the target's true inode, header and bytes
    meta = {
        "version": 2,
        "checkpoint": "model.safetensors",
        "index_sha256": None,
        "files": {"model.safetensors": ident(outside / "model.safetensors")},
        "ranges": [["model.safetensors", *tensor_range(outside / "model.safetensors", Q0)]],
    }
    offset, length = meta["ranges"][0][1:]
    craft(
        journal_path(folder, "model.safetensors"),
        meta,
        [b"\0" * length],
        [(outside / "model.safetensors").read_bytes()[offset : offset + length]],
    )
    before = tree_digest(tmp_path)
    refused(cli, folder, "recover", folder, match="symbolic link")
    refused(cli, folder, "inspect", folder, match="surgeon recover")
    assert tree_digest(tmp_path) == before


def test_a_shard_linked_out_of_the_folder_through_the_index_is_refused(tmp_path, cli):
    outside = tmp_path / "outside"
    tiny_llama().save_pretrained(outside)
    folder = tmp_path / "model"
    folder.mkdir()
    victim = outside / "model.safetensors"
    (folder / "model-00001-of-00001.safetensors").symlink_to(victim)
    from safetensors import safe_open

    with safe_open(victim, "pt") as f:
        names = list(f.keys())
    key = "model.safetensors.index.json"
    (folder / key).write_text(json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    offset, length = tensor_range(victim, Q0)
    meta = {
        "version": 2,
        "checkpoint": key,
        "index_sha256": hashlib.sha256((folder / key).read_bytes()).hexdigest(),
        "files": {"model-00001-of-00001.safetensors": ident(victim)},
        "ranges": [["model-00001-of-00001.safetensors", offset, length]],
    }
    craft(journal_path(folder, key), meta, [b"\0" * length], [victim.read_bytes()[offset : offset + length]])
    before = tree_digest(tmp_path)
    refused(cli, folder, "recover", folder, match="symbolic link")
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("case", ["config-key", "config-in-files", "dotdot", "slash", "other-checkpoint"])
def test_a_journal_naming_another_file_is_refused(llama_dir, cli, case):
    src = llama_dir / "model.safetensors"
    (llama_dir / "x.safetensors").write_bytes(src.read_bytes())
    offset, length = tensor_range(src, Q0)
    base = {"version": 2, "checkpoint": "model.safetensors", "index_sha256": None}
    if case == "config-key":  # a journal for config.json itself
        craft(
            journal_path(llama_dir, "config.json"),
            {
                **base,
                "checkpoint": "config.json",
                "files": {"config.json": ident(src)},
                "ranges": [["config.json", 0, 10]],
            },
            [b"x" * 10],
        )
        match = "not a safetensors checkpoint"
    else:
        name = {
            "config-in-files": "config.json",
            "dotdot": "../llama/model.safetensors",
            "slash": "/etc/passwd",
            "other-checkpoint": "x.safetensors",
        }[case]
        craft(
            journal_path(llama_dir, "model.safetensors"),
            {**base, "files": {name: ident(src)}, "ranges": [[name, offset, length]]},
            [b"\0" * length],
        )
        match = "is not a weight file of model.safetensors"
    refused(cli, llama_dir, "recover", llama_dir, match=match)


@pytest.mark.parametrize("where", ["header-part", "two-tensors", "past-the-end", "inside-a-tensor", "twice"])
def test_a_range_outside_one_tensors_bytes_is_refused(llama_dir, cli, where):
    src = llama_dir / "model.safetensors"
    offset, length = tensor_range(src, Q0)
    size = src.stat().st_size
    ranges = {
        "header-part": [[8, 16]],
        "two-tensors": [[offset, length + 64]],
        "past-the-end": [[size, 1 << 30]],
        "inside-a-tensor": [[offset + 4, length - 4]],
        "twice": [[offset, length], [offset, length]],
    }[where]
    meta = {
        "version": 2,
        "checkpoint": "model.safetensors",
        "index_sha256": None,
        "files": {"model.safetensors": ident(src)},
        "ranges": [["model.safetensors", o, n] for o, n in ranges],
    }
    craft(journal_path(llama_dir, "model.safetensors"), meta, [b"\0" * n for _, n in ranges])
    refused(cli, llama_dir, "recover", src, match="twice" if where == "twice" else "not the bytes of one tensor")


def test_a_stale_journal_is_refused_on_a_checkpoint_saved_later(llama_dir, cli):
    src = llama_dir / "model.safetensors"
    kill_half_way(src, "--layers", "all")
    import torch
    from safetensors.torch import load_file, save_file

    state = {k: v + 1 for k, v in load_file(src).items()}  # the same names and shapes: a newer save at the same path
    save_file(state, src, metadata={"format": "pt"})  # written anew: new bytes, maybe a reused inode
    newer = sha256(src)
    refused(cli, llama_dir, "recover", src, match="was not applied")
    assert sha256(src) == newer and journal_path(llama_dir, "model.safetensors").exists()
    # saved over the same inode, same size and header: the bytes still tell
    with open(src, "r+b") as f:
        offset, length = tensor_range(src, Q0)
        f.seek(offset)
        f.write(torch.randn(length // 4).numpy().tobytes())
    same_inode = sha256(src)
    refused(cli, llama_dir, "recover", src, match="was not applied")
    assert sha256(src) == same_inode


@pytest.mark.parametrize("what", ["fifo", "symlink", "folder"])
def test_a_journal_that_is_not_a_regular_file_hangs_nothing(llama_dir, tmp_path, what):
    journal = journal_path(llama_dir, "model.safetensors")
    if what == "fifo":
        os.mkfifo(journal)
    elif what == "symlink":
        (tmp_path / "elsewhere").write_bytes(b"SURGEON-JOURNAL-2\n")
        journal.symlink_to(tmp_path / "elsewhere")
    else:
        journal.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for args, match in [
        (["inspect", llama_dir], "surgeon recover"),
        (["reinit", llama_dir, "-o", tmp_path / "out"], "surgeon recover"),
        (["recover", llama_dir], "not a regular file" if what != "symlink" else "cannot be opened as a regular file"),
    ]:
        run = subprocess.run(
            [sys.executable, "-m", "surgeon", *map(str, args)], capture_output=True, text=True, env=env, timeout=120
        )
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 1 and len(lines) == 1 and match in lines[0], run.stderr
    assert not (tmp_path / "out").exists() and os.path.lexists(journal)


def test_a_huge_journal_is_refused_without_reading_it(llama_dir, tmp_path):
    """512 MiB (sparse) journals: junk after the magic, and a valid range list followed by junk."""
    src = llama_dir / "model.safetensors"
    offset, length = tensor_range(src, Q0)
    journal = journal_path(llama_dir, "model.safetensors")
    meta = {
        "version": 2,
        "checkpoint": "model.safetensors",
        "index_sha256": None,
        "files": {"model.safetensors": ident(src)},
        "ranges": [["model.safetensors", offset, length]],
    }
    for claimed_meta, why in ((None, "its ranges make"), (1 << 40, "its range list claims")):
        craft(journal, meta, [b"\0" * length], raw_meta=None)
        with open(journal, "r+b") as f:
            if claimed_meta is not None:
                f.seek(len(b"SURGEON-JOURNAL-2\n"))
                f.write(claimed_meta.to_bytes(8, "little"))
            f.truncate(512 << 20)
        # VmHWM: this process's own peak (ru_maxrss would count the pytest process it was forked from)
        script = (
            "import re, sys\nfrom surgeon.cli.commands import main\n"
            "try:\n    main.main(['recover', sys.argv[1]], standalone_mode=True)\n"
            "except SystemExit as e:\n"
            "    print('RC', e.code, 'PEAK_KB', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])\n"
        )
        run = subprocess.run([sys.executable, "-c", script, str(src)], capture_output=True, text=True, timeout=120)
        rc, rss = run.stdout.split()[1], int(run.stdout.split()[3])
        assert rc == "1" and "is damaged" in run.stderr and why in run.stderr, (
            run.stderr
        )  # refused before the bulk is read
        assert rss < 300 * 1024, rss  # the 512 MiB are never read into memory (python + surgeon alone: ~60 MiB)
    assert journal.exists()


@pytest.mark.parametrize(
    "bad",
    [
        "not-json",
        "a-list",
        "version-1",
        "wrong-checkpoint",
        "files-a-list",
        "no-files",
        "ino-a-string",
        "ino-a-bool",
        "negative-offset",
        "zero-length",
        "range-of-two",
        "index-digest-not-hex",
        "old-magic",
        "checksum",
        "old-digest",
    ],
)
def test_a_malformed_journal_is_refused_in_one_line_and_kept(llama_dir, cli, bad):
    src = llama_dir / "model.safetensors"
    offset, length = tensor_range(src, Q0)
    good = {
        "version": 2,
        "checkpoint": "model.safetensors",
        "index_sha256": None,
        "files": {"model.safetensors": ident(src)},
        "ranges": [["model.safetensors", offset, length]],
    }
    f = good["files"]["model.safetensors"]
    meta = {
        "a-list": [good],
        "version-1": {**good, "version": 1},
        "wrong-checkpoint": {**good, "checkpoint": "other.safetensors"},
        "files-a-list": {**good, "files": [f]},
        "no-files": {**good, "files": {}},
        "ino-a-string": {**good, "files": {"model.safetensors": {**f, "ino": str(f["ino"])}}},
        "ino-a-bool": {**good, "files": {"model.safetensors": {**f, "ino": True}}},
        "negative-offset": {**good, "ranges": [["model.safetensors", -offset, length]]},
        "zero-length": {**good, "ranges": [["model.safetensors", offset, 0]]},
        "range-of-two": {**good, "ranges": [["model.safetensors", offset]]},
        "index-digest-not-hex": {**good, "index_sha256": "zz"},
    }.get(bad, good)
    journal = journal_path(llama_dir, "model.safetensors")
    craft(journal, meta, [b"\0" * length], raw_meta=b"{not json" if bad == "not-json" else None)
    data = bytearray(journal.read_bytes())
    if bad == "old-magic":
        data[: len(b"SURGEON-JOURNAL-2\n")] = b"SURGEON-JOURNAL-1\n"
    elif bad == "checksum":
        data[-40] ^= 1
    elif bad == "old-digest":  # the old bytes changed and the checksum recomputed: each range's own digest still tells
        body_end = len(data) - 32 - 32
        data[body_end - 1] ^= 1
        data[-32:] = hashlib.sha256(bytes(data[:-32])).digest()
    journal.write_bytes(bytes(data))
    refused(cli, llama_dir, "recover", src, match="was not applied")


# --- read-only means read-only -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def half_patched(tmp_path_factory):
    """A folder left by a killed in-place run (real journal), a clean copy, and a file outside that a link points at."""
    base = tmp_path_factory.mktemp("half")
    (base / "outside.txt").write_text("a file outside the model folder\n")
    clean = base / "clean"
    tiny_llama().save_pretrained(clean)
    folder = base / "model"
    shutil.copytree(clean, folder)
    kill_half_way(folder, "--layers", "all")
    # after the run: surgeon refuses a folder with a link out of it (folder_files), in place too
    (folder / "notes.txt").symlink_to(base / "outside.txt")
    assert journal_path(folder, "model.safetensors").is_file()
    return base, folder, clean


@pytest.mark.parametrize(
    "command",
    [
        ["inspect", "{m}"],
        ["inspect", "{m}/model.safetensors"],
        ["verify", "{m}", "{c}"],
        ["verify", "{c}", "{m}"],
        ["reinit", "{m}", "--dry-run"],
        ["reinit", "{m}", "--dry-run", "--in-place"],
        ["reinit", "{m}", "-o", "{b}/out"],
        ["reinit", "{m}/model.safetensors", "-o", "{b}/out.safetensors"],
    ],
)
def test_read_only_commands_refuse_a_half_patched_checkpoint_and_write_nothing(half_patched, cli, command):
    base, folder, clean = half_patched
    args = [a.format(m=folder, c=clean, b=base) for a in command]
    before = tree_digest(base)  # the whole tree, the file outside the folder included (through the link)
    refused(cli, base, *args, match=f"surgeon recover {folder / 'model.safetensors'}")
    assert tree_digest(base) == before and not (base / "out").exists() and not (base / "out.safetensors").exists()


def test_push_refuses_a_folder_with_a_journal_before_asking_the_hub(half_patched, tmp_path):
    from helpers.hub import TOKEN, Surgeon
    from helpers.hub_server import HubServer

    base, folder, _ = half_patched
    before = tree_digest(base)
    with HubServer() as hub:
        hub.add_token(TOKEN, "me", ("org",))
        run = Surgeon(tmp_path, hub.url)("push", folder, "me/x", ok=False, token=TOKEN)
        assert "surgeon recover" in run.error and hub.requests == []
    assert tree_digest(base) == before
    # a journal's unfinished temporary file is never offered either
    tmp = tmp_path / "out"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"x")
    (tmp / ".model.safetensors.surgeon-journal.tmp").write_bytes(b"partial")
    with HubServer() as hub:
        hub.add_token(TOKEN, "me", ("org",))
        run = Surgeon(tmp_path, hub.url)("push", tmp, "me/x", ok=False, token=TOKEN)
        assert "surgeon recover" in run.error and hub.requests == []


def test_a_shard_of_a_half_patched_index_is_refused_too(tmp_path, cli):
    folder = tmp_path / "sharded"
    tiny_llama().save_pretrained(folder, max_shard_size="40KB")
    kill_half_way(folder)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    refused(cli, tmp_path, "inspect", shard, match="surgeon recover")
    refused(
        cli, tmp_path, "reinit", shard, "--in-place", match="surgeon recover"
    )  # a shard run does not roll back the index's journal


def test_in_place_on_the_same_checkpoint_rolls_back_first(llama_dir, tmp_path, cli):
    src = llama_dir / "model.safetensors"
    shutil.copytree(llama_dir, tmp_path / "clean")
    clean = tmp_path / "clean" / "model.safetensors"
    kill_half_way(src, "--layers", "all")
    result = cli("reinit", src, "--in-place", "--layers", "1", "--seed", "3")
    assert "rolled back an interrupted in-place run" in result.output
    cli("reinit", clean, "--in-place", "--layers", "1", "--seed", "3")
    assert sha256(src) == sha256(clean)  # the same as the run on the untouched original


def test_recover_through_the_python_api_refuses_with_checkpoint_error(llama_dir):
    best_forgery(llama_dir, "model.safetensors", Q0, key="model.safetensors")
    os.link(llama_dir / "model.safetensors", llama_dir / "twin.safetensors")  # shared bytes: never written through
    with pytest.raises(CheckpointError, match="2 hard links"):
        recover(llama_dir / "model.safetensors")
