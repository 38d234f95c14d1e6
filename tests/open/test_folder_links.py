"""The folder boundary (issue 27, item 1): nothing from outside a model folder reaches an output or an upload.

A hostile folder (a ``git clone``) holds links to a private file: as the model card, the tokenizer, the
config, a weight shard. ``reinit -o``, ``reinit --push-to-hub`` and ``push`` refuse it in one line that
names the link and its target, before anything is written or sent (the loopback Hub sees no request),
and the private bytes appear nowhere. Links to folders and FIFOs are left out, never walked or opened.
The Hugging Face cache's own links (``snapshots/REV/x -> ../../blobs/SHA``) still work, but only into
that repo's blobs. ``push --dry-run`` lists exactly the files and sends nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from helpers.cli import expect_cli_error
from helpers.hub import TOKEN, Surgeon, build_cache, make_source
from helpers.hub_server import HubServer
from helpers.onnx_graphs import tiny_attention
from helpers.paths import ROOT
from helpers.tiny import tiny_llama

SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- surgeon-folder-links-0f3a9c61 -----END-----"


def own_files(folder: Path) -> list[str]:
    """The folder's regular files (no link followed, no FIFO), relative posix paths: the test's own walk."""
    found = []
    for here, _, names in os.walk(folder):
        for n in names:
            p = Path(here) / n
            if p.is_file() and not p.is_symlink():
                found.append(p.relative_to(folder).as_posix())
    return sorted(found)


def leaks(root: Path, secret: Path, hub: HubServer | None = None) -> list[str]:
    """Where SECRET's bytes are, besides the secret file itself: regular files under ``root`` (links not
    followed) and everything the Hub received or holds."""
    where = [f for f in own_files(root) if root / f != secret and SECRET in (root / f).read_bytes()]
    if hub is not None:
        where += [f"request {r.method} {r.path}" for r in hub.requests if SECRET in r.body]
        where += [f"hub {repo}/{f}" for repo in hub.repos for f, c in hub.files(repo).items() if SECRET in c]
    return where


def writes(hub: HubServer, *, since: int = 0) -> list[str]:
    """The requests that could change something on the Hub."""
    return [f"{r.method} {r.path}" for r in hub.requests[since:] if r.method in ("POST", "PUT", "DELETE")]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A model folder as a Hub repo holds it: weights, config, tokenizer files and a card."""
    return make_source(tmp_path_factory.mktemp("source") / "model")


def hub_with(source: Path) -> HubServer:
    hub = HubServer()
    hub.add_token(TOKEN, "me", ("org",))
    hub.add_model("org/tiny", source)
    return hub


def copy_of(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("onnx", "pytorch_model.bin", "training_args.bin"))
    (dest / "vocab.txt").write_text("[PAD]\n[UNK]\nhello\n")
    return dest


@pytest.mark.parametrize("name", ["README.md", "tokenizer.json", "vocab.txt", "config.json"])
def test_a_link_out_of_the_folder_is_refused_before_anything_is_written_or_sent(source, tmp_path, name):
    secret = tmp_path / "id_rsa"
    secret.write_bytes(SECRET)
    folder = copy_of(source, tmp_path / "clone")
    (folder / name).unlink()
    (folder / name).symlink_to(os.path.relpath(secret, folder))  # as a git clone makes it: a relative link
    commands = [
        ["reinit", folder, "-o", tmp_path / "out"],
        ["reinit", folder, "-o", tmp_path / "pushed", "--push-to-hub", "me/x"],
        ["reinit", folder, "--dry-run", "--push-to-hub", "me/x"],
        ["push", folder, "me/x"],
        ["push", folder, "me/x", "--dry-run", "--json"],
    ]
    if name == "config.json":  # the config beside a weight file given by itself is read too
        commands.append(["reinit", folder / "model.safetensors", "-o", tmp_path / "out.safetensors"])
    with hub_with(source) as hub:
        runs = Surgeon(tmp_path, hub.url).many(*commands, token=TOKEN)
        for command, run in zip(commands, runs):
            line = run.error  # exactly one line, no traceback, non-zero exit
            assert f"{name} in {folder} is a link to {secret}, outside the folder" in line, (command, line)
            assert SECRET.decode() not in run.stdout + run.stderr
        assert hub.requests == [] and "me/x" not in hub.repos  # refused before the Hub was asked anything
        assert leaks(tmp_path, secret, hub) == []
    assert not any((tmp_path / p).exists() for p in ("out", "pushed", "out.safetensors", "clone-reinit"))


def test_weights_linked_out_of_the_folder_are_refused(tmp_path, cli):
    outside = tmp_path / "outside"
    tiny_llama().save_pretrained(outside, max_shard_size="100KB")
    shards = sorted(p.name for p in outside.glob("model-*.safetensors"))
    assert len(shards) > 1
    sharded = tmp_path / "sharded"
    shutil.copytree(outside, sharded)
    (sharded / shards[1]).unlink()
    (sharded / shards[1]).symlink_to(outside / shards[1])
    single = tmp_path / "single"
    single.mkdir()
    tiny_llama().save_pretrained(tmp_path / "elsewhere")
    shutil.copyfile(tmp_path / "elsewhere" / "config.json", single / "config.json")
    (single / "model.safetensors").symlink_to(tmp_path / "elsewhere" / "model.safetensors")
    cases = [
        (sharded, shards[1], outside / shards[1]),
        (sharded / "model.safetensors.index.json", shards[1], outside / shards[1]),  # the index given by itself
        (single, "model.safetensors", tmp_path / "elsewhere" / "model.safetensors"),
    ]
    for model, link, target in cases:
        folder = model if model.is_dir() else model.parent
        for args in (["reinit", model, "-o", tmp_path / "out"], ["inspect", model]):
            line = expect_cli_error(cli, tmp_path, *args, match=f"{link} in {folder} is a link to {target}")
            assert "outside the folder: surgeon reads no file from outside a model folder" in line
        assert not (tmp_path / "out").exists()


def test_linked_folders_and_fifos_are_left_out_never_walked_or_opened(source, tmp_path):
    secret_dir = tmp_path / "home"
    secret_dir.mkdir()
    secret = secret_dir / "id_rsa"
    secret.write_bytes(SECRET)
    folder = copy_of(source, tmp_path / "clone")
    (folder / "extra").symlink_to(secret_dir)  # a folder outside
    (folder / "tok").mkdir()
    (folder / "tok" / "merges.txt").write_text("h e\n")
    (folder / "inner").symlink_to("tok")  # a folder inside: never walked either (its files would come twice)
    for fifo in ("vocab.txt", "README.md"):
        (folder / fifo).unlink()
        os.mkfifo(folder / fifo)  # opening it would hang
    expected = own_files(folder)
    assert "vocab.txt" not in expected and "README.md" not in expected and "tok/merges.txt" in expected
    with hub_with(source) as hub:
        reinit, dry, pushed = Surgeon(tmp_path, hub.url).many(
            ["reinit", folder, "-o", tmp_path / "out"],
            ["push", folder, "me/x", "--dry-run", "--json"],
            ["push", folder, "me/x"],
            token=TOKEN,
        )
        assert reinit.rc == 0 and dry.rc == 0 and pushed.rc == 0, reinit.stderr + dry.stderr + pushed.stderr
        left = (
            f"README.md (a FIFO), extra/ (a link to a folder, {secret_dir}), "
            f"inner/ (a link to a folder, {folder / 'tok'}), vocab.txt (a FIFO)"
        )
        assert f"left out, never opened (surgeon reads only regular files from a folder): {left}" in reinit.stdout
        out = tmp_path / "out"
        assert own_files(out) == sorted({*expected, "README.md"})  # README.md: the new card, without a source card
        assert "## Source model card" not in (out / "README.md").read_text()
        assert not (out / "extra").exists() and not (out / "inner").exists() and not (out / "vocab.txt").exists()
        report = json.loads(dry.stdout)
        assert report["files"] == expected and report["dry_run"] is True and left in report["notes"][0]
        arrived = {f: c for f, c in hub.files("me/x").items() if f != ".gitattributes"}
        assert sorted(arrived) == expected
        assert all(arrived[f] == (folder / f).read_bytes() for f in expected)
        assert leaks(tmp_path, secret, hub) == []


def test_a_link_to_a_file_inside_the_folder_is_read_as_that_file(tmp_path, cli):
    folder = tmp_path / "model"
    tiny_llama().save_pretrained(folder)
    (folder / "tok").mkdir()
    (folder / "tok" / "tokenizer-v2.json").write_text('{"version": "2.0"}')
    (folder / "tokenizer.json").symlink_to("tok/tokenizer-v2.json")
    (folder / "docs").mkdir()
    (folder / "docs" / "card.md").write_text("# The card kept in docs/\n\nWritten once, linked as README.md.\n")
    (folder / "README.md").symlink_to("docs/card.md")
    out = tmp_path / "out"
    cli("reinit", folder, "-o", out, "--layers", "0")
    assert (out / "tokenizer.json").read_text() == '{"version": "2.0"}' and not (out / "tokenizer.json").is_symlink()
    assert (out / "tok" / "tokenizer-v2.json").read_text() == '{"version": "2.0"}'
    assert "Written once, linked as README.md." in (out / "README.md").read_text()  # the source card, kept
    assert cli("verify", folder, out).stdout.startswith("verified:")


def test_hub_cache_links_work_only_into_that_repos_blobs(source, tmp_path):
    with hub_with(source) as hub:
        surgeon = Surgeon(tmp_path, hub.url)
        # a real download: huggingface_hub's own snapshot links (a reinit fetches the weights it writes from;
        # inspect would read them by Range)
        surgeon("reinit", "org/tiny", "--layers", "0", "-o", tmp_path / "first")
        repo = surgeon.hf_home / "hub" / "models--org--tiny"
        (snapshot,) = (repo / "snapshots").iterdir()
        assert (snapshot / "model.safetensors").is_symlink()
        good = surgeon.many(
            ["reinit", snapshot, "-o", tmp_path / "out", "--layers", "0"],
            ["reinit", "org/tiny", "-o", tmp_path / "by-id", "--layers", "0", "--push-to-hub", "me/by-id"],
            ["push", snapshot, "me/copy"],
            token=TOKEN,
        )
        assert all(run.rc == 0 for run in good), [run.stderr for run in good]
        fetched = sorted(p.name for p in snapshot.iterdir())
        assert own_files(tmp_path / "out") == fetched  # README.md: surgeon's card now
        assert {f: c for f, c in hub.files("me/copy").items() if f != ".gitattributes"} == {
            f: (source / f).read_bytes() for f in fetched
        }
        assert "me/by-id" in hub.repos

        secret = tmp_path / "id_rsa"
        secret.write_bytes(SECRET)
        etag = hashlib.sha256(SECRET).hexdigest()
        build_cache(surgeon.hf_home, "org/other", {"vocab.txt": SECRET})  # another repo's blob store
        blob = surgeon.hf_home / "hub" / "models--org--other" / "blobs" / etag
        for target in (blob, secret):
            link = snapshot / "vocab.txt"
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(target, snapshot))
            before = len(hub.requests)
            runs = surgeon.many(
                ["reinit", snapshot, "-o", tmp_path / "bad"],
                ["push", snapshot, "me/bad"],
                ["reinit", "org/tiny", "-o", tmp_path / "bad", "--push-to-hub", "me/bad"],
                token=TOKEN,
            )
            outside = (
                f"vocab.txt in {snapshot} is a link to {target}, outside the folder and its Hugging Face cache repo"
            )
            for run in runs:
                assert outside in run.error, run.error
            assert writes(hub, since=before) == [] and "me/bad" not in hub.repos and not (tmp_path / "bad").exists()
            assert all(SECRET not in r.body for r in hub.requests[before:])
        assert leaks(tmp_path / "out", secret) == [] and leaks(tmp_path / "by-id", secret) == []


def test_push_dry_run_lists_exactly_the_files_and_sends_nothing(source, tmp_path):
    src = copy_of(source, tmp_path / "model")
    with hub_with(source) as hub:
        surgeon = Surgeon(tmp_path, hub.url)
        (plan,) = surgeon.many(
            ["reinit", src, "-o", tmp_path / "out", "--push-to-hub", "me/y", "--dry-run"], token=TOKEN
        )
        assert plan.rc == 0 and not (tmp_path / "out").exists(), plan.stderr
        # read-only questions only (what me/y holds, for the files the push would delete): nothing sent
        assert {r.method for r in hub.requests} <= {"GET"} and all("/me/y" in r.path for r in hub.requests)
        (listed,) = [line for line in plan.stdout.splitlines() if "the real run pushes out to me/y" in line]
        real = surgeon("reinit", src, "-o", tmp_path / "out", "--push-to-hub", "me/y", token=TOKEN)
        arrived = sorted(f for f in hub.files("me/y") if f != ".gitattributes")
        assert listed.endswith(f": {len(arrived)} files, {', '.join(arrived)}")
        assert f"files pushed: {', '.join(arrived)}" in real.stdout

        out = tmp_path / "out"
        n = len(hub.requests)
        text, as_json = surgeon.many(
            ["push", out, "me/z", "--dry-run"], ["push", out, "me/z", "--dry-run", "--json"], token=TOKEN
        )
        assert text.rc == 0 and as_json.rc == 0, text.stderr + as_json.stderr
        # read-only questions only (what me/z holds, for the files the push would delete): nothing written
        assert {r.method for r in hub.requests[n:]} <= {"GET"} and all("/me/z" in r.path for r in hub.requests[n:])
        assert "me/z" not in hub.repos
        expected = own_files(out)
        assert [line[2:] for line in text.stdout.splitlines() if line.startswith("  ")] == expected
        size = sum((out / f).stat().st_size for f in expected)
        report = json.loads(as_json.stdout)
        assert report["files"] == expected and report["bytes"] == size and report["dry_run"] is True
        assert report["commit"] == "" and report["created_repo"] is False
        assert f"dry run: would push these {len(expected)} files" in text.stdout and "nothing was sent" in text.stdout

        pushed = surgeon("push", out, "me/z", token=TOKEN)
        arrived = sorted(f for f in hub.files("me/z") if f != ".gitattributes")
        assert [line[2:] for line in pushed.stdout.splitlines() if line.startswith("  ")] == arrived == expected


def test_verify_reads_no_link_out_of_either_folder(tmp_path, cli):
    secret = tmp_path / "id_rsa"
    secret.write_bytes(SECRET)
    folder = tmp_path / "model"
    tiny_llama().save_pretrained(folder)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    out = tmp_path / "out"
    cli("reinit", folder, "-o", out, "--layers", "0")
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").symlink_to(secret)  # an output changed after surgeon made it
    line = expect_cli_error(
        cli, tmp_path, "verify", folder, out, match=f"tokenizer.json in {out} is a link to {secret}"
    )
    assert SECRET.decode() not in line
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(secret)
    expect_cli_error(cli, tmp_path, "verify", folder, out, match=f"tokenizer.json in {folder} is a link to {secret}")


def test_onnx_external_data_in_a_hub_cache_snapshot_is_read_from_its_blobs(tmp_path, cli):
    import onnx

    src = tmp_path / "src"
    src.mkdir()
    model = tiny_attention(layers=1)
    onnx.save_model(
        model, str(src / "model.onnx"), save_as_external_data=True, location="model.onnx_data", size_threshold=0
    )
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    snapshot = tmp_path / "hub" / "models--org--o" / "snapshots" / build_cache(tmp_path, "org/o", files)
    assert (snapshot / "model.onnx_data").is_symlink()
    cli("reinit", snapshot / "model.onnx", "-o", tmp_path / "out.onnx", "--layers", "0")
    assert onnx.load(str(tmp_path / "out.onnx")).graph.node == onnx.load(str(src / "model.onnx")).graph.node
    # the same data, but in another repo's blob store: not this snapshot's to read
    build_cache(tmp_path, "org/other", {"model.onnx_data": files["model.onnx_data"]})
    data = snapshot / "model.onnx_data"
    target = os.path.realpath(data).replace("models--org--o", "models--org--other")
    data.unlink()
    data.symlink_to(os.path.relpath(target, snapshot))
    expect_cli_error(
        cli,
        tmp_path,
        "reinit",
        snapshot / "model.onnx",
        "-o",
        tmp_path / "x.onnx",
        match=f"model.onnx_data in {snapshot} is a link to {target}",
    )


def test_a_folder_without_weights_says_so_whatever_links_lie_in_it(tmp_path, cli):
    """A project folder (its .venv full of links out of it) holds no weights: that is the one thing to say."""
    project = tmp_path / "project"
    (project / ".venv" / "bin").mkdir(parents=True)
    (project / "train.py").write_text("print('hi')\n")
    (project / ".venv" / "bin" / "python3").symlink_to(sys.executable)
    for args in (["reinit", project, "-o", tmp_path / "out"], ["inspect", project]):
        line = expect_cli_error(
            cli, tmp_path, *args, match=f"no weights in folder {project}: expected model.safetensors"
        )
        assert ".venv" not in line and "link" not in line
    # with weights there, the same link is still refused before anything is read
    shutil.copytree(ROOT / "examples" / "tiny-bert", project, dirs_exist_ok=True)
    expect_cli_error(cli, tmp_path, "inspect", project, match=".venv/bin/python3 in")
