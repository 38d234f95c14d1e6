"""What detection finds in a checkpoint: the blocks, and what the route knows beyond them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .blocks import AttentionBlock, Unreadable


@dataclass
class Detection:
    blocks: list[AttentionBlock]
    notes: list[str] = field(default_factory=list)  # why candidates were rejected, for "nothing found"
    graph: Any = None  # what a route knows beyond the blocks (ONNX: which nodes read each initializer)
    depths: dict[str, int] = field(default_factory=dict)  # stack -> its layers, with those without attention
    unreadable: list[Unreadable] = field(default_factory=list)  # attention left alone; refused when selected
    left_alone: list[str] = field(default_factory=list)  # what is not softmax attention, named in every report and card

    def stacks(self) -> list[str]:
        seen: list[str] = []
        for b in self.blocks:
            if b.stack not in seen:
                seen.append(b.stack)
        return seen
