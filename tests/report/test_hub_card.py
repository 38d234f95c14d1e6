"""The model card every folder output gets: parsed with huggingface_hub's own card parser."""

from __future__ import annotations

import re
import shlex

from huggingface_hub import ModelCard, ModelCardData

from surgeon import __version__, reinit_checkpoint
from surgeon.report.report import fmt_kappa

from helpers.digests import sha256, tree_digest
from helpers.tiny import tiny_llama


def reproduce(card: ModelCard) -> list[str]:
    """The arguments after ``surgeon`` of the card's reproduce command."""
    (command,) = re.findall(r"```bash\n(surgeon reinit [^\n]+)\n```", card.text)
    return shlex.split(command)[1:]


def test_card_of_a_real_model_keeps_its_card_and_reproduces(minilm_dir, tmp_path, monkeypatch, cli):
    (tmp_path / "all-MiniLM-L6-v2").symlink_to(minilm_dir)
    monkeypatch.chdir(tmp_path)
    report = reinit_checkpoint("all-MiniLM-L6-v2", output="reset", layers="-2-", seed=7)
    card = ModelCard.load(tmp_path / "reset" / "README.md")
    source = ModelCard.load(minilm_dir / "README.md")

    data = card.data.to_dict()
    assert data["tags"] == ["surgeon", "conditioned-initialization", *source.data.tags]
    assert data["license"] == source.data.license == "apache-2.0"
    assert data["library_name"] == "sentence-transformers" and data["language"] == "en"
    assert "base_model" not in data  # a local folder: no Hub id to point at
    assert source.data.datasets and "datasets" not in data  # what the source was trained on is not this model's
    assert ModelCardData(**data).to_dict() == data  # the Hub's metadata model takes it as it is

    # what was done and the numbers this run measured
    text = card.text
    assert "| seed | 7 |" in text and "| projections | q, k, v |" in text and f"| surgeon | {__version__} |" in text
    assert "| `encoder.layer.4.attention.self` | self | all 12 heads | all 12 heads | all 12 heads |" in text
    assert "encoder.layer.3" not in text.split("## Source model card")[0]
    assert len(report.rows) == 6
    for r in report.rows:
        heads = lambda s: "/".join(fmt_kappa(x) for x in (s.head_min, s.head_median, s.head_max))  # noqa: E731
        row = f"| `{r.block.module}` | {r.role} | {heads(r.before)} | {heads(r.after)} |"
        assert row in text, row
    assert "@inproceedings{saratchandran2026conditioned" in text and "openreview.net/forum?id=cKNOCYPo2W" in text
    # the source card follows, every word of it
    assert text.rstrip().endswith(source.text.strip())
    assert str(tmp_path) not in card.content  # no local paths published

    # the command in the card makes the same weights again
    args = reproduce(card)
    assert args[:2] == ["reinit", "all-MiniLM-L6-v2"] and "--layers=-2-" in args and args[-2:] == ["-o", "reset"]
    cli(*args[:-1], "again")
    assert sha256(tmp_path / "again" / "model.safetensors") == sha256(tmp_path / "reset" / "model.safetensors")
    assert (tmp_path / "again" / "README.md").read_text() == (tmp_path / "reset" / "README.md").read_text().replace(
        "# reset", "# again"
    ).replace("-o reset", "-o again")


def test_card_of_a_plain_folder_polar_selection(tmp_path, monkeypatch, cli):
    src = tmp_path / "llama"
    tiny_llama().save_pretrained(src)
    monkeypatch.chdir(tmp_path)
    reinit_checkpoint(
        src,
        output=tmp_path / "out",
        mode="polar",
        strength=0.5,
        keep_scale=True,
        heads="0-3",
        targets="q,k",
        layers="1-2",
        num_heads=8,
    )
    card = ModelCard.load(tmp_path / "out" / "README.md")
    data = card.data.to_dict()
    # no source card: no license to carry; a config.json with a model_type is a transformers model
    assert data == {
        "library_name": "transformers",
        "tags": ["surgeon", "polar-conditioning"],
    }  # the tag says what was done
    assert "## Source model card" not in card.text
    assert "| mode | polar, strength 0.5:" in card.text and "| keep scale | yes" in card.text
    assert "| `model.layers.1.self_attn` | self | heads 0-3 of 8 | key/value heads" not in card.text
    assert (
        "| `model.layers.1.self_attn` | self | heads 0-3 of 8 | heads 0 of 2 |" in card.text
    )  # GQA: 4 query heads share 1 kv head
    args = reproduce(card)
    assert args[1] == "llama"  # the absolute path given is not published, only its name
    for flag in (
        "--mode polar",
        "--strength 0.5",
        "--keep-scale",
        "--heads=0-3",
        "--targets q,k",
        "--layers=1-2",
        "--num-heads 8",
    ):
        assert flag in " ".join(args), flag
    cli(*args[:-1], "again")
    assert sha256(tmp_path / "again" / "model.safetensors") == sha256(tmp_path / "out" / "model.safetensors")


def test_no_card_for_file_outputs_and_in_place_runs(tmp_path):
    src = tmp_path / "llama"
    tiny_llama().save_pretrained(src)
    (src / "README.md").write_text("# my own notes\n")
    (tmp_path / "file-out").mkdir()
    reinit_checkpoint(
        src / "model.safetensors", output=tmp_path / "file-out", layers="0"
    )  # a file output: the file only
    assert sorted(tree_digest(tmp_path / "file-out")) == ["model.safetensors"]
    reinit_checkpoint(src, in_place=True, layers="0")  # replaces the weights, leaves README.md alone
    assert (src / "README.md").read_text() == "# my own notes\n"
    assert sorted(tree_digest(src)) == ["README.md", "config.json", "generation_config.json", "model.safetensors"]
