"""A reinit's destination and its grouped API: one frozen Destination whose kind is decided once, its size
measured on disk; options, hints and the push target as objects; the report made once, from the results."""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from surgeon import Hints, OptionError, PushTarget, ReinitOptions, reinit_checkpoint
from surgeon.open.source import open_source
from surgeon.write.output import OutputKind, resolve_destination

from helpers.tiny import tiny_llama

Q0, Q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One tiny Llama saved three ways: a safetensors folder, a sharded one, and a PyTorch .bin folder."""
    base = tmp_path_factory.mktemp("saved")
    model = tiny_llama()
    model.save_pretrained(base / "single")
    model.save_pretrained(base / "sharded", max_shard_size="100KB")
    (base / "bin").mkdir()
    shutil.copy(base / "single" / "config.json", base / "bin" / "config.json")
    torch.save(model.state_dict(), base / "bin" / "pytorch_model.bin")
    return {"single": base / "single", "sharded": base / "sharded", "bin": base / "bin"}


def _weights(path: Path) -> dict[str, torch.Tensor]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".bin":
            out.update(torch.load(f, weights_only=True))
        else:
            with safe_open(f, "pt") as g:
                out.update({k: g.get_tensor(k).clone() for k in g.keys()})
    return out


def _files_size(folder: Path, names) -> int:
    return sum((folder / n).stat().st_size for n in names)


# (input, how it is written, the kind, what the report's bytes_written must equal, measured on disk)
CASES = [
    ("single", "file", OutputKind.FILE, lambda src, out, changed: out.stat().st_size),
    ("single", "folder", OutputKind.FOLDER, lambda src, out, changed: _files_size(out, _all(out))),
    ("sharded", "folder", OutputKind.FOLDER, lambda src, out, changed: _files_size(out, _all(out))),
    ("single", "in place", OutputKind.PATCH, lambda src, out, changed: changed),
    ("sharded", "in place", OutputKind.PATCH, lambda src, out, changed: changed),
    ("bin", "in place", OutputKind.MERGE, lambda src, out, changed: _files_size(out, ["pytorch_model.bin"])),
    ("bin", "file in place", OutputKind.FILE, lambda src, out, changed: out.stat().st_size),
]


def _all(folder: Path) -> list[str]:
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]


@pytest.mark.parametrize("name,how,kind,expected_size", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_each_kind_is_decided_once_written_and_measured(saved, tmp_path, name, how, kind, expected_size):
    src = tmp_path / name
    shutil.copytree(saved[name], src)
    model = {"file": src / "model.safetensors", "file in place": src / "pytorch_model.bin"}.get(how, src)
    in_place = "in place" in how
    output = None if in_place else tmp_path / ("out.safetensors" if how == "file" else "out")
    before = _weights(model)

    dest = resolve_destination(open_source(model), output, in_place=in_place, overwrite=False)
    assert dest.kind is kind and dest.in_place is in_place
    with pytest.raises(dataclasses.FrozenInstanceError):
        dest.path = tmp_path  # type: ignore[misc]
    assert dest.gets_card is (kind is OutputKind.FOLDER)

    report = reinit_checkpoint(model, layers="0", output=output, in_place=in_place)
    written = dest.path
    after = _weights(written if kind is not OutputKind.MERGE else written)
    assert not torch.equal(after[Q0], before[Q0]) and torch.equal(after[Q1], before[Q1])
    assert set(after) == set(before)
    changed = sum(before[n].numel() * before[n].element_size() for n in before if not torch.equal(before[n], after[n]))
    assert report.bytes_written == expected_size(src, written, changed) > 0
    assert report.output == str(written)
    assert (written / "README.md").is_file() is (kind is OutputKind.FOLDER)


def test_grouped_objects_and_their_keywords(saved, tmp_path):
    """options, hints and push are objects; their fields as keywords replace the objects' fields."""
    bare = tmp_path / "bare.safetensors"  # no config.json: the head counts must come from hints
    shutil.copy(saved["single"] / "model.safetensors", bare)
    hints = Hints(num_heads=8, num_kv_heads=2)
    report = reinit_checkpoint(bare, options=ReinitOptions(layers="0"), hints=hints, targets="q", dry_run=True)
    assert [r.role for r in report.rows] == ["q"] and report.options["layers"] == "0"
    assert {b.heads for b in report.blocks} == {8} and {b.kv_heads for b in report.blocks} == {2}
    # a keyword wins over the object's field: 4 query heads of width 16 over the 64-wide rows
    narrow = reinit_checkpoint(bare, hints=hints, num_heads=4, num_kv_heads=1, force_hints=True, dry_run=True)
    assert {b.heads for b in narrow.blocks} == {4}
    assert Hints.build(hints, head_dim=8, force_hints=True) == Hints(8, 2, 8, True)
    with pytest.raises(TypeError, match="'num_head'.*the hints num_heads"):
        reinit_checkpoint(bare, num_head=8)
    with pytest.raises(TypeError, match=r"'push_branch': a push is .* push=PushTarget\('org/name', branch=...\)"):
        reinit_checkpoint(bare, push_branch="dev")
    for wrong, what in (
        (dict(hints="8"), "hints must be a surgeon.Hints, not str"),
        (dict(options={"layers": "0"}), "options must be a surgeon.ReinitOptions, not dict"),
        (dict(push=7), "push must be a repo id 'org/name' or a surgeon.PushTarget, not int"),
    ):
        with pytest.raises(TypeError, match=what):
            reinit_checkpoint(bare, **wrong)
    with pytest.raises(TypeError, match="the hints are num_heads"):
        Hints.build(hints, layers="0")


def test_push_target_is_checked_before_anything_is_opened(tmp_path):
    missing = tmp_path / "nothing-here"
    with pytest.raises(OptionError, match="not a"):
        reinit_checkpoint(missing, push="not a repo!")
    with pytest.raises(OptionError, match="opens a pull request against main"):
        PushTarget("me/x", create_pr=True, branch="dev")
    with pytest.raises(OptionError, match="go with push_to_hub=org/name"):
        PushTarget.build(None, private=True)
    assert PushTarget.build(None) is None
    assert PushTarget.build(None, token="hf_x", private=False, commit_message=None) is None  # settings left out
    with pytest.raises(TypeError, match="'privat'"):
        PushTarget.build("me/x", privat=True)
    assert PushTarget.build("me/x", private=True, create_pr=True) == PushTarget("me/x", private=True, create_pr=True)
    assert "token" not in repr(PushTarget("me/x", token="hf_secret_value"))
    with pytest.raises(TypeError, match="'revision'"):  # never published: no alias for branch
        PushTarget.build("me/x", branch="a", revision="b")
    assert not list(tmp_path.iterdir())


_PUSH_FROM_PYTHON = """
import json, sys
from surgeon import PushTarget, reinit_checkpoint
report = reinit_checkpoint("org/tiny", layers="0", output="out", push=PushTarget("me/py", branch="dev", private=True))
print(json.dumps(report.to_dict()))
"""


def test_python_push_to_a_branch(tmp_path):
    """The Python API pushes with a PushTarget, to the branch it names, through huggingface_hub's real upload."""
    from helpers.hub import TOKEN, Surgeon, digest, make_source
    from helpers.hub_server import HubServer

    source = make_source(tmp_path / "src")
    with HubServer() as hub:
        hub.add_token(TOKEN, "me", ("org",))
        hub.add_model("org/tiny", source)
        surgeon_env = Surgeon(tmp_path, hub.url)
        proc = subprocess.run(
            [sys.executable, "-c", _PUSH_FROM_PYTHON],
            cwd=tmp_path,
            env=dict(surgeon_env.env, HF_TOKEN=TOKEN),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        (pushed,) = hub.pushed
        assert pushed["branch"] == "dev" and hub.repos["me/py"].private
        assert pushed["message"].startswith("Conditioned re-initialization of q,k,v in 1 attention block of org/tiny")
        assert report["output"] == "out" and any("pushed" in n for n in report["notes"])
        arrived = {p for p in hub.files("me/py", revision="dev") if p != ".gitattributes"}
        assert arrived == set(digest(tmp_path / "out"))


def test_api_makes_each_report_once():
    """A checkpoint's Report is built in one place per command (inspect's in api.py, reinit's in
    write/checkpoint_report.py, for one process and for ranks) and never filled in afterwards."""
    from surgeon import api
    from surgeon.write import checkpoint_report

    trees = [ast.parse(Path(m.__file__).read_text()) for m in (api, checkpoint_report)]
    built = [
        [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Report"]
        for tree in trees
    ]
    assert [len(b) for b in built] == [1, 1]  # inspect's and reinit's
    for node in (n for tree in trees for n in ast.walk(tree)):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for t in targets:
            assert not (isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "report"), ast.unparse(node)
