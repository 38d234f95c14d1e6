"""--in-place on safetensors: only the changed byte ranges are rewritten, behind a durable undo journal.

The crash tests kill real surgeon processes with SIGKILL in the middle of patching, then check that the
next command (or `surgeon recover`) gives back the exact original bytes.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from surgeon import reinit_checkpoint
from surgeon.formats.journal_file import SUFFIX, journal_path
from surgeon.formats.safetensors_header import read_header, records

from helpers.cli import expect_cli_error
from helpers.digests import sha256
from helpers.kill import PAUSE_AFTER_FIRST_TENSOR, RUN_SURGEON, Interruptible, duration, kill_at
from helpers.tiny import tiny_llama

ATTN = ("q_proj", "k_proj", "v_proj")


def changed_ranges(path, names):
    header = read_header(path)
    return [
        (
            header.data_start + header.entries[n]["data_offsets"][0],
            header.data_start + header.entries[n]["data_offsets"][1],
        )
        for n in names
    ]


def attention_weights(path, layers):
    return [f"model.layers.{i}.self_attn.{p}.weight" for i in layers for p in ATTN]


def test_in_place_rewrites_only_the_changed_ranges(llama_dir):
    src = llama_dir / "model.safetensors"
    before_bytes, inode = src.read_bytes(), src.stat().st_ino
    before = {k: v.clone() for k, v in load_file(src).items()}
    report = reinit_checkpoint(src, in_place=True, layers="1")
    after_bytes = src.read_bytes()
    assert src.stat().st_ino == inode and len(after_bytes) == len(before_bytes)  # patched, not replaced
    spans = changed_ranges(src, attention_weights(src, [1]))
    mask = bytearray(len(before_bytes))
    for begin, end in spans:
        mask[begin:end] = b"\1" * (end - begin)
    outside = [i for i, (a, b) in enumerate(zip(before_bytes, after_bytes)) if a != b and not mask[i]]
    assert outside == []  # the header too: the record does not fit in it, so it is left alone
    assert report.bytes_written == sum(end - begin for begin, end in spans)
    assert any("record was not added" in n for n in report.notes)
    # through the model's own forward: layer 1's q/k heads are semi-orthogonal, the rest is the model it was
    after = load_file(src)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor) == (name not in attention_weights(src, [1])), name
    q = after["model.layers.1.self_attn.q_proj.weight"].double().view(8, 8, 64)
    assert torch.allclose(q @ q.mT, torch.eye(8, dtype=torch.float64).expand(8, 8, 8), atol=1e-5)
    assert not list(llama_dir.glob(f".*{SUFFIX}*"))


def test_in_place_gives_the_same_weights_as_a_copy(llama_dir, tmp_path):
    src = llama_dir / "model.safetensors"
    reinit_checkpoint(src, output=tmp_path / "copy.safetensors", layers="0,2", seed=4)
    reinit_checkpoint(src, in_place=True, layers="0,2", seed=4)
    copy, patched = load_file(tmp_path / "copy.safetensors"), load_file(src)
    assert copy.keys() == patched.keys() and all(torch.equal(copy[k], patched[k]) for k in copy)


def test_in_place_adds_the_record_where_the_header_has_room(tmp_path):
    src = tmp_path / "model.safetensors"
    tiny_llama().save_pretrained(tmp_path)
    # re-write the header with 4 KiB of padding, as a tool reserving room for metadata would
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].rstrip() + b" " * (n - len(raw[8 : 8 + n].rstrip()) + 4096)
    src.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])
    reinit_checkpoint(src, in_place=True, layers="0")
    assert records(read_header(src).metadata)[-1]["blocks"][0]["module"] == "model.layers.0.self_attn"
    load_file(src)  # the reference reader takes it


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import surgeon.write.journal as journal
    real, calls = journal.patch, []

    def patch(header, path, start, updates):  # patch the first tensor of this call, then die like kill -9
        real(header, path, start, [next(iter(updates))])
        os.kill(os.getpid(), signal.SIGKILL)

    journal.patch = patch
    from surgeon.cli.commands import main
    sys.argv = ["surgeon", *sys.argv[1:]]
    main()
    """
)


def test_kill_9_while_patching_is_rolled_back_by_recover(llama_dir, tmp_path, cli):
    src = llama_dir / "model.safetensors"
    original = sha256(src)
    run = subprocess.run(
        [sys.executable, "-c", KILLER, "reinit", str(src), "--in-place", "--layers", "all"], capture_output=True
    )
    assert run.returncode == -signal.SIGKILL
    assert sha256(src) != original  # it died half-way: one tensor patched
    assert journal_path(llama_dir, "model.safetensors").is_file()
    expect_cli_error(
        cli, llama_dir, "inspect", src, match=f"run `surgeon recover {src}` first"
    )  # read-only: refuses, writes nothing
    result = cli("recover", src)
    assert "rolled back an interrupted in-place run" in result.output
    assert sha256(src) == original and not list(llama_dir.glob(f".*{SUFFIX}*"))


def test_kill_9_rolled_back_by_recover_on_a_sharded_folder(tmp_path, cli):
    folder = tmp_path / "sharded"
    tiny_llama().save_pretrained(folder, max_shard_size="40KB")
    digests = {p.name: sha256(p) for p in folder.iterdir()}
    assert len(list(folder.glob("*.safetensors"))) > 2
    run = subprocess.run([sys.executable, "-c", KILLER, "reinit", str(folder), "--in-place"], capture_output=True)
    assert run.returncode == -signal.SIGKILL
    assert {p.name: sha256(p) for p in folder.iterdir() if not p.name.startswith(".")} != digests
    result = cli("recover", folder)
    assert "rolled back" in result.output
    assert {p.name: sha256(p) for p in folder.iterdir()} == digests
    assert cli("recover", folder).output.startswith("nothing to recover")


def test_recover_json_says_what_was_rolled_back(tmp_path, cli):
    """``recover --json``: the journals handled (what was done, the checkpoint, the files given back) and the
    lines the text output prints, on a checkpoint a real kill -9 left half-patched."""
    folder = tmp_path / "sharded"
    tiny_llama().save_pretrained(folder, max_shard_size="40KB")
    digests = {p.name: sha256(p) for p in folder.iterdir()}
    run = subprocess.run([sys.executable, "-c", KILLER, "reinit", str(folder), "--in-place"], capture_output=True)
    assert run.returncode == -signal.SIGKILL
    (journal,) = folder.glob(f".*{SUFFIX}")
    result = cli("recover", folder, "--json")
    assert {p.name: sha256(p) for p in folder.iterdir()} == digests
    out = json.loads(result.stdout)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted({f for name, f in weight_map.items() if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")})
    assert 0 < len(shards) < len(set(weight_map.values()))
    assert out == {
        "path": str(folder),
        "journals": [
            {
                "action": "rolled_back",
                "checkpoint": str(folder / "model.safetensors.index.json"),
                "journal": str(journal),
                "files": shards,
            }
        ],
        "notes": [
            f"rolled back an interrupted in-place run: {', '.join(shards)} in {folder} are as they were before it"
        ],
    }
    assert json.loads(cli("recover", folder, "--json").stdout) == {"path": str(folder), "journals": [], "notes": []}


def _llama_6(tmp_path):
    """A 6-layer Llama (the source), and the bytes of the original and of the finished in-place patch."""
    src_dir = tmp_path / "src"
    tiny_llama(
        hidden_size=256, intermediate_size=256, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=6
    ).save_pretrained(src_dir)
    done = tmp_path / "done"
    shutil.copytree(src_dir, done)
    reinit_checkpoint(done / "model.safetensors", in_place=True)
    return src_dir, sha256(src_dir / "model.safetensors"), sha256(done / "model.safetensors")


@pytest.mark.slow
def test_kill_9_from_outside_in_the_middle_of_patching_is_rolled_back(tmp_path, cli):
    """kill -9 from outside with one tensor patched and the rest not: a journal is left, the file is neither the
    original nor the result, and `surgeon recover` gives back the exact original."""
    src_dir, original, finished = _llama_6(tmp_path)
    src = src_dir / "model.safetensors"
    child = Interruptible(PAUSE_AFTER_FIRST_TENSOR + RUN_SURGEON, "reinit", src, "--in-place")
    child.wait_for("patching")
    child.send(signal.SIGKILL)
    assert child.finish().returncode == -signal.SIGKILL
    assert journal_path(src_dir, "model.safetensors").exists() and sha256(src) not in (original, finished)
    cli("recover", src)
    assert sha256(src) == original and not list(src_dir.glob(f".*{SUFFIX}*"))


@pytest.mark.slow
def test_kill_9_at_random_points_leaves_the_input_or_the_finished_patch(tmp_path, cli):
    """kill -9 from outside at times spread over a whole run on this machine: wherever each lands, the file is
    the original or the complete result, or a journal is left and `surgeon recover` restores the exact original.
    (Where a kill lands depends on the machine; a kill at a known point is the test above.)"""
    src_dir, original, finished = _llama_6(tmp_path)
    shutil.copytree(src_dir, tmp_path / "timing")
    whole = duration(["reinit", str(tmp_path / "timing" / "model.safetensors"), "--in-place"])
    assert sha256(tmp_path / "timing" / "model.safetensors") == finished
    for i, fraction in enumerate((0.3, 0.5, 0.7, 0.8, 0.9)):
        work = tmp_path / f"work-{i}"
        shutil.copytree(src_dir, work)
        killed = kill_at(["reinit", str(work / "model.safetensors"), "--in-place"], fraction * whole)
        journal = journal_path(work, "model.safetensors").exists()
        state = sha256(work / "model.safetensors")
        assert journal or state in (original, finished), (fraction, killed)  # no journal: untouched or whole
        cli("recover", work / "model.safetensors")
        after = sha256(work / "model.safetensors")
        assert after == (original if journal else state), (fraction, killed)  # a journal rolls back exactly
        assert not list(work.glob(f".*{SUFFIX}*"))


def test_a_running_in_place_job_is_neither_joined_nor_rolled_back(llama_dir, cli):
    src = llama_dir / "model.safetensors"
    fd = os.open(src, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a running --in-place job holds
        expect_cli_error(cli, llama_dir, "reinit", src, "--in-place", match="another surgeon run is patching")
        journal_path(llama_dir, "model.safetensors").write_bytes(b"not yet complete")  # its journal, say
        result = cli("recover", src)
        assert "in progress" in result.output and journal_path(llama_dir, "model.safetensors").exists()
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        journal_path(llama_dir, "model.safetensors").unlink()


def test_a_damaged_journal_is_refused_in_one_line(llama_dir, cli):
    src = llama_dir / "model.safetensors"
    journal_path(llama_dir, "model.safetensors").write_bytes(b"SURGEON-JOURNAL-1\n" + b"\0" * 64)
    expect_cli_error(cli, llama_dir, "recover", src, match="is damaged")


def test_an_unfinished_journal_is_discarded_without_touching_the_checkpoint(llama_dir, cli):
    src = llama_dir / "model.safetensors"
    before = sha256(src)
    tmp = journal_path(llama_dir, "model.safetensors").with_name(
        journal_path(llama_dir, "model.safetensors").name + ".tmp"
    )
    tmp.write_bytes(b"SURGEON-JOURNAL-1\n partial")  # a run died while writing its journal: nothing was patched
    cli("inspect", src)  # read-only: reads the intact checkpoint, leaves the leftover alone
    assert tmp.exists() and sha256(src) == before
    assert "died before patching anything" in cli("recover", src).output
    assert not tmp.exists() and sha256(src) == before


def test_in_place_of_a_torch_file_still_replaces_it_atomically(tmp_path):
    folder = tmp_path / "pt"
    folder.mkdir()
    model = tiny_llama()
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    reinit_checkpoint(folder / "pytorch_model.bin", in_place=True, layers="0")
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    assert not torch.equal(
        state["model.layers.0.self_attn.q_proj.weight"], model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(
        state["model.layers.1.self_attn.q_proj.weight"], model.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    )


def test_a_refusal_part_way_is_rolled_back_at_once(llama_dir):
    """Polar mode refuses a layer whose weights hold NaN after earlier layers were patched: the input comes back whole."""
    from safetensors.torch import save_file

    from surgeon import UnsupportedWeightsError

    src = llama_dir / "model.safetensors"
    state = load_file(src)
    state["model.layers.2.self_attn.q_proj.weight"][3, 5] = float("nan")
    save_file(state, src, metadata={"format": "pt"})
    before = sha256(src)
    with pytest.raises(
        UnsupportedWeightsError, match=r"model\.layers\.2\.self_attn\.q_proj\.weight: q head 0 holds NaN"
    ):
        reinit_checkpoint(src, in_place=True, mode="polar")
    assert sha256(src) == before and not list(llama_dir.glob(f".*{SUFFIX}*"))
    # the conditioned reset does not read the old values: it replaces them, and says so
    report = reinit_checkpoint(src, in_place=True, layers="2")
    assert any("holds NaN or Inf" in n and "replaced" in n for n in report.nonfinite_notes())
    assert torch.isfinite(load_file(src)["model.layers.2.self_attn.q_proj.weight"]).all()


def test_inspect_reports_nonfinite_heads_in_one_line(llama_dir, cli):
    from safetensors.torch import save_file

    src = llama_dir / "model.safetensors"
    state = load_file(src)
    state["model.layers.1.self_attn.k_proj.weight"][9, 0] = float("inf")  # key head 1 (head_dim 8)
    save_file(state, src, metadata={"format": "pt"})
    result = cli("inspect", src)
    assert "note: model.layers.1 k: head 1 holds NaN or Inf (kappa nan)" in result.output
    assert "Traceback" not in result.output


def _with_nan(path, name, row, col):
    from safetensors.torch import save_file

    state = load_file(path)
    state[name][row, col] = float("nan")
    save_file(state, path, metadata={"format": "pt"})


def test_polar_on_nan_weights_is_one_line_and_writes_nothing(llama_dir, tmp_path, cli):
    src = llama_dir / "model.safetensors"
    _with_nan(src, "model.layers.1.self_attn.v_proj.weight", 8, 2)  # value head 1 (head_dim 8)
    line = expect_cli_error(
        cli,
        llama_dir,
        "reinit",
        src,
        "--mode",
        "polar",
        "-o",
        tmp_path / "out.safetensors",
        match="model.layers.1.self_attn.v_proj.weight: v head 1 holds NaN or Inf",
    )
    assert "polar mode needs the old values" in line and not (tmp_path / "out.safetensors").exists()
    expect_cli_error(
        cli,
        llama_dir,
        "reinit",
        src,
        "--keep-scale",
        "-o",
        tmp_path / "o2.safetensors",
        match="--keep-scale needs the old values",
    )
    result = cli("reinit", src, "-o", tmp_path / "ok.safetensors", "--layers", "1")  # the conditioned reset goes on
    assert (
        "head 1 holds NaN or Inf (kappa nan); the conditioned reset does not read the old values, so they were replaced"
        in result.output
    )


def test_module_refusal_changes_no_parameter():
    import surgeon
    from surgeon import UnsupportedWeightsError

    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[2].self_attn.k_proj.weight[0, 0] = float("inf")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedWeightsError, match="k head 0 holds NaN or Inf"):
        surgeon.reinit_(model, mode="polar")
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n].detach()) for n in before)  # layers 0 and 1 were not touched either
    report = surgeon.inspect(model)
    assert "model.layers.2 k: head 0 holds NaN or Inf (kappa nan)" in report.render()
