"""Recipes: ``surgeon reinit MODEL --recipe FILE`` applies several steps in one pass over the bytes. Judged from outside:
a recipe's tensors equal those of its steps run one after another with the CLI (read back with the reference
safetensors reader), while each of the input's tensors is read once (counted); a one-step recipe writes what the CLI
writes, byte for byte; the report, the record and the card list every step; verify re-derives the whole recipe and
refuses one changed element; ``inspect --emit-recipe`` writes a recipe that replays the output."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from helpers.cli import expect_cli_error
from helpers.elements import nudge
from helpers.families import FAMILIES

RECIPE = """
[[step]]            # layers 0-1 back to the base
layers = "0-1"
mode = "restore"
from = "{base}"

[[step]]            # then layer 1's queries and keys 30% of the way to a conditioned draw
layers = 1
targets = "q,k"
strength = 0.3

[[step]]            # then heads 0-1 of layer 0 redrawn, on what the restore left
layers = "0"
heads = "0-1"
mode = "redraw"
seed = 4
"""
STEPS = [  # the same steps as command lines
    ["--layers", "0-1", "--mode", "restore", "--from", "{base}"],
    ["--layers", "1", "--targets", "q,k", "--strength", "0.3"],
    ["--layers", "0", "--heads", "0-1", "--mode", "redraw", "--seed", "4"],
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    FAMILIES["bert"].make().save_pretrained(root / "base")
    tuned = FAMILIES["bert"].make()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    tuned.save_pretrained(root / "tuned")
    return root / "base", root / "tuned"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _record(path):
    with safe_open(path / "model.safetensors", "np") as f:
        return json.loads(f.metadata()["surgeon"])[-1]


def test_a_recipe_equals_its_steps_run_one_after_another(models, tmp_path, cli, monkeypatch):
    from surgeon.formats.safetensors import SafetensorsWeights

    base, tuned = models
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE.format(base=base))
    reads: Counter = Counter()
    real_read = SafetensorsWeights.read

    def counted(self, name):  # counts the reads of the input's tensors, and reads them
        if self.folder == tuned:
            reads[name] += 1
        return real_read(self, name)

    monkeypatch.setattr(SafetensorsWeights, "read", counted)
    report = json.loads(cli("reinit", tuned, "--recipe", recipe, "-o", tmp_path / "recipe", "--json").stdout)
    monkeypatch.undo()
    assert reads and max(reads.values()) == 1  # one pass: each tensor read once, however many steps touch it
    assert "encoder.layer.0.attention.self.query.weight" in reads  # touched by two steps

    previous = tuned
    for i, args in enumerate(STEPS):  # the same steps, one run each
        cli("reinit", previous, *(a.format(base=base) for a in args), "-o", tmp_path / f"step{i}")
        previous = tmp_path / f"step{i}"
    one_by_one, together = (
        load_file(previous / "model.safetensors"),
        load_file(tmp_path / "recipe" / "model.safetensors"),
    )
    original = load_file(tuned / "model.safetensors")
    assert together.keys() == one_by_one.keys()
    for name in together:
        assert torch.equal(_bits(together[name]), _bits(one_by_one[name])), name
    assert sum(not torch.equal(original[n], together[n]) for n in original) == 12  # 6 restored, 2 mixed, +4 redrawn

    # the report, the record and the card list every step
    assert [p["step"] for p in report["projections"]] == [0] * 6 + [1] * 2 + [2] * 3
    assert [s["mode"] for s in report["options"]["steps"]] == ["restore", "conditioned", "redraw"]
    record = _record(tmp_path / "recipe")
    assert record["method"] == "recipe"
    assert [s["method"] for s in record["steps"]] == [
        "restore-from-checkpoint",
        "conditioned-initialization",
        "default-init-redraw",
    ]
    assert record["steps"][1]["options"]["strength"] == 0.3 and "sha256" in record["steps"][0]["from"]
    card = (tmp_path / "recipe" / "README.md").read_text()
    assert "by a recipe of 3 steps in one pass" in card and "--recipe recipe.toml" in card
    assert "| 1 | conditioned: " in card and '```toml\n[[step]]\nlayers = "0-1"' in card

    verified = cli("verify", tuned, tmp_path / "recipe", "--from", base).stdout
    assert verified.startswith("verified:") and "a recipe of 3 steps" in verified
    nudge(tmp_path / "recipe" / "model.safetensors", "encoder.layer.0.attention.self.key.weight", index=7)
    refused = cli("verify", tuned, tmp_path / "recipe", "--from", base, ok=False)
    assert refused.exit_code == 3 and "encoder.layer.0.attention.self.key.weight" in refused.stderr


def test_a_one_step_recipe_writes_what_the_cli_writes(models, tmp_path, cli):
    _, tuned = models
    recipe = tmp_path / "one.yaml"
    recipe.write_text("steps:\n  - {layers: 1, strength: 0.5, seed: 3}\n")
    cli("reinit", tuned, "--recipe", recipe, "-o", tmp_path / "a" / "out")
    cli("reinit", tuned, "--layers", "1", "--strength", "0.5", "--seed", "3", "-o", tmp_path / "b" / "out")
    for name in ("model.safetensors", "README.md"):
        assert (tmp_path / "a" / "out" / name).read_bytes() == (tmp_path / "b" / "out" / name).read_bytes(), name


def test_the_emitted_recipe_replays_the_output(models, tmp_path, cli, monkeypatch):
    base, tuned = models
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE.format(base=base))
    cli("reinit", tuned, "--recipe", recipe, "-o", tmp_path / "first")
    emitted = tmp_path / "emitted.toml"
    cli("inspect", tmp_path / "first", "--emit-recipe", emitted)
    text = emitted.read_text()
    assert text.count("[[step]]") == 3 and 'from = "base"' in text and "SOURCE was a checkpoint on disk" in text
    monkeypatch.chdir(base.parent)  # the SOURCE is named by its name: replayed beside it
    cli("reinit", tuned, "--recipe", emitted, "-o", tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (
        tmp_path / "first" / "model.safetensors"
    ).read_bytes()

    cli("reinit", tuned, "--layers", "0", "--mode", "redraw", "--std", "0.1", "-o", tmp_path / "plain")
    cli("inspect", tmp_path / "plain", "--emit-recipe", tmp_path / "plain.toml")  # a plain run: a one-step recipe
    cli("reinit", tuned, "--recipe", tmp_path / "plain.toml", "-o", tmp_path / "plain-again")
    assert (tmp_path / "plain-again" / "model.safetensors").read_bytes() == (
        tmp_path / "plain" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    "text,extra,match",
    [
        ("[[step]]\nlayers = 1\n", ("--seed", "2"), "holds each step's options: give --seed there"),
        ("[[step]]\nlayres = 1\n", (), "step 1 has an option surgeon does not know ('layres')"),
        ("[[step]]\nstrength = 0\n", (), "step 1: --strength 0 changes nothing"),
        ("[[step]]\nlayers = \n", (), "cannot be read as TOML"),
        ("layers = 1\n", (), "is not a recipe"),
    ],
    ids=["flags-too", "unknown-option", "bad-value", "not-toml", "no-steps"],
)
def test_a_bad_recipe_is_one_line_before_the_model_is_opened(tmp_path, cli, text, extra, match):
    recipe = tmp_path / "r.toml"
    recipe.write_text(text)
    expect_cli_error(cli, tmp_path, "reinit", tmp_path / "missing", "--recipe", recipe, *extra, match=match)


def test_a_polar_step_is_refused_in_a_recipe_of_several(models, tmp_path, cli):
    _, tuned = models
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[step]]\nlayers = 0\n\n[[step]]\nlayers = 1\nmode = "polar"\n')
    expect_cli_error(
        cli,
        tmp_path,
        "reinit",
        tuned,
        "--recipe",
        recipe,
        "-o",
        tmp_path / "o",
        match="step 1 of the recipe is --mode polar",
    )
