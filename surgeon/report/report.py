"""What a command found or did: a table for people, a dict/JSON for machines."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import Spelling, opt, python_spelling, spell
from ..modes import NAMES as MODES
from ..modes import get_mode
from ..text.shown import note_lines, shown
from ..text.sizes import fmt_bytes
from ..vocab.blocks import AttentionBlock, split_module
from ..vocab.selection import format_indices
from ..vocab.spectrum import ProjectionRow, Spectrum

if TYPE_CHECKING:
    from ..formats.fileio import IOFigures


def fmt_kappa(x: float | None) -> str:
    if x is None:
        return "-"  # not computed (the whole-projection kappa of a wide matrix, without --full)
    if math.isnan(x):
        return "nan"
    if not math.isfinite(x):
        return "inf"
    if x >= 1e5:
        return f"{x:.2e}"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def _spec_cells(s: Spectrum | None) -> list[str]:
    if s is None:
        return ["-", "-", "-"]
    norm = "-" if s.norm is None else f"{s.norm:.3g}"
    return [fmt_kappa(s.kappa), "/".join(fmt_kappa(x) for x in (s.head_min, s.head_median, s.head_max)), norm]


def table(headers: list[str], rows: list[list[str]], right: frozenset[int] | set[int] = frozenset()) -> str:
    """Aligned columns, one line per row: every cell is shown escaped (a name may hold a newline)."""
    headers, rows = [shown(h) for h in headers], [[shown(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


@dataclass(frozen=True)
class Report:
    """What a command found or did: the blocks, each projection's condition numbers, the options and notes.

    A value, made once: a caller that adds a note makes a new one (``dataclasses.replace``). The sequences are
    tuples (lists given are made tuples).

    ``str(report)`` / :meth:`render` is the table, :meth:`to_dict` / :meth:`to_json` the same for machines.
    """

    command: str  # "inspect" or "reinit"
    source: str
    format: str
    blocks: tuple[AttentionBlock, ...]
    rows: tuple[ProjectionRow, ...] = ()
    options: dict | None = None
    output: str | None = None
    dry_run: bool = False
    seconds: float = 0.0
    bytes_written: int = 0
    device: str = "cpu"
    notes: tuple[str, ...] = ()
    jacobian: Any = None  # inspect with jacobian=True: a surgeon.compute.jacobian.JacobianReport
    # a Hub model read by Range, or a push: the bytes moved, counted as they went (surgeon.hub.remote)
    transfer: dict[str, int] | None = None
    # what writing the output moved on disk: bytes written from memory, copied or shared by the kernel, read
    io: IOFigures | None = None

    def __post_init__(self) -> None:
        for name in ("blocks", "rows", "notes"):  # a list given (the API's callers may): a tuple all the same
            object.__setattr__(self, name, tuple(getattr(self, name)))

    # --- machines ------------------------------------------------------------------------
    def to_dict(self, spelling: Spelling = python_spelling) -> dict:
        out = {
            "command": self.command,
            "source": self.source,
            "format": self.format,
            "output": self.output,
            "dry_run": self.dry_run,
            "device": self.device,
            "seconds": round(self.seconds, 4),
            "bytes_written": self.bytes_written,
            "options": self.options,
            "blocks": block_dicts(self.blocks),
            "projections": [r.to_dict() for r in self.rows],
            "notes": [spell(n, spelling) for n in self.notes],
        }
        if self.jacobian is not None:
            out["jacobian"] = self.jacobian.to_dict()
        if self.transfer is not None:
            out["transfer"] = self.transfer
        if self.io is not None:
            out["io"] = self.io.to_dict()
        return out

    def to_json(self, spelling: Spelling = python_spelling, **kwargs: Any) -> str:
        """The report as JSON; ``spelling`` spells the options named in notes (the CLI passes its own)."""
        return json.dumps(self.to_dict(spelling), indent=kwargs.pop("indent", 2), **kwargs)

    # --- people --------------------------------------------------------------------------
    def __str__(self) -> str:
        return self.render()

    def render(self, spelling: Spelling = python_spelling) -> str:
        parts = [self._summary()]
        if self.command == "inspect":
            parts.append(self._stacks_table())
            parts.append(self._inspect_table())
        elif self.dry_run:
            parts.append(self._plan_table())
        else:
            parts.append(self._reinit_table())
        if self.command == "reinit" and not self.dry_run and self.rows:
            parts.append(spell(self._legend(), spelling))
        parts += note_lines(spell(n, spelling) for n in [*self.nonfinite_notes(), *self.notes])
        if self.command == "reinit" and not self.dry_run and self.output:
            parts.append(shown(f"wrote {self.output} ({self._sizes()}) in {self.seconds:.2f} s on {self.device}"))
        if self.jacobian is not None:
            parts.append(self.jacobian.render())
        return "\n\n".join(p for p in parts if p)

    def _sizes(self) -> str:
        size = fmt_bytes(self.bytes_written)
        io = self.io
        if io is None:
            return size
        return (
            f"{size}: {fmt_bytes(io.written)} written, {fmt_bytes(io.kernel)} shared or copied by the kernel, "
            f"{fmt_bytes(io.read)} read"
        )

    def nonfinite_notes(self) -> list[str]:
        """Heads whose weights hold NaN or Inf: reported, never a traceback."""
        out = []
        for r in self.rows:
            bad = r.before.nonfinite_heads if r.before is not None else ()
            if bad:
                many = len(bad) > 1
                what = f"{r.block.label} {r.role}: head{'s' if many else ''} {format_indices(list(bad))} hold{'' if many else 's'} NaN or Inf (kappa nan)"
                if r.after is not None and set(bad) <= set(r.heads_changed):
                    what += "; the conditioned reset does not read the old values, so they were replaced"
                out.append(what)
        return out

    def _legend(self) -> str:
        """One line under the table: what its kappas are, and what the mode leaves (its own legend)."""
        o = self.options or {}
        text = "head kappa: each head's, min/med/max" + (
            "; kappa: the whole projection's"
            if self._whole_measured()
            else f" ({opt('full', True)} adds the whole projection's)"
        )
        steps = o.get("steps") or [o]  # a recipe: each step's mode says its own
        legends = [get_mode(str(step["mode"])).legend(step) if step.get("mode") in MODES else "" for step in steps]
        return "; ".join([text, *dict.fromkeys(legend for legend in legends if legend)]) + ("" if any(legends) else ".")

    def _summary(self) -> str:
        stacks = list(dict.fromkeys(b.stack for b in self.blocks))
        attention, streams = with_streams(self.blocks)
        joint = sum(1 for b in attention if streams.get(b.module))
        head = shown(
            f"{self.source} ({self.format}): {_count(len(attention), 'attention block')} in {_count(len(stacks), 'stack')}"
            + (f" ({joint} with a context stream)" if joint else "")
        )
        if self.command == "inspect":
            return head
        o = self.options or {}
        what = "plan (dry run, nothing written)" if self.dry_run else "re-initialized"
        touched = len({split_module(r.block.module)[0] for r in self.rows})
        done = f"{what}: {_count(len(self.rows), 'projection')} in {_count(touched, 'block')}"
        if "steps" in o:  # a recipe: one line per step, in the order they were applied
            lines = [f"  step {i}: {_step_summary(s, self.blocks, selection=True)}" for i, s in enumerate(o["steps"])]
            return (
                f"{head}\n"
                + shown(f"{done}; a recipe of {len(o['steps'])} steps in one pass")
                + "\n"
                + "\n".join(shown(line) for line in lines)
            )
        return f"{head}\n" + shown(f"{done}; {_step_summary(o, self.blocks)}")

    def _stacks_table(self) -> str:
        attention, streams = with_streams(self.blocks)
        groups: dict[tuple, list[AttentionBlock]] = {}
        for b in attention:
            layout = b.layout + "".join(f" + {split_module(s.module)[1]} stream" for s in streams.get(b.module, ()))
            groups.setdefault((b.stack, b.kind, layout, b.heads, b.kv_heads, b.head_dim), []).append(b)
        rows = []
        for (stack, kind, layout, heads, kv, d), members in groups.items():
            first = members[0]
            rows.append(
                [
                    stack or "(top)",
                    kind,
                    format_indices(sorted({n for b in members for n in b.users})),
                    str(heads),
                    str(kv),
                    str(d),
                    layout,
                    ", ".join(_tensor_names(b) for b in (first, *streams.get(first.module, ()))),
                ]
            )
        return table(
            ["stack", "kind", "layers", "heads", "kv", "head_dim", "layout", "tensors (first layer)"],
            rows,
            right={3, 4, 5},
        )

    def _whole_measured(self) -> bool:
        """Whether any whole-projection kappa was measured (--full); if not, those columns are left out."""
        return any(s is not None and s.kappa is not None for r in self.rows for s in (r.before, r.after))

    def _inspect_table(self) -> str:
        whole, rows = self._whole_measured(), []
        for r in self.rows:
            proj = r.block.projection(r.role)
            cells = _spec_cells(r.before)
            rows.append(
                [_where(r.block), r.role, f"{proj.heads}x{proj.head_dim}", r.dtype, *(cells if whole else cells[1:2])]
            )
        if whole:
            return table(
                ["block", "proj", "heads", "dtype", "kappa", "head kappa min/med/max", "||W||2"], rows, right={4, 6}
            )
        return table(["block", "proj", "heads", "dtype", "head kappa min/med/max"], rows)

    def _plan_table(self) -> str:
        rows = []
        for r in self.rows:
            proj = r.block.projection(r.role)
            heads = "all" if len(r.heads_changed) == proj.heads else format_indices(r.heads_changed)
            rows.append(
                [
                    _where(r.block),
                    r.role,
                    proj.weight.tensor,
                    f"{heads} of {proj.heads}",
                    "yes" if r.bias_zeroed else "no",
                ]
            )
        return self._with_strengths(table, ["block", "proj", "tensor", "heads", "zero bias"], rows)

    def _with_strengths(self, make: Any, headers: list[str], rows: list[list[str]], **kw: Any) -> str:
        """The table with a step column (a recipe) and a strength column where a ramp or a recipe gave layers their
        own t (``rows``: in the order of self.rows)."""
        o = self.options or {}
        recipe = "steps" in o
        if recipe:
            headers, rows = ["step", *headers], [[str(r.step), *cells] for cells, r in zip(rows, self.rows)]
        ramps = isinstance(o.get("strength"), str) or any(
            isinstance(s.get("strength"), str) for s in o.get("steps", [])
        )
        if ramps or (recipe and any(r.strength is not None for r in self.rows)):
            strengths = ["-" if r.strength is None else f"{r.strength:.4g}" for r in self.rows]
            headers, rows = [*headers, "strength"], [[*cells, t] for cells, t in zip(rows, strengths)]
        return make(headers, rows, **kw)

    def _reinit_table(self) -> str:
        whole, rows = self._whole_measured(), []
        for r in self.rows:
            proj = r.block.projection(r.role)
            heads = "all" if len(r.heads_changed) == proj.heads else format_indices(r.heads_changed)
            b, a = _spec_cells(r.before), _spec_cells(r.after)
            if whole:
                rows.append(
                    [_where(r.block), r.role, heads, f"{b[0]} -> {a[0]}", f"{b[1]} -> {a[1]}", f"{b[2]} -> {a[2]}"]
                )
            else:
                rows.append([_where(r.block), r.role, heads, f"{b[1]} -> {a[1]}"])
        if whole:
            return self._with_strengths(
                table, ["block", "proj", "heads", "kappa", "head kappa min/med/max", "||W||2"], rows
            )
        return self._with_strengths(table, ["block", "proj", "heads", "head kappa min/med/max"], rows)


def _step_summary(o: dict, blocks: Sequence[AttentionBlock], *, selection: bool = False) -> str:
    """One run's (or, with its ``selection``, a recipe step's) mode, bias, seed, scale and strength, as recorded."""
    known = o.get("mode") in MODES
    mode = get_mode(str(o["mode"])).summary(o, blocks) if known else str(o.get("mode"))
    extras = f"mode {mode}, bias {o.get('bias')}, seed {o.get('seed')}" + (
        ", keep scale" if o.get("keep_scale") else ""
    )
    if known and get_mode(str(o["mode"])).mixes and o.get("strength") is not None:  # polar says its own
        extras += f", strength {o['strength']}" + (" (per layer below)" if isinstance(o["strength"], str) else "")
    if selection:
        chosen = [f"{key} {_spelled(o.get(key))}" for key in ("layers", "heads", "targets") if o.get(key) is not None]
        extras = ", ".join(chosen) + "; " + extras
    return extras


def _spelled(value: object) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def with_streams(blocks: Sequence[AttentionBlock]) -> tuple[list[AttentionBlock], dict[str, list[AttentionBlock]]]:
    """The attention blocks as the model has them, and each one's second streams by its module: a joint
    block's context projections (module "<attention>:context") are a stream of that attention, not a block."""
    attention = [b for b in blocks if not split_module(b.module)[1]]
    streams: dict[str, list[AttentionBlock]] = {}
    for b in blocks:
        if split_module(b.module)[1]:
            streams.setdefault(b.module.rpartition(":")[0], []).append(b)
    return attention, streams


def block_dicts(blocks: Sequence[AttentionBlock]) -> list[dict]:
    """``--json``'s blocks: one entry per attention block, its second streams under "streams" by name."""
    attention, streams = with_streams(blocks)
    out = []
    for b in attention:
        entry = b.to_dict()
        if streams.get(b.module):
            entry["streams"] = {split_module(s.module)[1]: s.to_dict() for s in streams[b.module]}
        out.append(entry)
    owners = {b.module for b in attention}
    # a stream whose block was not found (cannot happen from detection): listed, so that nothing is hidden
    return out + [s.to_dict() for owner, ss in streams.items() if owner not in owners for s in ss]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _where(block: AttentionBlock) -> str:
    return f"{block.label} {block.kind}"


def _tensor_names(block: AttentionBlock) -> str:
    names = block.tensors()
    owner = split_module(block.module)[0]  # a second stream (":context") or set ("[global]") of the module
    prefix = owner + "." if owner else ""
    return ", ".join(n.removeprefix(prefix) for n in names)
