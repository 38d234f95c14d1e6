"""Where a weight set's bytes come from: its folder on disk, or a Hub repo read by HTTP Range.

A format reads its files through a :class:`ByteSource` and never asks where they are: byte ranges by
:meth:`ByteSource.read` (a tensor to measure), a file on disk by :meth:`ByteSource.local` (the bytes a writer
copies). A Hub source (``surgeon.hub.remote.HubFiles``) answers the first by Range and the second by fetching
the file the first time a writer needs it, so no caller has to remember to fetch before writing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import CheckpointError


@dataclass
class Transfer:
    """Bytes a run moved from the Hub, counted at the transport (the bodies received), not from file sizes."""

    header_bytes: int = 0  # read by Range: the shards' headers
    tensor_bytes: int = 0  # read by Range: tensors' values
    range_requests: int = 0
    downloaded: int = 0  # whole files fetched (shards; small files by the client)

    @property
    def ranged(self) -> int:
        return self.header_bytes + self.tensor_bytes

    def to_dict(self) -> dict[str, int]:
        return {
            "read_by_range": self.ranged,
            "header_bytes": self.header_bytes,
            "tensor_bytes": self.tensor_bytes,
            "range_requests": self.range_requests,
            "downloaded": self.downloaded,
        }

    def note(self) -> str:
        from ..text.sizes import fmt_bytes

        what = (
            f"read {fmt_bytes(self.ranged)} from the Hub by HTTP Range in {self.range_requests} requests "
            f"(headers {fmt_bytes(self.header_bytes)}, tensors {fmt_bytes(self.tensor_bytes)})"
        )
        return what + (f"; downloaded {fmt_bytes(self.downloaded)} of shards" if self.downloaded else "")


class ByteSource(Protocol):
    """The bytes of a weight set's files (names relative to its folder)."""

    @property
    def transfer(self) -> Transfer | None:
        """What was moved over the network so far (None: the files are on disk)."""
        ...

    def on_disk(self, file: str) -> bool:
        """Whether ``file`` is on disk already (reading it moves nothing)."""
        ...

    def read(self, file: str, start: int, length: int) -> bytes:
        """Exactly ``length`` bytes of ``file`` from ``start`` (a CheckpointError where the file is shorter)."""
        ...

    def local(self, file: str) -> Path:
        """``file`` on disk, for a writer that copies its bytes (a remote source fetches it first)."""
        ...

    def describe(self, file: str) -> str:
        """Where ``file`` comes from, for a message."""
        ...


@dataclass(frozen=True)
class LocalFiles:
    """The files of a folder on disk."""

    folder: Path

    @property
    def transfer(self) -> Transfer | None:
        return None

    def on_disk(self, file: str) -> bool:
        return True

    def read(self, file: str, start: int, length: int) -> bytes:
        path = self.folder / file
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), length, start)
        if len(data) != length:
            raise CheckpointError(f"{path} ended while reading it: the file is truncated", path=path)
        return data

    def local(self, file: str) -> Path:
        return self.folder / file

    def describe(self, file: str) -> str:
        return str(self.folder / file)
