"""What the ONNX walk finds: each role's projection (Proj), a head split followed forward (Pending), a core."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Proj:
    """One role's projection: the weight, the columns it owns, its bias, the head split seen."""

    node: int  # the MatMul/Gemm/fused core that reads the weight
    op: str
    weight: str
    axis: int  # output-feature axis of the weight initializer
    in_features: int
    base: int  # first output column of this role
    width: int  # number of output columns of this role
    source: str  # the data tensor the projection reads
    bias: str | None = None
    bias_base: int = 0  # projection column that bias element 0 belongs to
    head_dim: int | None = None
    heads: int | None = None
    weight_nodes: set[int] = field(default_factory=set)
    bias_nodes: set[int] = field(default_factory=set)


@dataclass
class Pending:
    """A Reshape that split a projection's features into (..., a, b), followed forward."""

    shape: list[int | None]  # its target shape, as far as known
    axis: int | None  # where the ``a`` axis is now (None: lost track)
    rank: int | None
    heads: list[int | None] | None = None  # (heads, head_dim) when the Reshape split (a, heads, head_dim) at once


@dataclass
class Core:
    node: int
    label: str  # layout prefix for fused cores ("" for Softmax)
    q: Proj
    k: Proj
    v: Proj
    num_heads: int | None = None
    kv_heads: int | None = None
