"""What detection finds in a checkpoint: the blocks, and what the route knows beyond them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .blocks import AttentionBlock, Unreadable


class GraphView(Protocol):
    """A walked ONNX graph (``surgeon.detect.onnx.graph.Graph``), as the checks of a plan against shared
    initializers read it."""

    @property
    def nodes(self) -> Sequence[Any]: ...  # onnx NodeProtos, by index

    @property
    def inits(self) -> Mapping[str, Any]: ...  # initializer name -> its TensorProto

    @property
    def outputs(self) -> set[str]: ...

    @property
    def consumers(self) -> Mapping[str, list[int]]: ...  # tensor -> the nodes that read it

    def describe(self, n: int) -> str: ...


@dataclass(frozen=True)
class GraphFacts:
    """What the ONNX route knows beyond the blocks: which nodes read each projection's initializers."""

    graph: GraphView
    users: Mapping[tuple[str, str], Mapping[str, frozenset[int]]]  # (module, role) -> {"weight"/"bias": nodes}
    owners: Mapping[int, tuple[str, str]]  # projection node -> (block label, role), to name other readers


@dataclass(frozen=True)
class Detection:
    blocks: tuple[AttentionBlock, ...]
    notes: tuple[str, ...] = ()  # why candidates were rejected, for "nothing found"
    graph: GraphFacts | None = None  # routes that walk a graph (ONNX); None for those that read names
    depths: Mapping[str, int] = field(default_factory=dict)  # stack -> its layers, with those without attention
    unreadable: tuple[Unreadable, ...] = ()  # attention left alone; refused when selected
    left_alone: tuple[str, ...] = ()  # what is not softmax attention, named in every report and card
    layout: Mapping[str, str] | None = None  # the layout file the blocks were read with (Layout.recorded)

    def stacks(self) -> list[str]:
        seen: list[str] = []
        for b in self.blocks:
            if b.stack not in seen:
                seen.append(b.stack)
        return seen
