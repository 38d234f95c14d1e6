"""Journals as an attacker would write them, and real ones from killed runs, for the journal tests."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

from safetensors.torch import load_file

from surgeon.formats import journal_file as jf
from surgeon.formats.journal_file import journal_path
from surgeon.formats.safetensors_header import read_header

# `surgeon ARGS` that patches the first tensor of the first file, then dies as kill -9 does.
KILL_AFTER_FIRST = textwrap.dedent(
    """
    import os, signal, sys
    import surgeon.write.journal as journal
    real = journal.patch

    def patch(header, path, start, updates):
        real(header, path, start, [next(iter(updates))])
        os.kill(os.getpid(), signal.SIGKILL)

    journal.patch = patch
    from surgeon.cli.commands import main
    sys.argv = ["surgeon", *sys.argv[1:]]
    main()
    """
)


def kill_half_way(target: Path, *args: str) -> None:
    """A real `surgeon reinit TARGET --in-place` killed after one tensor: leaves a real journal."""
    run = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_FIRST, "reinit", str(target), "--in-place", *args],
        capture_output=True,
        text=True,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]


def ident(path: Path) -> dict:
    """What a journal must know of a file: here the true values, the best an attacker could do."""
    st = os.stat(path)
    header = read_header(path)
    head = path.read_bytes()[: header.data_start]
    return {"size": st.st_size, "dev": st.st_dev, "ino": st.st_ino, "header_sha256": hashlib.sha256(head).hexdigest()}


def tensor_range(path: Path, name: str) -> tuple[int, int]:
    header = read_header(path)
    begin, end = header.entries[name]["data_offsets"]
    return header.data_start + begin, end - begin


def craft(
    journal: Path,
    meta: object,
    olds: list[bytes],
    news: list[bytes | None] | None = None,
    *,
    raw_meta: bytes | None = None,
) -> None:
    """A journal in surgeon's format (written here from the format's description), with any content."""
    raw = raw_meta if raw_meta is not None else json.dumps(meta).encode()
    body = (
        jf.MAGIC
        + struct.pack("<Q", len(raw))
        + raw
        + b"".join(olds)
        + b"".join(hashlib.sha256(o).digest() for o in olds)
    )
    records = b""
    for i, new in enumerate(news or []):
        if new is not None:
            offset = meta["ranges"][i][1] if isinstance(meta, dict) else 0
            records += jf.new_record(i, jf.Range("x", offset, len(new)), new)
    journal.write_bytes(body + hashlib.sha256(body).digest() + records)


def best_forgery(
    folder: Path, file: str, tensor: str, payload: bytes | None = None, *, key: str | None = None
) -> tuple[Path, bytes]:
    """A journal for ``file`` that knows its inode and header, whose 'old bytes' of ``tensor`` are a payload
    and whose 'new bytes' are what the file holds now; returns (journal, payload)."""
    path = folder / file
    offset, length = tensor_range(path, tensor)
    payload = payload if payload is not None else bytes(range(256)) * (length // 256) + b"\x7f" * (length % 256)
    now = path.read_bytes()[offset : offset + length]
    key = key or file
    meta = {
        "version": 2,
        "checkpoint": key,
        "index_sha256": None,
        "files": {file: ident(path)},
        "ranges": [[file, offset, length]],
    }
    journal = journal_path(folder, key)
    craft(journal, meta, [payload], [now])
    return journal, payload


def tensors_equal(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(bool((x[k] == y[k]).all()) for k in x)
