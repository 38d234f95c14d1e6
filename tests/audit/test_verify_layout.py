"""surgeon inspect --verify-layout: name-based detection of a checkpoint against the forward of the
architecture its config.json names (built with transformers, randomly initialized)."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from surgeon.audit.layout import verify_layout
from surgeon.cli.commands import cli_spelling
from surgeon.errors import LayoutError, OptionError

from helpers.families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_names_agree_with_the_forward(name, tmp_path):
    FAMILIES[name].make().save_pretrained(tmp_path)
    check = verify_layout(tmp_path)
    expected = {"t5": 6, "bart": 6, "whisper": 6, "swin": 3, "modernbert": 3}.get(name, 2)
    assert check.blocks == expected
    assert check.architecture == json.loads((tmp_path / "config.json").read_text())["architectures"][0]


def test_wrong_head_count_is_caught(tmp_path):
    """Interleaved GPT-NeoX rows fit 2 heads of 24 as well as 4 heads of 12: only the forward tells."""
    FAMILIES["gpt_neox"].make().save_pretrained(tmp_path)
    with pytest.raises(LayoutError, match="num_heads=2 contradicts config.json, which says 4") as err:
        verify_layout(tmp_path, num_heads=2)
    assert err.value.options == ("num_heads", "force_hints")
    assert "--num-heads 2 contradicts config.json, which says 4" in err.value.describe(cli_spelling)
    with pytest.raises(LayoutError) as err:
        verify_layout(tmp_path, num_heads=2, force_hints=True)
    assert str(err.value) == (
        "layout check failed: gpt_neox.layers.0.attention q: names say 2 heads x 24 at rows 0,72 of "
        "gpt_neox.layers.0.attention.query_key_value.weight; the forward of GPTNeoXForCausalLM uses 4 heads x 12 "
        "at rows 0,36,72,108 of gpt_neox.layers.0.attention.query_key_value.weight"
    )


def test_cli_prints_the_agreement_or_one_line_error(cli, tmp_path):
    FAMILIES["falcon_new"].make().save_pretrained(tmp_path)
    out = cli("inspect", tmp_path, "--verify-layout", "--json")
    notes = json.loads(out.stdout)["notes"]
    assert notes[-1].startswith(
        "layout verified: the 2 attention blocks found by name are the ones the forward of FalconForCausalLM uses"
    )
    bad = cli("inspect", tmp_path, "--verify-layout", "--num-kv-heads", "8", ok=False)
    assert bad.exit_code != 0
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("surgeon: error: ")


def test_needs_a_config(tmp_path):
    torch.save(FAMILIES["llama"].make().state_dict(), tmp_path / "model.pt")
    with pytest.raises(
        OptionError,
        match=r"verify_layout=True builds the architecture from config.json, and .*model.pt has none; pass config=PATH",
    ) as err:
        verify_layout(tmp_path / "model.pt", num_heads=8, num_kv_heads=2)
    assert err.value.path == str(tmp_path / "model.pt")
    assert re.search(
        r"--verify-layout builds the architecture from config.json, and .*model.pt has none; pass --config PATH",
        err.value.describe(cli_spelling),
    )


def test_needs_transformers(tmp_path, monkeypatch):
    FAMILIES["bert"].make().save_pretrained(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an environment without it raises
    with pytest.raises(
        OptionError,
        match=r"^verify_layout=True needs transformers to build the architecture: pip install transformers$",
    ) as err:
        verify_layout(tmp_path)
    assert (
        err.value.describe(cli_spelling)
        == "--verify-layout needs transformers to build the architecture: pip install transformers"
    )
