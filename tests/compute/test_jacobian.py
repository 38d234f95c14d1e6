"""surgeon.jacobian_report and `surgeon inspect --jacobian`: Theorem 3.1's terms on real inputs.

The expected numbers are computed here independently: X from the model's own hidden states
(output_hidden_states, not hooks), the head Jacobian written out analytically in numpy (not
autograd), every condition number from numpy's SVD.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import surgeon

from helpers.cli import expect_cli_error
from helpers.tiny import tiny_bert

IDS = torch.tensor([[1, 5, 9, 33, 2, 70], [3, 8, 41, 17, 90, 6]])


def _kappa(m):
    s = np.linalg.svd(m, compute_uv=False)
    return s.max() / s.min()


def _softmax(s):
    e = np.exp(s - s.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _expected(x, wq, wk, wv):
    """Theorem 3.1's terms and the exact kappa(J) of softmax(X Wq Wk^T X^T / sqrt d) X Wv, by hand."""
    n, d = x.shape[0], wq.shape[1]
    p = _softmax(x @ wq @ wk.T @ x.T / math.sqrt(d))
    lam = np.stack([np.diag(r) - np.outer(r, r) for r in p])  # lam[i] = d p_i / d s_i
    lam_sv = np.concatenate([np.linalg.svd(b, compute_uv=False) for b in lam])
    keep = lam_sv[lam_sv > lam_sv.max() * n * n * np.finfo(np.float64).eps]
    q, k, v = x @ wq, x @ wk, x @ wv
    # dA[i,c] / dWq[a,b] = sum_jk V[j,c] lam[i,j,k] X[i,a] K[k,b] / sqrt d, and likewise for Wk; dA/dWv = (PX)[i,a] delta_cb
    jq = np.einsum("jc,ijk,ia,kb->icab", v, lam, x, k) / math.sqrt(d)
    jk = np.einsum("jc,ijk,ib,ka->icab", v, lam, q, x) / math.sqrt(d)
    jv = np.einsum("ia,cb->icab", p @ x, np.eye(d))
    jac = np.concatenate([j.reshape(n * d, -1) for j in (jq, jk, jv)], axis=1)
    terms = {
        "kappa_x": _kappa(x),
        "kappa_lambda": keep.max() / keep.min(),
        "kappa_p": _kappa(p),
        "kappa_q": _kappa(wq),
        "kappa_k": _kappa(wk),
        "kappa_v": _kappa(wv),
        "exact": _kappa(jac),
    }
    terms["bound"] = (
        terms["kappa_x"] ** 3 * terms["kappa_lambda"] * terms["kappa_v"] * (terms["kappa_q"] + terms["kappa_k"])
        + terms["kappa_x"] * terms["kappa_p"]
    )
    return terms


def _check_against_independent(model, report):
    with torch.no_grad():
        hidden = model(IDS, output_hidden_states=True).hidden_states  # BERT: layer i's attention reads hidden_states[i]
    assert len(report.rows) == 2 * 2 * 4  # inputs x layers x heads
    for r in report.rows:
        att = model.encoder.layer[r.layer].attention.self
        rows = slice(12 * r.head, 12 * (r.head + 1))
        w = [getattr(att, n).weight[rows].detach().double().T.numpy() for n in ("query", "key", "value")]
        want = _expected(hidden[r.layer][r.input].double().numpy(), *w)
        for key, value in want.items():
            assert getattr(r, key) == pytest.approx(value, rel=1e-6), (key, r)
        assert r.exact <= r.bound and not r.exact_pseudo
    return report


def test_jacobian_terms_equal_an_independent_computation_and_the_bound_holds(one_thread):
    model = tiny_bert()
    report = _check_against_independent(model, surgeon.jacobian_report(model, IDS))
    assert report.by_layer()[0]["bound_holds"] == "8/8"
    text = report.render()
    assert "encoder.layer.1.attention.self" in text and "8/8" in text


def test_after_a_conditioned_reset_the_weight_factor_is_two_and_the_bound_still_holds(one_thread):
    model = tiny_bert()
    surgeon.reinit_(model)
    report = _check_against_independent(model, surgeon.jacobian_report(model, IDS))
    for r in report.rows:
        assert r.kappa_v * (r.kappa_q + r.kappa_k) == pytest.approx(2.0, rel=1e-6)  # float32 weights


def test_cli_jacobian_on_the_real_minilm(cli, minilm_dir):
    out = json.loads(cli("inspect", minilm_dir, "--jacobian", "--json").stdout)
    layers = out["jacobian"]["layers"]
    assert [e["layer"] for e in layers] == list(range(6))
    rows = out["jacobian"]["rows"]
    assert len(rows) == 4 * 6 * 12  # the built-in sample's 4 sentences, 6 layers, 12 heads
    # the per-head kappa of W_Q from the built model equals inspect's, computed from the file by another route
    by_head = {r["head"]: r["kappa_q"] for r in rows if r["layer"] == 0 and r["input"] == 0}
    q0 = next(p for p in out["projections"] if p["layer"] == 0 and p["role"] == "q")
    assert [by_head[h] for h in range(12)] == pytest.approx(q0["before"]["heads"], rel=1e-6)
    assert all(r["bound"] >= r["kappa_x"] * r["kappa_p"] for r in rows)
    text = cli("inspect", minilm_dir, "--jacobian").stdout
    assert "Theorem 3.1" in text and "encoder.layer.5.attention.self" in text


def test_cli_jacobian_text_lines_are_tokenized(cli, minilm_dir, tmp_path):
    lines = tmp_path / "text.txt"
    lines.write_text("Short one.\n\nA second, slightly longer line of text.\n")
    out = json.loads(cli("inspect", minilm_dir, "--jacobian", "--inputs", lines, "--json").stdout)["jacobian"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    lengths = [len(tok(t)["input_ids"]) for t in ("Short one.", "A second, slightly longer line of text.")]
    assert sorted({(r["input"], r["tokens"]) for r in out["rows"]}) == list(enumerate(lengths))
    assert len(out["rows"]) == 2 * 6 * 12
    assert f"2 inputs of {lengths[0]}, {lengths[1]} tokens" in out["notes"][0]


def test_cli_jacobian_inputs_file_and_refusals(cli, llama_dir, tmp_path):
    ids = tmp_path / "ids.pt"
    torch.save(torch.tensor([[1, 5, 9, 33, 2]]), ids)
    out = json.loads(cli("inspect", llama_dir, "--jacobian", "--inputs", ids, "--json").stdout)["jacobian"]
    assert len(out["rows"]) == 3 * 8 and all(r["exact"] <= r["bound"] for r in out["rows"])
    expect_cli_error(cli, llama_dir, "inspect", llama_dir, "--jacobian", match="no tokenizer beside it")
    bad = tmp_path / "bad.pt"
    torch.save(torch.randn(3), bad)
    expect_cli_error(
        cli, llama_dir, "inspect", llama_dir, "--jacobian", "--inputs", bad, match="integer tensor of token ids"
    )


def test_a_custom_module_with_example_inputs(one_thread):
    """nn.MultiheadAttention (sequence-first): X is the query it is called with; weights from in_proj_weight."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2)  # batch_first=False: inputs are (N, batch, D)
    x = torch.randn(5, 1, 16)
    report = surgeon.jacobian_report(mha, (x, x, x))
    assert len(report.rows) == 2
    assert isinstance(report.rows, tuple) and isinstance(report.notes, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):  # a value, made once
        report.notes = ()
    w = mha.in_proj_weight.detach().double()
    for r in report.rows:
        rows = [slice(16 * i + 8 * r.head, 16 * i + 8 * (r.head + 1)) for i in range(3)]
        want = _expected(x[:, 0].double().numpy(), *(w[s].T.numpy() for s in rows))
        for key, value in want.items():
            assert getattr(r, key) == pytest.approx(value, rel=1e-6), key
        assert r.exact <= r.bound
