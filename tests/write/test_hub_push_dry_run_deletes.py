"""A reinit's push dry run says which of the destination's files the real push deletes (its other weights, which a
loader would read instead of the new ones), asking the Hub only read-only questions; the real push then deletes
exactly those, and the repo's one weight file is the new one."""

from __future__ import annotations

import torch
from safetensors.torch import load

from helpers.hub import TOKEN, Surgeon, serving
from helpers.tiny import tiny_llama


def test_the_dry_run_names_the_other_weights_the_push_deletes(tmp_path):
    torch.manual_seed(0)
    source, old = tmp_path / "src", tmp_path / "old"
    tiny_llama().save_pretrained(source)
    tiny_llama().save_pretrained(old, max_shard_size="100KB")  # the destination holds another layout: shards
    stale = sorted(p.name for p in old.iterdir() if p.name.startswith("model-") or p.name.endswith(".index.json"))
    assert len(stale) > 2  # an index and its shards
    work = tmp_path / "work"
    work.mkdir()
    with serving("org/tiny", source) as hub:
        hub.add_model("me/x", old)
        surgeon = Surgeon(work, hub.url)
        planned = surgeon("reinit", "org/tiny", "--layers", "0", "--push-to-hub", "me/x", "--dry-run", token=TOKEN)
        kept = surgeon(
            "reinit", "org/tiny", "--layers", "0", "--push-to-hub", "me/x", "--dry-run", "--keep-other-weights",
            token=TOKEN,
        )  # fmt: skip
        assert not any(r.method in ("POST", "PUT") for r in hub.requests)  # a dry run sends nothing
        line = next(x for x in planned.stdout.splitlines() if "the real push deletes" in x)
        assert f"the real push deletes {len(stale)} other weight file(s) me/x holds" in line
        assert all(name in line for name in stale) and "--keep-other-weights keeps them" in line
        assert "the real push deletes" not in kept.stdout
        surgeon("reinit", "org/tiny", "--layers", "0", "--push-to-hub", "me/x", token=TOKEN)
        pushed = hub.files("me/x")
    assert not set(stale) & set(pushed)  # deleted in the push's commit, as the dry run said
    new = load(pushed["model.safetensors"])
    original = load((source / "model.safetensors").read_bytes())
    assert not torch.equal(
        new["model.layers.0.self_attn.q_proj.weight"], original["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(
        new["model.layers.1.self_attn.q_proj.weight"], original["model.layers.1.self_attn.q_proj.weight"]
    )
