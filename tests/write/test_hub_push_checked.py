"""A push that reports success leaves the repo right, checked before and after on the loopback Hub: other weights
in the destination (another layout, a stale index, shards of another count, pytorch_model.bin) are deleted in the
same commit and transformers loads the new weights; a paths-info answer that changes between calls fails the push
naming the file; a staging folder is not pushed alone; a card whose record is not its weights' is refused."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import CommitOperationCopy

from surgeon import reinit_checkpoint

from helpers.hub import TOKEN, Surgeon, make_source
from helpers.hub_server import HubServer
from helpers.paths import ROOT

LAST = "model-00007-of-00008.safetensors"  # holds layer 7's q/k/v (make_llama_shards)
copies_across_repos = pytest.mark.skipif(
    "src_repo_id" not in CommitOperationCopy.__dataclass_fields__,
    reason="this huggingface_hub has no cross-repo copies (1.17 or newer has)",
)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Two sources (one safetensors file; index and shards, with pytorch_model.bin, training_args.bin and onnx/
    beside) and their outputs with layer 0 re-initialized."""
    base = tmp_path_factory.mktemp("checked")
    sharded = make_source(base / "sharded", shard="100KB")
    tiny = make_source(base / "tiny")
    single = base / "single"
    single.mkdir()
    for name in ("model.safetensors", "config.json", "generation_config.json", "README.md"):
        shutil.copyfile(tiny / name, single / name)
    reinit_checkpoint(single, output=base / "out-single", layers="0")
    reinit_checkpoint(sharded, output=base / "out-sharded", layers="0")
    return single, sharded, base / "out-single", base / "out-sharded"


def served() -> HubServer:
    hub = HubServer()
    hub.add_token(TOKEN, "me", ("org",))
    return hub


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def loaded(files: dict[str, bytes], where: Path) -> dict[str, torch.Tensor]:
    """What transformers' from_pretrained loads from a repo holding ``files``."""
    from transformers import AutoModelForCausalLM

    for path, content in files.items():
        (where / path).parent.mkdir(parents=True, exist_ok=True)
        (where / path).write_bytes(content)
    return AutoModelForCausalLM.from_pretrained(where).state_dict()


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def deleted_in_commits(hub: HubServer, repo: str) -> list[str]:
    return [
        op["value"]["path"]
        for r in hub.requests
        if r.method == "POST" and f"/api/models/{repo}/commit/" in r.path and r.status == 200
        for op in map(json.loads, r.body.splitlines())
        if op["key"] == "deletedFile"
    ]


def test_other_weights_are_deleted_in_the_same_commit_and_transformers_loads_the_new_ones(outputs, tmp_path):
    """me/D was pushed as one model.safetensors; the shards pushed over it come with its deletion (the dry run says
    so first), and from_pretrained reads the new weights, not the stale file it read before. The reverse: index,
    shards and pytorch_model.bin of me/E go when one file is pushed; what no loader reads as weights stays."""
    single, sharded, out_single, out_sharded = outputs
    with served() as hub:
        hub.add_model("me/D", {p: (single / p).read_bytes() for p in ("model.safetensors", "config.json")})
        hub.add_model("me/E", sharded)
        surgeon = Surgeon(tmp_path, hub.url)
        dry, onto_single, onto_shards = surgeon.many(
            ["push", out_sharded, "me/D", "--dry-run", "--json"],
            ["push", out_sharded, "me/D"],
            ["push", out_single, "me/E"],
            token=TOKEN,
        )
        assert dry.rc == onto_single.rc == onto_shards.rc == 0, dry.stderr + onto_single.stderr + onto_shards.stderr
        planned = json.loads(dry.stdout)
        assert planned["deleted"] == ["model.safetensors"] and planned["dry_run"]
        assert [f["path"] for f in planned["plan"]["deletions"]] == ["model.safetensors"]
        assert "deleted 1 files of other weights a loader would read (model.safetensors)" in onto_single.stdout
        assert "  model.safetensors (deleted: other weights)" in onto_single.stdout.splitlines()
        assert deleted_in_commits(hub, "me/D") == ["model.safetensors"]  # in the one commit, beside the uploads
        model = {p: c for p, c in folder_files(out_sharded).items() if p != "training_args.bin"}  # training state
        assert {p: c for p, c in hub.files("me/D").items() if p != ".gitattributes"} == model
        new = loaded(hub.files("me/D"), tmp_path / "D")
        assert same_weights(new, loaded(folder_files(out_sharded), tmp_path / "expected-D"))
        assert not same_weights(new, loaded(folder_files(single), tmp_path / "old-D"))  # layer 0 was re-initialized
        # the reverse: one file over an index, its shards and a pytorch_model.bin
        stale = sorted(p for p in folder_files(sharded) if p.endswith((".safetensors", ".index.json", "_model.bin")))
        assert len(stale) >= 4 and "pytorch_model.bin" in stale
        assert sorted(deleted_in_commits(hub, "me/E")) == stale
        left = set(hub.files("me/E")) - set(folder_files(out_single))
        assert left == {".gitattributes", "training_args.bin", "onnx/model.onnx", "onnx/config.json", "tokenizer.json",
            "tokenizer_config.json"}  # fmt: skip
        assert same_weights(
            loaded(hub.files("me/E"), tmp_path / "E"), loaded(folder_files(out_single), tmp_path / "expected-E")
        )


def test_keep_other_weights_keeps_them_with_a_warning(outputs, tmp_path):
    """Asked to keep them (surgeon push, and reinit --push-to-hub through its push flags), the other weights stay,
    and a note names them: transformers then reads the stale file, which is what the warning is about."""
    single, sharded, _, out_sharded = outputs
    with served() as hub:
        stale = {p: (single / p).read_bytes() for p in ("model.safetensors", "config.json")}
        hub.add_model("me/K", stale)
        hub.add_model("me/K2", stale)
        hub.add_model("org/sharded", sharded)
        surgeon = Surgeon(tmp_path, hub.url)
        kept, reinit = surgeon.many(
            ["push", out_sharded, "me/K", "--keep-other-weights"],
            ["reinit", "org/sharded", "--layers", "0", "-o", "r", "--push-to-hub", "me/K2", "--keep-other-weights"],
            token=TOKEN,
        )
        assert kept.rc == reinit.rc == 0, kept.stderr + reinit.stderr
        warning = (
            "note: kept model.safetensors in {} as asked (--keep-other-weights): other weights than the ones pushed, "
            "which a loader may read instead of them or beside them"
        )
        assert warning.format("me/K") in kept.stdout.splitlines() and warning.format("me/K2") in reinit.stdout
        assert "  model.safetensors (kept: other weights)" in kept.stdout.splitlines()
        for repo in ("me/K", "me/K2"):
            assert hub.files(repo)["model.safetensors"] == stale["model.safetensors"]
            assert deleted_in_commits(hub, repo) == []
        stale_read = loaded(hub.files("me/K"), tmp_path / "K")
        assert same_weights(stale_read, loaded(folder_files(single), tmp_path / "old"))


@copies_across_repos
def test_a_paths_info_answer_that_changes_between_calls_fails_the_push_naming_the_file(shards, hub, tmp_path):
    """The first paths-info answer about org/M says it holds the new shard: the push decides to copy it, the client
    asks again and copies the old one. The check after the commit finds it and names it, with the command that
    uploads it; never "copied server-side". The same lie to a push by changes fails it the same way."""
    surgeon = Surgeon(tmp_path, hub.url)
    out = tmp_path / "out"
    surgeon("reinit", "org/M", "--layers", "-1", "-o", out)
    hub.forge_paths_info("org/M", {LAST: (out / LAST).read_bytes()})
    run = surgeon("push", out, "me/F", ok=False, token=TOKEN)
    assert f"pushed to me/F ({hub.url}/me/F/commit/" in run.error
    assert f"but it does not hold what the push planned: {LAST} holds " in run.error
    assert "copied server-side from" not in run.stdout + run.stderr
    assert hub.files("me/F")[LAST] == (shards / LAST).read_bytes()  # the old shard, as the error says
    fix = re.search(r"run `([^`]+)` to upload them", run.error).group(1)
    assert shlex.split(fix) == ["surgeon", "push", str(out), "me/F", "--no-server-copy"]
    surgeon(*shlex.split(fix)[1:], token=TOKEN)
    assert {p: c for p, c in hub.files("me/F").items() if p != ".gitattributes"} == folder_files(out)
    # a push by changes: the copies' answer (asked once, at the pinned commit) lies about a shard it copies
    first = "model-00001-of-00008.safetensors"
    lie = bytearray((shards / first).read_bytes())
    lie[-1] ^= 1
    hub.forge_paths_info("org/M", {first: bytes(lie)})
    run = surgeon("reinit", "org/M", "--layers", "-1", "--push-to-hub", "me/G", ok=False, token=TOKEN)
    assert f"does not hold what the push planned: {first} holds " in run.error
    fix = shlex.split(re.search(r"run `([^`]+)` to upload them", run.error).group(1))
    assert fix[:3] == ["surgeon", "reinit", "org/M"] and fix[fix.index("--push-to-hub") + 1] == "me/G"
    assert fix[-4:] == ["--no-server-copy", "--staging", str(tmp_path / "M-reinit"), "--overwrite"]
    surgeon(*fix[1:], token=TOKEN)
    assert {p: c for p, c in hub.files("me/G").items() if p not in (".gitattributes", "README.md")} == {
        p: c for p, c in folder_files(out).items() if p != "README.md"
    }


@copies_across_repos
def test_the_staging_folder_of_a_failed_push_is_refused_with_the_reinit_that_resumes(shards, hub, tmp_path):
    """A push by changes fails at its commit; its staging folder (the card and one shard) pushed alone is refused in
    one line, dry run or not, with the reinit command that resumes, and so is a whole output short of a shard its
    index names; that command makes the whole repo."""
    surgeon = Surgeon(tmp_path, hub.url)
    hub.fail("POST", r"^/api/models/me/R/commit/", status=503, message="try later")
    surgeon("reinit", "org/M", "--layers", "-1", "--push-to-hub", "me/R", ok=False, token=TOKEN)
    staging = tmp_path / "M-reinit"
    assert sorted(p.name for p in staging.iterdir()) == ["README.md", LAST]
    full = tmp_path / "full" / "M-reinit"
    surgeon("reinit", "org/M", "--layers", "-1", "-o", full)
    short = tmp_path / "short"
    shutil.copytree(full, short)
    (short / LAST).unlink()
    since = len(hub.requests)
    alone, dry, short_run = surgeon.many(
        ["push", staging, "me/R"], ["push", staging, "me/R", "--dry-run"], ["push", short, "me/S"], token=TOKEN
    )
    for run in (alone, dry):
        assert run.error.startswith(
            f"surgeon: error: {staging} is not a whole model: it holds 1 shard of a sharded model ({LAST}) and no index"
        ), run.error
    assert f"its model.safetensors.index.json names 1 weight file it does not hold ({LAST})" in short_run.error
    assert [r for r in hub.requests[since:] if r.method != "GET"] == []  # nothing sent, nothing asked to write
    resume = shlex.split(re.search(r"run `(surgeon reinit [^`]+)`", alone.error).group(1))
    commit = hub.repos["org/M"].branches["main"]
    assert resume[:5] == ["surgeon", "reinit", "org/M", "--revision", commit] and "--layers=-1" in resume
    assert resume[-3:] == ["--staging", str(staging), "--overwrite"] and "--no-server-copy" not in resume
    surgeon(*resume[1:], token=TOKEN)
    repo = {p: c for p, c in hub.files("me/R").items() if p != ".gitattributes"}
    expected = folder_files(full)
    assert repo.keys() == expected.keys()
    assert all(repo[p] == expected[p] for p in expected if p != "README.md")  # the card's title names its repo


@copies_across_repos
def test_the_staging_folder_of_a_one_file_model_is_refused_too(outputs, tmp_path):
    """A one-file model's staging folder (its card and model.safetensors) holds no shard to give it away: the
    question its push asks the source anyway says the source holds a config.json, which every whole output
    carries. Refused with the reinit that resumes, which makes the whole repo."""
    single = outputs[0]
    with served() as hub:
        hub.add_model("org/one", single)
        commit = hub.repos["org/one"].branches["main"]
        hub.fail("POST", r"^/api/models/me/O/commit/", status=503, message="try later")
        surgeon = Surgeon(tmp_path, hub.url)
        surgeon("reinit", "org/one", "--layers", "0", "--push-to-hub", "me/O", ok=False, token=TOKEN)
        staging = tmp_path / "one-reinit"
        assert sorted(p.name for p in staging.iterdir()) == ["README.md", "model.safetensors"]
        run = surgeon("push", staging, "me/O", ok=False, token=TOKEN)
        assert run.error.startswith(
            f"surgeon: error: {staging} is not a whole model: it holds no config.json, which org/one@{commit[:12]} "
            "holds and every whole output of it carries"
        ), run.error
        assert hub.pushed == []
        resume = shlex.split(re.search(r"run `(surgeon reinit [^`]+)`", run.error).group(1))
        surgeon(*resume[1:], token=TOKEN)
        assert set(hub.files("me/O")) == {".gitattributes", *folder_files(single)}


def test_a_card_whose_record_is_not_its_weights_is_refused(shards, hub, tmp_path):
    """A surgeon record that is not the weights' (here in the card's front matter, where a source card's tags put
    it, before the card's own record, naming another model and seed) is refused in one line, and so is a card
    with a record over weights that hold none; nothing is asked of the Hub."""
    from surgeon.report.card import card_comment

    surgeon = Surgeon(tmp_path, hub.url)
    out = tmp_path / "out"
    surgeon("reinit", "org/M", "--layers", "-1", "-o", out)
    card = (out / "README.md").read_text()
    record = json.loads(re.search(r"<!-- surgeon-record (\{.*?\}) -->", card).group(1))
    forged = {
        **record,
        "options": {**record["options"], "seed": 7},
        "origin": {"repo": "org/Other", "commit": "0" * 40},
    }
    (out / "README.md").write_text(card.replace("tags:\n", f"tags:\n- '{card_comment(forged)}'\n", 1))
    stranger = tmp_path / "stranger"
    shutil.copytree(shards, stranger)  # the source's weights, which hold no record, under the output's card
    (stranger / "README.md").write_text(card)
    since = len(hub.requests)
    forged_run, stranger_run = surgeon.many(["push", out, "me/X"], ["push", stranger, "me/X"], token=TOKEN)
    assert forged_run.error == (
        f"surgeon: error: {out / 'README.md'}: its surgeon record is not the record in the folder's weights (its "
        "safetensors metadata): the card was changed after surgeon wrote it; restore the card surgeon wrote, or "
        "take the record out of it, and push again"
    )
    assert "it carries a surgeon record, and the folder's weights hold none" in stranger_run.error
    assert hub.requests[since:] == [] and "me/X" not in hub.repos


def test_would_delete_and_a_dry_run_read_the_destination_and_send_nothing(outputs, monkeypatch):
    """The lead's question for a reinit's dry run: what a push of these files would delete (read-only; nothing for
    a repo not there yet, or a push that keeps them); push_folder(dry_run=True) gives the same in a frozen result."""
    from huggingface_hub import constants

    from surgeon.hub.push import PushTarget, push_folder, would_delete

    single, _, _, out_sharded = outputs
    with served() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        hub.add_model("me/D", {p: (single / p).read_bytes() for p in ("model.safetensors", "config.json")})
        files = list(folder_files(out_sharded))
        assert would_delete("me/D", files, token=TOKEN) == ["model.safetensors"]
        assert would_delete("me/D", files, branch="dev", token=TOKEN) == ["model.safetensors"]  # made from main
        assert would_delete("me/D", files, create_pr=True, token=TOKEN) == ["model.safetensors"]
        assert would_delete("me/D", ["config.json", "README.md"], token=TOKEN) == []  # no weights pushed
        assert would_delete("me/none", files, token=TOKEN) == []
        assert PushTarget("me/D", token=TOKEN, keep_other_weights=True).would_delete(files) == []
        assert PushTarget("me/D", token=TOKEN).would_delete(files) == ["model.safetensors"]
        result = push_folder(out_sharded, "me/D", token=TOKEN, dry_run=True, include=["*"])  # training_args.bin too
        assert result.deleted == ["model.safetensors"] and result.plan is not None
        assert {f.path for f in result.plan.uploads} == set(files) and result.plan.predicted
        with pytest.raises(dataclasses.FrozenInstanceError):
            result.bytes = 0  # type: ignore[misc]
        assert all(r.method == "GET" for r in hub.requests) and len(hub.repos["me/D"].commits) == 2


def test_huggingface_hubs_private_state_is_read_in_compat_only():
    """_upload_mode, _remote_oid and _local_oid of a CommitOperationAdd are huggingface_hub's private bookkeeping:
    read through surgeon._compat only, where a release that drops them fails in one line."""
    from surgeon import _compat

    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "surgeon").rglob("*.py"))
        if path.name != "_compat.py"
        for name in re.findall(r"\._(?:upload_mode|remote_oid|local_oid)\b", path.read_text())
    ]
    assert found == []
    _compat.check_upload_state()
