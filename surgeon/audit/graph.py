"""An ONNX output's model against its original's, everything but the initializers' values.

The values are checked tensor by tensor elsewhere. Here: every model field (opsets, IR version, producer,
functions, ...), every graph field (inputs, outputs, value infos, sparse initializers, ...) and every node
(op type, domain, inputs, outputs, attributes, subgraphs) must be the original's, with only what surgeon
changes allowed to differ: the nodes of the chosen projections read the recorded copies of shared
initializers (the ``copies`` of the write plan, made again by ``OnnxWeights.write_plan``),
the copies are new initializers at the end of the graph, data files may have been renamed (``renamed``),
the re-initialized Constant nodes hold new values, and the ``surgeon`` metadata entry is new.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from ..errors import VerificationError

if TYPE_CHECKING:
    from google.protobuf.message import Message

    from ..formats.onnx import OnnxWeights
    from ..formats.write_plan import WritePlan

_DATA = frozenset(
    ("raw_data", "float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data", "external_data")
)


def check_graph(
    a: OnnxWeights, b: OnnxWeights, write_plan: WritePlan, renamed: dict[str, str], output: str | Path
) -> None:
    """``a``, ``b``: the original's and the output's OnnxWeights."""
    ma, mb = a.model, b.model
    for field in ma.DESCRIPTOR.fields:
        if field.name == "graph":
            continue
        if field.name == "metadata_props":
            theirs = [(p.key, p.value) for p in mb.metadata_props if p.key != "surgeon"]
            if theirs != [(p.key, p.value) for p in ma.metadata_props if p.key != "surgeon"]:
                raise VerificationError(
                    f"{output}: its metadata_props differ from the original's beyond surgeon's record"
                )
        elif _value(ma, field.name) != _value(mb, field.name):
            raise VerificationError(f"{output}: the model's {field.name} differs from the original's")
    ga, gb = ma.graph, mb.graph
    for field in ga.DESCRIPTOR.fields:
        if field.name not in ("node", "initializer") and _value(ga, field.name) != _value(gb, field.name):
            raise VerificationError(f"{output}: {_first(ga, gb, field.name)} differs from the original's")
    _check_nodes(a, ga, gb, write_plan, output)
    _check_initializers(a, ga, gb, write_plan, renamed, output)


def _value(msg: Message, name: str) -> object:
    value = getattr(msg, name)
    if hasattr(value, "SerializeToString"):
        return value.SerializeToString(deterministic=True) if msg.HasField(name) else None
    if hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
        return [v.SerializeToString(deterministic=True) if hasattr(v, "SerializeToString") else v for v in value]
    return value


def _first(ga: onnx.GraphProto, gb: onnx.GraphProto, name: str) -> str:
    """The first differing entry of a repeated graph field, for the message."""
    mine, theirs = getattr(ga, name), getattr(gb, name)
    label = {"input": "graph input", "output": "graph output", "value_info": "value info"}.get(
        name, f"the graph's {name}"
    )
    if not hasattr(mine, "__len__") or isinstance(mine, (str, bytes)):
        return label
    for i in range(max(len(mine), len(theirs))):
        if i >= len(mine) or i >= len(theirs) or _value_one(mine[i]) != _value_one(theirs[i]):
            entry = theirs[i] if i < len(theirs) else mine[i]
            return f"{label} {i}" + (f" ({getattr(entry, 'name', '')!r})" if getattr(entry, "name", "") else "")
    return label


def _value_one(v: object) -> object:
    return v.SerializeToString(deterministic=True) if hasattr(v, "SerializeToString") else v


def _check_nodes(
    a: OnnxWeights, ga: onnx.GraphProto, gb: onnx.GraphProto, write_plan: WritePlan, output: str | Path
) -> None:
    renames: dict[int, dict[str, str]] = {}
    for shared in write_plan.copies:
        for n in shared.readers:
            renames.setdefault(n, {})[shared.name] = shared.copy
    if len(ga.node) != len(gb.node):
        raise VerificationError(f"{output}: its graph has {len(gb.node)} nodes, the original {len(ga.node)}")
    for i, (mine, theirs) in enumerate(zip(ga.node, gb.node)):
        expected = onnx.NodeProto()
        expected.CopyFrom(mine)
        for j, x in enumerate(expected.input):
            expected.input[j] = renames.get(i, {}).get(x, x)
        found = theirs
        if mine.op_type == "Constant" and len(mine.output) == 1 and mine.output[0] in a.constants:
            expected, found = (
                _without_value(expected),
                _without_value(theirs),
            )  # a re-initialized Constant: its value is checked as a tensor
        if expected.SerializeToString(deterministic=True) != found.SerializeToString(deterministic=True):
            raise VerificationError(
                f"{output}: node {i} ({mine.name or mine.op_type}) {_node_difference(expected, found)}"
            )


def _without_value(node: onnx.NodeProto) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    for attr in out.attribute:
        if attr.name == "value" and attr.HasField("t"):
            for f in _DATA:
                attr.t.ClearField(f)
    return out


def _node_difference(expected: onnx.NodeProto, found: onnx.NodeProto) -> str:
    if (found.op_type, found.domain) != (expected.op_type, expected.domain):
        return f"is {found.domain + '.' if found.domain else ''}{found.op_type}, the original's is {expected.domain + '.' if expected.domain else ''}{expected.op_type}"
    for what in ("input", "output"):
        if list(getattr(found, what)) != list(getattr(expected, what)):
            return (
                f"has {what}s {list(getattr(found, what))[:6]}, surgeon's would be {list(getattr(expected, what))[:6]}"
            )
    mine = {x.name: x.SerializeToString(deterministic=True) for x in expected.attribute}
    theirs = {x.name: x.SerializeToString(deterministic=True) for x in found.attribute}
    for key in sorted(set(mine) | set(theirs)):
        if mine.get(key) != theirs.get(key):
            return f"has another attribute {key!r} than the original's"
    return "differs from the original's (name or doc string)"


def _check_initializers(
    a: OnnxWeights,
    ga: onnx.GraphProto,
    gb: onnx.GraphProto,
    write_plan: WritePlan,
    renamed: dict[str, str],
    output: str | Path,
) -> None:
    values = set(a.tensors) | {c.copy for c in write_plan.copies}  # names whose values are checked as tensors
    expected = [_header(t, values, {}) for t in ga.initializer]
    expected += [
        _header(
            onnx.TensorProto(name=c.copy, dims=a.protos[c.name].dims, data_type=a.protos[c.name].data_type), values, {}
        )
        for c in write_plan.copies
    ]
    back = {new: old for old, new in renamed.items()}
    found = [_header(t, values, back) for t in gb.initializer]
    if len(found) != len(expected):
        raise VerificationError(f"{output}: its graph has {len(found)} initializers, surgeon writes {len(expected)}")
    for mine, theirs, t in zip(expected, found, gb.initializer):
        if mine != theirs:
            raise VerificationError(
                f"{output}: initializer {t.name!r} differs from the original's (its name, type, shape or storage)"
            )


def _header(t: onnx.TensorProto, values: set[str], back: dict[str, str]) -> bytes:
    """What an initializer is without its values (whole, values included, where they are not checked as a
    tensor: strings and other types surgeon never changes); external data file names mapped ``back``."""
    if t.name not in values:
        return t.SerializeToString(deterministic=True)
    out = onnx.TensorProto()
    out.CopyFrom(t)
    for field in _DATA | {"data_location"}:
        out.ClearField(field)
    external = [(e.key, back.get(e.value, e.value) if e.key == "location" else e.value) for e in t.external_data]
    return (
        out.SerializeToString(deterministic=True)
        + repr((t.data_location == onnx.TensorProto.EXTERNAL, external)).encode()
    )
