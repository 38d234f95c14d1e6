"""``--mode restore --from SOURCE``: the selected heads (and their biases) take SOURCE's values. Judged from outside,
with the reference safetensors reader: the restored tensors hold SOURCE's bytes exactly, every other tensor MODEL's;
``--strength t`` is the mixture this test computes; a SOURCE of another shape, dtype or architecture is refused in one
line naming the tensor; the record names SOURCE (a Hub id and commit, or its files' sha256) and verify re-derives
from it, refusing a wrong SOURCE and an output with one changed element."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from surgeon import reinit_checkpoint

from helpers.cli import expect_cli_error
from helpers.elements import nudge
from helpers.families import FAMILIES
from helpers.hub import TOKEN, Surgeon
from helpers.hub_server import HubServer
from helpers.tiny import tiny_llama

ATTENTION = ("query", "key", "value")


def _tuned(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with every parameter moved a little: a stand-in for a fine-tuned copy of it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("restore")
    FAMILIES["bert"].make().save_pretrained(root / "base")
    _tuned(FAMILIES["bert"].make(), 1).save_pretrained(root / "tuned")
    return root / "base", root / "tuned"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _restored(layer: int) -> set[str]:
    return {f"encoder.layer.{layer}.attention.self.{p}.{w}" for p in ATTENTION for w in ("weight", "bias")}


def _record(path):
    with safe_open(path / "model.safetensors", "np") as f:
        (record,) = json.loads(f.metadata()["surgeon"])
    return record


def test_restore_gives_source_bytes_and_leaves_every_other_tensor(models, tmp_path, cli):
    base, tuned = models
    out = tmp_path / "out"
    cli("reinit", tuned, "--mode", "restore", "--from", base, "--layers", "1", "-o", out)
    a, b, got = (load_file(p / "model.safetensors") for p in (base, tuned, out))
    for name in got:
        expected = a[name] if name in _restored(1) else b[name]
        assert torch.equal(_bits(got[name]), _bits(expected)), name

    record = _record(out)
    assert record["method"] == "restore-from-checkpoint" and record["options"]["from_"] == "base"  # a name, no path
    digest = __import__("hashlib").sha256((base / "model.safetensors").read_bytes()).hexdigest()
    assert record["from"] == {"sha256": {"model.safetensors": digest}}
    card = (out / "README.md").read_text()
    assert "--mode restore" in card and "--from base" in card and str(base) not in card

    assert cli("verify", tuned, out, "--from", base).stdout.startswith("verified:")
    expect_cli_error(cli, tmp_path, "verify", tuned, out, match="was restored from base, a checkpoint on disk")
    expect_cli_error(cli, tmp_path, "verify", tuned, out, "--from", tuned, match="other sha256 digests")
    nudge(out / "model.safetensors", "encoder.layer.1.attention.self.value.bias")
    refused = cli("verify", tuned, out, "--from", base, ok=False)
    assert refused.exit_code == 3 and "encoder.layer.1.attention.self.value.bias" in refused.stderr, refused.stderr


def test_restore_of_some_heads_takes_only_their_rows(models, tmp_path):
    base, tuned = models
    out = tmp_path / "out"
    reinit_checkpoint(tuned, output=out, mode="restore", from_=str(base), heads="1,3", targets="q,k", layers="0")
    a, b, got = (load_file(p / "model.safetensors") for p in (base, tuned, out))
    d = 48 // 4
    rows = torch.zeros(48, dtype=torch.bool)
    rows[d : 2 * d] = rows[3 * d : 4 * d] = True
    for name in got:
        if name.startswith("encoder.layer.0.attention.self.") and ("query" in name or "key" in name):
            expected = torch.where(rows if name.endswith("bias") else rows[:, None], a[name], b[name])
        else:
            expected = b[name]
        assert torch.equal(_bits(got[name]), _bits(expected)), name


def test_restore_part_of_the_way(models, tmp_path, cli):
    """t = 0.4: (1 - t) * current + t * SOURCE, weights and biases alike, in float64 rounded once."""
    base, tuned = models
    out = tmp_path / "out"
    cli("reinit", tuned, "--mode", "restore", "--from", base, "--layers", "0", "--strength", "0.4", "-o", out)
    a, b, got = (load_file(p / "model.safetensors") for p in (base, tuned, out))
    for name in got:
        if name in _restored(0):
            expected = (0.6 * b[name].double() + 0.4 * a[name].double()).to(b[name].dtype)
        else:
            expected = b[name]
        assert torch.equal(_bits(got[name]), _bits(expected)), name
    assert cli("verify", tuned, out, "--from", base).stdout.startswith("verified:")
    nudge(out / "model.safetensors", "encoder.layer.0.attention.self.key.weight", index=5)
    assert cli("verify", tuned, out, "--from", base, ok=False).exit_code == 3


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: FAMILIES["bert"].make().half(), "encoder.layer.0.attention.self.query.weight is float16 in SOURCE"),
        (lambda: _wider_bert(), "encoder.layer.0.attention.self.query.weight is [64, 64] in SOURCE"),
        (lambda: tiny_llama(), "holds no tensor encoder.layer.0.attention.self.query.weight"),
    ],
    ids=["dtype", "shape", "architecture"],
)
def test_a_mismatched_source_is_refused_naming_the_tensor(models, tmp_path, cli, make, match):
    _, tuned = models
    make().save_pretrained(tmp_path / "other")
    expect_cli_error(
        cli, tmp_path, "reinit", tuned, "--mode", "restore", "--from", tmp_path / "other", "-o", tmp_path / "o",
        match=match,
    )  # fmt: skip


def _wider_bert():
    import transformers

    config = transformers.BertConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96
    )
    return transformers.BertModel(config)


def test_restore_needs_a_source_and_a_checkpoint(tmp_path, cli):
    import surgeon

    expect_cli_error(cli, tmp_path, "reinit", tmp_path / "m", "--mode", "restore", match="name it with --from")
    expect_cli_error(
        cli, tmp_path, "reinit", tmp_path / "m", "--from", "x", match="--from applies to --mode restore only"
    )
    with pytest.raises(surgeon.OptionError, match="restore a checkpoint on disk or on the Hub"):
        surgeon.reinit_(FAMILIES["bert"].make(), mode="restore", from_="anything")


def test_restore_from_a_hub_model_at_a_revision(models, tmp_path):
    """SOURCE on the (loopback) Hub, at a branch: the record pins the commit, and verify reads it from the Hub."""
    base, tuned = models
    other = tmp_path / "v1"
    _tuned(FAMILIES["bert"].make(), 2).save_pretrained(other)
    out = tmp_path / "out"
    with HubServer() as hub:
        hub.add_token(TOKEN, "me", ("org",))
        hub.add_model("org/base", base)
        commit = hub.add_model("org/base", other, branch="v1")
        surgeon = Surgeon(tmp_path, hub.url)
        surgeon("reinit", tuned, "--mode", "restore", "--from", "org/base", "--from-revision", "v1", "--layers", "0",
                "-o", out)  # fmt: skip
        record = _record(out)
        assert record["from"] == {"repo": "org/base", "commit": commit}
        assert record["options"]["from_"] == "org/base" and record["options"]["from_revision"] == commit
        assert f"--from org/base --from-revision {commit}" in (out / "README.md").read_text()
        v1, b, got = (load_file(p / "model.safetensors") for p in (other, tuned, out))
        for name in got:
            assert torch.equal(_bits(got[name]), _bits(v1[name] if name in _restored(0) else b[name])), name
        assert surgeon("verify", tuned, out).stdout.startswith("verified:")
        nudge(out / "model.safetensors", "encoder.layer.0.attention.self.query.weight")
        assert surgeon("verify", tuned, out, ok=False).rc == 3
