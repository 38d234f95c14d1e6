"""A mode declares its parameters once (surgeon.modes.base.Parameter): the option field, the Python keyword, the
flag and its --help, the record's row (read back by verify), the card's row and reproduce command, and the docs'
table are all made from the declaration. The proof: on a copy of the package, a new mode with a parameter of its
own is added as one module (and its registry entry), nothing else, and runs from --help to verify."""

from __future__ import annotations

import json

from safetensors import safe_open

from helpers.elements import nudge
from helpers.package_copy import assert_layer_1_qk_heads_at, package_with_mode, python_from, surgeon_from
from helpers.paths import ROOT

SCALED = """
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Mode, Parameter
from .conditioned import Conditioned

if TYPE_CHECKING:
    import torch

    from .base import Draw

SCALE = Parameter("scale", "Scaled mode: the singular value of every new q/k head (default 0.5).", default=0.5,
                  metavar="C")


class Scaled(Mode, name="scaled"):
    help = "the conditioned reset at a scale of its own"
    parameters = (SCALE,)
    method = "scaled-conditioned-initialization"
    label = "Scaled conditioned re-initialization"

    def draw(self, job: Draw) -> torch.Tensor:
        return Conditioned().draw(job) * SCALE.resolved(job.options.scale)

    def summary(self, options: dict, blocks: Sequence) -> str:
        return f"scaled conditioned reset, scale {options.get('scale')}"

    def card_intro(self, options: dict, blocks: Sequence) -> str:
        return "with a scaled conditioned reset"

    def card_row(self, options: dict, blocks: Sequence) -> str:
        return "scaled: conditioned, every q/k head scaled"
"""


def test_a_mode_with_a_parameter_of_its_own_runs_end_to_end(tmp_path):
    src = package_with_mode(tmp_path, "scaled", SCALED, "Scaled")
    model, out = ROOT / "examples" / "tiny-bert", tmp_path / "out"

    helped = surgeon_from(src, "reinit", "--help")
    text = " ".join(helped.stdout.split())  # click wraps the help
    assert helped.returncode == 0, helped.stderr
    assert "--scale C Scaled mode: the singular value of every new q/k head (default 0.5)." in text
    assert text.index("Mode (how):") < text.index("--scale C") < text.index("Output:")  # in the mode's section

    run = surgeon_from(
        src, "reinit", str(model), "--mode", "scaled", "--scale", "0.25", "--layers", "1", "--targets", "q,k",
        "-o", str(out), "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["options"]["scale"] == 0.25

    # the weights: every new q/k head has all its singular values at the scale given
    assert_layer_1_qk_heads_at(model, out, 0.25)

    # the record's row, the card's row and its reproduce command
    with safe_open(out / "model.safetensors", "np") as f:
        (record,) = json.loads(f.metadata()["surgeon"])
    assert record["options"]["scale"] == 0.25 and record["method"] == "scaled-conditioned-initialization"
    card = (out / "README.md").read_text()
    assert "| scale | 0.25 |" in card and "--mode scaled" in card and "--scale 0.25" in card

    verified = surgeon_from(src, "verify", str(model), str(out))
    assert verified.returncode == 0 and verified.stdout.startswith("verified:"), verified.stdout + verified.stderr
    nudge(out / "model.safetensors", "encoder.layer.1.attention.self.query.weight")
    refused = surgeon_from(src, "verify", str(model), str(out))
    assert refused.returncode == 3 and "encoder.layer.1.attention.self.query.weight" in refused.stderr, refused.stderr

    # refused for another mode and out of range, by the declaration, before any model is opened
    for args, says in (
        (("--scale", "0.25"), "--scale applies to --mode scaled only"),
        (("--mode", "scaled", "--scale", "0"), "--scale must be a finite number above 0"),
    ):
        bad = surgeon_from(src, "reinit", str(tmp_path / "missing"), *args)
        assert bad.returncode == 1 and says in bad.stderr, bad.stderr

    # the Python keyword, and the docs' table row
    api = python_from(
        src,
        "from surgeon import ReinitOptions; from surgeon.modes import parameter_docs; "
        "o = ReinitOptions(mode='scaled', scale=0.25); print(o.scale, o.to_dict()['scale']); print(parameter_docs())",
    )
    assert api.returncode == 0, api.stderr
    first, *table = api.stdout.splitlines()
    assert first == "0.25 0.25"
    assert (
        "| `--scale C` | `scale=` | `scaled` | Scaled mode: the singular value of every new q/k head (default 0.5). |"
        in table
    )


def test_the_docs_table_of_parameters_is_the_declarations():
    """docs/modes.md shows every mode's parameters as their modes declare them (parameter_docs makes the table)."""
    from surgeon.modes import parameter_docs

    assert parameter_docs() in (ROOT / "docs" / "modes.md").read_text()
