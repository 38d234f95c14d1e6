"""A shard with no changed tensor is written byte for byte as its source (so the Hub can copy it
server-side); surgeon's record goes only into the shards that change, and `verify` finds it there."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from helpers.digests import sha256
from helpers.hub import make_llama_shards

LAST = "model-00007-of-00008.safetensors"  # holds layer 7's q/k/v (make_llama_shards)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_llama_shards(tmp_path_factory.mktemp("src") / "m")


def records(path) -> list:
    with safe_open(path, "pt") as f:
        return json.loads((f.metadata() or {}).get("surgeon", "[]"))


def changed_shards(index_folder, layers: set[int]) -> set[str]:
    weight_map = json.loads((index_folder / "model.safetensors.index.json").read_text())["weight_map"]
    return {
        shard
        for name, shard in weight_map.items()
        if any(f"layers.{i}.self_attn.{p}_proj" in name for i in layers for p in "qkv")
    }


def test_only_changed_shards_differ_and_carry_the_record(cli, shards, tmp_path):
    out = tmp_path / "out"
    cli("reinit", shards, "--layers", "-1", "-o", out)
    assert changed_shards(shards, {7}) == {LAST}
    for path in sorted(shards.glob("*.safetensors")):
        if path.name == LAST:
            assert sha256(out / path.name) != sha256(path)
            assert [[b["layer"] for b in r["blocks"]] for r in records(out / path.name)] == [[7]]
        else:  # the whole file, header included, is the source's
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    assert cli("verify", shards, out).stdout.startswith(f"verified: {out} is {shards} with 1 attention block")


def test_a_second_run_keeps_the_whole_history(cli, shards, tmp_path):
    """Run 2 changes another shard than run 1 did: that shard's record holds both runs, and verify
    checks run 2 against run 1's output (the earlier record found in the shard run 1 changed)."""
    first, second = tmp_path / "first", tmp_path / "second"
    cli("reinit", shards, "--layers", "-1", "-o", first)
    cli("reinit", first, "--layers", "0", "--seed", "3", "-o", second)
    (zero,) = changed_shards(shards, {0})
    assert [[b["layer"] for b in r["blocks"]] for r in records(second / zero)] == [[7], [0]]
    assert (second / LAST).read_bytes() == (first / LAST).read_bytes()
    cli("verify", first, second)
