"""Mimetic initialization (Trockman & Kolter, ICML 2023); writes the output projections W_O too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Mode

if TYPE_CHECKING:
    import torch

    from ..vocab.change import Change, OptionsView, PlanView
    from .base import Draw

MIMETIC_BIBTEX = """\
@inproceedings{trockman2023mimetic,
  title     = {Mimetic Initialization of Self-Attention Layers},
  author    = {Trockman, Asher and Kolter, J. Zico},
  booktitle = {Proceedings of the 40th International Conference on Machine Learning (ICML)},
  year      = {2023}
}"""


class Mimetic(Mode, name="mimetic"):
    help = "Trockman & Kolter 2023 (writes W_O too)"
    method = "mimetic-initialization"
    label = "Mimetic initialization"
    writes_outputs = True
    sharded = False
    citation = MIMETIC_BIBTEX

    def draw(self, job: Draw) -> torch.Tensor:
        from .baselines import mimetic_heads, module_key

        block, tensor = job.change.block, job.change.projection.weight.tensor
        return mimetic_heads(job.change, module_key(block, tensor, job.key), job.options, device=job.device)

    def find_outputs(self, plan: PlanView, shapes: dict) -> dict[str, tuple[str, bool]]:
        from .baselines import out_projections

        return out_projections(plan, shapes)

    def draw_output(self, change: Change, options: OptionsView, *, key: str, linear: bool) -> torch.Tensor:
        from .baselines import mimetic_out, module_key

        return mimetic_out(
            change.block, module_key(change.block, change.projection.weight.tensor, key), options, linear
        )

    def summary(self, options: dict, blocks: Sequence) -> str:
        return (
            "mimetic (W_Q W_K^T ~ 0.7 Z + 0.7 I per head, W_V W_O ~ 0.4 Z - 0.4 I per layer; "
            "the output projections W_O are rewritten too)"
        )

    def card_intro(self, options: dict, blocks: Sequence) -> str:
        return (
            "with mimetic initialization (Trockman & Kolter, ICML 2023: W_Q W_K^T ~ 0.7 Z + 0.7 I per head, "
            "W_V W_O ~ 0.4 Z - 0.4 I per layer), the output projections W_O included"
        )

    def card_row(self, options: dict, blocks: Sequence) -> str:
        return "mimetic: W_Q W_K^T ~ 0.7 Z + 0.7 I per head, W_V W_O ~ 0.4 Z - 0.4 I per layer (W_O rewritten)"
