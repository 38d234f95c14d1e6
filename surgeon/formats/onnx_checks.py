"""What an .onnx from a stranger may not do to surgeon's byte-level writer: keep its external data in
the model file itself, alias one initializer's bytes with another's, or already use the name of a copy."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import onnx

from ..errors import CheckpointError


def refuse_self_location(model_path: Path, data_path: Path, tensor: str, location: str) -> None:
    """External data must live in a file of its own: the .onnx's bytes are protobuf, and writing a
    tensor's values over them (or the .onnx over the data) leaves a model that no longer loads."""
    try:
        same = data_path.exists() and os.path.samefile(data_path, model_path)
    except OSError:
        same = False
    if same:
        raise CheckpointError(
            f"{model_path}: initializer {tensor!r} keeps its external data in the model file itself ({location[:80]!r}); "
            "the model is corrupt or crafted: re-export it with its data in a file of its own"
        )


def aliased(folder: Path, ranges: Iterable[tuple[str, str, int, int]]) -> dict[str, tuple[str, str, int, int]]:
    """Initializers whose external-data byte ranges overlap another's, from (name, file, offset, length):
    name -> (the other, file, first shared byte, end of the shared bytes). Two names of one file (a hard
    or symbolic link inside ``folder``) are one file. Sorted per file, so O(n log n)."""
    by_file: dict[tuple[int, int] | str, list[tuple[int, int, str]]] = {}
    shown: dict[tuple[int, int] | str, str] = {}
    for name, file, offset, length in ranges:
        if length > 0:
            key = _identity(folder / file) or file
            shown.setdefault(key, file)
            by_file.setdefault(key, []).append((offset, offset + length, name))
    out: dict[str, tuple[str, str, int, int]] = {}
    for key, spans in by_file.items():
        spans.sort()
        reach, owner = -1, ""  # the furthest end so far, and whose it is
        for start, end, name in spans:
            if start < reach:
                shared = (shown[key], start, min(end, reach))
                out.setdefault(name, (owner, *shared))
                out.setdefault(owner, (name, *shared))
            if end > reach:
                reach, owner = end, name
    return out


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def refuse_aliased(changed: Iterable[str], aliases: Mapping[str, tuple[str, str, int, int]]) -> None:
    """Changing an initializer whose bytes another one reads too would change both."""
    for name in changed:
        if name in aliases:
            other, file, start, end = aliases[name]
            raise CheckpointError(
                f"initializers {name!r} and {other!r} share bytes {start}-{end} of {file}, so changing {name!r} would change "
                f"{other!r} too; the model is corrupt or crafted: re-export it so that each initializer has bytes of its own"
            )


def graph_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a graph (and each subgraph in it) uses: inputs, outputs, initializers, sparse
    initializers, value infos, node inputs and outputs."""
    names: set[str] = set()
    todo = [graph]
    while todo:
        g = todo.pop()
        names.update(v.name for v in (*g.input, *g.output, *g.value_info))
        names.update(t.name for t in g.initializer)
        names.update(s.values.name for s in g.sparse_initializer)
        for node in g.node:
            names.update(node.input)
            names.update(node.output)
            for a in node.attribute:
                todo += [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
    names.discard("")
    return names
