"""A Hub model's safetensors read where they are: headers and measured tensors by HTTP Range, whole shards
fetched into the HF cache only when they are written.

Detection and planning need only the shards' headers (names, dtypes, shapes, offsets): each is read with
two Range requests (its 8-byte length, then the header), from the commit the model resolved to, and
parsed with the same caps and checks as a local file's (``safetensors_header``). A tensor's values are
read by Range too (``inspect``), and a shard is downloaded whole (``fetch``) only where a run writes it.
Every byte is counted as it arrives (``Transfer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ..formats.base import read_index, shard_order
from ..formats.safetensors import FILE_SUFFIX, INDEX_SUFFIX, SafetensorsWeights, torch_dtype
from ..formats.safetensors_header import Header, header_length, parse_header, read_header

if TYPE_CHECKING:
    import torch

    from ..open.source import Source


@dataclass
class Transfer:
    """Bytes a run moved from the Hub, counted at the transport (the bodies received), not from file sizes."""

    header_bytes: int = 0  # read by Range: the shards' headers
    tensor_bytes: int = 0  # read by Range: tensors' values
    range_requests: int = 0
    downloaded: int = 0  # whole files fetched into the HF cache (shards; small files by the client)

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


class RemoteRepo:
    """One Hub model at one commit, read by byte ranges."""

    def __init__(self, repo_id: str, commit: str) -> None:
        self.repo_id, self.commit = repo_id, commit
        self.transfer = Transfer()

    def read(self, file: str, start: int, length: int) -> tuple[bytes, int]:
        """``length`` bytes of ``file`` from ``start``, and the file's whole size (from Content-Range); the body
        is streamed under the Hub HTTP policy (``hub.http``): never more than ``length`` bytes are taken."""
        import re

        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        from .http import get_range

        url = hf_hub_url(self.repo_id, file, revision=self.commit)  # the commit: never a branch that can move
        answer = get_range(url, build_hf_headers(), start, length)
        self.transfer.range_requests += 1
        total = re.fullmatch(r"bytes \d+-\d+/(\d+)", answer.content_range)
        if answer.status != 206 or total is None:
            raise CheckpointError(
                f"{file}: the Hub answered a byte-range request with the whole file (HTTP {answer.status}); "
                "read it without Range"
            )
        if len(answer.data) != min(length, max(0, int(total.group(1)) - start)):
            raise CheckpointError(f"{file}: the Hub sent {len(answer.data)} bytes for a range of {length}")
        return answer.data, int(total.group(1))

    def header(self, file: str) -> Header:
        """The shard's header, as strictly checked as a local file's: its length, then its JSON."""
        path = Path(file)
        prefix, size = self.read(file, 0, 8)
        self.transfer.header_bytes += len(prefix)
        length = header_length(path, prefix, size)
        raw, _ = self.read(file, 8, length) if length else (b"", size)
        self.transfer.header_bytes += len(raw)
        return parse_header(path, length, raw, size)


class RemoteSafetensorsWeights(SafetensorsWeights):
    """Safetensors weights on the Hub: headers read by Range, data read by Range until a shard is fetched."""

    def __init__(self, folder: Path, files: list[str], index: str | None, repo: RemoteRepo) -> None:
        self.repo = repo
        self.fetched: set[str] = set()
        super().__init__(folder, files, index, headers={f: repo.header(f) for f in files})

    @property
    def local_files(self) -> list[str]:
        return sorted(self.fetched) + ([self.index] if self.index else [])

    def raw(self, name: str) -> bytes:
        info = self.tensors[name]
        if info.file in self.fetched:
            return super().raw(name)
        header = self.headers[info.file]
        begin, end = header.entries[name]["data_offsets"]
        if end == begin:
            return b""
        data, _ = self.repo.read(info.file, header.data_start + begin, end - begin)
        self.repo.transfer.tensor_bytes += len(data)
        return data

    def read(self, name: str) -> torch.Tensor:
        import torch

        info = self.tensors[name]
        if info.file in self.fetched:
            return super().read(name)
        header = self.headers[info.file]
        dtype, shape = torch_dtype(header, name), tuple(header.entries[name]["shape"])
        data = self.raw(name)
        return (
            torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
        )

    def nbytes(self) -> int:
        return sum(h.file_size for h in self.headers.values()) + (
            (self.folder / self.index).stat().st_size if self.index else 0
        )

    def fetch(self, files: list[str] | None = None) -> None:
        """Download ``files`` (default: every shard) into the HF cache, pinned to the commit read, and read
        them from there on; a shard whose header is no longer the one planned from is refused."""
        from huggingface_hub import hf_hub_download

        from .failures import read_error

        for file in self.files if files is None else files:
            if file in self.fetched:
                continue
            try:
                path = Path(hf_hub_download(self.repo.repo_id, file, revision=self.repo.commit))
            except Exception as exc:  # the client's errors, one line each
                raise read_error(exc, self.repo.repo_id, self.repo.commit, False) from None
            local = read_header(path)
            if local.entries != self.headers[file].entries or local.file_size != self.headers[file].file_size:
                raise CheckpointError(
                    f"Hub model {self.repo.repo_id}: {file} in the HF cache is not the file whose header was read "
                    f"at commit {self.repo.commit[:12]}; remove it from the cache and run this again"
                )
            self.repo.transfer.downloaded += local.file_size  # counted by the client's own download
            self.headers[file] = local
            self.fetched.add(file)

    def save(self, dest: Path, updates, record, write_plan, files=None) -> None:  # type: ignore[no-untyped-def]
        missing = [f for f in (self.files if files is None else files) if f not in self.fetched]
        if missing:  # a shard is written from its bytes on disk: fetch first (api.reinit_checkpoint does)
            raise AssertionError(f"shards not fetched before writing: {missing[:3]}")
        super().save(dest, updates, record, write_plan, files)


def remote_layout(wanted: list[str]) -> tuple[list[str], str | None] | None:
    """Where a Hub model can be read by Range: its weights are safetensors, one file or one index's shards
    (returns (the weight files, the index)); None otherwise (other formats, variants: fetched whole)."""
    weights = [f for f in wanted if f.endswith(FILE_SUFFIX)]
    indexes = [f for f in wanted if f.endswith(INDEX_SUFFIX)]
    if not weights or len(indexes) > 1 or (not indexes and len(weights) != 1):
        return None
    return weights, (indexes[0] if indexes else None)


def open_remote(folder: Path, repo: RemoteRepo, weights: list[str], index: str | None) -> RemoteSafetensorsWeights:
    """The weight set of a Hub model whose small files (the index among them) are in ``folder``."""
    if index is None:
        return RemoteSafetensorsWeights(folder, weights, None, repo)
    shards = shard_order(read_index(folder / index, FILE_SUFFIX))
    missing = sorted(set(shards) - set(weights))
    if missing:
        raise CheckpointError(f"missing shard {missing[0]}: {index} lists it but the repo has no such file")
    return RemoteSafetensorsWeights(folder, shards, index, repo)


def transfer_notes(source: Source) -> list[str]:
    """The report's line on what a Hub model read by Range moved (none for other sources)."""
    weights = source.primary
    return [weights.repo.transfer.note()] if isinstance(weights, RemoteSafetensorsWeights) else []


def transfer_of(source: Source) -> dict[str, int] | None:
    """What a Hub model read by Range moved so far, for the report's ``transfer`` (None for other sources)."""
    weights = source.primary
    return weights.repo.transfer.to_dict() if isinstance(weights, RemoteSafetensorsWeights) else None


def fetch_weights(source: Source, files: list[str] | None = None) -> None:
    """Fetch ``files`` (default: all) of a Hub model read by Range, before they are written from."""
    weights = source.primary
    if isinstance(weights, RemoteSafetensorsWeights):
        weights.fetch(files)
