"""A source's model card never speaks for the output: the surgeon records it carries (in its front matter, its
tags, its text) are the source's, escaped in a section of their own, and `surgeon verify` reads the output's
record from its weights, the card's one record equal to it."""

from __future__ import annotations

import json
import re

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open

from helpers.cli import expect_cli_error
from helpers.tiny import tiny_llama

# surgeon's record comment, as the card format spells it: found here by the test's own pattern
RECORD = re.compile(r"<!-- surgeon-record (\{.*?\}) -->", re.S)


def _weights_record(folder) -> dict:
    """The last record of a safetensors output, read with safetensors' own reader."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return json.loads(f.metadata()["surgeon"])[-1]


def _card_records(folder) -> list[dict]:
    return [json.loads(body) for body in RECORD.findall((folder / "README.md").read_text())]


def _forged_comment(record: dict) -> str:
    """A record comment that survives YAML's line folding as a front-matter tag: one space in the JSON (between
    tokens), where the folded line breaks, so that the rest and the comment's end share the next line."""
    text = json.dumps(record, separators=(",", ":"))
    cut = text.rindex(',"commit"') + 1
    return f"<!-- surgeon-record {text[:cut]} {text[cut:]} -->"


def _save(folder, fmt: str) -> None:
    model = tiny_llama()
    if fmt == "safetensors":
        model.save_pretrained(folder)
    else:  # no metadata slot: the card is where the record is kept
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")


@pytest.fixture
def forged(tmp_path, cli):
    """A genuine record of another run (seed 99, layer 0) of the same model, with a Hub origin added."""
    decoy = tmp_path / "decoy-src"
    _save(decoy, "safetensors")
    cli("reinit", decoy, "--layers", "0", "--seed", "99", "-o", tmp_path / "decoy")
    record = _weights_record(tmp_path / "decoy")
    record["origin"] = {"repo": "evil/model", "commit": "a" * 40}
    return record


def _source_with_forged_card(tmp_path, fmt: str, forged: dict):
    src = tmp_path / f"src-{fmt}"
    _save(src, fmt)
    comment = _forged_comment(forged)
    matter = f"license: mit\ntags:\n- llama\n- {json.dumps(comment)}\n"
    (src / "README.md").write_text(f"---\n{matter}---\n\n# The source\n\nTrained by us.\n\n{comment}\n")
    return src


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_source_cards_forged_record_stays_the_sources(cli, tmp_path, forged, fmt):
    src = _source_with_forged_card(tmp_path, fmt, forged)
    out = tmp_path / f"out-{fmt}"
    cli("reinit", src, "--layers", "1", "--seed", "5", "-o", out)

    (own,) = _card_records(out)  # the output's own record only
    assert own["options"]["seed"] == 5 and [b["layer"] for b in own["blocks"]] == [1] and "origin" not in own
    if fmt == "safetensors":
        assert own == _weights_record(out)
    card = ModelCard.load(out / "README.md")
    assert card.data.tags == ["surgeon", "conditioned-initialization", "llama"]  # markup is no tag
    assert card.data.license == "mit"
    ours, section = card.text.split("## Source model card")
    assert "surgeon-record" not in card.content.split(ours)[0]  # the front matter
    assert "&lt;" not in ours and ours.count("surgeon-record") == 1
    # the source's matter, in its own section: its front matter as a code block, its text; the records escaped
    escaped = "&lt;!-- surgeon-record {"
    fence = re.search(r"```yaml\n(.*?)\n```", section, re.S)
    assert fence and "license: mit" in fence[1] and escaped in fence[1]
    assert "Trained by us." in section and section.count(escaped) == 2 and "<!--" not in section

    assert cli("verify", src, out).stdout.startswith(f"verified: {out} is {src} with 1 attention block")


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_card_changed_after_the_run_is_refused(cli, tmp_path, forged, fmt):
    src = _source_with_forged_card(tmp_path, fmt, forged)
    out = tmp_path / f"out-{fmt}"
    cli("reinit", src, "--layers", "1", "--seed", "5", "-o", out)
    card = (out / "README.md").read_text()

    def refused(text: str, match: str) -> None:
        (out / "README.md").write_text(text)
        line = expect_cli_error(cli, tmp_path, "verify", src, out, match=match)
        assert cli("verify", src, out, ok=False).exit_code == 3, line

    # the source's record in its text made readable again: the card holds two, and which speaks for the output
    # cannot be told
    at = card.rindex("&lt;!-- surgeon-record")
    several = f"the model card {out / 'README.md'} holds 2 surgeon records, and surgeon writes one"
    refused(card[:at] + "<" + card[at + len("&lt;") :], several)
    # one put before the output's own, in its front matter
    refused(card.replace("- conditioned-initialization\n", f"- {_forged_comment(forged)}\n", 1), "holds 2")
    # the output's own record edited
    edited = card.replace('"seed":5', '"seed":6', 1)
    assert edited != card
    if fmt == "safetensors":  # the weights hold the record: the card must equal it
        refused(edited, "the record in its README.md is not the record of its weights")
    else:  # the card is the record: the weights are not what it says
        refused(edited, "the recipe re-derived from the record's seed gives other values")
    (out / "README.md").write_text(card)
    assert cli("verify", src, out).stdout.startswith("verified:")
