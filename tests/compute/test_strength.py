"""``--strength t`` for the fresh modes: each selected head becomes ``(1 - t) * old + t * fresh``, and ``--strength A:B``
ramps t over each stack's selected layers. Judged from outside: t = 1 is the output without it, byte for byte; t = 0.5
is the mixture this test computes from the base weights and a t = 1 output (read with the reference safetensors
reader), rounded to the stored dtype; a ramp gives each layer the value a line through A and B gives it; polar keeps
its own meaning (sigma -> sigma^(1-t)); verify accepts every output and refuses one with one changed element."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers.cli import expect_cli_error
from helpers.elements import nudge
from helpers.families import FAMILIES
from helpers.tiny import tiny_llama


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert") / "bert"
    FAMILIES["bert"].make().save_pretrained(path)  # biases drawn, not zero: what happens to them shows
    return path


def _run(cli, src, out, *args) -> dict:
    return json.loads(cli("reinit", src, "-o", out, "--json", *args).stdout)


def _verified_and_refused_when_nudged(cli, src, out, tensor):
    assert cli("verify", src, out).stdout.startswith("verified:")
    nudge(out / "model.safetensors", tensor)
    refused = cli("verify", src, out, ok=False)
    assert refused.exit_code == 3 and tensor in refused.stderr, refused.stderr


def _mixture(base: torch.Tensor, full: torch.Tensor, t: float) -> torch.Tensor:
    """(1 - t) * base + t * full in float64, rounded once to the stored dtype."""
    return ((1 - t) * base.double() + t * full.double()).to(base.dtype)


@pytest.mark.parametrize("mode", ["conditioned", "redraw", "mimetic"])
def test_strength_one_is_the_output_without_it_and_a_half_is_the_mixture(bert, tmp_path, cli, mode):
    plain, one, half = tmp_path / "plain" / "out", tmp_path / "one" / "out", tmp_path / "half"  # the card names "out"
    _run(cli, bert, plain, "--mode", mode)
    _run(cli, bert, one, "--mode", mode, "--strength", "1")
    for name in ("model.safetensors", "README.md"):  # the weights, the record and the card: the same bytes
        assert (one / name).read_bytes() == (plain / name).read_bytes(), name

    report = _run(cli, bert, half, "--mode", mode, "--strength", "0.5")
    assert {p["strength"] for p in report["projections"]} == {0.5}
    base, full, mixed = (load_file(p / "model.safetensors") for p in (bert, one, half))
    changed = {n for n in base if not torch.equal(base[n], full[n])}
    weights = {n for n in changed if not n.endswith("bias")}
    assert any(".self.query.weight" in n for n in weights)
    assert any(".output.dense.weight" in n for n in weights) == (mode == "mimetic")  # W_O, mixed too
    for name in base:
        if name in weights:
            expected = _mixture(base[name], full[name], 0.5)
            assert torch.equal(mixed[name].view(torch.uint8), expected.view(torch.uint8)), name
        else:  # untouched, or a bias: as --bias says (zeroed, as at t = 1), never mixed
            assert torch.equal(mixed[name], full[name]), name
    assert any(n.endswith("query.bias") and not torch.equal(base[n], mixed[n]) for n in base)  # zeroed: visible
    _verified_and_refused_when_nudged(cli, bert, half, "encoder.layer.0.attention.self.query.weight")


def test_a_mixture_of_some_heads_in_bfloat16_keeps_the_rest(tmp_path, cli):
    """Heads 0-3 of q only, bf16: the other rows keep their bits; the mixed rows are rounded once, to bf16."""
    src = tmp_path / "llama"
    tiny_llama().to(torch.bfloat16).save_pretrained(src)
    args = ("--targets", "q", "--heads", "0-3", "--layers", "1")
    _run(cli, src, tmp_path / "one", *args)
    _run(cli, src, tmp_path / "half", *args, "--strength", "0.5")
    base, full, mixed = (load_file(p / "model.safetensors") for p in (src, tmp_path / "one", tmp_path / "half"))
    name = "model.layers.1.self_attn.q_proj.weight"
    d = 64 // 8
    rows = slice(0, 4 * d)
    assert torch.equal(
        mixed[name][rows].view(torch.int16), _mixture(base[name], full[name], 0.5)[rows].view(torch.int16)
    )
    assert torch.equal(mixed[name][4 * d :].view(torch.int16), base[name][4 * d :].view(torch.int16))
    assert all(torch.equal(base[n], mixed[n]) for n in base if n != name)
    _verified_and_refused_when_nudged(cli, src, tmp_path / "half", name)


def test_keep_scale_applies_to_the_mixture(bert, tmp_path, cli):
    _run(cli, bert, tmp_path / "one", "--layers", "0")
    _run(cli, bert, tmp_path / "kept", "--layers", "0", "--strength", "0.3", "--keep-scale")
    base, full, kept = (load_file(p / "model.safetensors") for p in (bert, tmp_path / "one", tmp_path / "kept"))
    for proj in ("query", "key", "value"):
        name = f"encoder.layer.0.attention.self.{proj}.weight"
        old, mix = (
            base[name].double().reshape(4, 12, 48),
            _mixture(base[name], full[name], 0.3).double().reshape(4, 12, 48),
        )
        old_norm, mix_norm = torch.linalg.matrix_norm(old), torch.linalg.matrix_norm(mix)
        expected = mix * (old_norm / mix_norm)[:, None, None]  # the mixture's direction at the old head's norm
        np.testing.assert_allclose(
            kept[name].double().reshape(4, 12, 48).numpy(), expected.numpy(), rtol=2e-6, atol=1e-7
        )
    _verified_and_refused_when_nudged(cli, bert, tmp_path / "kept", "encoder.layer.0.attention.self.key.weight")


def test_a_ramp_gives_each_layer_of_each_stack_its_value(tmp_path, cli):
    """BART: an encoder and a decoder stack of 2 layers each (the decoder's self- and cross-attention): A:B ramps
    over each stack on its own, so layer 0 of both takes A and layer 1 of both takes B."""
    src = tmp_path / "bart"
    FAMILIES["bart"].make().save_pretrained(src)
    _run(cli, src, tmp_path / "one")
    report = _run(cli, src, tmp_path / "ramp", "--strength", "0.25:0.75")
    at = {(p["stack"], p["layer"], p["kind"]): p["strength"] for p in report["projections"]}
    assert at == {
        (stack, layer, kind): (0.25, 0.75)[layer]
        for stack, kinds in (("model.encoder.layers", ("self",)), ("model.decoder.layers", ("self", "cross")))
        for layer in (0, 1)
        for kind in kinds
    }
    base, full, ramp = (load_file(p / "model.safetensors") for p in (src, tmp_path / "one", tmp_path / "ramp"))
    for name in base:
        if name.endswith("_proj.weight") and "out_proj" not in name and ("self_attn" in name or "encoder_attn" in name):
            t = 0.25 if ".layers.0." in name else 0.75
            assert torch.equal(ramp[name], _mixture(base[name], full[name], t)), name
    table = cli("reinit", src, "-o", tmp_path / "again", "--strength", "0.25:0.75").stdout
    assert "strength 0.25:0.75 (per layer below)" in table
    assert [line.split()[-1] for line in table.splitlines() if line.startswith("model.encoder.layers.")] == (
        ["0.25"] * 3 + ["0.75"] * 3
    )
    _verified_and_refused_when_nudged(cli, src, tmp_path / "ramp", "model.decoder.layers.1.encoder_attn.k_proj.weight")


def test_one_selected_layer_takes_the_end_of_the_ramp(bert, tmp_path, cli):
    _run(cli, bert, tmp_path / "one", "--layers", "1")
    report = _run(cli, bert, tmp_path / "ramp", "--layers", "1", "--strength", "0.2:0.5")
    assert {p["strength"] for p in report["projections"]} == {0.5}
    base, full, ramp = (load_file(p / "model.safetensors") for p in (bert, tmp_path / "one", tmp_path / "ramp"))
    name = "encoder.layer.1.attention.self.value.weight"
    assert torch.equal(ramp[name], _mixture(base[name], full[name], 0.5))
    card = (tmp_path / "ramp" / "README.md").read_text()
    assert "--strength 0.2:0.5" in card and "| strength |" in card


def test_polar_keeps_its_own_strength_per_layer(tmp_path, cli):
    """Polar with a ramp: each layer's singular values move to sigma^(1 - t) at that layer's t."""
    src = tmp_path / "llama"
    tiny_llama().save_pretrained(src)
    _run(cli, src, tmp_path / "polar", "--mode", "polar", "--targets", "q", "--strength", "0.5:1")
    base, out = load_file(src / "model.safetensors"), load_file(tmp_path / "polar" / "model.safetensors")
    for layer, t in ((0, 0.5), (1, 0.75), (2, 1.0)):
        name = f"model.layers.{layer}.self_attn.q_proj.weight"
        old = torch.linalg.svdvals(base[name].double().reshape(8, 8, 64))
        new = torch.linalg.svdvals(out[name].double().reshape(8, 8, 64))
        np.testing.assert_allclose(new.numpy(), (old ** (1 - t)).numpy(), rtol=1e-5)
    assert cli("verify", src, tmp_path / "polar").stdout.startswith("verified:")


def test_strength_zero_is_refused_as_changing_nothing(bert, tmp_path, cli):
    expect_cli_error(
        cli, tmp_path, "reinit", bert, "-o", tmp_path / "o", "--strength", "0", match="--strength 0 changes nothing"
    )


def test_biases_follow_the_bias_option_not_the_strength(bert, tmp_path, cli):
    _run(cli, bert, tmp_path / "kept", "--strength", "0.5", "--bias", "keep", "--layers", "0")
    base, kept = load_file(bert / "model.safetensors"), load_file(tmp_path / "kept" / "model.safetensors")
    biases = [n for n in base if ".layer.0.attention.self." in n and n.endswith("bias")]
    assert len(biases) == 3 and all(torch.equal(base[n], kept[n]) for n in biases)
    assert not torch.equal(
        base["encoder.layer.0.attention.self.query.weight"], kept["encoder.layer.0.attention.self.query.weight"]
    )
