"""``surgeon verify ORIGINAL OUTPUT``: check an output against the record surgeon wrote into it.

The record (``__metadata__["surgeon"]`` in safetensors, ``metadata_props["surgeon"]`` in ONNX, a comment
in the model card README.md of a folder output for PyTorch files) holds the options of the run. From
them and the ORIGINAL, the plan is made again, exactly as ``surgeon reinit`` made it, and:

- every tensor the plan does not touch must be byte-identical in OUTPUT (raw bytes through the format
  readers, not decoded where the format allows);
- every touched tensor must be what the recipe gives: in conditioned mode the same bytes (the draws
  depend only on seed, tensor, role and head); in polar mode the same values within the dtype's
  rounding, the rows outside the selected heads byte-identical, and with strength 1 each selected head
  semi-orthogonal within the dtype's rounding.

(``surgeon inspect --verify-layout``, in ``surgeon/layout_check.py``, is a different check: name-based
detection against the real forward of the architecture.)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .detect.config import HintInput
from .errors import CheckpointError, SurgeonError, VerificationError  # noqa: F401  (re-exported)
from .plan import ReinitOptions

CARD_RECORD = re.compile(r"<!-- surgeon-record (\{.*?\}) -->")


@dataclass
class Verification:
    original: str
    output: str
    record: dict
    changed: list[str]  # tensors re-derived from the record
    identical: int  # tensors checked byte-identical
    mode: str

    def summary(self) -> str:
        o = self.record.get("options", {})
        how = "re-derived byte for byte from the seed" if self.mode in ("conditioned", "redraw", "mimetic") else "semi-orthogonal/polar within the dtype's rounding"
        n = len(self.record.get("blocks", []))
        return (
            f"verified: {self.output} is {self.original} with {n} attention block{'s' if n != 1 else ''} re-initialized as recorded "
            f"(mode {self.mode}, targets {','.join(o.get('targets', []))}, seed {o.get('seed')}): {len(self.changed)} changed "
            f"tensor{'s' if len(self.changed) != 1 else ''} {how}, {self.identical} other tensor{'s' if self.identical != 1 else ''} byte-identical"
        )

    def to_dict(self) -> dict:
        return {"ok": True, "original": self.original, "output": self.output, "record": self.record,
                "changed": self.changed, "identical": self.identical, "summary": self.summary()}


def card_record(text: str) -> dict | None:
    found = CARD_RECORD.findall(text)
    return json.loads(found[-1]) if found else None


def card_comment(record: dict) -> str:
    """The record as an HTML comment for the model card (invisible when rendered)."""
    return "<!-- surgeon-record " + json.dumps(record, sort_keys=True, separators=(",", ":")).replace(">", "\\u003e") + " -->"


def _records(source) -> tuple[list[dict], str]:
    """surgeon's records in an opened checkpoint (oldest first), and where they were found."""
    weights = source.primary
    try:
        if weights.format == "safetensors":
            from .formats.safetensors import records

            return records(weights.metadata()), "its safetensors metadata"
        if weights.format == "onnx":
            from .formats.onnx import surgeon_records

            return surgeon_records(weights.model), "its ONNX metadata_props"
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{source.path}: surgeon's record in the file's metadata is not valid JSON ({exc})") from None
    card = source.folder / "README.md"
    if source.kind == "folder" and card.is_file():
        try:
            record = card_record(card.read_text(encoding="utf-8", errors="replace"))
        except ValueError:
            raise CheckpointError(f"{card}: surgeon's record in the model card is not valid JSON") from None
        return ([record] if record else []), f"the model card {card}"
    return [], "its metadata" if weights.format != "torch" else "the file (PyTorch files have no metadata slot)"


def _raw(weights, name: str) -> bytes:
    """A tensor's stored bytes, read by byte range where the format allows (no decoding)."""
    from .formats.safetensors import tensor_bytes

    if weights.format == "safetensors":
        info = weights.tensors[name]
        header = weights.headers[info.file]
        begin, end = header.entries[name]["data_offsets"]
        with open(header.path, "rb") as f:
            f.seek(header.data_start + begin)
            return f.read(end - begin)
    if weights.format == "onnx":
        stored = weights._stored[name]
        if stored.in_place:
            with open(weights.folder / stored.file, "rb") as f:
                f.seek(stored.offset)
                return f.read(stored.length)
    return tensor_bytes(weights.read(name))


def verify(
    original: str | Path,
    output: str | Path,
    *,
    revision: str | None = None,
    config: str | Path | None = None,
    num_heads: HintInput = None,
    num_kv_heads: HintInput = None,
    head_dim: HintInput = None,
    force_hints: bool = False,
    device: str | torch.device = "cpu",
) -> Verification:
    """Check that ``output`` is exactly what surgeon's record in it says was made from ``original``.

    Returns a :class:`Verification` (``.summary()`` is a one-line verdict); raises
    :class:`VerificationError` at the first mismatch, and a :class:`SurgeonError` when there is no record.
    """
    from . import api
    from .apply import Engine, resolve_device
    from .detect import detect_source
    from .detect.config import Hints
    from .plan import make_plan
    from .source import open_source

    dev = resolve_device(device)
    src = api.load(original, config=config, revision=revision)
    out_path = Path(output)
    if not out_path.exists():
        raise CheckpointError(f"no such file or folder {output}: give the output of surgeon reinit as OUTPUT")
    out = open_source(out_path, config=config)
    if out.format != src.format:
        raise VerificationError(f"{output} is {out.format} and {original} is {src.format}: surgeon writes the input's format")
    history, where = _records(out)
    if not history:
        hint = " (a folder output carries it in its README.md; a single .bin/.pt file has none)" * (out.format == "torch")
        raise CheckpointError(f"{output} holds no surgeon record in {where}{hint}: there is nothing to verify it against")
    before, _ = _records(src) if src.format != "torch" else ([], "")
    record = history[-1]
    if not isinstance(record, dict) or not isinstance(record.get("options"), dict):
        raise CheckpointError(f"{output}: the last surgeon record in {where} has no options: it was not written by this surgeon")
    options = _recorded_options(record, output)
    detection = detect_source(src, Hints(num_heads, num_kv_heads, head_dim, force_hints))
    plan = make_plan(detection.blocks, options, detection.depths)
    from .baselines import attach_out_projections

    attach_out_projections(plan, {n: t.shape for n, t in src.primary.tensors.items()}, fmt=src.format)
    if plan.record()["blocks"] != record.get("blocks"):
        raise VerificationError(
            f"{output}: its record lists re-initialized blocks that the recorded options do not select in {original}; "
            "is ORIGINAL the model it was made from?"
        )
    if src.format != "torch" and before != history[:-1]:
        raise VerificationError(f"{output}: its earlier surgeon records differ from {original}'s; is ORIGINAL the model it was made from?")
    a, b = src.primary, out.primary
    copies: dict[str, str] = record["copies"] if out.format == "onnx" and isinstance(record.get("copies"), dict) else {}
    if list(a.tensors) + [copies[n] for n in a.tensors if n in copies] != list(b.tensors):
        missing = [n for n in a.tensors if n not in b.tensors] + [n for n in b.tensors if n not in a.tensors]
        raise VerificationError(f"{output} and {original} do not hold the same tensors (first difference: {missing[0] if missing else 'their order'})")
    engine = Engine(plan, dev)
    changed = set(engine.tensor_names)
    identical = _check_untouched(a, b, changed - set(copies), output, original)
    _check_changed(a, b, engine, options, output, copies)
    return Verification(str(original), str(output), record, sorted(changed), identical, options.mode)


def _recorded_options(record: dict, output: str | Path) -> ReinitOptions:
    opts = dict(record["options"])
    known = set(ReinitOptions.__dataclass_fields__)
    try:
        return ReinitOptions(**{k: v for k, v in opts.items() if k in known}).validated()
    except (TypeError, SurgeonError) as exc:
        raise CheckpointError(f"{output}: the surgeon record's options cannot be read ({exc})") from None


def _check_untouched(a, b, changed: set[str], output: str | Path, original: str | Path) -> int:
    """Every tensor outside the recorded selection is byte-identical; returns how many there are."""
    identical = 0
    for name, info in a.tensors.items():
        theirs = b.tensors[name]
        if (info.shape, info.dtype) != (theirs.shape, theirs.dtype):
            raise VerificationError(f"{output}: tensor {name!r} is {theirs.dtype} {list(theirs.shape)}, the original {info.dtype} {list(info.shape)}")
        if name in changed:
            continue
        if _raw(a, name) != _raw(b, name):
            raise VerificationError(f"{output}: tensor {name!r} is not in the recorded selection, but its bytes differ from {original}'s")
        identical += 1
    return identical


def _check_changed(a, b, engine, options: ReinitOptions, output: str | Path, copies: dict | None = None) -> None:
    """Every re-initialized tensor is what the recorded recipe gives (byte for byte where it is exact);
    for a shared ONNX initializer the chosen projections got a copy of (``copies``), the copy is."""
    for name in engine.tensor_names:
        expected = engine.update(name, a.read(name), record=False)
        new_name = (copies or {}).get(name, name)
        found = b.read(new_name)
        if options.mode in ("conditioned", "redraw", "mimetic") or not any(what == "weight" for _, what in engine.edits[name]):
            if _raw(b, new_name) != _tensor_bytes(expected):
                raise VerificationError(f"{output}: tensor {name!r}: {_first_difference(expected, found)}; the recipe re-derived from the record's seed gives other values")
        else:
            _check_polar(name, engine, a.read(name), expected, found, options, output)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    from .formats.safetensors import tensor_bytes

    return tensor_bytes(t)


def _first_difference(expected: torch.Tensor, found: torch.Tensor) -> str:
    diff = (expected.double() != found.double()) if expected.dtype.is_floating_point else (expected != found)
    idx = diff.nonzero()
    if not len(idx):
        return "the bytes differ"
    where = tuple(int(i) for i in idx[0])
    return f"element {list(where)} is {found[where].item():.9g}, the recipe gives {expected[where].item():.9g}"


def _selected(name: str, engine, shape) -> torch.Tensor:
    """Where the plan changes tensor ``name``: a boolean mask of its shape."""
    mask = torch.zeros(shape, dtype=torch.bool)
    for change, what in engine.edits[name]:
        rows = change.projection.weight if what == "weight" else change.projection.bias
        view = mask if rows.axis == 0 or what == "bias" else mask.transpose(0, 1)
        for h in change.heads:
            view[rows.head_slice(h)] = True
    return mask


def _check_polar(name, engine, original, expected, found, options, output) -> None:
    from .apply import head_matrices

    mask = _selected(name, engine, tuple(found.shape))
    if not torch.equal(found[~mask], original[~mask]):
        raise VerificationError(f"{output}: tensor {name!r} changed outside the recorded heads")
    eps = torch.finfo(found.dtype).eps
    exp64, got64 = expected.double(), found.double()
    scale = exp64.abs().max().item() or 1.0
    bad = ((exp64 - got64).abs() > 4 * eps * scale) & mask
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise VerificationError(
            f"{output}: tensor {name!r}: element {list(where)} is {got64[where].item():.9g}, polar conditioning of the original gives "
            f"{exp64[where].item():.9g} (beyond {found.dtype} rounding)"
        )
    if options.effective_strength == 1.0 and not options.keep_scale:
        for change, what in engine.edits[name]:
            if what != "weight":
                continue
            heads = head_matrices(got64, change.projection.weight, change.heads)
            d, n = heads.shape[1], heads.shape[2]
            gram = heads @ heads.transpose(1, 2) if d <= n else heads.transpose(1, 2) @ heads
            err = (gram - torch.eye(min(d, n), dtype=torch.float64)).abs().amax().item()
            if err > 16 * eps * max(d, n) ** 0.5:
                raise VerificationError(
                    f"{output}: tensor {name!r}: the {change.role} heads of {change.block.module} are not semi-orthogonal "
                    f"(|W Wᵀ - I| up to {err:.3g}, {found.dtype} rounding allows {16 * eps * max(d, n) ** 0.5:.3g})"
                )
