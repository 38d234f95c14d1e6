"""What detection says about the blocks it found: layouts read by convention, gated queries, shared-block adapters."""

from __future__ import annotations

from ..spec import AttentionBlock
from .config import ConfigView
from .families import SHARED_BLOCKS


def block_notes(blocks: list[AttentionBlock], view: ConfigView) -> list[str]:
    """The notes on ``blocks`` a user should read, in the order a report shows them."""
    return _assumed_layouts(blocks, view) + _gated(blocks) + _adapters(blocks, view)


# Fused tensors whose packing is a naming convention rather than something config.json states.
_CONVENTIONAL = {"fused qkv": "timm/nanoGPT", "fused to_qkv": "chunk(3)"}


def _assumed_layouts(blocks: list[AttentionBlock], view: ConfigView) -> list[str]:
    """Say so when a fused layout rests on a naming convention alone (no model_type to confirm it)."""
    if view.model_type or view.config.get(
        "architecture"
    ):  # a timm config names the model (FUSED_PACKING_BY_ARCHITECTURE)
        return []
    notes = []
    for layout in dict.fromkeys(b.layout for b in blocks):
        if layout in _CONVENTIONAL:
            tensor = layout.split()[1]
            notes.append(
                f"{tensor} tensors are read as blocked [Q | K | V] (the {_CONVENTIONAL[layout]} convention; no config.json "
                "model_type confirms it); if your model interleaves heads, check with the Python API (surgeon.inspect(module))"
            )
    return notes


def _gated(blocks: list[AttentionBlock]) -> list[str]:
    gated = [b for b in blocks if b.layout.endswith("gated q")]
    if not gated:
        return []
    return [
        f"gated attention: {gated[0].q.weight.tensor.rsplit('.', 1)[0]} (and {len(gated) - 1} more) holds per head {gated[0].head_dim} query rows, "
        "then the output gate's rows; the query rows are re-initialized, the gate rows are kept byte for byte"
    ]


def _adapters(blocks: list[AttentionBlock], view: ConfigView) -> list[str]:
    rule = SHARED_BLOCKS.get(view.model_type or "")
    if (
        rule is None
        or not rule.adapters_flag
        or view.config.get(rule.adapters_flag) is not True
        or not any(b.shared_layers for b in blocks)
    ):
        return []
    return [
        f"each layer adds its own adapter to the shared block's q/k/v ({rule.adapters_flag}); the adapters are kept, so a "
        "layer's query/key/value maps are the re-initialized weights plus its adapter"
    ]
