"""One element of a tensor in a safetensors file changed in place (header and every other byte as they were):
what a verify must refuse."""

from __future__ import annotations

from pathlib import Path

import torch

from surgeon.formats.safetensors import read_header

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def nudge(path: Path, name: str, index: int = 0) -> None:
    """Flip the lowest bit of element ``index`` (flat) of tensor ``name``: the smallest change its dtype holds."""
    header = read_header(path)
    entry = header.entries[name]
    begin, _ = entry["data_offsets"]
    size = torch.empty((), dtype=DTYPES[entry["dtype"]]).element_size()
    data = bytearray(path.read_bytes())
    data[header.data_start + begin + index * size] ^= 1  # little-endian: the first byte holds the lowest bit
    path.write_bytes(bytes(data))
