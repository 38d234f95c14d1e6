"""`surgeon reinit --help` lists its options in sections, as `hf` and mergekit do: every option in one."""

from __future__ import annotations

import re

import click

from surgeon.cli.commands import REINIT_SECTIONS, reinit

TITLES = ("Selection", "Mode", "Output", "Hub", "Hints")


def _sections(text: str) -> dict[str, list[str]]:
    """Section title -> the flags listed under it, read from the help text as printed."""
    out: dict[str, list[str]] = {}
    title = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            out[title] = []
        elif title and (flag := re.match(r"^  (?:-\w, )?(--[\w-]+)", line)):
            out[title].append(flag.group(1))
    return out


def test_reinit_help_groups_every_option_under_a_section(cli):
    text = cli("reinit", "--help").output
    sections = _sections(text)
    assert [next(t for t in sections if t.startswith(want)) for want in TITLES]  # each section is there, titled
    assert list(sections)[: len(TITLES)] == [t for t in sections if t.startswith(TITLES)]  # in this order, first
    assert sections.pop("Other options") == ["--help"]  # nothing else left unsectioned
    assert "--num-kv-heads" in next(v for t, v in sections.items() if t.startswith("Hints"))
    assert "--push-to-hub" in next(v for t, v in sections.items() if t.startswith("Hub"))
    assert "--layers" in next(v for t, v in sections.items() if t.startswith("Selection"))
    listed = [flag for flags in sections.values() for flag in flags]
    ctx = click.Context(reinit)
    visible = [
        next(o for o in p.opts if o.startswith("--"))
        for p in reinit.get_params(ctx)
        if isinstance(p, click.Option) and not p.hidden and p.name != "_click_default_help"
    ]
    assert sorted(listed) == sorted(visible)  # each visible option once, in a section
    assert set(n for names in REINIT_SECTIONS.values() for n in names) <= {p.name for p in reinit.get_params(ctx)}
