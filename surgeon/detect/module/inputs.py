"""Probe inputs for a transformers model, built from its config (hf_inputs)."""

from __future__ import annotations

import inspect as _inspect
from typing import Any

import torch
from torch import nn

from ...errors import LayoutError
from .probe import PROBE_TOKENS

MAX_IMAGE_SIZE = 4096  # pixels a side of a probe image (Donut's encoder, among the largest, reads 2560)


def hf_inputs(model: nn.Module, *, tokens: int = PROBE_TOKENS) -> dict:
    """Small inputs for a transformers model, built from its config (token ids, pixels or audio features)."""
    cfg = model.config
    params = _inspect.signature(model.forward).parameters
    first = next(model.parameters())
    dev, dtype = first.device, first.dtype if first.is_floating_point() else torch.float32
    gen = torch.Generator().manual_seed(0)

    def get(*keys, scope=None):
        # multimodal configs (CLIP, SigLIP) keep the text tower's numbers in text_config
        for c in (scope,) if scope is not None else (cfg, getattr(cfg, "text_config", None)):
            for k in keys:
                v = getattr(c, k, None)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
        return None

    def pixels(c):
        size = c.image_size if isinstance(c.image_size, int) else c.image_size[0]
        if not isinstance(size, int) or not 0 < size <= MAX_IMAGE_SIZE:  # no tensor holds it in every model (Swin)
            raise LayoutError(
                f"cannot build a probe input for {type(model).__name__}: its config's image_size is {size!r}, "
                f"where surgeon probes images of 1 to {MAX_IMAGE_SIZE} pixels a side"
            )
        return torch.randn(1, get("num_channels", scope=c) or 3, size, size, generator=gen).to(dev, dtype)

    main = getattr(model, "main_input_name", "input_ids")
    cap = get("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")
    length = max(1, min(tokens, cap - 2)) if cap and cap > 2 else tokens
    vocab = get("vocab_size") or 8
    out: dict[str, Any] = {}
    if main == "input_ids":
        out["input_ids"] = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=gen).to(dev)
    elif main == "pixel_values":
        out["pixel_values"] = pixels(cfg)
    elif main == "input_features":
        frames = 2 * (get("max_source_positions") or 1500)
        out["input_features"] = torch.randn(1, get("num_mel_bins") or 80, frames, generator=gen).to(dev, dtype)
    else:
        raise LayoutError(
            f"cannot build a probe input for {type(model).__name__} (main input {main!r}); pass example_inputs=..."
        )
    vision = getattr(cfg, "vision_config", None)
    if main == "input_ids" and "pixel_values" in params and getattr(vision, "image_size", None):
        out["pixel_values"] = pixels(vision)  # two-tower models run both towers
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        out["decoder_input_ids"] = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=gen).to(dev)
    if "use_cache" in params:
        out["use_cache"] = False
    return out
