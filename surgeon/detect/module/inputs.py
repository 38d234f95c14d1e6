"""Probe inputs built from what a model declares: a transformers model's config (hf_inputs), a torchtitan decoder's own mask builder (decoder_inputs); and the call on inputs a user gives (example_call)."""

from __future__ import annotations

import inspect as _inspect
from collections.abc import Callable, Mapping
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

    def get(*keys: str, scope: Any = None) -> int | None:
        # multimodal configs (CLIP, SigLIP) keep the text tower's numbers in text_config
        for c in (scope,) if scope is not None else (cfg, getattr(cfg, "text_config", None)):
            for k in keys:
                v = getattr(c, k, None)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
        return None

    def pixels(c: Any) -> torch.Tensor:
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


# torchtitan's decoders (models/common/decoder.py): forward(tokens, positions, attention_masks), where flex
# attention needs the BlockMask its own get_attention_masks(positions) builds
DECODER_ARGS = ("tokens", "positions", "attention_masks")


def decoder_inputs(model: nn.Module, *, tokens: int = PROBE_TOKENS) -> dict | None:
    """Token ids, positions and the model's own attention masks for a torchtitan-style decoder; None otherwise."""
    build_masks = getattr(model, "get_attention_masks", None)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    try:
        params = tuple(_inspect.signature(model.forward).parameters)[: len(DECODER_ARGS)]
    except (TypeError, ValueError):
        return None
    if params != DECODER_ARGS or not callable(build_masks) or not isinstance(vocab, int) or vocab < 1:
        return None
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(tokens, device=device)[None]
    with torch.compiler.set_stance("force_eager"):  # its compiled mask builder, run eagerly: no compile wait
        masks = build_masks(positions)
    return {"tokens": ids, "positions": positions, "attention_masks": masks}


def example_call(module: nn.Module, example_inputs: Any) -> Callable[[], Any]:
    """``module`` called on the inputs a user gives: a dict as keyword arguments, a tuple or list as positional
    arguments, anything else as the one argument."""
    if isinstance(example_inputs, Mapping):
        return lambda: module(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return lambda: module(*example_inputs)
    return lambda: module(example_inputs)
