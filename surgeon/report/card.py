"""The model card (README.md) of a re-initialized model folder.

Front matter the Hub understands (base model, tags, library, license), then what was done, the
condition numbers this run measured, the command that reproduces it (with surgeon's record of the run) and the
paper to cite. The source model's own card follows in a section of its own, its front matter as a code block and
its text as it came, so nothing it said is lost. Never holds a token, a time or an absolute path: the same run
gives the same card.

The card holds one surgeon record, the output's own: any other text that would read as one (in the source's
card, its tags, a tensor or folder name) is escaped (``<`` as ``&lt;``), so that no source can speak for the
output to `surgeon verify` or `surgeon push`.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..detect.hints import Hints
from ..files.bounded import CARD_LIMIT, read_text
from ..files.folder import file_in
from ..modes import get_mode
from ..open.source import Source
from ..plan.planner import Plan
from ..text.shown import shown
from ..vocab.blocks import AttentionBlock, split_module
from ..vocab.selection import format_indices
from ..vocab.spectrum import ProjectionRow
from .report import fmt_kappa, with_streams

if TYPE_CHECKING:
    from huggingface_hub import ModelCardData

    from ..options import Recipe

RECIPE_FILE = "recipe.toml"  # how a recipe's reproduce command names the recipe its card shows
TAG = "surgeon"  # every card; the mode adds its own (conditioned-initialization, default-init-redraw, ...)
# Source metadata that still describes the re-initialized model. Evaluation results (model-index),
# datasets, metrics and the source's own base_model describe the source only, so they are dropped.
KEPT_METADATA = ("license", "license_name", "license_link", "language", "pipeline_tag", "library_name")
_YAML_BLOCK = re.compile(r"^(\s*---[\r\n]+)([\S\s]*?)([\r\n]+---(\r\n|\n|$))")


@dataclass(frozen=True)
class SourceCard:
    """The source model's card: its metadata (as a dict), its front matter as written and its Markdown body."""

    metadata: dict
    body: str
    matter: str = ""

    @classmethod
    def read(cls, path: Path) -> SourceCard | None:
        if not path.is_file():
            return None
        import yaml  # PyYAML: huggingface-hub's own dependency
        from huggingface_hub import ModelCardData

        text = read_text(path, what="model card", limit=CARD_LIMIT)
        # as huggingface_hub.ModelCard parses a card, without the import of the Hub client that comes with it
        # (about 0.1 s of every run that writes a card)
        match = _YAML_BLOCK.search(text)
        matter, body = (match.group(2), text[match.end() :]) if match else ("", text)
        try:
            metadata = yaml.safe_load(matter) or {}
            if not isinstance(metadata, dict):
                raise ValueError("the front matter is not a mapping")
            return cls(ModelCardData(**metadata, ignore_metadata_errors=True).to_dict(), body, matter)
        except Exception:  # front matter that is not a YAML mapping: keep the text, drop the metadata
            return cls({}, body, matter)


def reproduce_command(model: str, *, revision: str | None, options: dict, hints: Hints, output: str) -> str:
    """The ``surgeon reinit`` command line that makes the same weights again (every option spelled out).

    Made from the fields of ReinitOptions (``options``: as recorded by ``ReinitOptions.to_dict``),
    spelt as the CLI spells them; a recipe's (``{"steps": [...]}``) names its file, ``recipe.toml``.
    """
    from ..errors import shell_spelling as flag
    from ..options import option_infos

    q = _quoted

    def spec(value: str | int | list[int]) -> str:
        return (
            value if isinstance(value, str) else str(value) if isinstance(value, int) else format_indices(sorted(value))
        )

    args = ["surgeon", "reinit", q(model)]
    if revision:
        args.append(flag("revision", q(revision)))
    recipe = "steps" in options  # its steps in the recipe file the card shows beside the command
    if recipe:
        args.append(flag("recipe", RECIPE_FILE))
    for name, info in [] if recipe else option_infos():
        value = options.get(name)
        if (info.recorded is not None and not info.recorded(options)) or value is None or value == []:
            continue
        if info.switch:
            args += [flag(name, None)] if value else []
        elif info.spec:  # `--layers=-2-`: with "=", a spec that starts with "-" cannot be read as an option
            args.append(f"{flag(name, None)}={q(spec(value))}")
        else:
            args.append(flag(name, q(",".join(value) if isinstance(value, list) else str(value))))
    for name in ("num_heads", "num_kv_heads", "head_dim"):
        value = hints.spelled(name)
        if value is not None:
            args.append(flag(name, q(value)))
    if hints.force:
        args.append(flag("force_hints", None))
    if hints.layout is not None:  # the file's name only: a local path is not published
        args.append(flag("layout", q(Path(str(getattr(hints.layout, "path", hints.layout))).name)))
    return " ".join(args + [flag("output", q(output))])


def source_card(source: Source) -> SourceCard | None:
    """The input folder's own model card, read (and capped) before anything is written: only a README.md
    the folder's walk took as its own (folder_files), checked again as it is read."""
    own = source.kind == "folder" and "README.md" in source.extra_files
    readme = file_in(source.folder, "README.md") if own else None
    return SourceCard.read(readme) if readme is not None else None


def build_card(
    *,
    source: Source,
    original: SourceCard | None,
    plan: Plan,
    results: list[ProjectionRow],
    command: str,
    title: str,
    base_model: str | None = None,
) -> str:
    """The card's text, its front matter rendered by ``huggingface_hub.ModelCardData``; ``original``:
    the input's card (:func:`source_card`), whose metadata and text it keeps; ``base_model``: the Hub model a
    local source comes from (default: the source's Hub id, else the ``base_model`` its own card names)."""
    modes = list(dict.fromkeys(get_mode(step.options.mode) for step in (plan.steps or (plan,))))  # a recipe: each
    lineage = source.hub_id or base_model or _named_base(original.metadata if original else {})
    data = _card_data(source, original.metadata if original else {}, [m.tag for m in modes], lineage)
    recipe = (
        [
            "The steps, in the order they were applied (`recipe.toml`):",
            _fenced(_recipe(plan).to_toml().rstrip(), "toml"),
        ]
        if plan.steps
        else []
    )
    ours = [
        f"# {shown(title)}",
        _intro(source, plan, lineage),
        *dict.fromkeys(m.card_caveat() for m in modes),
        "## What was done",
        _steps_table(plan) if plan.steps else _options_table(plan),
        _blocks_table(plan),
        *_plan_notes(plan),
        "## Condition numbers",
        "Measured by this run on the weights as written: kappa = sigma_max / sigma_min of each head's matrix, "
        "min / median / max over the heads of each projection (and of the whole projection, when measured with --full).",
        _kappa_table(results),
        "## Reproduce",
        f"With surgeon {__version__}:",
        f"```bash\n{command}\n```",
        *recipe,
    ]
    after: list[str] = []
    if any(m.fresh for m in modes):
        after.append(
            "Each head's random draw depends only on (seed, tensor name, role, head), the name as in the base model "
            "(without a task class's prefix such as `bert.` or `model.`), not on the order of processing, "
            "the sharding or the other heads selected."
        )
    citations = list(dict.fromkeys(m.citation for m in modes if m.citation))
    if citations:
        after += ["## Citation", *(f"```bibtex\n{c}\n```" for c in citations)]
    if original and (original.body.strip() or original.matter.strip()):
        after += _source_section(source, original)
    # the record goes in as written; every other part is escaped, so that the record is the card's only one
    parts = [*map(inert, ours), _record_comment(plan), *map(inert, after)]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(parts) + "\n"


def _source_section(source: Source, original: SourceCard) -> list[str]:
    """The source's card in a section of its own: its front matter as a code block (metadata of the source, never
    of this model), then its text as it came."""
    name = f"`{source.hub_id}`" if source.hub_id else "the source model"
    section = [
        "## Source model card",
        f"The card of {name}, as it came with the source: it describes the source, not this model "
        "(a surgeon record in it is escaped, `<` as `&lt;`: it is the source's, never this model's).",
    ]
    if original.matter.strip():
        section += ["Its front matter:", _fenced(original.matter.strip("\r\n"), "yaml")]
    if original.body.strip():
        section.append(original.body.strip())
    return section


def _named_base(meta: dict) -> str | None:
    """The one Hub id a card's ``base_model`` names (a string, or a list of one), if it is a well-formed one."""
    from ..open.hub_ids import parse_repo_id

    named = meta.get("base_model")
    named = named[0] if isinstance(named, list) and len(named) == 1 else named
    return parse_repo_id(f"hf://{named}") if isinstance(named, str) else None


def _card_data(source: Source, meta: dict, mode_tags: list[str], lineage: str | None) -> ModelCardData:
    """The front matter: the source's metadata that still holds (KEPT_METADATA), its tags and surgeon's."""
    from huggingface_hub import ModelCardData

    kept = {k: inert_value(meta[k]) for k in KEPT_METADATA if meta.get(k) is not None}
    if "library_name" not in kept and isinstance(source.config, dict) and source.config.get("model_type"):
        kept["library_name"] = "transformers"  # a config.json with a model_type is a transformers model
    source_tags = meta.get("tags") or []
    carried = [str(t) for t in (source_tags if isinstance(source_tags, list) else [source_tags])]
    # a tag is a word on one line: markup (a comment, a record) is no tag, and stays in the source's section
    tags = list(dict.fromkeys([TAG, *mode_tags] + [t for t in carried if shown(t) == t and not set(t) & set("<>")]))
    return ModelCardData(base_model=lineage, tags=tags, **kept)


def _intro(source: Source, plan: Plan, lineage: str | None) -> str:
    """The card's first paragraph: which model, how many blocks changed, by which mode."""
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT.rstrip("/")
    if source.hub_id:
        commit = f" (commit `{source.hub_commit[:12]}`)" if source.hub_commit else ""
        origin = f"[`{source.hub_id}`]({endpoint}/{source.hub_id}){commit}"
    elif lineage:
        origin = f"{_code(source.path.name)} (base model [`{lineage}`]({endpoint}/{lineage}))"
    else:
        origin = _code(source.path.name)
    touched, blocks = len(with_streams(plan.touched_blocks)[0]), len(with_streams(plan.blocks)[0])
    steps = plan.steps or (plan,)
    hows = [get_mode(s.options.mode).card_intro(s.options.to_dict(), s.touched_blocks) for s in steps]
    how = (
        hows[0]
        if not plan.steps
        else f"by a recipe of {len(steps)} steps in one pass, in this order: "
        + "; ".join(f"step {i}, {h}" for i, h in enumerate(hows))
    )
    outputs = any(get_mode(s.options.mode).writes_outputs for s in steps)
    return (
        f"This is {origin} with the attention query/key/value projections of {touched} of its "
        f"{blocks} attention block{'s' if blocks != 1 else ''} re-initialized by surgeon {__version__} "
        f"{how}. Every other tensor"
        + (" (except the output projections W_O of those blocks, rewritten by this mode)" if outputs else "")
        + " is byte for byte the source's."
    )


def _recipe(plan: Plan) -> Recipe:
    from ..options import Recipe

    return Recipe(tuple(step.options for step in plan.steps))


def _steps_table(plan: Plan) -> str:
    """A recipe's steps, one row each, in the order they were applied."""
    lines = ["| step | mode | projections | layers | heads | biases | keep scale | strength | seed |"]
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, step in enumerate(plan.steps):
        o = step.options.to_dict()
        cells = [
            str(i),
            get_mode(o["mode"]).card_row(o, step.touched_blocks),
            ", ".join(o["targets"]),
            _spec_cell(o["layers"]),
            _spec_cell(o["heads"]),
            _BIASES[o["bias"]],
            "yes" if o["keep_scale"] else "no",
            "-" if o["strength"] is None else str(o["strength"]),
            str(o["seed"]),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


_BIASES = {"zero": "zeroed", "keep": "kept", "source": "SOURCE's"}


def _spec_cell(value: Any) -> str:
    return str(value) if not isinstance(value, list) else format_indices(value)


def _record_comment(plan: Plan) -> str:
    """surgeon's record, for `surgeon verify` (PyTorch files have no metadata slot for it), and the Hub model
    and commit it was made from (``origin``), for `surgeon push`."""
    record = plan.record()
    if plan.origin is not None:
        record["origin"] = dict(plan.origin)
    return card_comment(record)


# surgeon's record in a card: an HTML comment (invisible when rendered) that `surgeon verify` reads back
CARD_OPEN, CARD_CLOSE = "<!-- surgeon-record ", " -->"


def card_comment(record: dict) -> str:
    """The record as an HTML comment for the model card (``>`` escaped, so the comment cannot end early)."""
    return CARD_OPEN + json.dumps(record, sort_keys=True, separators=(",", ":")).replace(">", "\\u003e") + CARD_CLOSE


_MARK = CARD_OPEN.rstrip()


def inert(text: str) -> str:
    """``text`` with nothing in it that reads as a surgeon record: the comment's ``<`` as ``&lt;`` (Markdown shows
    the same text; in a code block, the escape itself)."""
    return text.replace(_MARK, "&lt;" + _MARK[1:])


def inert_value(value: Any) -> Any:
    """:func:`inert` on every string of a metadata value (lists and mappings too, keys included)."""
    if isinstance(value, str):
        return inert(value)
    if isinstance(value, list):
        return [inert_value(v) for v in value]
    if isinstance(value, dict):
        return {inert_value(k): inert_value(v) for k, v in value.items()}
    return value


def write_card(folder: Path, **kwargs: Any) -> Path:
    from ..text.redact import redact

    path = Path(folder) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(
        path, mode="w", newline="", encoding="utf-8"
    ) as f:  # as ModelCard.save, with no token, even one in the source's card
        f.write(redact(build_card(**kwargs)))
    return path


def _options_table(plan: Plan) -> str:
    o = plan.options.to_dict()
    mode = get_mode(o["mode"])
    rows = [
        ("mode", mode.card_row(o, plan.touched_blocks)),
        *((p.label, str(o[p.name])) for p in mode.parameters if o.get(p.name) is not None),  # as declared
        *(
            [("strength", _strength_cell(o["strength"], mode.strength_help))]
            if o["strength"] is not None and mode.mixes
            else []
        ),
        ("projections", ", ".join(o["targets"])),
        ("layers", _spec_cell(o["layers"])),
        ("heads", _spec_cell(o["heads"])),
        ("attention", o["attention"] + (f", stacks {', '.join(o['stack'])}" if o.get("stack") else "")),
        ("biases of re-initialized heads", _BIASES[o["bias"]]),
        ("keep scale", "yes (each head rescaled to its old Frobenius norm)" if o["keep_scale"] else "no"),
        ("seed", str(o["seed"])),
        ("surgeon", __version__),
    ]
    return "| | |\n| --- | --- |\n" + "\n".join(f"| {k} | {_cell(v)} |" for k, v in rows)


def _strength_cell(strength: float | str, meaning: str) -> str:
    ramp = " (each layer's t in the blocks table)" if isinstance(strength, str) else ""
    return f"t = {strength}{ramp}: {meaning}"


def _blocks_table(plan: Plan) -> str:
    """One row per attention block; a joint block's context stream is in its cells, not a row of its own; with a
    strength ramp, the t of each block's layer. A recipe: one row per step and block, its step first, and the t
    of every row where a step gave one."""
    steps = plan.steps or (plan,)
    targets = [r for r in ("q", "k", "v") if any(r in s.options.targets for s in steps)]
    recipe = bool(plan.steps)
    ramp = any(s.options.strength is not None and (s.options.strength.ramp or recipe) for s in steps)
    lines = [
        ("| step " if recipe else "") + "| block | kind | " + " | ".join(targets) + (" | strength |" if ramp else " |")
    ]
    lines.append(("| --- " if recipe else "") + "| --- | --- |" + " --- |" * (len(targets) + ramp))
    for i, step in enumerate(steps):
        at = {(c.block.stack, c.block.layer): c.strength for c in step.changes}
        attention, streams = with_streams(step.touched_blocks)
        orphans = [s for owner, ss in streams.items() if owner not in {b.module for b in attention} for s in ss]
        for block in attention + orphans:
            cells = []
            for role in targets:
                own = _heads_cell(step, block, role)
                extra = [(split_module(s.module)[1], _heads_cell(step, s, role)) for s in streams.get(block.module, ())]
                extra = [(name, text) for name, text in extra if text != "-"]
                if extra and all(text == own for _, text in extra):
                    own += "".join(f" (and its {name} stream)" for name, _ in extra)
                else:
                    own += "".join(f"; {name} stream: {text}" for name, text in extra)
                cells.append(own)
            if ramp:
                t = at.get((block.stack, block.layer))
                cells.append("-" if t is None else f"{t:.4g}")
            first = f"| {i} " if recipe else ""
            lines.append(f"{first}| {_cell(_code(block.module))} | {block.kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _heads_cell(plan: Plan, block: AttentionBlock, role: str) -> str:
    change = next((c for c in plan.changes if c.block.module == block.module and c.role == role), None)
    if change is None:
        return "-"
    total = change.projection.heads
    return f"all {total} heads" if len(change.heads) == total else f"heads {format_indices(change.heads)} of {total}"


def _plan_notes(plan: Plan) -> list[str]:
    """What the selection skipped, and shared blocks that change several layers (as the report says)."""
    from ..errors import shell_spelling, spell

    return ["\n".join(f"- {shown(spell(n, shell_spelling))}" for n in plan.notes)] if plan.notes else []


def _kappa_table(results: list[ProjectionRow]) -> str:
    measured = [r for r in results if r.before is not None and r.after is not None]
    whole = any(r.before.kappa is not None for r in measured if r.before is not None)
    steps = any(r.step is not None for r in measured)  # a recipe: each step's before is what the last one left
    lines = [
        ("| step " if steps else "")
        + "| block | proj | "
        + ("kappa before | kappa after | " if whole else "")
        + "head kappa before (min/med/max) | head kappa after (min/med/max) |"
    ]
    lines.append(("| --- " if steps else "") + "| --- | --- | " + ("---: | ---: | " if whole else "") + "--- | --- |")
    for r in measured:
        assert r.before is not None and r.after is not None
        heads = lambda s: "/".join(fmt_kappa(x) for x in (s.head_min, s.head_median, s.head_max))  # noqa: E731
        cells = f"{fmt_kappa(r.before.kappa)} | {fmt_kappa(r.after.kappa)} | " if whole else ""
        step = f"| {r.step} " if steps else ""
        lines.append(
            f"{step}| {_cell(_code(r.block.module))} | {r.role} | {cells}{heads(r.before)} | {heads(r.after)} |"
        )
    return "\n".join(lines)


# --- names in the card: a name from a file can hold a newline, "|" or "`" -----------------------------


def _code(name: str) -> str:
    """``name`` as inline code on one line (escaped), fenced by more backticks than it holds in a row."""
    name = shown(name)
    fence = "`" * (max((len(run) for run in re.findall("`+", name)), default=0) + 1)
    pad = " " if name.startswith("`") or name.endswith("`") else ""
    return f"{fence}{pad}{name}{pad}{fence}"


def _fenced(text: str, info: str) -> str:
    """``text`` as a fenced code block, fenced by more backticks than it holds in a row (it cannot end the block)."""
    fence = "`" * max(3, max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    return f"{fence}{info}\n{text}\n{fence}"


def _cell(text: str) -> str:
    """A table cell: one line, and a "|" in it does not end the cell."""
    return shown(text).replace("|", "\\|")


def _quoted(arg: str) -> str:
    """A shell word on one line: shlex's quoting, or bash's $'...' where the word holds a control character
    (the command still gives back the same path; a raw newline could end the card's code block)."""
    if shown(arg) == arg:
        return shlex.quote(arg)

    def char(c: str) -> str:
        if c in "\\'":
            return "\\" + c
        if shown(c) == c:
            return c
        return "".join(f"\\x{byte:02x}" for byte in c.encode())  # its UTF-8 bytes: bash's \u needs a UTF-8 locale

    return "$'" + "".join(map(char, arg)) + "'"
