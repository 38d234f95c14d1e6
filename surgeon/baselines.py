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
draws (:func:`surgeon.conditioning.head_seed`, with the role tagged ``/redraw`` so the two modes use
independent streams), on the CPU with numpy's SFC64: the same bits on every machine and device,
whatever the processing order or selection.

The gain of the conditioned mode (``--gain``) is applied in :func:`surgeon.apply.new_heads`: a
semi-orthogonal head has Frobenius norm sqrt(d), a normal(0, s) one about s * sqrt(d * D), so
``gain = s * sqrt(D)`` matches the default init's scale (0.55 for GPT-2 small, D = 768, s = 0.02).

This module is torch-free at import (the planning path imports it).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

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


def with_model_defaults(options, config: Any):
    """``options`` with the redraw std filled in from the model's config (unchanged for other modes)."""
    if options.mode != "redraw" or options.std is not None:
        return options
    return replace(options, std=config_std(config)[0])


def is_xavier(tensor: str) -> bool:
    return tensor.rsplit(".", 1)[-1] in XAVIER_TENSORS


def redraw_heads(change, key: str, options, *, device=None):
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
