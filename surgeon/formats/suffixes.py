"""The file names of each weight format, read by the registry's table and by the format's own module (which the
registry imports on first use, so these sit below both)."""

from __future__ import annotations

SAFETENSORS_SUFFIX = ".safetensors"
SAFETENSORS_INDEX = SAFETENSORS_SUFFIX + ".index.json"
TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")  # the first: the shards a sharded state dict is written as
DCP_METADATA, DCP_SUFFIX = ".metadata", ".distcp"  # torch.distributed.checkpoint
