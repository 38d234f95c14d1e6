"""Check a checkpoint's name-based layout against what its architecture's forward really does.

``surgeon inspect MODEL --verify-layout``: the architecture named by config.json is built with
transformers (randomly initialized, nothing downloaded: only its structure matters), the module
walker's forward route (:func:`surgeon.detect.module.probe_blocks`) reads which rows of which
tensor reach q, k and v per head, and the result is compared with name-based detection of the
checkpoint, block by block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..detect.hints import HintInput, Hints
from ..errors import LayoutError, OptionError, opt
from ..vocab.blocks import ROLES, AttentionBlock, Projection, Rows

if TYPE_CHECKING:
    from ..detect.architecture import CheckpointNames
    from ..open.source import Source


@dataclass
class LayoutCheck:
    """Name-based detection and the forward agree on every attention block."""

    source: str
    architecture: str  # the transformers class that was built
    blocks: int

    def summary(self) -> str:
        return (
            f"layout verified: {'the ' + str(self.blocks) + ' attention blocks' if self.blocks != 1 else 'the attention block'} "
            f"found by name {'are the ones' if self.blocks != 1 else 'is the one'} the forward of "
            f"{self.architecture} uses, with the same q/k/v rows per head, heads and biases"
        )


def verify_layout(
    model: str | Path,
    *,
    revision: str | None = None,
    config: str | Path | None = None,
    num_heads: HintInput = None,
    num_kv_heads: HintInput = None,
    head_dim: HintInput = None,
    force_hints: bool = False,
) -> LayoutCheck:
    """Raise LayoutError (one line) at the first disagreement; return the agreement otherwise."""
    from ..detect import detect_source
    from ..hub.read import open_model

    source = open_model(model, config=config, revision=revision, whole=True)
    return check_layout(source, detect_source(source, Hints(num_heads, num_kv_heads, head_dim, force_hints)).blocks)


def check_layout(source: Source, blocks: Sequence[AttentionBlock]) -> LayoutCheck:
    """:func:`verify_layout` on a checkpoint already opened and detected (``blocks``)."""
    from ..detect.architecture import CheckpointNames, build_architecture, config_name
    from ..detect.module import checkpoint_names, probe_blocks

    purpose = opt("verify_layout", True)
    if not source.config:
        raise OptionError(
            f"{purpose} builds the architecture from config.json, and {source.path} has none; pass {opt('config', 'PATH')}",
            path=source.path,
        )
    arch = build_architecture(source.config, purpose=purpose, tensors=source.primary.tensors, where=config_name(source))
    try:
        probed = probe_blocks(arch)
    except LayoutError as exc:
        raise LayoutError(
            f"cannot verify the layout: the forward of {type(arch).__name__} does not settle it ({exc})"
        ) from None
    names = CheckpointNames(checkpoint_names(arch), set(source.primary.tensors))
    probed = [_renamed(b, names) for b in probed]
    _compare(blocks, probed, type(arch).__name__)
    return LayoutCheck(str(source.path), type(arch).__name__, len(blocks))


def _renamed(block: AttentionBlock, names: CheckpointNames) -> AttentionBlock:
    from dataclasses import replace

    def rows(r: Rows) -> Rows:
        return replace(r, tensor=names(r.tensor))

    q, k, v = (
        replace(p, weight=rows(p.weight), bias=None if p.bias is None else rows(p.bias)) for p in block.projections
    )
    return replace(block, q=q, k=k, v=v)


def _describe(p: Projection) -> str:
    axis = "rows" if p.weight.axis == 0 else "columns"
    starts = ",".join(map(str, p.weight.offsets[:4])) + (",..." if len(p.weight.offsets) > 4 else "")
    return f"{p.heads} heads x {p.head_dim} at {axis} {starts} of {p.weight.tensor}"


def _compare(by_names: Sequence[AttentionBlock], by_forward: list[AttentionBlock], arch: str) -> None:
    forward = {b.q.weight.tensor: b for b in by_forward}
    for block in by_names:
        seen = forward.pop(block.q.weight.tensor, None)
        if seen is None:
            raise LayoutError(
                f"layout check failed: names put a query projection in {block.q.weight.tensor}, but the forward of {arch} never uses it as one"
            )
        for role in ROLES:
            ours, theirs = block.projection(role), seen.projection(role)
            if (ours.weight, ours.in_features) != (theirs.weight, theirs.in_features):
                raise LayoutError(
                    f"layout check failed: {block.module} {role}: names say {_describe(ours)}; the forward of {arch} uses {_describe(theirs)}"
                )
            if ours.bias != theirs.bias:
                say = lambda b: f"{b.tensor} at {','.join(map(str, b.offsets[:4]))}" if b else "no bias"  # noqa: E731
                raise LayoutError(
                    f"layout check failed: {block.module} {role} bias: names say {say(ours.bias)}; the forward of {arch} adds {say(theirs.bias)}"
                )
        if block.kind != seen.kind:
            raise LayoutError(
                f"layout check failed: names call {block.module} {block.kind}-attention; the forward of {arch} uses it as {seen.kind}-attention"
            )
    if forward:
        extra = next(iter(forward.values()))
        raise LayoutError(
            f"layout check failed: the forward of {arch} computes attention from {_describe(extra.q)}, which name-based detection missed"
        )
