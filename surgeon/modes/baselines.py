"""Baseline initializations, as modes beside the conditioned reset, for fair comparisons.

``redraw`` -- the control every experiment needs: the projections get their family's own default
init again, drawn fresh. Sources and defaults:

* Hugging Face transformers models (BERT, GPT-2, Llama, ViT, ...): ``_init_weights`` draws every
  ``nn.Linear`` weight from normal(0, ``config.initializer_range``) and zeroes its bias; the
  default ``initializer_range`` is 0.02. Families that call it ``init_std`` (BART, Marian) are read
  the same way. surgeon draws normal(0, std) with std from ``--std``, else the config's
  ``initializer_range`` / ``init_std``, else 0.02 (and says which in the record's options).
* ``torch.nn.MultiheadAttention``: ``_reset_parameters`` applies ``xavier_uniform_`` to
  ``in_proj_weight`` (or to each of ``q/k/v_proj_weight``) and zeroes ``in_proj_bias``: uniform on
  +-sqrt(6 / (fan_in + fan_out)) of the whole tensor. surgeon uses that for tensors named so.

Every head is drawn from its own generator keyed by (seed, tensor, role, head) like the conditioned
draws (:func:`surgeon.modes.conditioning.head_seed`, with the role tagged ``/redraw`` so the two modes use
independent streams), on the CPU with numpy's SFC64: the same bits on every machine and device,
whatever the processing order or selection.

The gain of the conditioned mode (``--gain``) is applied in :func:`surgeon.compute.engine.new_heads`: a
semi-orthogonal head has Frobenius norm sqrt(d), a normal(0, s) one about s * sqrt(d * D), so
``gain = s * sqrt(D)`` matches the default init's scale (0.55 for GPT-2 small, D = 768, s = 0.02).

This module is torch-free at import (the planning path imports it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray

    from ..vocab.blocks import AttentionBlock
    from ..vocab.change import Change, OptionsView, PlanView

DEFAULT_STD = 0.02
XAVIER_TENSORS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")  # nn.MultiheadAttention


def config_std(config: Any) -> tuple[float, str]:
    """The std of the family's default normal init, and where it came from."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    if config is not None:
        for key in ("initializer_range", "init_std"):
            value = get(key, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
                return float(value), f"config {key}"
    return DEFAULT_STD, "default"


def is_xavier(tensor: str) -> bool:
    return tensor.rsplit(".", 1)[-1] in XAVIER_TENSORS


def redraw_heads(
    change: Change, key: str, options: OptionsView, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Fresh default-init per-head matrices ``(len(heads), d, in)`` float64 for ``change.heads``."""
    import numpy as np
    import torch

    from .conditioning import head_seed

    proj, block = change.projection, change.block
    d, n_in = proj.head_dim, proj.in_features
    out = np.empty((len(change.heads), d, n_in), dtype=np.float64)
    if is_xavier(proj.weight.tensor):
        fan_out = sum(p.heads * p.head_dim for p in block.projections if p.weight.tensor == proj.weight.tensor)
        bound = math.sqrt(6.0 / (n_in + fan_out))
        for i, h in enumerate(change.heads):
            rng = np.random.Generator(np.random.SFC64(head_seed(options.seed, key, f"{change.role}/redraw", h)))
            out[i] = rng.uniform(-bound, bound, size=(d, n_in))
    else:
        std = DEFAULT_STD if options.std is None else float(options.std)
        for i, h in enumerate(change.heads):
            rng = np.random.Generator(np.random.SFC64(head_seed(options.seed, key, f"{change.role}/redraw", h)))
            rng.standard_normal(out=out[i])
        out *= std
    return torch.from_numpy(out).to(device or "cpu")


# --- mimetic initialization (Trockman & Kolter, "Mimetic Initialization of Self-Attention Layers", ICML 2023) ---
#
# Per head, W_Q W_K^T ~ a1 Z + b1 I (D x D), factored by SVD A = U S V^T into W_Q = U_d S_d^1/2 and
# W_K = V_d S_d^1/2 (the rank-d truncation: the best rank-d approximation of A). Per layer,
# W_V W_O ~ a2 Z - b2 I, factored the same way into W_V = U S^1/2 (D x H*d) and W_O = S^1/2 V^T
# (H*d x D). Z has entries uniform on +-sqrt(3/D) (variance 1/D). Defaults a1 = b1 = 0.7,
# a2 = b2 = 0.4 (the paper's). This mode writes W_O as well; Z is drawn per (seed, module, head) on
# the CPU like every other draw, the SVDs run in float64 numpy (LAPACK).

MIMETIC = {"a1": 0.7, "b1": 0.7, "a2": 0.4, "b2": 0.4}
OUT_NAMES = ("o_proj", "out_proj", "c_proj", "o", "wo", "dense", "proj", "to_out.0")


def find_out_projection(block: AttentionBlock, shapes: Mapping[str, Sequence[int]]) -> tuple[str, bool] | None:
    """W_O of ``block`` among tensor ``shapes`` (name -> shape): (tensor, stored as (D, H*d) i.e. nn.Linear)."""
    width, inner = block.q.in_features, block.heads * block.head_dim
    linear = block.q.weight.axis == 0  # Conv1D-style (in, out) families store W_O that way too
    parent = block.module.rsplit(".", 1)[0] if "." in block.module else ""
    names = [f"{block.module}.{n}.weight" for n in OUT_NAMES] + ([f"{parent}.output.dense.weight"] if parent else [])
    want = (width, inner) if linear else (inner, width)
    hits = [n for n in names if n in shapes and tuple(shapes[n]) == want]
    return (hits[0], linear) if len(hits) == 1 else None


def out_projections(plan: PlanView, shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[str, bool]]:
    """For --mode mimetic: every touched block's W_O (block module -> ``find_out_projection``), or refuse in one line."""
    from ..errors import LayoutError, OptionError, opt

    outputs = {}
    for block in plan.touched_blocks:
        roles = {c.role: c for c in plan.changes if c.block.module == block.module}
        if set(roles) != {"q", "k", "v"} or any(len(c.heads) != c.projection.heads for c in roles.values()):
            raise OptionError(
                f"{opt('mode', 'mimetic')} sets W_Q W_K^T per head and W_V W_O per layer: select all heads and {opt('targets', 'q,k,v')} ({block.module})"
            )
        if block.kv_heads != block.heads:
            raise OptionError(
                f"{opt('mode', 'mimetic')} needs one key/value head per query head, and {block.module} has {block.heads} query and {block.kv_heads} key/value heads"
            )
        if block.heads * block.head_dim > block.q.in_features:
            raise OptionError(
                f"{opt('mode', 'mimetic')}: {block.module} has more head features ({block.heads * block.head_dim}) than its width ({block.q.in_features})"
            )
        found = find_out_projection(block, shapes)
        if found is None:
            raise LayoutError(
                f"{opt('mode', 'mimetic')} writes W_O, and no single output projection of {block.module} was found (looked for {', '.join(OUT_NAMES)} and the BERT-style output.dense)"
            )
        outputs[block.module] = found
    return outputs


def module_key(block: AttentionBlock, tensor: str, seed_name: str | None) -> str:
    """The name the mimetic draws of ``block`` are keyed by: its module path as the checkpoint spells it."""
    name = seed_name or tensor
    suffix = tensor[len(block.module) :] if tensor.startswith(block.module + ".") else None
    return name[: -len(suffix)] if suffix and name.endswith(suffix) else block.module


def _mimetic_z(seed: int, key: str, tag: str, head: int, width: int) -> NDArray[np.float64]:
    import numpy as np

    from .conditioning import head_seed

    bound = math.sqrt(3.0 / width)
    return np.random.Generator(np.random.SFC64(head_seed(seed, key, tag, head))).uniform(
        -bound, bound, size=(width, width)
    )


def mimetic_qk(seed: int, key: str, head: int, width: int, d: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(W_Q, W_K), each D x d, with W_Q W_K^T the best rank-d approximation of a1 Z + b1 I."""
    import numpy as np

    a = MIMETIC["a1"] * _mimetic_z(seed, key, "qk/mimetic", head, width) + MIMETIC["b1"] * np.eye(width)
    u, s, vt = np.linalg.svd(a)
    root = np.sqrt(s[:d])
    return u[:, :d] * root, vt[:d].T * root


def mimetic_vo(seed: int, key: str, width: int, inner: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(W_V, W_O): D x H*d and H*d x D, with W_V W_O the best rank-(H*d) approximation of a2 Z - b2 I."""
    import numpy as np

    a = MIMETIC["a2"] * _mimetic_z(seed, key, "vo/mimetic", 0, width) - MIMETIC["b2"] * np.eye(width)
    u, s, vt = np.linalg.svd(a)
    root = np.sqrt(s[:inner])
    return u[:, :inner] * root, root[:, None] * vt[:inner]


def mimetic_heads(
    change: Change, key: str, options: OptionsView, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Per-head matrices ``(len(heads), d, D)`` (PyTorch orientation) of q, k or v, float64."""
    import numpy as np
    import torch

    block, d = change.block, change.projection.head_dim
    width = block.q.in_features
    if change.role == "v":
        wv = mimetic_vo(options.seed, key, width, block.heads * d)[0].T  # (H*d, D)
        out = np.stack([wv[h * d : (h + 1) * d] for h in change.heads])
    else:
        pick = 0 if change.role == "q" else 1
        out = np.stack([mimetic_qk(options.seed, key, h, width, d)[pick].T for h in change.heads])
    return torch.from_numpy(np.ascontiguousarray(out)).to(device or "cpu")


def mimetic_out(block: AttentionBlock, key: str, options: OptionsView, linear: bool) -> torch.Tensor:
    """The whole W_O tensor as stored (float64): (D, H*d) for nn.Linear, (H*d, D) for Conv1D."""
    import torch

    wo = mimetic_vo(options.seed, key, block.q.in_features, block.heads * block.head_dim)[1]
    return torch.from_numpy(wo.T.copy() if linear else wo.copy())
