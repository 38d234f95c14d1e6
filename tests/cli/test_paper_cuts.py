"""The paper cuts of issue 53: `inspect --help` grouped like `reinit --help`, `print(surgeon.verify(...))` the
one-line verdict."""

from __future__ import annotations

import torch

import surgeon

from helpers.tiny import tiny_llama


def test_inspect_help_groups_its_options_like_reinit(cli):
    text = cli("inspect", "--help").output
    titles = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert titles == ["What to report", "Output", "Hub", "Hints (when config.json does not say)", "Other options"]
    other = text.split("Other options:")[1].split("Examples:")[0]
    assert "--help" in other and "--json" not in other and "--num-heads" not in other


def test_printing_a_verify_result_prints_its_one_line_verdict(tmp_path, cli):
    tiny_llama().save_pretrained(tmp_path / "base")
    cli("reinit", tmp_path / "base", "--layers", "0", "-o", tmp_path / "out")
    result = surgeon.verify(tmp_path / "base", tmp_path / "out")
    assert str(result) == result.summary() and str(result).startswith("verified: ") and "\n" not in str(result)


def test_a_mistyped_path_under_a_local_folder_is_a_local_path_with_a_did_you_mean(tmp_path, cli, monkeypatch):
    from helpers.cli import expect_cli_error

    tiny_llama().save_pretrained(tmp_path / "minilm")
    monkeypatch.chdir(tmp_path)
    line = expect_cli_error(cli, tmp_path, "inspect", "minilm/model.safetensor", match="no such file or folder")
    assert "did you mean minilm/model.safetensors?" in line and "HF_ENDPOINT" not in line and len(line) < 200


def test_a_reinit_dry_run_names_where_the_real_run_writes(tmp_path, cli):
    tiny_llama().save_pretrained(tmp_path / "llama")
    out = cli("reinit", tmp_path / "llama", "--layers", "0", "-o", tmp_path / "reset", "--dry-run").stdout
    assert f"note: the real run writes {tmp_path / 'reset'}" in out.splitlines() and not (tmp_path / "reset").exists()


def test_no_attention_found_is_short_however_deep_the_path(tmp_path, cli):
    from safetensors.torch import save_file

    from helpers.cli import expect_cli_error

    deep = tmp_path / "a-long-temporary-folder-name-of-the-kind-tools-make" / "and-one-more-level"
    deep.mkdir(parents=True)
    save_file({"embed.weight": torch.zeros(4, 4)}, deep / "model.safetensors")
    line = expect_cli_error(cli, tmp_path, "inspect", deep / "model.safetensors", match="no attention found in")
    assert str(tmp_path) not in line and "and-one-more-level/model.safetensors" in line and len(line) <= 230


def test_the_footnote_under_the_table_is_one_line(tmp_path, cli):
    """Every reinit's legend (what the kappas are, what the mode leaves) is one line of at most ~200 characters, once."""
    tiny_llama().save_pretrained(tmp_path / "base")
    out = cli("reinit", tmp_path / "base", "--layers", "0", "-o", tmp_path / "out").stdout.splitlines()
    (at,) = [i for i, line in enumerate(out) if line.startswith("head kappa:")]
    assert len(out[at]) <= 210 and "kappa > 1" in out[at], out[at]
    assert at + 1 == len(out) or not out[at + 1].strip()  # nothing of it spills onto a second line
