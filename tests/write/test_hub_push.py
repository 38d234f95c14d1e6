"""Pushing to a loopback Hub through huggingface_hub's real upload path; the server checks what arrives."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex

import pytest
from huggingface_hub import ModelCard

from surgeon import __version__, reinit_checkpoint

from helpers.hub import OTHER_TOKEN, SOURCE_BODY, TOKEN, Surgeon, all_text_under, digest, make_source
from helpers.hub_server import HubServer


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("sources")
    return make_source(base / "single"), make_source(base / "sharded", shard="100KB")


def serve(source, **kwargs) -> HubServer:
    hub = HubServer(**kwargs)
    hub.add_token(TOKEN, "me", ("org",))
    hub.add_token(OTHER_TOKEN, "stranger")
    hub.add_model("org/tiny", source)
    return hub


def commit_lines(hub: HubServer) -> list[dict]:
    """The NDJSON operations of every commit the server received."""
    bodies = [r.body for r in hub.requests if r.method == "POST" and "/commit/" in r.path and r.status == 200]
    return [[json.loads(line) for line in body.splitlines()] for body in bodies]


def test_reinit_and_push_in_one_commit(sources, tmp_path):
    with serve(sources[0]) as hub:
        surgeon = Surgeon(tmp_path, hub.url)
        run = surgeon(
            "reinit",
            "org/tiny",
            "--layers",
            "0",
            "-o",
            "out",
            "--push-to-hub",
            "me/tiny-reset",
            "--private",
            "--no-server-copy",  # every file uploaded (the copies: test_push_of_an_output_made_from_the_hub_...)
            token=TOKEN,
        )
        out = tmp_path / "out"
        repo = hub.repos["me/tiny-reset"]
        assert repo.private
        assert "note: created the private model repo me/tiny-reset" in run.stdout
        (pushed,) = hub.pushed  # one commit, on main, by the token's user
        assert pushed["branch"] == "main" and pushed["user"] == "me"
        assert (
            pushed["message"]
            == f"Conditioned re-initialization of q,k,v in 1 attention block of org/tiny (surgeon {__version__})"
        )
        assert (
            "pushed 6 files (" in run.stdout
            and f"in one commit: {hub.url}/me/tiny-reset/commit/{pushed['commit']}" in run.stdout
        )
        # every file arrived with its exact bytes; nothing else was added
        arrived = {
            p: hashlib.sha256(c).hexdigest() for p, c in hub.files("me/tiny-reset").items() if p != ".gitattributes"
        }
        assert arrived == digest(out)
        # the weights went through the large-file path (LFS upload + commit pointer), small files inline
        (ops,) = commit_lines(hub)
        kinds = {op["value"]["path"]: op["key"] for op in ops[1:]}
        assert kinds == {p: ("lfsFile" if p.endswith(".safetensors") else "file") for p in digest(out)}
        assert hub.lfs_uploads() == [digest(out)["model.safetensors"]]
        # the card was validated by the Hub's YAML check before the commit, and is the one on disk
        assert hub.validated_cards == [(out / "README.md").read_text()]
        card = ModelCard(hub.files("me/tiny-reset")["README.md"].decode())
        assert card.data.to_dict() == {  # the source's datasets and model-index (its eval results) are dropped
            "base_model": "org/tiny",
            "license": "apache-2.0",
            "pipeline_tag": "text-generation",
            "library_name": "transformers",
            "tags": ["surgeon", "conditioned-initialization", "llama", "tiny-test-model"],
        }
        assert card.text.startswith("\n# me/tiny-reset\n") and card.text.rstrip().endswith(SOURCE_BODY.strip())
        source_commit = hub.repos["org/tiny"].branches["main"]
        assert f"surgeon reinit org/tiny --revision {source_commit} --layers=0 " in card.text
        # the token went in the Authorization header of every write, and nowhere else
        writes = [r for r in hub.requests if r.method == "POST" and not r.path.startswith("/__lfs/")]
        assert writes and all(r.auth == TOKEN for r in writes)
        for r in hub.requests:
            assert TOKEN not in r.path + json.dumps(r.query) + json.dumps(r.headers) + r.body.decode("latin-1")
        assert TOKEN not in run.stdout + run.stderr + all_text_under(tmp_path)

        # pushing the same folder again sends nothing and makes no commit
        again = surgeon("push", "out", "me/tiny-reset", token=TOKEN)
        assert "nothing to push: all 6 files are on me/tiny-reset (branch main) already, unchanged" in again.stdout
        assert len(hub.pushed) == 1 and len(hub.lfs_uploads()) == 1


def test_push_to_a_branch_and_as_a_pull_request_with_multipart_uploads(sources, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("model.safetensors", "config.json", "generation_config.json", "README.md"):
        (plain / name).write_bytes((sources[0] / name).read_bytes())
    out = tmp_path / "out"
    reinit_checkpoint(plain, output=out, layers="1")
    with serve(sources[0], multipart_threshold=64 * 1024, chunk_size=64 * 1024) as hub:
        surgeon = Surgeon(tmp_path, hub.url)
        branch, pr = surgeon.many(
            ["push", out, "org/tiny-reset", "--branch", "reset-v2", "--commit-message", "Reset layer 1"],
            ["push", out, "org/tiny-reset", "--create-pr", "--json"],
            token=TOKEN,
        )
        assert branch.rc == 0 and pr.rc == 0, branch.stderr + pr.stderr
        repo = hub.repos["org/tiny-reset"]
        assert set(hub.files("org/tiny-reset", "main")) == {".gitattributes"}  # main untouched
        for ref in ("reset-v2", "refs/pr/1"):
            arrived = {
                p: hashlib.sha256(c).hexdigest()
                for p, c in hub.files("org/tiny-reset", ref).items()
                if p != ".gitattributes"
            }
            assert arrived == digest(out), ref
        assert [p["message"] for p in hub.pushed] == ["Reset layer 1", f"Upload out with surgeon {__version__}"]
        assert [p["branch"] for p in hub.pushed] == ["reset-v2", "refs/pr/1"] and repo.prs == 1
        result = json.loads(pr.stdout)
        assert result["pr_url"] == f"{hub.url}/org/tiny-reset/discussions/1"
        assert (
            "pushed 4 files" in branch.stdout
            and "1 through the large-file path" in branch.stdout
            and "(branch reset-v2)" in branch.stdout
        )
        # the weights went up once, in 64 KB parts; the pull request found them on the Hub already
        size = (out / "model.safetensors").stat().st_size
        parts = [r for r in hub.requests if r.method == "PUT" and "/part/" in r.path]
        assert len(parts) == math.ceil(size / (64 * 1024)) > 1
        assert hub.lfs_uploads() == [digest(out)["model.safetensors"]]


def test_the_push_branch_flags_reach_the_branch_and_no_other_spelling_is_read(sources, tmp_path):
    """push --branch and reinit --push-branch name the branch. The old spellings (--revision / --push-revision for
    the branch to push to) are gone: refused in one line, no warning line, nothing pushed."""
    out = tmp_path / "out"
    reinit_checkpoint(sources[0], output=out, layers="0")
    with serve(sources[0]) as hub:
        surgeon = Surgeon(tmp_path, hub.url)
        runs = surgeon.many(
            ["push", out, "me/a", "--branch", "dev"],
            ["reinit", "org/tiny", "--layers", "0", "-o", "r1", "--push-to-hub", "me/c", "--push-branch", "dev"],
            ["push", out, "me/b", "--revision", "dev"],
            ["reinit", "org/tiny", "--layers", "0", "-o", "r2", "--push-to-hub", "me/d", "--push-revision", "dev"],
            token=TOKEN,
        )
        assert [r.rc for r in runs] == [0, 0, 2, 2], [r.stderr for r in runs]
        assert [(p["repo_id"], p["branch"]) for p in hub.pushed] == [("me/a", "dev"), ("me/c", "dev")]
        assert "warning" not in "".join(r.stderr for r in runs)
        assert "(branch dev)" in runs[0].stdout
        for run, flag in zip(runs[2:], ("--revision", "--push-revision")):
            assert flag in run.error, run.error  # one line, no traceback
        assert "me/b" not in hub.repos and "me/d" not in hub.repos and not (tmp_path / "r2").exists()


def test_an_interrupted_push_says_what_arrived_and_a_rerun_finishes(sources, tmp_path):
    expected = tmp_path / "expected"
    reinit_checkpoint(sources[1], output=expected, layers="0")  # the same bytes the command below writes
    shards = sorted(p for p in digest(expected) if p.endswith(".safetensors"))
    assert len(shards) >= 3
    with serve(sources[1]) as hub:
        hub.fail(
            "PUT", f"^/__lfs/{digest(expected)[shards[1]]}$", status=507, times=None, message="Insufficient Storage"
        )
        surgeon = Surgeon(tmp_path, hub.url)
        out = tmp_path / "out"
        error = surgeon(
            "reinit", "org/tiny", "--layers", "0", "-o", out, "--push-to-hub", "org/sharded", "--no-server-copy",
            token=TOKEN, ok=False,
        ).error  # fmt: skip
        assert all(digest(out)[s] == digest(expected)[s] for s in shards)  # the output is complete on disk
        assert f"wrote {out}, but the push failed: push to org/sharded stopped at {shards[1]} " in error
        assert "(the Hub answered 507 for org/sharded: Insufficient Storage)" in error
        assert f"uploaded before it: {shards[0]} (1 large files); not uploaded: {shards[1]}, {shards[2]}, " in error
        assert "nothing was committed; run `" in error
        assert hub.pushed == [] and set(hub.files("org/sharded")) == {".gitattributes"}
        assert TOKEN not in error

        hub.faults.clear()
        rerun = re.search(r"run `([^`]+)` to finish", error).group(1)
        args = shlex.split(rerun)
        assert args[:4] == ["surgeon", "push", str(out), "org/sharded"]  # and the commit message the push had
        assert args[4] == "--commit-message" and "q,k,v in 1 attention block of org/tiny" in args[5]
        assert args[6:] == ["--no-server-copy"]  # as the failed push was
        finished = surgeon(*shlex.split(rerun)[1:], token=TOKEN)
        assert "pushed" in finished.stdout and len(hub.pushed) == 1
        arrived = {
            p: hashlib.sha256(c).hexdigest() for p, c in hub.files("org/sharded").items() if p != ".gitattributes"
        }
        assert arrived == digest(out)
        uploads = hub.lfs_uploads()
        assert sorted(uploads) == sorted(
            digest(out)[s] for s in shards
        )  # each shard sent once: the first run's not again


def test_push_refusals_are_one_line_and_write_nothing(sources, tmp_path):
    single = tmp_path / "model.safetensors"
    single.write_bytes((sources[0] / "model.safetensors").read_bytes())
    out = tmp_path / "made-earlier"
    reinit_checkpoint(sources[0], output=out, layers="0")
    bad_card = tmp_path / "bad-card"
    bad_card.mkdir()
    (bad_card / "README.md").write_text("---\n- not\n- a mapping\n---\n")
    with serve(sources[0]) as hub:
        surgeon = Surgeon(tmp_path, hub.url)
        before = digest(tmp_path)
        no_token = [
            (
                ["reinit", "org/tiny", "--push-to-hub", "me/x"],
                "pushing to the Hub needs a token with write access: set HF_TOKEN or run `hf auth login`",
            ),
            (["push", out, "me/x"], "pushing to the Hub needs a token"),
            (
                ["reinit", "org/tiny", "--private"],
                "--private, --push-branch, --create-pr and --commit-message go with --push-to-hub org/name",
            ),
            (
                ["reinit", "org/tiny", "--push-to-hub", "me/x", "--create-pr", "--push-branch", "dev"],
                "--create-pr opens a pull request against main",
            ),
            (
                ["reinit", "org/tiny", "--push-to-hub", "not a repo!"],
                "push target 'not a repo!' is not a Hub repository id",
            ),
        ]
        for run, (args, text) in zip(surgeon.many(*[c[0] for c in no_token]), no_token):
            assert text in run.error, (args, run.error)
        assert hub.requests == []  # all refused before asking the Hub anything
        with_token = [
            (
                ["reinit", single, "--push-to-hub", "me/x"],
                "--push-to-hub uploads a model folder, and the output of model.safetensors is a single file",
            ),
            (["push", tmp_path / "missing", "me/x"], "is not there: surgeon push uploads a model folder"),
            (["push", bad_card, "me/x"], "the model card's metadata does not parse"),
            (["push", out, "stranger/x"], "the token in use cannot write to stranger/x"),
        ]
        for run, (args, text) in zip(surgeon.many(*[c[0] for c in with_token], token=TOKEN), with_token):
            assert text in run.error, (args, run.error)
        assert digest(tmp_path) == before and "me/x" not in hub.repos and "stranger/x" not in hub.repos
        # a stranger may not commit to org/tiny, and a reinit that fails to push keeps its output and says where
        stranger, kept = surgeon.many(
            ["push", out, "org/tiny"],
            ["reinit", "org/tiny", "-o", "kept", "--push-to-hub", "org/tiny", "--push-branch", "dev"],
            token=OTHER_TOKEN,
        )
        assert (
            "the token in use cannot write to org/tiny: it needs write access to 'org' (or push with --create-pr)"
            in stranger.error
        )
        assert "wrote kept, but the push failed: the token in use cannot write to org/tiny" in kept.error
        assert (tmp_path / "kept" / "model.safetensors").is_file()
        assert OTHER_TOKEN not in stranger.stderr + kept.stderr
        bad = surgeon("push", out, "me/x", token="hf_bad", ok=False)
        assert "the Hub rejected the token (HF_TOKEN or the saved login)" in bad.error and "hf_bad" not in bad.stderr
        assert hub.pushed == []


def test_dry_runs_need_no_token_and_every_failed_push_ends_with_the_command_that_retries_it(sources, tmp_path):
    """Nothing is sent by a dry run, so no token is asked for (it says the real push needs one); a push that
    fails before anything reached the Hub ends with the `surgeon push` command that sends the same folder."""
    out = tmp_path / "made-earlier"
    reinit_checkpoint(sources[0], output=out, layers="0")
    with serve(sources[0]) as hub:
        surgeon = Surgeon(tmp_path, hub.url)
        before = digest(out)
        pushed, reinit = surgeon.many(
            ["push", out, "me/x", "--dry-run"],
            ["reinit", "org/tiny", "-o", "planned", "--push-to-hub", "me/x", "--dry-run"],
        )
        for run in (pushed, reinit):
            assert run.rc == 0, run.stderr
            assert "no Hub token found: the real push needs one with write access" in run.stdout
        assert "dry run: would push these" in pushed.stdout and "the real run pushes planned to me/x" in reinit.stdout
        assert not any(r.method in ("POST", "PUT") for r in hub.requests)  # nothing sent
        assert digest(out) == before and not (tmp_path / "planned").exists()  # nothing written
        with_token = surgeon("push", out, "me/x", "--dry-run", token=TOKEN)
        assert "no Hub token found" not in with_token.stdout
        # the Hub refuses a stranger's push outright: nothing arrived, and the line ends with the retry
        refused, kept = surgeon.many(
            ["push", out, "org/tiny", "--branch", "dev"],
            ["reinit", "org/tiny", "-o", "kept", "--push-to-hub", "org/other", "--commit-message", "reset it"],
            token=OTHER_TOKEN,
        )
    for run, rerun in (
        (refused, f"surgeon push {out} org/tiny --branch dev"),
        (kept, "surgeon push kept org/other --commit-message 'reset it'"),
    ):
        assert run.rc != 0 and run.error.endswith(f"; retry with `{rerun}`"), run.error
        assert OTHER_TOKEN not in run.stderr
    assert (tmp_path / "kept" / "model.safetensors").is_file() and hub.pushed == []


def test_a_local_source_card_names_its_lineage_and_never_the_local_path(sources, tmp_path):
    local = tmp_path / "somewhere" / "deep" / "minilm"
    local.parent.mkdir(parents=True)
    import shutil

    shutil.copytree(sources[0], local)
    out = tmp_path / "out"
    reinit_checkpoint(local, output=out, layers="0", base_model="org/tiny")
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "org/tiny"
    assert "This is `minilm` (base model [`org/tiny`](" in card.text
    reproduce = card.text.split("## Reproduce")[1]
    assert "surgeon reinit minilm " in reproduce and "somewhere" not in card.content
    # without the flag, the base_model the source's own card names
    (local / "README.md").write_text("---\nbase_model: org/parent\nlicense: mit\n---\n\n# minilm\n")
    reinit_checkpoint(local, output=tmp_path / "out2", layers="0")
    card = ModelCard.load(tmp_path / "out2" / "README.md")
    assert card.data.base_model == "org/parent" and card.data.license == "mit"
    with pytest.raises(Exception, match=r"base_model 'not an id' is not a Hub repository id"):
        reinit_checkpoint(local, output=tmp_path / "out3", base_model="not an id")
    assert not (tmp_path / "out3").exists()


def test_push_of_an_output_made_from_the_hub_copies_or_says_why_not(sources, tmp_path):
    """`surgeon push` of an output made from org/tiny: with a huggingface_hub that copies across repos (1.17 or newer),
    the files the record's commit holds unchanged are copied server-side; with one that cannot (the floors
    job's 1.3), a note says so and every file is uploaded. Either way the repo holds the folder's bytes."""
    from huggingface_hub import CommitOperationCopy, __version__

    with serve(sources[1]) as hub:
        surgeon = Surgeon(tmp_path, hub.url)
        surgeon("reinit", "org/tiny", "--layers", "0", "-o", "out")
        out = tmp_path / "out"
        run = surgeon("push", out, "me/copied", token=TOKEN)
        arrived = {p: c for p, c in hub.files("me/copied").items() if p != ".gitattributes"}
        assert arrived == {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
        unchanged = {
            p.relative_to(out).as_posix()
            for p in out.rglob("*")
            if p.is_file()
            and p.name != "README.md"
            and (sources[1] / p.relative_to(out)).read_bytes() == p.read_bytes()
        }
        assert any(f.endswith(".safetensors") for f in unchanged)  # the shards layer 0 is not in
        copied = {d["filename"] for d in hub.duplicated()}
        if "src_repo_id" in CommitOperationCopy.__dataclass_fields__:
            assert f"and {len(unchanged)} unchanged files (" in run.stdout
            assert copied == {f for f in unchanged if f.endswith(".safetensors")}
            assert f"copied server-side from org/tiny@{hub.repos['org/tiny'].branches['main']}" in run.stdout
        else:
            assert copied == set()
            assert f"note: uploading every file: huggingface_hub {__version__} has no cross-repo copies" in run.stdout
        # reinit --push-to-hub without -o: the changes alone where the client copies, the whole output where not
        direct = surgeon("reinit", "org/tiny", "--layers", "0", "--push-to-hub", "me/direct", token=TOKEN)
        staged = {p.name for p in (tmp_path / "tiny-reinit").iterdir()}
        if "src_repo_id" in CommitOperationCopy.__dataclass_fields__:
            assert staged == {"README.md"} | {f for f in arrived if f.endswith(".safetensors")} - unchanged
        else:
            assert staged == set(arrived) and len(hub.duplicated()) == 0
            assert (
                f"note: uploading every file: huggingface_hub {__version__} has no cross-repo copies" in direct.stdout
            )
        assert {p: c for p, c in hub.files("me/direct").items() if p != ".gitattributes"}.keys() == arrived.keys()
