"""Reading models by Hub id: from a loopback Hub (HF_ENDPOINT) and from a hand-built HF cache (offline).

Every run is the real ``surgeon`` command in a fresh process with its own HF_HOME / HF_ENDPOINT /
HF_HUB_OFFLINE / HF_TOKEN; nothing here reaches the internet.
"""

from __future__ import annotations

import json
import shutil
from urllib.parse import unquote

import pytest

from surgeon import reinit_checkpoint

from helpers.hub import OTHER_TOKEN, TOKEN, Surgeon, build_cache, closed_port_url, digest, local_kappas, make_source
from helpers.hub_server import HubServer

FETCHED = [
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("sources")
    return make_source(base / "main"), make_source(base / "v2", seed=3)


@pytest.fixture
def hub(sources):
    with HubServer() as server:
        server.add_token(TOKEN, "me", ("org",))
        server.add_token(OTHER_TOKEN, "stranger")
        server.add_model("org/tiny", sources[0])
        yield server


@pytest.fixture
def surgeon(tmp_path, hub):
    return Surgeon(tmp_path, hub.url)


def kappas(report: dict) -> list[float]:
    return [p["before"]["heads"] for p in report["projections"]]


def test_reads_by_id_fetching_only_what_it_needs(surgeon, hub, sources, tmp_path):
    commit = hub.repos["org/tiny"].branches["main"]
    report = json.loads(surgeon("inspect", "org/tiny", "--json").stdout)
    assert report["source"] == "org/tiny@main"
    assert any(
        f"read org/tiny from the Hugging Face Hub, revision main (commit {commit[:12]})" in n for n in report["notes"]
    )
    assert "not fetched (same weights in another format): pytorch_model.bin" in report["notes"]
    # one weight format, configs, tokenizer and card; never pytorch_model.bin, onnx/, training_args.bin; the
    # weights are read by Range (their header, then the measured tensors), not downloaded
    assert sorted(hub.downloads()) == [f for f in FETCHED if f != "model.safetensors"]
    assert {unquote(path.rsplit("/", 1)[1]) for path, _ in hub.ranges()} == {"model.safetensors"}
    snapshot = surgeon.hf_home / "hub" / "models--org--tiny" / "snapshots" / commit
    assert digest(snapshot) == {
        k: v for k, v in digest(sources[0]).items() if k in FETCHED and k != "model.safetensors"
    }
    assert (surgeon.hf_home / "hub" / "models--org--tiny" / "refs" / "main").read_text() == commit
    assert kappas(report) == local_kappas(sources[0])  # same numbers as locally

    # reinit by id: the default output is ./<name>-reinit, the same weights as a local run, from the cache
    n = len(hub.downloads())
    run = surgeon("reinit", "org/tiny", "--layers", "0")
    assert hub.downloads()[n:] == ["model.safetensors"]  # the weights, to write from; nothing downloaded twice
    out = tmp_path / "tiny-reinit"
    assert f"wrote {out}" in run.stdout
    local = tmp_path / "local"
    reinit_checkpoint(sources[0], output=local, layers="0")
    assert digest(out)["model.safetensors"] == digest(local)["model.safetensors"]
    assert sorted(digest(out)) == FETCHED  # README.md is now the new card (test_hub_card.py)


def test_revision_branch_tag_and_commit(surgeon, hub, sources):
    v2 = hub.add_model("org/tiny", {"model.safetensors": (sources[1] / "model.safetensors").read_bytes()}, branch="v2")
    hub.repos["org/tiny"].tags["v1.0"] = hub.repos["org/tiny"].branches["main"]
    runs = surgeon.many(
        *[
            ["inspect", "org/tiny", *rev, "--json"]
            for rev in ([], ["--revision", "v2"], ["--revision", v2], ["--revision", "v1.0"])
        ],
        ["inspect", "org/tiny", "--revision", "nope"],
    )
    main, on_branch, by_commit, by_tag = (kappas(json.loads(r.stdout)) for r in runs[:4])
    assert on_branch != main
    assert on_branch == local_kappas(sources[1])
    assert by_commit == on_branch and by_tag == main
    assert "org/tiny has no revision 'nope'" in runs[4].error


def test_a_local_path_wins_over_a_hub_id(surgeon, hub, sources, tmp_path):
    shutil.copytree(sources[1], tmp_path / "org" / "tiny")
    local, revision = surgeon.many(["inspect", "org/tiny", "--json"], ["inspect", "org/tiny", "--revision", "main"])
    assert not [r for r in hub.requests if "org/tiny" in r.path]  # the Hub was not asked
    local = json.loads(local.stdout)
    assert local["source"] == "org/tiny"
    # nothing of the Hub's org/tiny has been used here: no note that it could have been meant
    assert not [n for n in local["notes"] if "hf://" in n]
    assert kappas(local) == local_kappas(sources[1])
    expected = "--revision applies to Hugging Face Hub ids only, and org/tiny is a local path; for the Hub model of that name write hf://org/tiny"
    assert expected in revision.error
    remote = json.loads(surgeon("inspect", "hf://org/tiny", "--json").stdout)
    assert remote["source"] == "org/tiny@main" and kappas(remote) != kappas(local)
    # now the cache holds the Hub model of that name, so the local one is said to have won
    again = json.loads(surgeon("inspect", "org/tiny", "--json").stdout)
    assert again["source"] == "org/tiny"
    assert (
        "org/tiny is a local folder, so it was used (write hf://org/tiny for the Hub model of that name)"
        in again["notes"]
    )


def test_read_errors_are_one_line(surgeon, hub, sources, tmp_path):
    hub.add_model("org/private", sources[0], private=True)
    hub.add_model("org/gated", sources[0], gated=True)
    before = digest(tmp_path)
    cases = {
        None: [
            (
                ["inspect", "org/missing"],
                "there is no file or folder org/missing, and no model org/missing on http://127.0.0.1:",
                "or it is private and no token was sent",
            ),
            (["inspect", "hf://org/missing"], "surgeon: error: no model org/missing on"),
            (["reinit", "org/private"], "no model org/private", "set HF_TOKEN / run `hf auth login`"),
            (["inspect", "org/gated"], "org/gated is a gated model", "(no token was sent)"),
        ],
        OTHER_TOKEN: [
            (["reinit", "org/private"], "no model org/private", "or the token in use has no access to it"),
            (
                ["inspect", "org/gated"],
                "org/gated is a gated model: accept its conditions at",
                "use a token of that account",
            ),
        ],
        "hf_not_a_real_token": [(["inspect", "org/tiny"], "the Hub rejected the token (HF_TOKEN or the saved login)")],
    }
    for token, calls in cases.items():
        for run, (args, *expected) in zip(surgeon.many(*[c[0] for c in calls], token=token), calls):
            for text in expected:
                assert text in run.error, (args, run.error)
            if token:
                assert token not in run.stderr + run.stdout
    assert digest(tmp_path) == before  # nothing written: no output folder, not even an HF cache entry
    # with access, the private repo reads like any other
    assert json.loads(surgeon("inspect", "org/private", "--json", token=TOKEN).stdout)["source"] == "org/private@main"


def test_offline_from_a_hand_built_cache(tmp_path, sources):
    surgeon = Surgeon(tmp_path, closed_port_url())  # nothing listens there: any request would fail
    files = {f: (sources[0] / f).read_bytes() for f in ("README.md", "config.json", "model.safetensors")}
    commit = build_cache(surgeon.hf_home, "org/cached", files)
    build_cache(surgeon.hf_home, "org/partial", {"config.json": files["config.json"]})

    report, reinit, *errors = surgeon.many(
        ["inspect", "org/cached", "--json"],
        ["reinit", "org/cached", "--layers", "0"],
        ["reinit", "org/nowhere"],
        ["reinit", "org/cached", "--revision", "v2"],
        ["reinit", "org/partial"],
        offline=True,
    )
    report = json.loads(report.stdout)
    assert report["source"] == "org/cached@main"
    assert any(
        f"(commit {commit[:12]}): 3 files in the HF cache (HF_HUB_OFFLINE is set, nothing downloaded)" in n
        for n in report["notes"]
    )
    assert kappas(report) == local_kappas(sources[0])
    assert reinit.rc == 0 and "base_model: org/cached" in (tmp_path / "cached-reinit" / "README.md").read_text()
    for run, text in zip(
        errors,
        [
            "there is no file or folder org/nowhere, and org/nowhere is not (completely) in the Hugging Face cache",
            "org/cached at revision v2 is not (completely) in the Hugging Face cache",
            "org/partial is not (completely) in the Hugging Face cache",
        ],
    ):
        assert text in run.error and "HF_HUB_OFFLINE is set, so it cannot be downloaded" in run.error, run.error
    assert not (tmp_path / "nowhere-reinit").exists() and not (tmp_path / "partial-reinit").exists()

    # online, but the Hub cannot be reached: the cache serves at once (no retries), the rest fails in one line
    cached, nowhere, by_commit = surgeon.many(
        ["inspect", "org/cached", "--json"],
        ["inspect", "org/nowhere"],
        ["inspect", "org/cached", "--revision", commit, "--json"],
    )
    assert any("could not be reached, nothing downloaded" in n for n in json.loads(cached.stdout)["notes"])
    assert "cannot reach the Hugging Face Hub at http://127.0.0.1:" in nowhere.error
    assert kappas(json.loads(by_commit.stdout)) == kappas(report)


def test_which_files_are_fetched():
    from surgeon.hub.read import pick_files

    bert = [  # a classic transformers repo: the same weights in five formats, plus exports in folders
        ".gitattributes",
        "README.md",
        "config.json",
        "model.safetensors",
        "pytorch_model.bin",
        "tf_model.h5",
        "flax_model.msgpack",
        "rust_model.ot",
        "coreml/fill-mask/float32_model.mlpackage/Manifest.json",
        "onnx/model.onnx",
        "onnx/config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
    ]
    assert pick_files(bert) == (
        ["README.md", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt"],
        ["pytorch_model.bin"],
    )
    sharded = [  # sharded in two formats, custom code, a chat template, sentence-transformers modules, training leftovers
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "pytorch_model.bin.index.json",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "configuration_x.py",
        "modeling_x.py",
        "chat_template.jinja",
        "spiece.model",
        "modules.json",
        "1_Pooling/config.json",
        "2_Dense/config.json",
        "2_Dense/model.safetensors",
        "training_args.bin",
        "optimizer.pt",
        "checkpoint-500/config.json",
        "checkpoint-500/model.safetensors",
        "images/plot.png",
    ]
    chosen, skipped = pick_files(sharded)
    assert chosen == sorted(
        [
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "configuration_x.py",
            "modeling_x.py",
            "chat_template.jinja",
            "spiece.model",
            "modules.json",
            "1_Pooling/config.json",
            "2_Dense/config.json",
            "2_Dense/model.safetensors",  # sentence-transformers modules belong to the model
        ]
    )
    assert skipped == [
        "pytorch_model.bin.index.json",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
    ]
    assert pick_files(["pytorch_model.bin", "config.json", "training_args.bin"])[0] == [
        "config.json",
        "pytorch_model.bin",
    ]
    assert pick_files(["model.onnx", "model.onnx_data", "config.json"])[0] == [
        "config.json",
        "model.onnx",
        "model.onnx_data",
    ]
    assert pick_files(["README.md", "model.gguf"])[0] == ["README.md"]  # nothing surgeon reads: download() refuses
