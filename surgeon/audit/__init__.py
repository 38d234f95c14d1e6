"""``surgeon verify ORIGINAL OUTPUT``: check an output against the record surgeon wrote into it.

The record (``__metadata__["surgeon"]`` in safetensors, ``metadata_props["surgeon"]`` in ONNX, a comment
in the model card README.md of a folder output for PyTorch files) holds the options of the run: read from the
weights where their format has a slot for it, the card's one record must equal it (``files.check_card``); it is
read as hostile input and type-checked field by field (surgeon.report.record). From it and the ORIGINAL, the
plan is made again, exactly as ``surgeon reinit`` made it, and everything in OUTPUT is checked:

- a folder output holds exactly the files surgeon writes: the carried-over ones (config.json, code,
  tokenizer, ...) byte for byte, the model card with this record, nothing added (``files.py``);
- an ONNX output's model and graph are the original's node for node, but for the recorded copies of
  shared initializers (``graph.py``);
- every tensor the plan does not touch is byte-identical (raw bytes through the format readers);
- every touched tensor is what the recipe gives: in the fresh modes the same bytes (the draws depend only
  on seed, tensor, role and head); in polar mode within one ulp of the dtype per element and, with
  strength 1, semi-orthogonal (the bound is derived in ``values.py``).

An output made by another surgeon version whose re-derived values differ is "cannot verify" (exit 1,
saying which version to use), not a mismatch: draws may change between versions.

(``surgeon inspect --verify-layout``, in ``surgeon/audit/layout.py``, is a different check: name-based
detection against the real forward of the architecture.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from .._version import __version__
from ..detect.hints import HintInput, Hints
from ..errors import CheckpointError, DerivedMismatch, OptionError, SurgeonError, VerificationError, opt
from ..formats.write_plan import WritePlan
from ..modes import get_mode
from ..report.card import card_comment
from ..report.record import Record, card_records, only_record, other_version_note, parse_record, stored_history
from ..text.shown import shown
from ..vocab.blocks import split_module
from ..write.journal import hold
from .values import check_changed, check_untouched

if TYPE_CHECKING:
    from ..compute.engine import Engine
    from ..formats.base import WeightSet
    from ..formats.onnx import OnnxWeights
    from ..open.source import Source
    from ..options import ReinitOptions
    from ..plan.planner import Plan
    from ..vocab.detection import Detection

__all__ = ["Verification", "verify", "card_record", "card_comment", "CheckpointError", "VerificationError"]


@dataclass
class Verification:
    """What :func:`verify` checked: the record, the tensors re-derived and those found byte-identical."""

    original: str
    output: str
    record: dict
    changed: list[str]  # tensors re-derived from the record
    identical: int  # tensors checked byte-identical
    mode: str
    files: int = 0  # other files of a folder output checked byte-identical

    def __str__(self) -> str:  # print(surgeon.verify(...)) prints the verdict, not the fields
        return self.summary()

    def summary(self) -> str:
        """The one-line verdict (names shown escaped: a path with a newline in it stays on the line)."""
        runs = self.record.get("steps") or [self.record]  # a recipe: each step
        o = runs[0].get("options", {})
        how = get_mode(self.mode).verify_bound if "steps" not in self.record else "re-derived byte for byte"
        # a joint block's context stream ("<module>:context") is recorded beside its block: one attention block
        n = len({split_module(str(b.get("module", "")))[0] for run in runs for b in run.get("blocks", [])})
        files = f", {self.files} other file{'s' if self.files != 1 else ''} byte-identical" if self.files else ""
        made = f" (made by surgeon {self.record.get('version')})" if self.record.get("version") != __version__ else ""
        what = (
            f"a recipe of {len(runs)} steps: modes {', '.join(str(r.get('options', {}).get('mode')) for r in runs)}"
            if len(runs) > 1
            else f"mode {self.mode}, targets {','.join(o.get('targets', []))}, seed {o.get('seed')}"
        )
        return shown(
            f"verified: {self.output} is {self.original} with {n} attention block{'s' if n != 1 else ''} re-initialized as recorded "
            f"({what}): {len(self.changed)} changed "
            f"tensor{'s' if len(self.changed) != 1 else ''} {how}, {self.identical} other tensor{'s' if self.identical != 1 else ''} "
            f"byte-identical{files}{made}"
        )

    def to_dict(self) -> dict:
        return {
            "ok": True,
            "original": self.original,
            "output": self.output,
            "record": self.record,
            "changed": self.changed,
            "identical": self.identical,
            "files": self.files,
            "summary": self.summary(),
        }


def card_record(text: str) -> dict | None:
    """The model card's record: surgeon writes one, the output's own (a source card's records are escaped in it);
    several are a VerificationError."""
    return only_record(card_records(text), "the model card")


def verify(
    original: str | Path,
    output: str | Path,
    *,
    revision: str | None = None,
    config: str | Path | None = None,
    hints: Hints | None = None,
    device: str | torch.device = "cpu",
    from_: str | Path | None = None,
    **hint_keywords: HintInput | bool,
) -> Verification:
    """Check that ``output`` is exactly what surgeon's record in it says was made from ``original``.

    Args:
        original: The checkpoint the run read: a path or a Hub id.
        output: What the run wrote (a file or folder).
        revision: The Hub model's branch, tag or commit (default: main).
        config: A config.json to read heads from (default: the one beside the weights).
        hints: What the run needed to be told about heads (a :class:`~surgeon.detect.hints.Hints`).
        device: Where the values are re-derived.
        from_: A restore's SOURCE on disk (its files must have the sha256 the record names); a SOURCE on the Hub
            is read from the Hub at the recorded commit.
        **hint_keywords: Fields of Hints (``num_heads=8``, ...), replacing those of ``hints``.

    Returns:
        The verification; ``.summary()`` is a one-line verdict.

    Raises:
        VerificationError: At the first mismatch.
        CheckpointError: It cannot verify: no record, a malformed one, or one of another surgeon version
            whose values differ.
    """
    from ..files.bounded import refuse_special
    from ..hub.read import open_model
    from ..open.source import open_source

    src = open_model(original, config=config, revision=revision, whole=True)
    out_path = Path(output)
    if not out_path.exists():
        raise CheckpointError(f"no such file or folder {output}: give the output of surgeon reinit as OUTPUT")
    refuse_special(out_path, what="OUTPUT")  # a FIFO or a device would hang the readers
    out = open_source(out_path, config=config)
    with hold(src, exclusive=False), hold(out, exclusive=False):  # never while an in-place run patches either
        return _verify_opened(src, out, Hints.build(hints, **hint_keywords), device, original, output, from_)


def _verify_opened(
    src: Source,
    out: Source,
    hints: Hints,
    device: str | torch.device,
    original: str | Path,
    output: str | Path,
    from_: str | Path | None = None,
) -> Verification:
    _check_kind(src, out, original, output)
    record, earlier, where = _read_record(out, output)
    files = 0
    if out.kind == "folder":
        from .files import check_folder

        files = check_folder(src, out, output)
    if [w.format for w in src.weights] != [w.format for w in out.weights]:
        raise VerificationError(
            f"{output} holds the weights in {', '.join(w.describe() for w in out.weights)}, {original} in "
            f"{', '.join(w.describe() for w in src.weights)}: surgeon rewrites each set its original has, and adds none"
        )
    try:
        references = [_reference(step.source, step.options, from_, output) for step in record.runs]
        if from_ is not None and all(r is None for r in references):
            raise OptionError(f"{output} was not restored from a checkpoint on disk: leave {opt('from_')} out")
        changed, identical = _check_weights(src, out, record, earlier, hints, device, output, original, references)
    except DerivedMismatch as exc:
        if not record.other_version:
            raise
        raise CheckpointError(
            f"{output}: {other_version_note(record.version)} (with this version: {str(exc).split(': ', 1)[-1]})"
        ) from None
    if out.kind == "folder":
        from .files import check_card

        check_card(src, out, record, output)
    return Verification(str(original), str(output), record.raw, sorted(changed), identical, record.options.mode, files)


def _reference(
    named: dict | None, options: ReinitOptions, given: str | Path | None, output: str | Path
) -> Source | None:
    """A restore's SOURCE (``named``: as its record names it), opened: the Hub model at the recorded commit, or the
    checkpoint on disk given as ``given`` (its digests are compared once it is planned); None for the other modes."""
    from ..hub.read import open_model

    if named is None:
        return None
    if "repo" in named:
        return open_model(f"hf://{named['repo']}", revision=named["commit"])
    if given is None:
        files = ", ".join(f"{name} (sha256 {digest[:16]}...)" for name, digest in sorted(named["sha256"].items()))
        raise CheckpointError(
            f"{output} was restored from {options.from_}, a checkpoint on disk ({files}): give it with "
            f"{opt('from_', 'PATH')}"
        )
    return open_model(given)


def _check_kind(src: Source, out: Source, original: str | Path, output: str | Path) -> None:
    if out.format != src.format:
        raise VerificationError(
            f"{output} is {out.format} and {original} is {src.format}: surgeon writes the input's format"
        )
    if (src.kind == "file") != (out.kind == "file") or (src.kind == "folder" and out.kind != "folder"):
        raise VerificationError(
            f"{output} is a {out.kind} and {original} a {src.kind}: surgeon writes a {'file' if src.kind == 'file' else 'folder'} for it"
        )


def _read_record(out: Source, output: str | Path) -> tuple[Record, list | None, str]:
    """The last record (type-checked), the ones before it (None where the format keeps no history), where they are."""
    found, where = stored_history(out)
    reset_in_memory = (out.config or {}).get("surgeon") if isinstance(out.config, dict) else None
    if not found and isinstance(reset_in_memory, list) and reset_in_memory and isinstance(reset_in_memory[-1], dict):
        raise CheckpointError(  # a model reset in memory and trained since: its config says how to diff it
            f"{output} was reset in memory and trained since (its config.json's surgeon entry), so its weights are not "
            f"a reset to verify: make the reset point with `{reset_in_memory[-1].get('reproduce')}` and run "
            f"`surgeon diff RESET {output}` to see what training changed"
        )
    if not found:
        hint = " (a folder output carries it in its README.md; a single .bin/.pt file has none)" * (
            not out.primary.record_slot
        )
        raise CheckpointError(
            f"{output} holds no surgeon record in {where}{hint}: there is nothing to verify it against"
        )
    return parse_record(found[-1], f"{output} ({where})"), (found[:-1] if out.primary.record_slot else None), where


def _same_layout(given: dict | None, used: dict | None, output: str | Path) -> None:
    """The blocks are read with the layout file the run used (the record keeps its name and digest), or not at all:
    another layout could name other tensors for the same roles, and re-derive them the same wrong way."""
    if (given or {}).get("sha256") == (used or {}).get("sha256"):  # the same bytes, under any name
        return
    if used is None:
        raise DerivedMismatch(f"{output} was made without a layout file: leave {opt('layout')} out")
    said = f"layout file {used['file']} (sha256 {used['sha256'][:16]}...)"
    if given is None:
        raise DerivedMismatch(f"{output} was made with {said}: give that file with {opt('layout', used['file'])}")
    raise DerivedMismatch(
        f"{output} was made with {said}, and {opt('layout', given['file'])} is another layout "
        f"(sha256 {given['sha256'][:16]}...): give the layout file the run used"
    )


def _check_weights(
    src: Source,
    out: Source,
    record: Record,
    earlier: list | None,
    hints: Hints,
    device: str | torch.device,
    output: str | Path,
    original: str | Path,
    references: list[Source | None],
) -> tuple[set[str], int]:
    """The plan made again from the record (a recipe's: every step, in order); every weight set's tensors checked.
    Returns (changed, identical)."""
    from ..compute.devices import resolve_device
    from ..compute.engine import Engine
    from ..detect import detect_source
    from ..plan.planner import prepare_checkpoint, prepare_recipe

    detection = detect_source(src, hints)
    try:
        if record.recipe is not None:
            plan = prepare_recipe(src, detection, record.recipe, references)
        else:
            plan = prepare_checkpoint(src, detection, record.options, reference=references[0])
    except SurgeonError as exc:
        raise DerivedMismatch(
            f"{output}: its recorded options do not fit {original} ({exc}); is ORIGINAL the model it was made from?"
        ) from None
    made = plan.record()
    for step, again in zip(record.runs, made.get("steps") or [made], strict=True):
        if again.get("from") != step.source:  # the SOURCE given is the one the record names, file for file
            raise CheckpointError(
                f"{output} was restored from a SOURCE whose files have other sha256 digests than the one given "
                f"({opt('from_')}): give the checkpoint it was restored from"
            )
    _same_layout(made.get("layout"), record.raw.get("layout"), output)
    if [again["blocks"] for again in made.get("steps") or [made]] != [step.blocks for step in record.runs]:
        raise DerivedMismatch(
            f"{output}: its record lists re-initialized blocks that the recorded options do not select in {original}; "
            "is ORIGINAL the model it was made from?"
        )
    if earlier is not None:
        before, _ = stored_history(src)
        if (before or []) != earlier:
            raise VerificationError(
                f"{output}: its earlier surgeon records differ from {original}'s; is ORIGINAL the model it was made from?"
            )
    write_plan = _write_plan(src, out, plan, detection, record, output)
    engine = Engine(plan, resolve_device(device))
    changed, identical = set(engine.tensor_names), 0
    for i, (a, b) in enumerate(zip(src.weights, out.weights)):
        try:
            identical += _check_set(a, b, engine, record, earlier, write_plan, output, original)
        except VerificationError as exc:
            if i:  # the same weights in a second format (a .bin beside the .safetensors): say which
                exc.context = f"in its {b.describe()}: "
            raise
    return changed, identical


def _write_plan(
    src: Source, out: Source, plan: Plan, detection: Detection, record: Record, output: str | Path
) -> WritePlan:
    """What the original's format decided for the recorded plan, made again: an ONNX output's record must
    list exactly its copies of shared initializers, and its graph must be the original's with only them
    added (``graph.check_graph``)."""
    if not src.primary.graph:  # only graphs share initializers
        return WritePlan()
    a, b = cast("OnnxWeights", src.primary), cast("OnnxWeights", out.primary)  # the one format with a graph
    from ..formats.onnx_wire import renamed_data_files
    from .graph import check_graph

    try:
        write_plan = a.write_plan(plan, detection)
    except SurgeonError as exc:
        raise DerivedMismatch(
            f"{output}: surgeon could not have carried out the recorded plan on the original ({exc})"
        ) from None
    expected = write_plan.copy_names
    if record.copies != expected:
        raise DerivedMismatch(
            f"{output}: its record lists the copies {record.copies or 'none'}, and the recorded plan needs {expected or 'none'}"
        )
    same = out.kind == "folder"
    renamed = {f: f for f in a.files[1:]} if same else renamed_data_files(a.files[1:], a.path.name, b.path.name)
    check_graph(a, b, write_plan, renamed, output)
    return write_plan


def _check_set(
    a: WeightSet,
    b: WeightSet,
    engine: Engine,
    record: Record,
    earlier: list | None,
    write_plan: WritePlan,
    output: str | Path,
    original: str | Path,
) -> int:
    """One weight set: the same tensors, in order (an ONNX output adds the copies after the initializers),
    the untouched ones byte-identical, the changed ones re-derived. Returns how many were byte-identical."""
    copies = write_plan.copy_names
    expected = a.output_names(write_plan)
    if expected != list(b.tensors):
        missing = [n for n in expected if n not in b.tensors] + [n for n in b.tensors if n not in expected]
        raise VerificationError(
            f"{output} and {original} do not hold the same tensors (first difference: {missing[0] if missing else 'their order'})"
        )
    changed = set(engine.tensor_names) & set(a.tensors)
    a.check_non_tensor(b, changed, (earlier or []) + [record.raw], output)  # metadata, files copied as they are
    untouched = [
        n for n in a.tensors if n not in changed or n in copies
    ]  # a shared initializer keeps its bytes; its copy changes
    identical = check_untouched(a, b, untouched, output, original)
    check_changed(a, b, engine, [n for n in engine.tensor_names if n in changed], record.options, output, copies)
    return identical
