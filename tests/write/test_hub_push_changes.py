"""`reinit org/M --push-to-hub me/M2` on an 8-shard Llama-shaped repo: only the changed shard is
downloaded and uploaded, the card beside it; every other file arrives as a server-side copy pinned to the
source's commit; the pushed repo is byte-identical to the full local output pushed whole (the fallback)."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from huggingface_hub import CommitOperationCopy

from helpers.hub import TOKEN, Surgeon, header_bytes, weights_served

pytestmark = pytest.mark.skipif(
    "src_repo_id" not in CommitOperationCopy.__dataclass_fields__,
    reason="this huggingface_hub has no cross-repo copies (1.17 or newer has)",
)
LAST = "model-00007-of-00008.safetensors"  # holds layer 7's q/k/v (make_llama_shards)
LFS_DATA = r"^/__lfs/[0-9a-f]{64}$"  # the loopback Hub's LFS upload of one object's bytes


def pushed(hub, repo):
    return {p: c for p, c in hub.files(repo).items() if p != ".gitattributes"}


def same_repo(hub, repo, other) -> bool:
    """The two repos hold the same files, byte for byte (the card's title names its own repo)."""
    a, b = pushed(hub, repo), pushed(hub, other)
    b["README.md"] = b["README.md"].replace(f"# {other}\n".encode(), f"# {repo}\n".encode(), 1)
    return a == b


def test_push_by_changes_matches_the_full_output_pushed_whole(shards, hub, tmp_path):
    surgeon = Surgeon(tmp_path, hub.url)
    commit = hub.repos["org/M"].branches["main"]
    surgeon("reinit", "org/M", "--layers", "-1", "--push-to-hub", "me/M2", token=TOKEN)
    last = (shards / LAST).stat().st_size
    # downloaded: the headers and the one changed shard (the small files are counted apart)
    assert weights_served(hub) == header_bytes(shards) + last
    assert [f for f in hub.downloads() if f.endswith(".safetensors")] == [LAST]
    # staged: the changed shard and the card, nothing else
    assert sorted(p.name for p in (tmp_path / "M-reinit").iterdir()) == ["README.md", LAST]
    # uploaded through LFS: that shard; the card inline; everything else copied from the pinned commit
    card = len(pushed(hub, "me/M2")["README.md"])
    assert hub.received(LFS_DATA) == len(pushed(hub, "me/M2")[LAST])  # the new shard's bytes, once
    (ops,) = [
        [json.loads(x) for x in r.body.splitlines()] for r in hub.requests if "/commit/" in r.path and r.status == 200
    ]
    assert {op["value"]["path"] for op in ops[1:] if op["key"] == "lfsFile" and "size" in op["value"]} == {LAST}
    copied = {d["filename"] for d in hub.duplicated()}
    assert copied == {p.name for p in shards.glob("*.safetensors")} - {LAST}
    paths_info = [r for r in hub.requests if "/api/models/org/M/paths-info/" in r.path]
    assert paths_info and all(r.path.endswith(f"/paths-info/{commit}") for r in paths_info)  # pinned, never main
    # the commit carries the card, the small files inline (base64) and pointers: no weight bytes
    small = sum(p.stat().st_size for p in shards.iterdir() if not p.name.endswith(".safetensors"))
    assert hub.received(r"/commit/") < card + 2 * small + 4096 < last
    # the same repo as the full local output, pushed whole (today's path, the fallback)
    full = tmp_path / "full" / "M-reinit"  # the same name: the card's reproduce command names the output
    surgeon("reinit", "org/M", "--layers", "-1", "-o", full, "--push-to-hub", "me/M3", token=TOKEN)
    assert same_repo(hub, "me/M2", "me/M3")


def test_layers_all_uploads_every_shard_and_copies_none_that_changed(shards, hub, tmp_path):
    Surgeon(tmp_path, hub.url)("reinit", "org/M", "--push-to-hub", "me/all", token=TOKEN)
    index = json.loads((shards / "model.safetensors.index.json").read_text())["weight_map"]
    changed = {s for n, s in index.items() if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))}
    assert {d["filename"] for d in hub.duplicated()} == {p.name for p in shards.glob("*.safetensors")} - changed
    assert hub.received(LFS_DATA) == sum(len(pushed(hub, "me/all")[s]) for s in changed)
    for shard in changed:
        assert pushed(hub, "me/all")[shard] != (shards / shard).read_bytes()


def test_fallbacks_say_why_in_one_line_and_push_the_same_repo(shards, hub, tmp_path):
    surgeon = Surgeon(tmp_path, hub.url)
    full = tmp_path / "full" / "M-reinit"  # the same name: the card's reproduce command names the output
    surgeon(
        "reinit", "org/M", "--layers", "-1", "-o", full, "--push-to-hub", "me/full", "--no-server-copy", token=TOKEN
    )
    assert hub.duplicated() == []  # every file uploaded: the reference
    forced = surgeon("reinit", "org/M", "--layers", "-1", "--push-to-hub", "me/forced", "--no-server-copy", token=TOKEN)
    assert "note: uploading every file (--no-server-copy)" in forced.stdout
    hub.refuse_duplicate = "source and target are in different storage regions"
    refused = surgeon("reinit", "org/M", "--layers", "-1", "--push-to-hub", "me/refused", "--overwrite", token=TOKEN)
    hub.refuse_duplicate = None
    # a source the token cannot read: the Hub answers 404 when asked about its files
    hub.fail("POST", r"^/api/models/org/M/paths-info/", status=404, message="Repository not found")
    private = surgeon("reinit", "org/M", "--layers", "-1", "--push-to-hub", "me/private", "--overwrite", token=TOKEN)
    assert hub.duplicated() == []
    for run, why in ((refused, "different storage regions"), (private, "404 Not Found")):
        (line,) = [x for x in run.stdout.splitlines() if "server-side copy" in x]
        assert why in line and line.endswith("uploading every file instead"), line
    for repo in ("me/forced", "me/refused", "me/private"):
        assert same_repo(hub, repo, "me/full"), repo


def test_an_interrupted_push_resumes(shards, hub, tmp_path):
    """The commit fails after the changed shard was uploaded: the error gives the reinit command that finishes it
    (the card's reproduce command, pushing by changes again), which finishes it without sending the shard
    again, and the repo is the whole output."""
    surgeon = Surgeon(tmp_path, hub.url)
    hub.fail("POST", r"^/api/models/me/resumed/commit/", status=503, message="try later")
    stopped = surgeon("reinit", "org/M", "--layers", "-1", "--push-to-hub", "me/resumed", ok=False, token=TOKEN)
    assert "surgeon push" not in stopped.error  # the staging folder alone is not the model
    resume = shlex.split(re.search(r"run `(surgeon reinit [^`]+)` to finish", stopped.error).group(1))
    commit = hub.repos["org/M"].branches["main"]
    assert resume[:5] == ["surgeon", "reinit", "org/M", "--revision", commit] and "--layers=-1" in resume
    assert resume[-7:-4] == ["--push-to-hub", "me/resumed", "--commit-message"]
    assert resume[-3:] == ["--staging", str(tmp_path / "M-reinit"), "--overwrite"]
    sent = hub.received(LFS_DATA)
    surgeon(*resume[1:], token=TOKEN)
    assert hub.received(LFS_DATA) == sent == len(pushed(hub, "me/resumed")[LAST])  # uploaded once, in all
    surgeon(
        "reinit",
        "org/M",
        "--layers",
        "-1",
        "-o",
        tmp_path / "full" / "M-reinit",
        "--push-to-hub",
        "me/whole",
        token=TOKEN,
    )
    assert same_repo(hub, "me/resumed", "me/whole")


def test_dry_run_predicts_the_bytes_a_push_moves(shards, hub, tmp_path):
    run = Surgeon(tmp_path, hub.url)(
        "reinit", "org/M", "--layers", "-1", "--push-to-hub", "me/M2", "--dry-run", token=TOKEN
    )
    assert weights_served(hub) == header_bytes(shards) and "me/M2" not in hub.repos  # headers only, nothing sent
    size = (shards / LAST).stat().st_size
    assert f"downloads 1 changed shard(s) ({LAST}: {size:,} bytes)" in run.stdout
    assert "copies 7 unchanged shard(s)" in run.stdout


def test_push_of_a_whole_output_copies_what_its_record_names_unchanged(shards, hub, tmp_path):
    """`surgeon push OUTPUT` of a whole local output made from org/M: its record names org/M and the commit,
    so the files equal to that commit's are copied server-side and only the changed shard and the card are
    uploaded; the repo is the one every file uploaded gives."""
    surgeon = Surgeon(tmp_path, hub.url)
    commit = hub.repos["org/M"].branches["main"]
    out = tmp_path / "full" / "M-reinit"
    surgeon("reinit", "org/M", "--layers", "-1", "-o", out)
    hub.add_model("org/M", shards)  # org/M moves on after the output was made: its commit is what counts
    assert hub.repos["org/M"].branches["main"] != commit
    dry = json.loads(surgeon("push", out, "me/P", "--dry-run", "--json").stdout)
    assert dry["files"] == ["README.md", LAST] and dry["copied_from"] == f"org/M@{commit}"
    assert hub.duplicated() == [] and "me/P" not in hub.repos  # a dry run sends nothing
    run = json.loads(surgeon("push", out, "me/P", "--json", token=TOKEN).stdout)
    assert sorted(run["files"]) == ["README.md", LAST]
    assert {d["filename"] for d in hub.duplicated()} == {p.name for p in shards.glob("*.safetensors")} - {LAST}
    assert run["copied_bytes"] == sum(p.stat().st_size for p in out.iterdir() if p.name in run["copied"])
    assert hub.received(LFS_DATA) == run["bytes"] - len(pushed(hub, "me/P")["README.md"])  # the shard, once
    paths_info = [r for r in hub.requests if "/api/models/org/M/paths-info/" in r.path]
    assert paths_info and all(r.path.endswith(f"/paths-info/{commit}") for r in paths_info)  # pinned, never main
    surgeon("push", out, "me/whole", "--no-server-copy", token=TOKEN)
    assert len(hub.duplicated()) == 7  # none more
    assert pushed(hub, "me/P") == pushed(hub, "me/whole") == {p.name: p.read_bytes() for p in out.iterdir()}


def test_a_record_naming_another_model_copies_nothing_that_differs(shards, hub, tmp_path):
    """The record is a stranger's text: an origin that names a model whose files differ copies none of
    them (each is compared before it is copied), and a malformed origin is a note; the push goes on."""
    surgeon = Surgeon(tmp_path, hub.url)
    other = {p.name: p.read_bytes() for p in shards.iterdir()}
    for name in other:  # the same files, but each shard's last weight byte differs
        if name.endswith(".safetensors"):
            other[name] = other[name][:-1] + bytes([other[name][-1] ^ 1])
    hub.add_model("org/Other", other)
    out = tmp_path / "M-reinit"
    surgeon("reinit", "org/M", "--layers", "-1", "-o", out)
    card = (out / "README.md").read_text()
    origin = '"origin":{"commit":"%s","repo":"%s"}'
    ours = origin % (hub.repos["org/M"].branches["main"], "org/M")
    assert ours in card
    (out / "README.md").write_text(card.replace(ours, origin % (hub.repos["org/Other"].branches["main"], "org/Other")))
    run = json.loads(surgeon("push", out, "me/A", "--json", token=TOKEN).stdout)
    same = {p.name for p in out.iterdir() if other.get(p.name) == p.read_bytes()}
    assert set(run["copied"]) == same - {"README.md"}
    assert not any(f.endswith(".safetensors") for f in run["copied"])
    assert pushed(hub, "me/A") == {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "README.md").write_text(card.replace(ours, origin % ("main", "org/M")))
    run = surgeon("push", out, "me/B", token=TOKEN)
    assert "note: every file uploaded: " in run.stdout and "origin is not a Hub model id and a commit id" in run.stdout
    assert pushed(hub, "me/B") == {p.name: p.read_bytes() for p in out.iterdir()}
    # the source cannot be asked about its files: said in one line, every file uploaded
    (out / "README.md").write_text(card)
    hub.fail("POST", r"^/api/models/org/M/paths-info/", status=500, message="try later")
    run = surgeon("push", out, "me/C", token=TOKEN)
    (line,) = [x for x in run.stdout.splitlines() if "could not ask org/M@" in x]
    assert "500" in line and line.endswith("); uploading every file instead"), line
    assert pushed(hub, "me/C") == {p.name: p.read_bytes() for p in out.iterdir()}


def test_json_gives_the_bytes_moved_as_counted(shards, hub, tmp_path):
    """`--json`'s transfer: bytes read by Range and downloaded, counted as they arrived (the server's own count
    of what it served agrees), uploaded and copied server-side (the pushed repo's files); a dry run predicts."""
    surgeon = Surgeon(tmp_path, hub.url)
    dry = json.loads(
        surgeon("reinit", "org/M", "--layers", "-1", "--push-to-hub", "me/J", "--dry-run", "--json").stdout
    )["transfer"]
    last = (shards / LAST).stat().st_size
    others = sum(p.stat().st_size for p in shards.glob("*.safetensors")) - last
    assert dry == {
        "read_by_range": header_bytes(shards),
        "header_bytes": header_bytes(shards),
        "tensor_bytes": 0,
        "range_requests": dry["range_requests"],
        "downloaded": 0,
        "predicted_downloaded": last,
        "predicted_copied_server_side": others,
    }
    since = len(hub.requests)
    run = json.loads(
        surgeon("reinit", "org/M", "--layers", "-1", "--push-to-hub", "me/J", "--json", token=TOKEN).stdout
    )
    moved, repo = run["transfer"], pushed(hub, "me/J")
    assert moved["read_by_range"] + moved["downloaded"] == weights_served(hub, since) == header_bytes(shards) + last
    assert moved["uploaded"] == len(repo[LAST]) + len(repo["README.md"])
    assert moved["copied_server_side"] == sum(len(c) for p, c in repo.items() if p not in (LAST, "README.md"))


def test_staging_names_where_the_changes_are_staged(shards, hub, tmp_path):
    surgeon = Surgeon(tmp_path, hub.url)
    surgeon("reinit", "org/M", "--layers", "-1", "--push-to-hub", "me/S", "--staging", "stage/here", token=TOKEN)
    assert sorted(p.name for p in (tmp_path / "stage" / "here").iterdir()) == ["README.md", LAST]
    assert not (tmp_path / "M-reinit").exists() and len(hub.duplicated()) == 7
    both = surgeon("reinit", "org/M", "--push-to-hub", "me/S", "--staging", "s2", "-o", "out", ok=False, token=TOKEN)
    assert (
        both.error
        == "surgeon: error: --staging is where a push stages what changed, and -o/--output writes the whole output: give one of them"
    )
    assert not (tmp_path / "s2").exists() and not (tmp_path / "out").exists()
