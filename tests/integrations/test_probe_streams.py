"""Joint attention in memory, read by the forward probe: one attention product whose tokens come from two sets of
projections (a context stream and an image stream, in that order, as diffusers' Flux processor joins them). A
pair surgeon knows by name (to_q and add_q_proj) is one block and its context stream; a pair it does not know is
refused rather than half re-initialized."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgeon
from surgeon.errors import LayoutError

HEADS, HEAD_DIM, WIDTH = 2, 4, 8


class Joint(nn.Module):
    """softmax(Q Kᵀ) V over [context tokens | image tokens], each stream through its own q/k/v projections."""

    def __init__(self, image: tuple[str, str, str], context: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = image, context
        for name in image + context:
            setattr(self, name, nn.Linear(WIDTH, HEADS * HEAD_DIM))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        image, context = self.names

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)

        q, k, v = (
            torch.cat([heads(getattr(self, c)(ctx)), heads(getattr(self, i)(x))], dim=2) for c, i in zip(context, image)
        )
        return nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class Model(nn.Module):
    def __init__(self, image: tuple[str, str, str], context: tuple[str, str, str]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.ModuleDict({"attn": Joint(image, context)})])

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        return self.blocks[0]["attn"](x, ctx)


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(1, 4, WIDTH, generator=gen), torch.randn(1, 3, WIDTH, generator=gen))


def test_a_known_context_stream_read_second_is_the_blocks_companion():
    model = Model(("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj"))
    found = surgeon.inspect_module(model, example_inputs=_inputs())
    assert {b.module: b.q.weight.tensor for b in found.blocks} == {
        "blocks.0.attn": "blocks.0.attn.to_q.weight",
        "blocks.0.attn:context": "blocks.0.attn.add_q_proj.weight",
    }


def test_streams_surgeon_cannot_pair_are_refused_not_half_reinitialized():
    model = Model(("img_q", "img_k", "img_v"), ("txt_q", "txt_k", "txt_v"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(LayoutError, match=r"blocks\.0\.attn.*2 projections token by token.*txt_q.*img_q"):
        surgeon.reinit_(model, example_inputs=_inputs())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
