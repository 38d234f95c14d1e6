"""`surgeon push` of a real Trainer output folder pushes the model, not the training state beside it."""

from __future__ import annotations

import json

import pytest

from helpers.hub import TOKEN, Surgeon
from helpers.hub_server import HubServer
from helpers.training import trainer_output

MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors"]


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    return trainer_output(tmp_path_factory.mktemp("trainer") / "finetuned")


def served() -> HubServer:
    hub = HubServer()
    hub.add_token(TOKEN, "me")
    return hub


def test_dry_run_lists_the_model_files_the_left_out_ones_and_the_destination(output, tmp_path):
    left_out = sorted(
        str(p.relative_to(output)) for p in output.rglob("*") if p.is_file() and p.name not in MODEL_FILES
    ) + sorted(f"{c}/{f}" for c in ("checkpoint-2", "checkpoint-3") for f in MODEL_FILES)
    size = sum((output / f).stat().st_size for f in left_out)
    with served() as hub:
        run = Surgeon(tmp_path, hub.url)("push", str(output), "me/finetuned", "--dry-run", token=TOKEN)
        data = json.loads(
            Surgeon(tmp_path, hub.url)("push", str(output), "me/finetuned", "--dry-run", "--json", token=TOKEN).stdout
        )
        assert not hub.pushed
    assert sorted(data["files"]) == MODEL_FILES
    assert sorted(data["left_out"]) == sorted(left_out) and data["left_out_bytes"] == size
    lines = run.stdout.splitlines()
    (note,) = [line for line in lines if line.startswith("note: left out")]
    assert note.startswith(f"note: left out {len(left_out)} files (") and "checkpoint-2/ (8 files)" in note
    assert "--include GLOB" in note
    assert (
        "would push these 3 files" in run.stdout
        and f"to me/finetuned ({hub.url}/me/finetuned, branch main)" in run.stdout
    )
    assert {line.strip() for line in lines if line.startswith("  ") and "(left out)" not in line} == set(MODEL_FILES)
    assert {line.strip().removesuffix(" (left out)") for line in lines if "(left out)" in line} == set(left_out)


def test_push_sends_only_the_model_and_include_exclude_choose(output, tmp_path):
    with served() as hub:
        surgeon = Surgeon(tmp_path, hub.url)
        surgeon("push", str(output), "me/finetuned", token=TOKEN)
        assert sorted(set(hub.files("me/finetuned")) - {".gitattributes"}) == MODEL_FILES
        surgeon(
            "push", str(output), "me/last-checkpoint", "--include", "checkpoint-3/", "--exclude", "*.pth", token=TOKEN
        )
        got = sorted(set(hub.files("me/last-checkpoint")) - {".gitattributes"})
        assert got == sorted(
            f"checkpoint-3/{p.name}" for p in (output / "checkpoint-3").iterdir() if p.suffix != ".pth"
        )
        refused = surgeon("push", str(output), "me/none", "--include", "*.gguf", token=TOKEN, ok=False)
        assert "no file of" in refused.error and "--include *.gguf" in refused.error
