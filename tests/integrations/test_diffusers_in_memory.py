"""diffusers transformers in memory, whose attention runs through the library's attention processors and its
dispatch function (diffusers/models/attention_dispatch.py). Flux's processor puts the context stream's tokens
before the image's (``torch.cat([encoder_query, query], dim=1)``), SD3's after them: either way ``surgeon.reinit_``
on the live model writes what the checkpoint route writes, and what both write is judged by the library's own
attention modules (``Attention.heads``, ``head_dim``) and run through the model's own forward."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from surgeon import reinit_
from surgeon.api import reinit_checkpoint

from helpers.diffusers_models import randomized, sd3

diffusers = pytest.importorskip("diffusers")

WEIGHTS = "diffusion_pytorch_model.safetensors"
GRID = 2  # the latent image is GRID x GRID tokens


def _flux_like(cls, **extra):
    """A tiny transformer of the Flux family (two double-stream blocks, two single-stream blocks); ``extra``: the
    arguments of its own."""

    def build():
        torch.manual_seed(0)
        return randomized(
            cls(
                patch_size=1,
                in_channels=4,
                num_layers=2,
                num_single_layers=2,
                attention_head_dim=8,
                num_attention_heads=2,
                joint_attention_dim=16,
                **extra,
            )
        )

    return build


def _image_ids(axes: int) -> torch.Tensor:
    """Each latent token's rotary ids, FluxPipeline's _prepare_latent_image_ids: (0, row, column) of the latent
    grid (Flux 2's pipeline adds a fourth axis, 0 for one image); the text's ids are zero."""
    rows, cols = torch.meshgrid(torch.arange(GRID), torch.arange(GRID), indexing="ij")
    ids = [torch.zeros_like(rows), rows, cols] + [torch.zeros_like(rows)] * (axes - 3)
    return torch.stack(ids, dim=-1).reshape(-1, axes).float()


def _flux_inputs(pooled: bool = True, axes: int = 3, batched_ids: bool = False, guidance: bool = False):
    """What FluxPipeline hands its transformer: packed latents, T5 tokens, CLIP's pooled vector (where the model
    takes one), the timestep and the rotary ids of each token."""

    def inputs():
        gen = torch.Generator().manual_seed(1)
        img_ids, txt_ids = _image_ids(axes), torch.zeros(3, axes)
        out = dict(
            hidden_states=torch.randn(1, GRID * GRID, 4, generator=gen),
            encoder_hidden_states=torch.randn(1, 3, 16, generator=gen),
            timestep=torch.tensor([0.5]),
            img_ids=img_ids[None] if batched_ids else img_ids,
            txt_ids=txt_ids[None] if batched_ids else txt_ids,
        )
        if pooled:
            out["pooled_projections"] = torch.randn(1, 8, generator=gen)
        if guidance:
            out["guidance"] = torch.tensor([1.0])
        return out

    return inputs


def sd3_inputs():
    gen = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=gen),
        encoder_hidden_states=torch.randn(1, 5, 16, generator=gen),
        pooled_projections=torch.randn(1, 8, generator=gen),
        timestep=torch.tensor([1]),
    )


# name -> (the model, its inputs, options for both routes): the context stream first (Flux and its kin), or after the
# image (SD3); Flux 2's single-stream blocks fuse q/k/v with the MLP's rows (to_qkv_mlp_proj), a layout the
# checkpoint route does not read, so its double-stream blocks alone
CASES = {
    "flux": (
        _flux_like(diffusers.FluxTransformer2DModel, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4)),
        _flux_inputs(),
        {},
    ),
    "flux2": (
        _flux_like(diffusers.Flux2Transformer2DModel, axes_dims_rope=(2, 2, 2, 2), timestep_guidance_channels=16),
        _flux_inputs(pooled=False, axes=4, batched_ids=True, guidance=True),
        {"stack": "transformer_blocks"},
    ),
    "chroma": (
        _flux_like(
            diffusers.ChromaTransformer2DModel,
            axes_dims_rope=(2, 2, 4),
            approximator_num_channels=8,
            approximator_hidden_dim=16,
            approximator_layers=1,
        ),
        _flux_inputs(pooled=False),
        {},
    ),
    "bria": (
        _flux_like(diffusers.BriaTransformer2DModel, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4)),
        _flux_inputs(),
        {},
    ),
    "longcat_image": (
        _flux_like(diffusers.LongCatImageTransformer2DModel, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4)),
        _flux_inputs(pooled=False),
        {},
    ),
    "sd3": (sd3, sd3_inputs, {}),
}


def attention_modules(model):
    """The library's attention modules (Attention, FluxAttention, ...): the ones holding to_q and their heads."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "to_q") and isinstance(getattr(m, "heads", None), int)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reinit_in_memory_writes_what_the_checkpoint_route_writes(tmp_path, case):
    build, inputs, options = CASES[case]
    model = build()
    model.save_pretrained(tmp_path / "src")
    reinit_checkpoint(tmp_path / "src", output=tmp_path / "out", seed=5, **options)
    before, after = load_file(tmp_path / "src" / WEIGHTS), load_file(tmp_path / "out" / WEIGHTS)
    live = build()
    reinit_(live, example_inputs=inputs(), seed=5, **options)
    mine = live.state_dict()
    assert set(mine) == set(after)
    assert [n for n in after if not torch.equal(mine[n], after[n])] == []
    # what both wrote, by the library's own modules: every projection of every attention module chosen and of its
    # context stream, the q and k heads orthonormal at the head size the module runs; nothing outside them
    stack = options.get("stack")
    modules = {n: m for n, m in attention_modules(model).items() if stack is None or n.startswith(stack + ".")}
    streams = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
    expected = {
        f"{name}.{leaf}.{kind}"
        for name in modules
        for leaf in streams
        for kind in ("weight", "bias")
        if f"{name}.{leaf}.{kind}" in before
    }
    assert any(".add_q_proj." in n for n in expected)  # joint attention, its context stream among them
    assert {n for n in before if not torch.equal(before[n], after[n])} == expected
    for name, m in modules.items():
        d = m.head_dim if isinstance(getattr(m, "head_dim", None), int) else m.inner_dim // m.heads
        for leaf in ("to_q", "to_k", "add_q_proj", "add_k_proj"):
            if f"{name}.{leaf}.weight" not in after:
                continue
            w = after[f"{name}.{leaf}.weight"].double().view(m.heads, d, -1)
            gram = w @ w.transpose(1, 2)
            assert torch.allclose(gram, torch.eye(d, dtype=torch.float64).expand_as(gram), atol=1e-5), (name, leaf)
    with torch.no_grad():
        assert torch.isfinite(live(**inputs()).sample).all()
