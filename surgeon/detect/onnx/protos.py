"""Reading an ONNX graph's protos: Constant values, how many elements an initializer holds, the inputs a
subgraph reads from outside, and each value's rank from shape inference."""

from __future__ import annotations

import math

import numpy as np
import onnx

SMALL_VALUES = 4096  # constants read for their values (shapes, axes, split sizes): at most this many


def constant_value(where: str, a: onnx.AttributeProto) -> np.ndarray | None:
    """A small Constant's value; None for a large one or one with external data (never read from a
    file here); a tensor whose data does not fill its shape (dims like 2**32) is a corrupt model."""
    if a.name != "value":
        value = onnx.helper.get_attribute_value(a)
        return (
            np.array(value)
            if isinstance(value, (int, float, list)) and len(np.atleast_1d(value)) <= SMALL_VALUES
            else None
        )
    if a.t.data_location == onnx.TensorProto.EXTERNAL or a.t.data_type == onnx.TensorProto.STRING:
        return None
    size = math.prod(a.t.dims)
    if size > SMALL_VALUES:
        if a.t.data_type not in _INTS or held(a.t) == size:
            return None
    else:
        try:
            return onnx.numpy_helper.to_array(a.t)
        except ValueError:
            pass
    from ...errors import CheckpointError

    raise CheckpointError(
        f"{where} holds a tensor of shape {list(a.t.dims)} whose data does not fill it: the model is corrupt; "
        "re-export or re-download it"
    )


_INTS: dict[int, int] = {onnx.TensorProto.INT64: 8, onnx.TensorProto.INT32: 4}


def held(t: onnx.TensorProto) -> int:
    """How many values an INT64/INT32 tensor holds, from its raw bytes or its repeated field."""
    if t.HasField("raw_data"):
        return len(t.raw_data) // _INTS[t.data_type]
    return len(t.int64_data) if t.data_type == onnx.TensorProto.INT64 else len(t.int32_data)


def subgraph_inputs(node: onnx.NodeProto) -> list[str]:
    """Outer-scope tensors read inside If/Loop/Scan bodies (they are users too)."""
    names: list[str] = []
    for a in node.attribute:
        graphs = (
            [a.g]
            if a.type == onnx.AttributeProto.GRAPH
            else list(a.graphs)
            if a.type == onnx.AttributeProto.GRAPHS
            else []
        )
        for sub in graphs:
            for inner in sub.node:
                names += list(inner.input) + subgraph_inputs(inner)
    return names


def infer_ranks(model: onnx.ModelProto, dims: dict[str, list[int | None]] | None = None) -> dict[str, int]:
    """Tensor ranks from ONNX shape inference on a copy of the graph without the weights' data;
    ``dims`` gets each tensor's static shape (None where an axis is only known at run time)."""
    g = model.graph
    stubs = []
    for t in g.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL and math.prod(t.dims) <= 64:
            stubs.append(t)  # small constants (shapes, axes) keep their values
        else:
            stubs.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    inits = [t for t in stubs if isinstance(t, onnx.TensorProto)]
    listed = {i.name for i in g.input}
    extra_inputs = [t for t in stubs if not isinstance(t, onnx.TensorProto) and t.name not in listed]
    lite = onnx.helper.make_graph(
        list(g.node), g.name or "g", list(g.input) + extra_inputs, list(g.output), inits, value_info=list(g.value_info)
    )
    lite_model = onnx.helper.make_model(lite, opset_imports=list(model.opset_import), functions=list(model.functions))
    lite_model.ir_version = model.ir_version
    ranks: dict[str, int] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(
            lite_model, check_type=False, strict_mode=False, data_prop=True
        ).graph
        infos = list(inferred.value_info) + list(inferred.input) + list(inferred.output)
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        infos = list(g.value_info) + list(g.input) + list(g.output)
    for vi in infos:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            ranks[vi.name] = len(t.shape.dim)
            if dims is not None:
                dims[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    for t in g.initializer:
        ranks[t.name] = len(t.dims)
    return ranks
