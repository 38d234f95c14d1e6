"""docs/ARCHITECTURE.md's recipe for an init mode, followed to the letter on a copy of the package: one module in
surgeon/modes/ and one entry in its registry, nothing else. The claim is that the CLI's choices, the plan,
the engine, the report, the record and verify all read the registry; the new mode's heads are judged by their
singular values, read back with the reference safetensors reader."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.package_copy import assert_layer_1_qk_heads_at, package_with_mode, surgeon_from
from helpers.paths import ROOT

HALVED = """
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Mode
from .conditioned import Conditioned

if TYPE_CHECKING:
    import torch

    from .base import Draw


class Halved(Mode, name="halved"):
    help = "the conditioned reset at half scale"
    method = "halved-conditioned-initialization"
    label = "Halved conditioned re-initialization"

    def draw(self, job: Draw) -> torch.Tensor:
        return Conditioned().draw(job) * 0.5

    def summary(self, options: dict, blocks: Sequence) -> str:
        return "halved conditioned reset"

    def card_intro(self, options: dict, blocks: Sequence) -> str:
        return "with a halved conditioned reset"

    def card_row(self, options: dict, blocks: Sequence) -> str:
        return "halved: conditioned, every head at half scale"
"""


def test_a_mode_added_by_the_recipe_runs_end_to_end(tmp_path):
    registry = "for m in (Conditioned(), Polar(), Redraw(), Mimetic(), Restore())}"
    assert registry in (ROOT / "surgeon" / "modes" / "__init__.py").read_text()  # the one line the recipe names
    src = package_with_mode(tmp_path, "halved", HALVED, "Halved")
    model, out = ROOT / "examples" / "tiny-bert", tmp_path / "out"

    helped = surgeon_from(src, "reinit", "--help")
    text = " ".join(helped.stdout.split())  # click wraps the help
    assert (
        helped.returncode == 0 and "|restore|halved]" in text and "halved: the conditioned reset at half scale" in text
    )

    run = surgeon_from(
        src, "reinit", str(model), "--mode", "halved", "--layers", "1", "--targets", "q,k", "-o", str(out), "--json"
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["options"]["mode"] == "halved"

    assert_layer_1_qk_heads_at(model, out, 0.5)

    (record,) = json.loads(load_file_metadata(out / "model.safetensors")["surgeon"])
    assert record["method"] == "halved-conditioned-initialization"
    assert "halved" in (out / "README.md").read_text()

    verified = surgeon_from(src, "verify", str(model), str(out))
    assert verified.returncode == 0, verified.stdout + verified.stderr


def load_file_metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(path, "np") as f:
        return f.metadata()
