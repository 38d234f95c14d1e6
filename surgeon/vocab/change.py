"""One chosen projection (:class:`Change`), and the plan as the stages below planning read it.

The planner (surgeon.plan.planner) makes the :class:`~surgeon.plan.planner.Plan`; the modes (surgeon.modes) draw
it and the formats (surgeon.formats) decide how to write it. Both sit below the options and the planner in the
package order (tests/project/test_import_graph.py), so this module, which imports nothing of surgeon's but the
blocks, names what they read of a plan: :class:`PlanView` and :class:`OptionsView`, by shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from .blocks import AttentionBlock, Projection, Role


@dataclass(frozen=True)
class Change:
    """Re-initialize ``heads`` of one projection (key/value head numbers for k and v), ``strength``: how far (t of
    its layer; None: not given, the mode's full effect); ``step``: the recipe step it belongs to (None: no recipe)."""

    block: AttentionBlock
    role: Role
    heads: tuple[int, ...]
    strength: float | None = None
    step: int | None = None

    @property
    def projection(self) -> Projection:
        return self.block.projection(self.role)


class OptionsView(Protocol):
    """The options the modes draw with and the formats write by (a surgeon.options.ReinitOptions)."""

    @property
    def seed(self) -> int: ...
    @property
    def value_identity(self) -> str: ...
    @property
    def keep_scale(self) -> bool: ...
    @property
    def strength(self) -> Any: ...  # a surgeon.modes.base.Strength, or None
    @property
    def bias_policy(self) -> str: ...  # "zero", "keep" or "source"
    @property
    def zero_bias(self) -> bool: ...

    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass: Mode.with_defaults may replace() a field

    if TYPE_CHECKING:  # each mode's own parameters (gain, std, ...): fields made from their declarations

        def __getattr__(self, name: str) -> Any: ...


class PlanView(Protocol):
    """A plan as a mode finds the tensors it writes besides Q/K/V, and a format decides how to write it."""

    @property
    def changes(self) -> Sequence[Change]: ...
    @property
    def options(self) -> OptionsView: ...
    @property
    def touched_blocks(self) -> list[AttentionBlock]: ...
    def tensors(self) -> list[str]: ...
