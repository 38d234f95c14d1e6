"""Finding attention blocks: by tensor names (checkpoints), ONNX graphs and nn.Module graphs.

Two entries, one per kind of input: :func:`detect_source` for a checkpoint (:class:`surgeon.open.source.Source`),
routed by its format (ONNX by its graph, every other format by tensor names), and
:func:`surgeon.detect.module.detect_module` for an ``nn.Module``, by its modules and forward. Family facts are data in
:mod:`.families`; placement is :mod:`.placement`.
Importing this package does not import torch, numpy or onnx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..open.source import Source
    from ..vocab.detection import Detection
    from .hints import Hints


def detect_source(source: Source, hints: Hints | None = None) -> Detection:
    """Every attention block of a checkpoint, by its graph (ONNX) or its tensor names.
    Raises NoAttentionFoundError if there is none."""
    weights = source.primary
    if weights.graph:  # tensor names carry no structure: walk the graph
        if hints is not None and hints.layout is not None:
            from ..errors import OptionError, opt

            raise OptionError(
                f"{opt('layout')} names tensors, but an ONNX graph's attention is found by walking the graph: "
                f"leave {opt('layout')} out"
            )
        from .onnx import find_attention

        onnx_weights: Any = weights  # an OnnxWeights: its graph, constants and path
        return find_attention(
            onnx_weights.model,
            onnx_weights.const,
            source.config,
            hints,
            source=str(onnx_weights.path),
            constants=onnx_weights.constants,
        )
    from .by_name import detect as by_name

    return by_name(weights.tensors, source.config, hints, source=str(source.path))
