"""The token ids ``inspect --jacobian`` runs on: ``--inputs FILE`` (a .pt tensor or text lines) or a sample.

``FILE`` comes from anywhere, so it is read as hostile input: at most INPUTS_LIMIT bytes, a .pt file only
with ``torch.load(weights_only=True)`` (a zip whose members would unpack past the cap is refused first),
and every id must be a row of the model's input embedding. Each fault is one line that says what the file
must be.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import OptionError, opt
from ..files.bounded import read_bytes

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..open.source import Source

SAMPLE_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention layers mix information across the tokens of a sequence.",
    "A well-conditioned Jacobian makes gradient descent better behaved.",
    "Paris is the capital and most populous city of France.",
]
INPUTS_LIMIT = 64 << 20  # a 2-D tensor of a thousand 8k-token sequences in int64
_PT_FORM = "a .pt file must hold a 1-D or 2-D integer tensor of token ids, saved with torch.save"


def token_ids(source: Source, inputs: str | Path | None) -> list[torch.Tensor]:
    """One (1, N) int64 tensor per input sequence."""
    if inputs is not None and str(inputs).endswith(".pt"):
        return _tensor_ids(inputs)
    if inputs is not None:
        raw = read_bytes(inputs, what="inputs", limit=INPUTS_LIMIT)
        text = [line.strip() for line in raw.decode("utf-8", errors="replace").splitlines() if line.strip()]
        if not text:
            raise OptionError(f"{opt('inputs', inputs)} holds no text lines")
    else:
        text = SAMPLE_TEXT
    folder = source.folder if source.kind == "folder" else None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder)) if folder is not None else None
    except Exception:  # no tokenizer files, or ones this transformers cannot read
        tok = None
    if tok is None:
        raise OptionError(
            f"{opt('jacobian', True)} needs token ids: this model has no tokenizer beside it; pass {opt('inputs', 'FILE.pt')} (a tensor of token ids)"
        )
    return [tok(t, return_tensors="pt")["input_ids"] for t in text]


def _tensor_ids(inputs: str | Path) -> list[torch.Tensor]:
    import torch

    raw = read_bytes(inputs, what="inputs", limit=INPUTS_LIMIT)
    if zipfile.is_zipfile(io.BytesIO(raw)):
        try:
            unpacked = sum(member.file_size for member in zipfile.ZipFile(io.BytesIO(raw)).infolist())
        except (zipfile.BadZipFile, ValueError, OSError):
            unpacked = None
        if unpacked is None or unpacked > INPUTS_LIMIT:
            raise OptionError(
                f"{opt('inputs', inputs)} is a zip that unpacks past {INPUTS_LIMIT >> 20} MiB: {_PT_FORM}"
            )
    try:
        ids = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception:  # UnpicklingError (objects weights_only refuses, or junk), RuntimeError, EOFError and kin
        raise OptionError(
            f"{opt('inputs', inputs)} is not a file torch.load reads with weights_only=True (it holds objects other "
            f"than tensors, or is not a torch.save file): {_PT_FORM}"
        ) from None
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() not in (1, 2):
        raise OptionError(f"{opt('inputs', inputs)}: {_PT_FORM}")
    if ids.numel() == 0:
        raise OptionError(f"{opt('inputs', inputs)} holds no token ids: {_PT_FORM}")
    return [t[None].long() for t in (ids if ids.dim() == 2 else ids[None])]


def check_ids(ids: list[torch.Tensor], model: nn.Module, inputs: str | Path | None) -> None:
    """Every id names a row of the model's input embedding (the forward would index past it)."""
    has_embedding = hasattr(model, "get_input_embeddings")  # transformers models; nn.Module's stubs lack it
    embedding = getattr(model, "get_input_embeddings")() if has_embedding else None  # noqa: B009
    rows = getattr(embedding, "num_embeddings", None)
    if not isinstance(rows, int):
        return
    for t in (t for t in ids if t.numel()):
        low, high = int(t.min()), int(t.max())
        if low < 0 or high >= rows:
            raise OptionError(
                f"{opt('inputs', inputs or 'FILE')} holds token id {low if low < 0 else high}, and the model's "
                f"embedding has ids 0 to {rows - 1}: are these ids from this model's tokenizer?"
            )
