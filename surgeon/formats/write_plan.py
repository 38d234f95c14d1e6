"""What a format decides about writing a plan, before anything is written: one frozen :class:`WritePlan`.

``WeightSet.write_plan(plan, detection)`` makes it (refusing a plan the format cannot carry out safely);
the output stage hands it to ``save``/``save_as``, and ``surgeon verify`` makes it again
to know what the output must hold. No weight set keeps any of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class SharedCopy:
    """An initializer shared with nodes outside the plan: the chosen projections' nodes read a new copy of it."""

    name: str  # the shared initializer, kept as it is for the other readers
    copy: str  # the new initializer holding the changed values
    readers: tuple[int, ...]  # the graph's nodes (by index) re-encoded to read the copy


@dataclass(frozen=True)
class WritePlan:
    """A format's decisions for one plan: notes for the report, and the copies of shared initializers."""

    notes: tuple[str, ...] = ()
    copies: tuple[SharedCopy, ...] = ()

    @property
    def copy_names(self) -> dict[str, str]:
        """Shared initializer -> its copy's name (what the record lists)."""
        return {c.name: c.copy for c in self.copies}
