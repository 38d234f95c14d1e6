"""verify of a recipe's output: every step re-derived in order from the record; a record whose steps were edited is a
mismatch (the weights hold another recipe), one with steps surgeon never writes cannot be read (one line)."""

from __future__ import annotations

import pytest

from helpers.records import edit_last, rewrite_record
from helpers.tiny import tiny_llama

RECIPE = '[[step]]\nlayers = "0-1"\nstrength = 0.5\n\n[[step]]\nlayers = 1\ntargets = "q"\nmode = "redraw"\n'


@pytest.fixture
def made(tmp_path, cli):
    src, out, recipe = tmp_path / "llama", tmp_path / "out.safetensors", tmp_path / "r.toml"
    tiny_llama().save_pretrained(src)
    recipe.write_text(RECIPE)
    cli("reinit", src / "model.safetensors", "--recipe", recipe, "-o", out)
    assert cli("verify", src / "model.safetensors", out).stdout.startswith("verified:")
    return src / "model.safetensors", out


@pytest.mark.parametrize(
    "edit,code,match",
    [
        (lambda r: r["steps"][0]["options"].update(strength=0.25), 3, "the recipe re-derived from the record"),
        (lambda r: r["steps"].reverse(), 3, "the recipe re-derived from the record"),  # the other order: other values
        (lambda r: r["steps"][1]["options"].update(seed=1), 3, "q_proj.weight"),
        (lambda r: r.update(steps=r["steps"][:1]), 1, "a recipe of 1 steps: not surgeon's"),
        (lambda r: r["steps"][1].update(tool="surgeon"), 1, "step 1 of the last surgeon record has a field"),
        (lambda r: r["steps"][0].update(method="polar-conditioning"), 1, "says method 'polar-conditioning'"),
        (lambda r: r.update(options={}), 1, "has 'options' beside its steps"),
    ],
    ids=["strength", "order", "seed", "one-step", "extra-field", "method", "options-beside"],
)
def test_an_edited_recipe_record_is_refused(made, cli, edit, code, match):
    src, out = made
    rewrite_record(out, edit_last(edit))
    result = cli("verify", src, out, ok=False)
    assert result.exit_code == code and match in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
