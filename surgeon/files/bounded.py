"""Small files from an input, read with a size cap, and JSON parsed with a depth cap.

Everything surgeon parses from a model folder (config.json and the libraries' configs, index files, the
model card, surgeon's records, ``--jacobian --inputs``) comes from someone else, so its size and
nesting are checked before it costs memory or stack: the size with ``fstat`` before a byte is read (a
regular file only, opened without blocking by :func:`open_regular`, so a FIFO cannot hang), the nesting by a scan of the
brackets before ``json.loads`` can recurse. Each refusal is one ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, SurgeonError

CONFIG_LIMIT = 16 << 20  # config.json of real models is under 100 KiB; a library's config alike
INDEX_LIMIT = 64 << 20  # a *.index.json lists every tensor name: a few MiB for the largest models
CARD_LIMIT = 16 << 20  # a README.md model card
YAML_LIMIT = 1 << 20  # a framework's YAML config (litgpt's model_config.yaml: 2 KiB); YAML parses slowly in Python
MAX_DEPTH = 64  # JSON nesting: configs and records nest 5 levels or so

_ONE_KIND = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_RUNS = re.compile(rb"\[+|\]+")
_OPEN = ord("[")
_NUMPY_FROM = 1 << 20  # bytes: beyond this, numpy counts (splitting millions of strings in Python takes seconds)


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"


_SPECIAL = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}


def special(mode: int) -> str | None:
    """What a file of ``mode`` is when reading or replacing it could block or reach a device: "a FIFO", "a
    socket", "a device"; None for a regular file, a folder or a link."""
    return _SPECIAL.get(stat.S_IFMT(mode))


def refuse_special(path: str | Path, *, what: str, error: type[SurgeonError] = CheckpointError) -> None:
    """Every path a user names (the model, ``--output``, ``--emit-layout``) that is a FIFO, a socket or a device is
    refused in one line, before anything opens it (opening a FIFO blocks until a writer comes)."""
    try:
        kind = special(os.stat(path).st_mode)
    except OSError:
        return  # nothing there (or a link to nothing): the caller says what it needs
    if kind is not None:
        raise error(f"{what} {path} is {kind}: surgeon reads and writes regular files and folders only", path=path)


def open_regular(path: str | Path, *, what: str) -> int:
    """The one opener of a file a user names or a folder holds: opened without blocking (a FIFO cannot hang it),
    then refused unless it is a regular file. Returns the descriptor (the caller closes it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"no such {what} file: {path}", path=path) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {path}: {exc.strerror or exc}", path=path) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = special(mode) or ("a folder" if stat.S_ISDIR(mode) else "not a regular file")
        raise CheckpointError(f"cannot read {what} {path}: it is {kind}, not a regular file", path=path)
    return fd


def read_bytes(path: str | Path, *, what: str, limit: int) -> bytes:
    """The bytes of ``path`` (a regular file of at most ``limit`` bytes); ``what``: "config", "index", ..."""
    fd = open_regular(path, what=what)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise CheckpointError(
                f"{what} {path} is {st.st_size} bytes: too large (surgeon reads at most {_size(limit)} of it); "
                "is it the right file?",
                path=path,
            )
        chunks, total = [], 0
        # its size and one byte more (os.read allocates what it is asked for), then on: a file growing while
        # it is read stops at the cap too
        while chunk := os.read(fd, min(max(st.st_size + 1 - total, 1 << 16), limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise CheckpointError(f"{what} {path} grew past {_size(limit)} while it was read", path=path)
        return b"".join(chunks)
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {path}: {exc.strerror or exc}", path=path) from None
    finally:
        os.close(fd)


def read_text(path: str | Path, *, what: str, limit: int) -> str:
    """:func:`read_bytes` decoded as UTF-8 (bad bytes replaced)."""
    return read_bytes(path, what=what, limit=limit).decode("utf-8", errors="replace")


def read_json(path: str | Path, *, what: str = "config", limit: int = CONFIG_LIMIT) -> Any:
    """The JSON value in ``path``, size and depth checked; any fault is one line naming the file."""
    return loads(read_bytes(path, what=what, limit=limit), where=f"{what} {path}")


def read_yaml(path: str | Path, *, what: str = "config", limit: int = YAML_LIMIT) -> Any:
    """The YAML value in ``path`` (a framework's config: litgpt's model_config.yaml), size checked and read with
    ``yaml.safe_load`` (plain data only, no tags that build objects); any fault is one line naming the file."""
    text = read_text(path, what=what, limit=limit)
    try:
        import yaml  # PyYAML: huggingface-hub's own dependency
    except ImportError:
        raise CheckpointError(f"{what} {path} is YAML and PyYAML is not installed: pip install pyyaml") from None
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:  # deep nesting recurses in yaml's composer
        raise CheckpointError(f"{what} {path} is not valid YAML ({str(exc).splitlines()[0][:120]})") from None


def loads(text: str | bytes, *, where: str) -> Any:
    """``json.loads`` of text from an input; nested more than MAX_DEPTH levels, or not JSON, is one line
    ``{where} is not valid JSON (why)`` (``where``: what it is and whose, e.g. "config /m/config.json")."""
    data = text.encode("utf-8", errors="surrogatepass") if isinstance(text, str) else text
    if too_deep(data):
        raise CheckpointError(f"{where} is not valid JSON (nested too deeply): it may nest {MAX_DEPTH} levels at most")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{where} is not valid JSON ({str(exc)[:120]})") from None


def too_deep(data: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether ``data`` nests over ``limit`` levels: json.loads would recurse deeper.

    json.loads recurses once per bracket opened and not yet closed outside a string, and stops at the
    first closing bracket too many; so does this count."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")  # escaped backslashes, then escaped quotes
    deep = _deeper_than_numpy if len(unescaped) > _NUMPY_FROM else _deeper_than
    return deep(unescaped, limit)


def _deeper_than(data: bytes, limit: int) -> bool:
    outside = b"".join(data.split(b'"')[::2])  # every second piece is inside a string
    depth = 0
    for run in _RUNS.finditer(outside.translate(_ONE_KIND, _NOT_BRACKETS)):
        depth += len(run[0]) if run[0][0] == _OPEN else -len(run[0])
        if depth > limit:
            return True
        if depth < 0:
            return False
    return False


def _deeper_than_numpy(data: bytes, limit: int) -> bool:
    """:func:`_deeper_than` for megabytes (millions of strings would take seconds in Python), a chunk at a time."""
    import numpy as np

    steps = np.zeros(256, np.int32)
    steps[list(b"[{")], steps[list(b"]}")] = 1, -1
    depth, inside = 0, 0  # inside: 1 while a string is open at the end of the last chunk
    for start in range(0, len(data), _NUMPY_FROM):
        chunk = np.frombuffer(data, np.uint8, count=min(_NUMPY_FROM, len(data) - start), offset=start)
        strings = np.bitwise_xor.accumulate(chunk == ord('"'), dtype=np.uint8) ^ inside
        path = np.cumsum(steps[chunk] * (1 - strings), dtype=np.int32) + depth
        below = np.flatnonzero(path < 0)
        if below.size:
            return bool(path[: below[0]].max(initial=depth) > limit)
        if path.max() > limit:
            return True
        depth, inside = int(path[-1]), int(strings[-1])
    return False
