"""reinit_ and inspect on models sharded or replicated over real processes (CPU, gloo, torch.multiprocessing).

FSDP2 (fully_shard) and plain DTensor parameters over 2 and 3 ranks: every rank writes the rows it
owns, and the full state dict equals bit for bit the single-process reinit_ of the unsharded model
and the checkpoint path's output for its saved checkpoint, for Llama (GQA, attention biases) and
GPT-2 (fused Conv1D c_attn, stored transposed). With 3 ranks the 64 query rows split 22/22/20, so
heads straddle shard boundaries; GPT-2's Conv1D is sharded across its input rows, so every head
straddles. DDP: ranks whose projections drifted apart end identical without a broadcast.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import surgeon

from helpers.distributed import (
    SEED,
    ddp_worker,
    dtensor_worker,
    fsdp_worker,
    full_state,
    large_config,
    make,
    memory_worker,
    report_rows,
    spawn,
    tokens,
)
from helpers.paths import ROOT

FAMILIES = ["llama", "gpt2"]


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    """family -> (single-process state after reinit_, its report rows, logits, checkpoint-path tensors)."""
    out = {}
    for family in FAMILIES:
        model = make(family)
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder / "in")
        surgeon.reinit_checkpoint(folder / "in", output=folder / "out", seed=SEED, layers="0-", device="cpu")
        report = surgeon.reinit_(model, seed=SEED, layers="0-")
        with torch.no_grad():
            logits = model(tokens(family)).logits
        out[family] = (full_state(model), report_rows(report), logits, load_file(folder / "out" / "model.safetensors"))
    return out


def same_bits(a: dict, b: dict, keys=None) -> None:
    keys = sorted(a) if keys is None else keys
    assert set(keys) <= set(a) and set(keys) <= set(b)
    for k in keys:
        assert a[k].dtype == b[k].dtype and torch.equal(
            a[k].view(-1).view(torch.int32) if a[k].dtype == torch.float32 else a[k],
            b[k].view(-1).view(torch.int32) if b[k].dtype == torch.float32 else b[k],
        ), k


def check_three_way(state: dict, single: dict, checkpoint: dict) -> None:
    same_bits(state, single)
    same_bits(state, checkpoint, sorted(checkpoint))  # every tensor the checkpoint path wrote (tied ones once)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_reinit_equals_single_process_and_checkpoint(world, tmp_path, expected):
    spawn(fsdp_worker, world, tmp_path, str(tmp_path), FAMILIES)
    for family in FAMILIES:
        single, rows, logits, checkpoint = expected[family]
        ranks = [torch.load(tmp_path / f"fsdp-{family}-{r}.pt", weights_only=False) for r in range(world)]
        for got in ranks:
            check_three_way(got["state"], single, checkpoint)
            assert got["report"] == rows  # the same report on every rank, equal to the single-process one
            assert got["inspect"] == ranks[0]["inspect"]
            torch.testing.assert_close(
                got["logits"], logits, rtol=1e-5, atol=1e-5
            )  # the sharded forward uses the new weights
        assert "->" in ranks[0]["printed"] and all(r["printed"] is None for r in ranks[1:])
    # the re-initialized projections really changed (the comparison above is not between untouched models)
    assert not torch.equal(
        make("llama").state_dict()["model.layers.0.self_attn.q_proj.weight"],
        single_q := expected["llama"][0]["model.layers.0.self_attn.q_proj.weight"],
    )
    gram = single_q.double().reshape(8, 8, 64) @ single_q.double().reshape(8, 8, 64).mT
    torch.testing.assert_close(gram, torch.eye(8, dtype=torch.float64).expand(8, 8, 8), atol=1e-6, rtol=0)


def test_dtensor_column_sharded_parameters(tmp_path, expected):
    spawn(dtensor_worker, 3, tmp_path, str(tmp_path), FAMILIES)
    for family in FAMILIES:
        single, rows, _, checkpoint = expected[family]
        for r in range(3):
            got = torch.load(tmp_path / f"dtensor-{family}-{r}.pt", weights_only=False)
            same_bits(got["state"], {n: single[n] for n in got["state"]})
            same_bits(got["state"], checkpoint, sorted(set(checkpoint) & set(got["state"])))
            assert got["report"] == rows


def test_ddp_ranks_end_identical_without_broadcast(tmp_path, expected):
    spawn(ddp_worker, 2, tmp_path, str(tmp_path), FAMILIES)
    for family in FAMILIES:
        single, rows, _, _ = expected[family]
        r0, r1 = (torch.load(tmp_path / f"ddp-{family}-{r}.pt", weights_only=False) for r in range(2))
        same_bits(r0["state"], single)
        same_bits(r1["state"], single)
        same_bits(r0["stepped"], r1["stepped"])  # and they stay together through a DDP step
        assert any(not torch.equal(r0["stepped"][k], r0["state"][k]) for k in r0["state"])  # a real step happened
        assert r0["report"] == rows  # rank 0 did not drift: its report is the single-process one
        after = [{k: v for k, v in p.items() if not k.startswith("before")} for p in rows["projections"]]
        assert [
            {k: v for k, v in p.items() if not k.startswith("before")} for p in r1["report"]["projections"]
        ] == after
        assert r1["report"]["projections"] != rows["projections"]  # rank 1's "before" saw its drifted weights


def test_fsdp2_peak_memory_stays_near_the_shard(tmp_path):
    """Built on meta, each rank loads only its rows: reinit_ adds a few projections to its RSS, never the model."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(large_config())
    model.save_pretrained(tmp_path / "large")
    surgeon.reinit_(model, seed=SEED)
    single = {n: p.detach() for n, p in model.named_parameters()}
    total = sum(p.nbytes for p in single.values())
    projection64 = 512 * 512 * 8  # the largest projection (q), in float64
    spawn(memory_worker, 2, tmp_path, str(tmp_path), str(tmp_path / "large" / "model.safetensors"))
    for r in range(2):
        got = torch.load(tmp_path / f"memory-{r}.pt", weights_only=False)
        same_bits(got["state"], single)
        assert got["shard_bytes"] < 0.55 * total
        print(
            f"rank {r}: shard {got['shard_bytes'] / 2**20:.1f} MiB of {total / 2**20:.1f} MiB, reinit_ peak above RSS {got['extra_peak'] / 2**20:.1f} MiB"
        )
        assert (
            got["extra_peak"] < 8 * projection64
        )  # measured ~11 MiB; a whole-model gather would add 81 MiB, (got["extra_peak"], got["shard_bytes"], total)


def test_readme_fsdp_example_runs_under_torchrun():
    import os
    import subprocess
    import sys

    root = ROOT
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "examples/fsdp_reinit.py",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # a hang guard
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sharded over 2 ranks == single process, bit for bit: True" in result.stdout
    assert result.stdout.count("model.layers.3 self  q") == 1  # the report, printed by rank 0 only
