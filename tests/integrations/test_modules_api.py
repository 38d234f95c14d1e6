"""The public Python API on models in memory: surgeon.reinit_, surgeon.inspect and their dispatch,
the report, option handling, errors, trainability afterwards, and the CUDA path (skipped here)."""

from __future__ import annotations

import json

import pytest
import torch

import surgeon
from surgeon.cli.commands import cli_spelling
from surgeon.errors import NoAttentionFoundError, OptionError, SelectionError

from helpers.families import FAMILIES
from helpers.modules import LucidAttention, Stack
from helpers.records import DEFAULT_OPTIONS
from helpers.tiny import tiny_llama

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return minilm_dir, SentenceTransformer(str(minilm_dir), device="cpu")


def test_real_minilm_in_memory_matches_the_checkpoint_path(minilm, tmp_path):
    """A sentence-transformers model in memory (BERT inside a wrapper): same blocks, same condition
    numbers as the checkpoint on disk, and the same weights after the same reset."""
    import copy

    folder, st = minilm
    model = copy.deepcopy(st)
    on_disk = surgeon.inspect(folder, full=True)
    in_memory = surgeon.inspect(model, full=True)
    prefix = "0.model."  # sentence-transformers' Transformer module holds the BertModel as .model
    assert [b.module for b in in_memory.blocks] == [prefix + b.module for b in on_disk.blocks]
    for a, b in zip(in_memory.rows, on_disk.rows):
        assert a.role == b.role
        assert a.before.head_kappas == pytest.approx(b.before.head_kappas, rel=1e-12)
        assert a.before.kappa == pytest.approx(b.before.kappa, rel=1e-9)

    report = surgeon.reinit_(model, layers="-2-", seed=5)
    surgeon.reinit_checkpoint(folder, output=tmp_path / "out", layers="-2-", seed=5)
    from safetensors.torch import load_file

    expected = load_file(tmp_path / "out" / "model.safetensors")
    got = model.get_submodule(prefix[:-1]).state_dict()
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    assert {(r.block.layer, r.role) for r in report.rows} == {(layer, r) for layer in (4, 5) for r in "qkv"}
    emb = model.encode(["surgery on attention"], convert_to_tensor=True)
    assert emb.shape == (1, 384) and torch.isfinite(emb).all()


def test_report_content():
    model = tiny_llama()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = surgeon.reinit_(model, layers=[2], targets="q,v", seed=1)
    assert report.command == "reinit" and report.output is None
    assert report.source == "LlamaForCausalLM (in memory)"
    assert report.format == "nn.Module, float32 on cpu"
    assert [(b.stack, b.layer) for b in report.blocks] == [("model.layers", i) for i in range(3)]
    assert [(r.block.layer, r.role, r.heads_changed, r.dtype, r.bias_zeroed) for r in report.rows] == [
        (2, "q", tuple(range(8)), "float32", False),
        (2, "v", (0, 1), "float32", False),
    ]
    for row in report.rows:
        old = weights[row.block.projection(row.role).weight.tensor].double()
        heads = old.view(-1, 8, 64)
        expected = [float(s[0] / s[-1]) for s in torch.linalg.svdvals(heads)]
        assert row.before.head_kappas == pytest.approx(expected, rel=1e-9)
        assert row.after.head_max == pytest.approx(1.0, abs=1e-5)
    data = json.loads(report.to_json())
    assert data["options"]["layers"] == [2] and data["options"]["targets"] == ["q", "v"]
    assert [p["role"] for p in data["projections"]] == ["q", "v"]
    assert data["output"] is None and data["device"] == "cpu"
    text = report.render()
    assert "re-initialized: 2 projections in 1 block;" in text
    assert "model.layers.2 self  q" in text


def test_layer_specs_and_iterables_pick_the_same_layers():
    picks = []
    for spec in ("1-2", "-2-", [1, 2], (i for i in (2, 1)), range(1, 3)):
        picks.append([r.block.layer for r in surgeon.reinit_(tiny_llama(), layers=spec, targets="q").rows])
    assert all(p == [1, 2] for p in picks)


def test_an_options_object_and_keywords_give_the_same_weights():
    """reinit_ takes a ReinitOptions, keywords that build one, or both (the keywords win)."""
    by_keywords, by_object, mixed = tiny_llama(), tiny_llama(), tiny_llama()
    surgeon.reinit_(by_keywords, layers="-2-", targets="q,k", seed=4)
    surgeon.reinit_(by_object, options=surgeon.ReinitOptions(layers="-2-", targets="q,k", seed=4))
    report = surgeon.reinit_(
        mixed, options=surgeon.ReinitOptions(layers="0", targets="q,k", seed=9), layers="-2-", seed=4
    )
    weights = dict(by_keywords.named_parameters())
    for model in (by_object, mixed):
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert report.options["layers"] == "-2-" and report.options["seed"] == 4
    with pytest.raises(TypeError, match="unexpected keyword argument 'sed'; the options are"):
        surgeon.reinit_(tiny_llama(), sed=4)
    with pytest.raises(TypeError, match="options must be a surgeon.ReinitOptions, not dict"):
        surgeon.reinit_(tiny_llama(), options={"seed": 4})


def test_defaults_mirror_the_cli():
    report = surgeon.reinit_(tiny_llama())
    assert report.options == DEFAULT_OPTIONS
    assert len(report.rows) == 9


def test_polar_mode_in_memory_keeps_singular_vectors():
    model = tiny_llama()
    q = model.model.layers[0].self_attn.q_proj.weight
    old = q.detach().double().view(8, 8, 64)
    surgeon.reinit_(model, layers="0", targets="q", mode="polar", strength=0.5)
    new = q.detach().double().view(8, 8, 64)
    s_old, s_new = torch.linalg.svdvals(old), torch.linalg.svdvals(new)
    assert torch.allclose(s_new, s_old.sqrt(), rtol=1e-5)


def test_model_stays_trainable():
    model = tiny_llama().train()
    surgeon.reinit_(model, seed=2)
    assert all(p.requires_grad for p in model.parameters())
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    ids = torch.randint(0, 96, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_dispatch_and_errors(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "llama")
    by_path = surgeon.inspect(tmp_path / "llama")
    by_module = surgeon.inspect(model)
    assert [b.module for b in by_path.blocks] == [b.module for b in by_module.blocks]
    assert surgeon.reinit(tmp_path / "llama", output=tmp_path / "out", dry_run=True).dry_run

    with pytest.raises(
        OptionError, match=r"^surgeon.reinit writes a new checkpoint .* call surgeon.reinit_\(model, ...\)$"
    ):
        surgeon.reinit(model)
    with pytest.raises(
        OptionError,
        match=r"^surgeon.reinit_ takes a torch.nn.Module, not PosixPath; for a checkpoint path or Hub id use surgeon.reinit\(path\)$",
    ):
        surgeon.reinit_(tmp_path / "llama")
    with pytest.raises(OptionError, match="unknown mode 'fancy'"):
        surgeon.reinit_(model, mode="fancy")
    with pytest.raises(SelectionError, match=r"^layer 3 is out of range: model.layers has layers 0-2$"):
        surgeon.reinit_(model, layers="3")
    with pytest.raises(NoAttentionFoundError):
        surgeon.reinit_(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError):
        surgeon.reinit_(model, "all")  # keyword-only options
    meta = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(OptionError, match="meta device"):
        surgeon.inspect(meta)
    # nothing was changed by the failed calls
    assert torch.equal(
        model.model.layers[0].self_attn.q_proj.weight, tiny_llama().model.layers[0].self_attn.q_proj.weight
    )


def test_hints_that_contradict_the_forward_are_refused():
    model = Stack(lambda: LucidAttention(24, heads=4, dim_head=6), 24)
    with pytest.raises(
        surgeon.LayoutError, match=r"^layers.0.attn: its forward uses 4 query heads, not 3 \(num_heads\)$"
    ) as err:
        surgeon.inspect(model, num_heads=3)
    assert err.value.option == "num_heads"
    assert err.value.describe(cli_spelling) == "layers.0.attn: its forward uses 4 query heads, not 3 (--num-heads)"


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype):
    cpu = FAMILIES["llama"].make().to(dtype)
    gpu = FAMILIES["llama"].make().to("cuda", dtype)
    a = surgeon.reinit_(cpu, seed=4)
    b = surgeon.reinit_(gpu, seed=4)
    assert b.device.startswith("cuda") and all(p.is_cuda and p.dtype == dtype for p in gpu.parameters())
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    for (n, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        assert torch.allclose(p.float(), q.float().cpu(), atol=tol, rtol=0), n
    for ra, rb in zip(a.rows, b.rows):
        assert ra.after.head_kappas == pytest.approx(rb.after.head_kappas, rel=1e-3)


@cuda
def test_cuda_forward_route():
    torch.manual_seed(0)
    model = Stack(lambda: LucidAttention(24), 24).cuda().half()
    report = surgeon.reinit_(model, seed=1)
    assert report.device.startswith("cuda") and len(report.rows) == 6
    assert all(p.dtype == torch.float16 and p.is_cuda for p in model.parameters())
