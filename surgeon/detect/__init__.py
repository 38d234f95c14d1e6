"""Finding attention blocks: by tensor names (checkpoints), ONNX graphs and nn.Module graphs.

The one entry is :func:`detect`, routed by what it is given: a checkpoint (:class:`surgeon.open.source.Source`)
by its format (ONNX by its graph, every other format by tensor names), an ``nn.Module`` by its
modules and forward. Family facts are data in :mod:`.families`; placement is :mod:`.placement`.
Importing this package does not import torch, numpy or onnx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..open.source import Source
    from ..vocab.detection import Detection
    from .hints import Hints


def detect(what: Any, hints: Hints | None = None, **module_options: Any) -> Any:
    """Every attention block of ``what``: a :class:`~surgeon.open.source.Source` (returns a
    :class:`Detection`) or an ``nn.Module`` (returns a ``ModuleDetection``; ``example_inputs=``).
    Raises NoAttentionFoundError if there is none."""
    from ..open.source import Source

    if isinstance(what, Source):
        return detect_source(what, hints)
    from .module import detect_module

    return detect_module(what, hints=hints, **module_options)


def detect_source(source: Source, hints: Hints | None = None) -> Detection:
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
