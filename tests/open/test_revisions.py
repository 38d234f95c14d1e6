"""Revisions are checked where they enter, before huggingface_hub sees them (issue 27, item 2).

huggingface_hub caches ``refs/<revision>`` as a file and reads it back offline: a revision holding ``..``
would create a file outside HF_HOME (online) or read one there as the commit hash (offline). Every
command, and the Python API, refuses such a revision in one line, asks the Hub nothing and writes nothing.
The whole test folder (cwd, HF_HOME and what lies around them) is listed and hashed before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from surgeon import inspect_checkpoint, reinit_checkpoint
from surgeon.errors import OptionError

from helpers.hub import Surgeon, build_cache, closed_port_url, make_source
from helpers.hub_server import HubServer

# each walks from HF_HOME/hub/models--org--tiny/refs/ up into the test's own folder, where it can be seen
HOSTILE = [
    "../../../../escaped",
    "%2e%2e/%2e%2e/%2e%2e/%2e%2e/escaped",
    "main\nsurgeon: verified: all good",
    "main\x1b[2K",
    "/tmp/escaped",
    "refs/../../../../escaped",
]


def tree(folder: Path) -> dict[str, str]:
    """Every path under ``folder`` (folders and links too), with the content hash of each regular file."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_source(tmp_path_factory.mktemp("sources") / "main")


def test_hostile_revisions_are_refused_online_before_any_request(tmp_path, source):
    work = tmp_path / "work"
    work.mkdir()
    with HubServer() as hub:
        hub.add_model("org/tiny", source)
        surgeon = Surgeon(work, hub.url)
        surgeon("inspect", "org/tiny")  # the cache holds the model: a hostile revision has something to walk from
        for revision in HOSTILE:  # a hostile mirror answers every revision with a commit
            hub.repos["org/tiny"].branches[revision] = hub.repos["org/tiny"].branches["main"]
        before, asked = tree(tmp_path), len(hub.requests)
        calls = []
        for revision in HOSTILE:
            calls += [
                ["inspect", "org/tiny", "--revision", revision],
                ["reinit", "org/tiny", "--revision", revision, "-o", str(work / "out")],
                ["verify", "org/tiny", str(work / "out"), "--revision", revision],
            ]
        runs = surgeon.many(*calls)
        for call, run in zip(calls, runs):
            line = run.error  # one line, no traceback
            assert line.startswith("surgeon: error: --revision "), (call, line)
            assert "is not a branch, tag or commit hash" in line, line
        assert len(hub.requests) == asked  # huggingface_hub was never called
    assert tree(tmp_path) == before  # nothing written anywhere: no refs/ file, no parent folder, no output
    assert not (tmp_path / "escaped").exists()


def test_a_good_revision_still_reads(tmp_path, source):
    with HubServer() as hub:
        hub.add_model("org/tiny", source)
        hub.repos["org/tiny"].tags["v1.0"] = commit = hub.repos["org/tiny"].branches["main"]
        surgeon = Surgeon(tmp_path, hub.url)
        for revision in ("main", "v1.0", commit):
            report = json.loads(surgeon("inspect", "org/tiny", "--revision", revision, "--json").stdout)
            assert any(f"(commit {commit[:12]})" in n for n in report["notes"]), report["notes"]


def test_offline_a_revision_cannot_read_a_file_outside_the_cache(tmp_path, source):
    surgeon = Surgeon(tmp_path, closed_port_url())
    files = {f: (source / f).read_bytes() for f in ("config.json", "model.safetensors")}
    commit = build_cache(surgeon.hf_home, "org/tiny", files)
    # a file outside HF_HOME holding the commit: read as refs/<revision>, it would resolve the snapshot
    (tmp_path / "escaped").write_text(commit)
    before = tree(tmp_path)
    runs = surgeon.many(
        *[["inspect", "org/tiny", "--revision", r] for r in ("../../../../escaped", "main\n", "%2e%2e")],
        ["inspect", "org/tiny", "--revision", commit],
        offline=True,
    )
    for run in runs[:3]:
        assert "is not a branch, tag or commit hash" in run.error, run.error
    assert runs[3].rc == 0, runs[3].stderr  # the commit itself still opens offline
    assert tree(tmp_path) == before


def test_a_cache_ref_that_is_not_a_commit_is_not_followed(tmp_path, source):
    """refs/main is what the server answered once: a ref file holding a path does not name a folder to read."""
    surgeon = Surgeon(tmp_path, closed_port_url())
    files = {f: (source / f).read_bytes() for f in ("config.json", "model.safetensors")}
    commit = build_cache(surgeon.hf_home, "org/tiny", files)
    storage = surgeon.hf_home / "hub" / "models--org--tiny"
    # a look-alike snapshot outside the repo's own snapshots/, reached through a forged ref
    (tmp_path / "elsewhere").symlink_to(storage / "snapshots" / commit, target_is_directory=True)
    (storage / "refs" / "main").write_text("../../../../elsewhere")
    before = tree(tmp_path)
    run = surgeon("inspect", "org/tiny", ok=False, offline=True)
    assert "is not a commit hash" in run.error and "'../../../../elsewhere'" in run.error, run.error
    assert tree(tmp_path) == before


def test_the_python_api_refuses_the_same_revisions(tmp_path, llama_dir):
    for revision in HOSTILE:
        for call in (
            lambda r: inspect_checkpoint("org/tiny", revision=r),
            lambda r: reinit_checkpoint("org/tiny", revision=r, output=tmp_path / "out"),
        ):
            with pytest.raises(OptionError, match=r"^revision .* is not a branch, tag or commit hash"):
                call(revision)
    with pytest.raises(OptionError, match="must be a branch, tag or commit hash"):
        inspect_checkpoint("org/tiny", revision=3)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_a_push_branch_follows_the_same_rules():
    from surgeon.hub.push import PushTarget

    for branch in ("a\nb", "x~1", "..", "%2e%2e", "main.lock"):
        with pytest.raises(OptionError, match="the branch to push to"):
            PushTarget("me/model", branch=branch)
    assert PushTarget("me/model", branch="reset-v2").branch == "reset-v2"
    assert PushTarget("me/model", branch="refs/pr/3").branch == "refs/pr/3"


def test_a_push_branch_has_one_name():
    """revision= names what a model is read at; the branch a push commits to is branch= only (no alias)."""
    from surgeon.hub.push import PushTarget

    with pytest.raises(TypeError, match="revision"):
        PushTarget("me/model", revision="reset-v2")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="revision"):
        PushTarget.build("me/model", revision="reset-v2")
