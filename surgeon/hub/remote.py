"""A Hub model's safetensors read where they are: the byte source (``HubFiles``) the safetensors format reads
through, headers and measured tensors by HTTP Range, a whole shard fetched into the HF cache the first time a
writer needs its bytes.

Detection and planning need only the shards' headers (names, dtypes, shapes, offsets): each is read with
two Range requests (its 8-byte length, then the header), from the commit the model resolved to, and
parsed with the same caps and checks as a local file's (``safetensors_header``). A tensor's values are
read by Range too (``inspect``), and a shard is downloaded whole (``HubFiles.local``) only where a run writes
it. Every byte is counted as it arrives (``Transfer``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ..formats.base import read_index, shard_order
from ..formats.byte_source import LocalFiles, Transfer
from ..formats.safetensors import FILE_SUFFIX, INDEX_SUFFIX, SafetensorsWeights
from ..formats.safetensors_header import Header, header_length, parse_header

if TYPE_CHECKING:
    from ..open.source import Source


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


class HubFiles:
    """The byte source of a Hub model's safetensors (``formats.byte_source.ByteSource``): byte ranges read by
    HTTP Range from the pinned commit; a shard fetched into the HF cache, pinned to that commit, the first time a
    writer asks for it on disk. Files the snapshot holds already (the index) are read from ``folder``."""

    def __init__(self, repo: RemoteRepo, folder: Path, remote: list[str]) -> None:
        self.repo, self.folder = repo, folder
        self.remote = set(remote)  # the shards left on the Hub
        self.fetched: dict[str, Path] = {}

    @property
    def transfer(self) -> Transfer:
        return self.repo.transfer

    def on_disk(self, file: str) -> bool:
        return file not in self.remote or file in self.fetched

    def read(self, file: str, start: int, length: int) -> bytes:
        if not self.on_disk(file):
            data, _ = self.repo.read(file, start, length)
            self.repo.transfer.tensor_bytes += len(data)
            return data
        path = self.local(file)
        return LocalFiles(path.parent).read(path.name, start, length)

    def local(self, file: str) -> Path:
        if file not in self.remote:
            return self.folder / file
        if file not in self.fetched:
            from huggingface_hub import hf_hub_download

            from .failures import read_error

            try:
                path = Path(hf_hub_download(self.repo.repo_id, file, revision=self.repo.commit))
            except Exception as exc:  # the client's errors, one line each
                raise read_error(exc, self.repo.repo_id, self.repo.commit, False) from None
            self.repo.transfer.downloaded += path.stat().st_size  # counted by the client's own download
            self.fetched[file] = path
        return self.fetched[file]

    def describe(self, file: str) -> str:
        return f"Hub model {self.repo.repo_id} at commit {self.repo.commit[:12]}"


def remote_layout(wanted: list[str]) -> tuple[list[str], str | None] | None:
    """Where a Hub model can be read by Range: its weights are safetensors, one file or one index's shards
    (returns (the weight files, the index)); None otherwise (other formats, variants: fetched whole)."""
    weights = [f for f in wanted if f.endswith(FILE_SUFFIX)]
    indexes = [f for f in wanted if f.endswith(INDEX_SUFFIX)]
    if not weights or len(indexes) > 1 or (not indexes and len(weights) != 1):
        return None
    return weights, (indexes[0] if indexes else None)


def open_remote(folder: Path, repo: RemoteRepo, weights: list[str], index: str | None) -> SafetensorsWeights:
    """The weight set of a Hub model whose small files (the index among them) are in ``folder``: its shards'
    headers read by Range, their bytes read through :class:`HubFiles`."""
    shards = weights
    if index is not None:
        shards = shard_order(read_index(folder / index, FILE_SUFFIX))
        missing = sorted(set(shards) - set(weights))
        if missing:
            raise CheckpointError(f"missing shard {missing[0]}: {index} lists it but the repo has no such file")
    headers = {f: repo.header(f) for f in shards}
    return SafetensorsWeights(folder, shards, index, headers=headers, source=HubFiles(repo, folder, shards))


def ranged(source: Source) -> SafetensorsWeights | None:
    """The safetensors of a Hub model read by Range (None for any other source)."""
    weights = source.primary
    return weights if isinstance(weights, SafetensorsWeights) and isinstance(weights.bytes, HubFiles) else None
