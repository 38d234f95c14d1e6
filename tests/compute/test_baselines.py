"""Baseline modes: redraw (the family's own default init, drawn again) and the conditioned gain.

Each is checked through the model's own forward: the expected weights are computed here
independently (numpy SFC64 generators keyed like surgeon's draws, or an SVD), put into a copy of the
model by hand, and both models must give the same outputs on the same tokens.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import surgeon
from surgeon.modes.conditioning import head_seed

from helpers.cli import expect_cli_error
from helpers.tiny import tiny_bert, tiny_llama

TOKENS = torch.tensor([[1, 5, 9, 33, 2, 70, 11, 4, 60, 8]])


def _expected_redraw(weight: torch.Tensor, key: str, role: str, heads: int, std: float, seed: int = 0) -> torch.Tensor:
    """normal(0, std) per head from SFC64(head_seed(seed, tensor, role/redraw, head)), written out here."""
    d = weight.shape[0] // heads
    rows = []
    for h in range(heads):
        rng = np.random.Generator(np.random.SFC64(head_seed(seed, key, f"{role}/redraw", h)))
        rows.append(rng.standard_normal((d, weight.shape[1])) * std)
    return torch.from_numpy(np.concatenate(rows)).to(weight.dtype)


def _attn(model, layer):
    return model.model.layers[layer].self_attn


def test_redraw_llama_is_the_config_normal_through_the_forward(one_thread):
    model = tiny_llama(initializer_range=0.05)
    expected = copy.deepcopy(model)
    report = surgeon.reinit_(model, mode="redraw", seed=3)
    assert report.options["std"] == 0.05 and report.options["bias"] == "zero"
    cfg = model.config
    for i in range(cfg.num_hidden_layers):
        for role, proj, heads in (("q", "q_proj", 8), ("k", "k_proj", 2), ("v", "v_proj", 2)):
            name = f"layers.{i}.self_attn.{proj}.weight"  # keyed relative to the base model (no model.)
            w = _expected_redraw(getattr(_attn(expected, i), proj).weight, name, role, heads, 0.05, seed=3)
            getattr(_attn(expected, i), proj).weight.data.copy_(w)
    with torch.no_grad():
        got, want = model(TOKENS).logits, expected(TOKENS).logits
    assert torch.equal(got, want)
    # the draws are the family's distribution: std of all q/k/v weights within 3% of 0.05, mean ~ 0
    flat = torch.cat(
        [getattr(_attn(model, i), p).weight.flatten() for i in range(3) for p in ("q_proj", "k_proj", "v_proj")]
    )
    assert abs(flat.std().item() / 0.05 - 1) < 0.03 and abs(flat.mean().item()) < 0.05 * 4 / math.sqrt(flat.numel())


def test_redraw_default_std_std_option_and_seeds(one_thread):
    model = tiny_llama(initializer_range=0.3)
    assert surgeon.reinit_(model, mode="redraw", std=0.02).options["std"] == 0.02  # --std wins over the config
    a = _attn(model, 0).q_proj.weight.detach().clone()
    other = tiny_llama()
    surgeon.reinit_(other, mode="redraw", std=0.02)
    assert torch.equal(_attn(other, 0).q_proj.weight, a)  # same (seed, tensor, role, head): same bits
    surgeon.reinit_(other, mode="redraw", std=0.02, seed=1)
    assert not torch.equal(_attn(other, 0).q_proj.weight, a)
    # a head's draw does not depend on which other heads are selected
    part = tiny_llama()
    surgeon.reinit_(part, mode="redraw", std=0.02, heads="4-7", targets="q")
    assert torch.equal(_attn(part, 0).q_proj.weight[32:], a[32:])
    assert torch.equal(_attn(part, 0).q_proj.weight[:32], _attn(tiny_llama(), 0).q_proj.weight[:32])


def test_redraw_checkpoint_equals_in_memory_and_verifies(cli, llama_dir, tmp_path):
    out = tmp_path / "out"
    cli("reinit", llama_dir, "--mode", "redraw", "--seed", "2", "-o", out)
    assert "verified" in cli("verify", llama_dir, out).stdout
    model = tiny_llama()
    surgeon.reinit_(model, mode="redraw", seed=2)
    saved = load_file(out / "model.safetensors")
    for name, p in model.state_dict().items():
        assert torch.equal(saved[name], p), name
    card = (out / "README.md").read_text()
    assert "--mode redraw" in card and "--std 0.02" in card


def test_redraw_multihead_attention_is_xavier_uniform(one_thread):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    x = torch.randn(1, 7, 64)
    before = mha.out_proj.weight.detach().clone()
    report = surgeon.reinit_(mha, mode="redraw", example_inputs=(x, x, x))
    assert report.options["std"] == 0.02  # no config: the documented default (unused by xavier tensors)
    # only xavier draws were made, so the summary names no normal(0, std)
    assert "mode redraw, xavier_uniform for nn.MultiheadAttention tensors, bias" in report.render()
    w = mha.in_proj_weight.detach()
    bound = math.sqrt(6 / (64 + 192))  # torch's xavier_uniform_ on the (192, 64) in_proj_weight
    assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound
    assert abs(w.std().item() / (bound / math.sqrt(3)) - 1) < 0.03
    assert torch.count_nonzero(mha.in_proj_bias) == 0 and torch.equal(mha.out_proj.weight, before)
    out, _ = mha(x, x, x)
    assert torch.isfinite(out).all()


def _sv(m: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(m.double())


def test_conditioned_gain_scales_query_key_not_value(one_thread):
    plain, scaled = tiny_bert(), tiny_bert()
    surgeon.reinit_(plain)
    report = surgeon.reinit_(scaled, gain=0.25)
    assert report.options["gain"] == 0.25 and "gain" not in surgeon.reinit_(tiny_bert()).options
    for i in range(2):
        a, b = plain.encoder.layer[i].attention.self, scaled.encoder.layer[i].attention.self
        for h in range(4):
            rows = slice(12 * h, 12 * (h + 1))
            for proj in ("query", "key"):
                assert torch.allclose(
                    _sv(getattr(b, proj).weight[rows]), torch.full((12,), 0.25, dtype=torch.float64), atol=1e-6
                )
                assert torch.allclose(getattr(b, proj).weight, 0.25 * getattr(a, proj).weight)
        assert torch.equal(b.value.weight, a.value.weight)
    # through the forward: the gain-0.25 model equals the plain reset with q/k scaled by hand
    by_hand = copy.deepcopy(plain)
    with torch.no_grad():
        for layer in by_hand.encoder.layer:
            layer.attention.self.query.weight.mul_(0.25)
            layer.attention.self.key.weight.mul_(0.25)
        assert torch.allclose(scaled(TOKENS).last_hidden_state, by_hand(TOKENS).last_hidden_state, atol=1e-6)
    # gain 1 is the plain reset, bit for bit
    one = tiny_bert()
    surgeon.reinit_(one, gain=1.0)
    assert all(torch.equal(p, q) for p, q in zip(one.state_dict().values(), plain.state_dict().values()))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("--mode", "polar", "--gain", "0.5"), "--gain applies to --mode conditioned only"),
        (("--std", "0.1"), "--std applies to --mode redraw only"),
        (("--gain", "0"), "--gain must be a finite number above 0"),
        (("--mode", "redraw", "--std", "nan"), "--std must be a finite number above 0"),
        (("--gain", "2", "--keep-scale"), "--gain and --keep-scale"),
    ],
)
def test_baseline_option_errors_are_one_line(cli, llama_dir, tmp_path, args, match):
    expect_cli_error(cli, llama_dir, "reinit", llama_dir, *args, "-o", tmp_path / "o", match=match)


# --- mimetic (Trockman & Kolter 2023) --------------------------------------------------------------


def _z(seed, key, tag, head, width):
    rng = np.random.Generator(np.random.SFC64(head_seed(seed, key, tag, head)))
    return rng.uniform(-math.sqrt(3 / width), math.sqrt(3 / width), size=(width, width))


def _rank(a, r):
    u, s, vt = np.linalg.svd(a)
    return (u[:, :r] * s[:r]) @ vt[:r]


def test_mimetic_bert_products_through_the_forward(one_thread):
    model = tiny_bert()
    report = surgeon.reinit_(model, mode="mimetic", seed=4)
    assert "output projections W_O are rewritten too" in report.render()
    x = torch.tensor([[1, 5, 9, 33, 2, 70]])
    for i, layer in enumerate(model.encoder.layer):
        att, key = layer.attention.self, f"encoder.layer.{i}.attention.self"
        wq, wk, wv = (getattr(att, n).weight.detach().double().T.numpy() for n in ("query", "key", "value"))  # D x H*d
        wo = layer.attention.output.dense.weight.detach().double().T.numpy()  # H*d x D
        for h in range(4):
            s = slice(12 * h, 12 * (h + 1))
            want = _rank(0.7 * _z(4, key, "qk/mimetic", h, 48) + 0.7 * np.eye(48), 12)
            assert np.allclose(wq[:, s] @ wk[:, s].T, want, atol=1e-5)
        assert np.allclose(
            wv @ wo, 0.4 * _z(4, key, "vo/mimetic", 0, 48) - 0.4 * np.eye(48), atol=1e-5
        )  # full rank: exact
        assert torch.count_nonzero(att.query.bias) == 0
        # through the forward: attention scores of head 0 are X (0.7 Z + 0.7 I)_rank12 X^T / sqrt(12)
        with torch.no_grad():
            hidden = model(x, output_hidden_states=True).hidden_states[i][0].double().numpy()
        scores = (hidden @ wq[:, :12]) @ (hidden @ wk[:, :12]).T
        assert np.allclose(
            scores, hidden @ _rank(0.7 * _z(4, key, "qk/mimetic", 0, 48) + 0.7 * np.eye(48), 12) @ hidden.T, atol=1e-4
        )


def test_mimetic_gpt2_checkpoint_equals_in_memory_and_verifies(cli, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    def make():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)).eval()

    src, out = tmp_path / "gpt2", tmp_path / "out"
    make().save_pretrained(src)
    result = cli("reinit", src, "--mode", "mimetic", "-o", out)
    assert "W_O are rewritten too" in result.stdout
    assert "verified" in cli("verify", src, out).stdout
    model = make()
    before = model.transformer.h[0].attn.c_proj.weight.detach().clone()
    surgeon.reinit_(model, mode="mimetic")
    saved = load_file(out / "model.safetensors")
    for name, p in model.state_dict().items():
        if name in saved:
            assert torch.equal(saved[name], p), name
    wo = model.transformer.h[0].attn.c_proj.weight.detach().double()  # Conv1D: stored (H*d, D) = W_O
    wv = model.transformer.h[0].attn.c_attn.weight.detach().double()[:, 64:]  # Conv1D (D, 3*H*d): the value block
    assert not torch.equal(wo.float(), before)
    assert torch.allclose(
        wv @ wo,
        torch.from_numpy(0.4 * _z(0, "h.0.attn", "vo/mimetic", 0, 32) - 0.4 * np.eye(32)),  # keyed without transformer.
        atol=1e-5,
    )
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3, 4]])).logits).all()


def test_mimetic_refusals(cli, llama_dir, tmp_path):
    expect_cli_error(
        cli,
        llama_dir,
        "reinit",
        llama_dir,
        "--mode",
        "mimetic",
        "-o",
        tmp_path / "o",
        match="needs one key/value head per query head",
    )
    model = tiny_bert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(surgeon.OptionError, match="select all heads and targets=q,k,v"):
        surgeon.reinit_(model, mode="mimetic", targets="q,k")
    with pytest.raises(surgeon.OptionError, match="select all heads"):
        surgeon.reinit_(model, mode="mimetic", heads="0-1")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # refused before anything changed


def test_mimetic_without_an_output_projection_is_refused():
    class Attn(torch.nn.Module):  # q/k/v but no recognisable W_O
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(16, 16) for _ in range(3))
            self.mix = torch.nn.Linear(16, 16)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = (p(x).view(b, n, 2, 8).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            return self.mix(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 16))

    with pytest.raises(surgeon.LayoutError, match="no single output projection"):
        surgeon.reinit_(Attn(), mode="mimetic", num_heads=2)
