"""A name from a file cannot add a line to surgeon's output (issue 27, item 4).

Every input here is real: a tiny Llama saved by transformers, then given shard, file, folder, tensor, ONNX
node and journal names that hold ``SEP + "surgeon: verified: all good"``, where SEP is a newline, a carriage
return, a terminal's erase-line sequence, U+2028, U+0085 or U+202E. Each channel (the error line on stderr, notes and report
tables on stdout, ``--json``, the model card, verify's verdict, recover's notes) is run on that input and on
its twin, whose names hold ``_`` in place of SEP, and must print as many lines as the twin, none of them
starting with ``surgeon: verified``, with the name shown escaped (``\\n``, ``\\r``, ``\\x1b``, ``\\u2028``, ...).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers.tiny import tiny_llama

FORGED = "surgeon: verified: all good"
# U+0085 (NEL) is a C1 line break; U+202E (right-to-left override) shows what follows it reversed
SEPS = {"newline": "\n", "return": "\r", "erase-line": "\x1b[2K", "u2028": "\u2028", "nel": "\x85", "rlo": "\u202e"}
ESCAPED = {
    "\n": ("\\n",),
    "\r": ("\\r",),
    "\x1b[2K": ("\\x1b[2K", "\\x9b2K"),
    "\u2028": ("\\u2028",),
    "\x85": ("\\x85",),
    "\u202e": ("\\u202e",),
}


@pytest.fixture
def cli():
    """The real command in-process, as conftest's ``cli``, but writing what a terminal would get: click strips
    ANSI sequences from a stream that is not a terminal (``color=True`` keeps them, as a terminal sees them)."""
    from click.testing import CliRunner

    from surgeon.cli.commands import main

    def run(*args, ok: bool = True):
        result = CliRunner().invoke(main, [str(a) for a in args], color=True)
        assert not ok or result.exit_code == 0, f"surgeon {args} failed:\n{result.stderr}{result.stdout}"
        return result

    return run


@pytest.fixture(params=list(SEPS.values()), ids=list(SEPS))
def sep(request) -> str:
    return request.param


def payload(sep: str) -> str:
    return sep + FORGED


TWIN = "_" + FORGED  # the same name with nothing to escape


def in_tensor(name: str) -> str:
    """``name`` in a tensor name: the erase-line sequence as its 8-bit CSI (U+009B), since a "[" in a tensor
    name reaches a different bug (detection fails with an internal KeyError, reported separately)."""
    return name.replace("\x1b[", "\x9b")


def assert_not_forged(text: str, twin: str, sep: str | None) -> None:
    """``text`` has as many lines as ``twin`` (Python's splitlines ends a line at \\r and U+2028 too), none
    of them surgeon's verdict forged, no raw control character, and (but for JSON's own escapes) SEP escaped."""
    lines = text.splitlines()
    assert len(lines) == len(twin.splitlines()), text
    assert not [line for line in lines if line.lstrip().startswith(FORGED)], text
    assert not set(text) & {"\r", "\x1b", "\x9b", "\u2028", "\x85", "\u202e"}, text
    if sep is not None:
        assert any(escaped in text for escaped in ESCAPED[sep]), text


def run_both(cli, make, sep: str, *args: str, ok: bool = True):
    """``surgeon ARGS`` on the input(s) ``make(name)`` builds with the payload, and on the twin's; ``{0}``
    (``{}``), ``{1}`` in ARGS are the paths made. Returns (result, twin's result)."""
    results = []
    for name in (payload(sep), TWIN):
        made = make(name)
        paths = made if isinstance(made, tuple) else (made,)
        results.append(cli(*[a.format(*paths) for a in args], ok=ok))
    return results


def assert_error_line(cli, make, sep: str, *args: str) -> None:
    """One ``surgeon: error:`` line on stderr, as the twin's, nothing on stdout."""
    result, twin = run_both(cli, make, sep, *args, ok=False)
    assert result.exit_code == twin.exit_code != 0
    assert result.stderr.startswith("surgeon: error: ") and "Traceback" not in result.stderr
    assert result.stdout == "" and len(twin.stderr.splitlines()) == 1
    assert_not_forged(result.stderr, twin.stderr, sep)


@pytest.fixture(scope="module")
def llama_state() -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in tiny_llama().state_dict().items()}


@pytest.fixture
def llama(tmp_path, llama_state):
    """``llama(folder=, tensors=)``: a new tiny Llama folder named ``folder``, with config.json, whose every
    tensor name starts with ``x<tensors>.`` (see in_tensor; transformers' own names when ``tensors`` is None)."""
    count = iter(range(1000))

    def make(folder: str = "src", tensors: str | None = None) -> Path:
        path = tmp_path / str(next(count)) / folder
        path.mkdir(parents=True)
        tiny_llama().config.save_pretrained(path)
        prefix = None if tensors is None else f"x{in_tensor(tensors)}."
        state = llama_state if prefix is None else {prefix + k: v for k, v in llama_state.items()}
        save_file(state, str(path / "model.safetensors"), {"format": "pt"})
        return path

    return make


# --- errors: one line on stderr ------------------------------------------------------------------


def missing_shard(folder: Path, name: str) -> Path:
    """A sharded tiny Llama saved by transformers whose index names a shard ``x<name>.safetensors`` that is not there."""
    path = folder / f"sharded{len(list(folder.iterdir()))}"
    tiny_llama().save_pretrained(path, max_shard_size="100KB")
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][next(iter(data["weight_map"]))] = f"x{name}.safetensors"
    index.write_text(json.dumps(data))
    return path


def test_missing_shard_named_with_a_newline_is_one_error_line(cli, tmp_path, sep):
    def make(name):
        return missing_shard(tmp_path, name)

    assert_error_line(cli, make, sep, "inspect", "{}")
    assert_error_line(cli, make, sep, "reinit", "{}", "--dry-run")


def test_diffusers_component_folder_named_with_a_newline_is_one_error_line(cli, tmp_path, sep):
    def make(name):
        path = tmp_path / f"pipe{len(list(tmp_path.iterdir()))}"
        (path / f"unet{name}").mkdir(parents=True)
        (path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
        save_file({"w": torch.zeros(2, 2)}, str(path / f"unet{name}" / "diffusion_pytorch_model.safetensors"))
        return path

    assert_error_line(cli, make, sep, "inspect", "{}")


def test_journal_named_with_a_newline_is_one_error_line(cli, llama, sep):
    def make(name):
        path = llama()
        (path / f".x{name}.safetensors.surgeon-journal").write_bytes(b"a journal left in a downloaded folder")
        return path

    assert_error_line(cli, make, sep, "inspect", "{}")
    assert_error_line(cli, make, sep, "reinit", "{}", "-o", "{}-out")


def test_verify_mismatch_is_one_error_line(cli, llama, sep):
    """Folders and tensors named with the payload, and a tensor outside the selection changed after the run."""

    def make(name):
        src = llama(f"src{name}", tensors=name)
        out = src.parent / f"out{name}"
        cli("reinit", src, "--layers", "0", "-o", out)
        weights = out / "model.safetensors"
        with safe_open(str(weights), "pt") as f:
            metadata = f.metadata()
        tensors = load_file(weights)
        tensors[f"x{in_tensor(name)}.lm_head.weight"][0, 0] += 1
        save_file(tensors, str(weights), metadata)
        return src, out

    result, twin = run_both(cli, make, sep, "verify", "{0}", "{1}", ok=False)
    assert result.exit_code == twin.exit_code == 3
    assert "lm_head.weight" in result.stderr and len(twin.stderr.splitlines()) == 1
    assert_not_forged(result.stderr, twin.stderr, sep)


def test_onnx_node_names_in_a_refusal_are_one_error_line(cli, tmp_path, sep):
    quantized = lambda name: onnx_model(tmp_path, name, q_weight="quantized")  # noqa: E731
    assert_error_line(cli, quantized, sep, "reinit", "{}", "--dry-run")


# --- stdout: notes, report tables, JSON ----------------------------------------------------------


def test_stale_copy_named_with_a_newline_is_one_note_line(cli, llama, sep):
    def make(name):
        path = llama()
        (path / f"export{name}.onnx").write_bytes(b"never read: only its name is reported")
        return path

    result, twin = run_both(cli, make, sep, "inspect", "{}")
    assert [line for line in result.stdout.splitlines() if line.startswith("note: left out other copies")]
    assert_not_forged(result.stdout, twin.stdout, sep)


def test_recover_note_naming_a_journal_is_one_line(cli, llama, sep):
    journals = []

    def make(name):
        path = llama()
        (path / "model.safetensors").rename(path / f"m{name}.safetensors")
        journals.append(path / f".m{name}.safetensors.surgeon-journal.tmp")  # a run that died writing it
        journals[-1].write_bytes(b"")
        return path

    result, twin = run_both(cli, make, sep, "recover", "{}")
    assert result.stdout.startswith("note: removed ") and not any(j.exists() for j in journals)
    assert_not_forged(result.stdout, twin.stdout, sep)


def test_tensor_names_with_a_newline_stay_in_their_table_rows(cli, llama, sep):
    for args in (("inspect", "{}"), ("reinit", "{}", "--dry-run")):
        result, twin = run_both(cli, lambda name: llama(tensors=name), sep, *args)
        assert result.stderr == twin.stderr == ""
        assert_not_forged(result.stdout, twin.stdout, sep)


def test_json_keeps_the_raw_names(cli, llama, sep):
    made: list[Path] = []
    result, twin = run_both(
        cli, lambda name: made.append(llama(tensors=name)) or made[-1], sep, "inspect", "{}", "--json"
    )
    assert_not_forged(result.stdout, twin.stdout, None)  # json.dumps escapes control characters itself
    with safe_open(str(made[0] / "model.safetensors"), "pt") as f:
        names = set(f.keys())  # the reference reader: the names as the file holds them
    report = json.loads(result.stdout)
    tensors = {p["tensor"] for p in report["projections"]}
    assert len(tensors) == 9 and tensors <= names
    assert all(b["module"].startswith(f"x{in_tensor(payload(sep))}.") for b in report["blocks"])


def onnx_model(folder: Path, name: str, **options) -> Path:
    """The tiny hand-made attention graph, its node scopes and layer 0's weights (or the shared query weight)
    renamed to hold ``name``."""
    import onnx

    from helpers.onnx_graphs import tiny_attention

    model = tiny_attention(**options)
    renames = {t.name: t.name + name for t in model.graph.initializer if t.name.startswith(("onnx::MatMul_0", "q_"))}
    for t in model.graph.initializer:
        t.name = renames.get(t.name, t.name)
    for node in model.graph.node:
        node.name = node.name.replace("/layers.", f"/enc{name}/layers.")
        node.input[:] = [renames.get(i, i) for i in node.input]
    path = folder / f"m{len(list(folder.iterdir()))}.onnx"
    onnx.save(model, path)
    return path


def test_onnx_node_and_initializer_names_stay_on_their_lines(cli, tmp_path, sep):
    for args in (("inspect", "{}"), ("reinit", "{}", "--dry-run")):
        result, twin = run_both(cli, lambda name: onnx_model(tmp_path, name), sep, *args)
        assert_not_forged(result.stdout, twin.stdout, sep)
    # one query weight read by both layers, layer 0 chosen: a note names the initializer and its copy
    shared = lambda name: onnx_model(tmp_path, name, share_q=True)  # noqa: E731
    result, twin = run_both(cli, shared, sep, "reinit", "{}", "--layers", "0", "-o", "{}.out.onnx")
    assert [line for line in result.stdout.splitlines() if line.startswith("note: initializer 'q_shared")]
    assert_not_forged(result.stdout, twin.stdout, sep)


# --- the model card and verify's verdict ----------------------------------------------------------


def test_card_and_verdict_keep_names_on_their_lines(cli, llama, sep):
    """Source folder, output folder and tensors all named with the payload: the report, the card (title,
    intro, tables, reproduce command) and verify's one-line verdict."""
    runs = []
    for name in (payload(sep), TWIN):
        src = llama(f"src{name}", tensors=name)
        out = src.parent / f"out{name}"
        report = cli("reinit", src, "--layers", "0", "-o", out).stdout
        runs.append((src, out, report, (out / "README.md").read_text(encoding="utf-8"), cli("verify", src, out).stdout))
    (src, out, report, card, verdict), (_, _, twin_report, twin_card, twin_verdict) = runs
    assert_not_forged(report, twin_report, sep)
    assert_not_forged(card, twin_card, sep)
    assert_not_forged(verdict, twin_verdict, sep)
    assert verdict.startswith("verified: ") and len(verdict.splitlines()) == 1
    # the reproduce command, one line, still names the real folders: bash reads its words back (C locale)
    [command] = [line for line in card.splitlines() if line.startswith("surgeon reinit ")]
    words = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, check=True, env={**os.environ, "LC_ALL": "C"}
    ).stdout.split(b"\0")
    assert os.fsencode(src.name) in words and os.fsencode(out.name) in words


def test_card_table_cells_hold_pipes_and_backticks(cli, llama):
    """A "|" in a name does not add a column to the card's tables, a "`" does not end its code span."""
    src = llama(tensors="a|b`c")
    cli("reinit", src, "--layers", "0", "-o", src.parent / "out")
    card = (src.parent / "out" / "README.md").read_text(encoding="utf-8")
    tables = [block.splitlines() for block in card.split("\n\n") if block.startswith("| block |")]
    assert [len(rows) for rows in tables] == [3, 5]  # header, rule, then layer 0's block; its q, k and v
    for rows in tables:
        cells = {len(row.replace("\\|", "").split("|")) for row in rows}
        assert len(cells) == 1, rows
        assert all(row.startswith("| ``xa\\|b`c.model.layers.0") for row in rows[2:]), rows


def test_python_api_keeps_raw_names_and_shows_them_escaped(llama, sep, tmp_path):
    import surgeon

    with pytest.raises(surgeon.CheckpointError) as error:
        surgeon.inspect_checkpoint(missing_shard(tmp_path, payload(sep)))
    assert_not_forged(str(error.value), "one line", sep)

    path = llama(tensors=payload(sep))
    report, twin = surgeon.inspect_checkpoint(path), surgeon.inspect_checkpoint(llama(tensors=TWIN))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {r.block.projection(r.role).weight.tensor for r in report.rows} <= names  # raw, as the file has them
    assert all(b.module.startswith(f"x{in_tensor(payload(sep))}.") for b in report.blocks)
    assert_not_forged(str(report), str(twin), sep)


def test_escapes_are_the_ones_repr_writes():
    """Every character surgeon.text.shown escapes is one Python's repr escapes too, and written the same way."""
    from surgeon.text.shown import shown

    unsafe = [chr(c) for c in range(0x110000) if shown(chr(c)) != chr(c)]
    assert {"\n", "\r", "\x1b", "\x85", "\u2028", "\u2029", "\u202e", "\u2066", "\u200f", "\u061c"} <= set(unsafe)
    assert all(shown(c) == repr(c)[1:-1] for c in unsafe)
    assert shown("plain name, é 漢字 \\ | `") == "plain name, é 漢字 \\ | `"
