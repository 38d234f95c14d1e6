"""surgeon reinit in 1 process against 2 torchrun ranks, and a file copy: wall time and peak memory.

    python benchmarks/ranks.py                 # ~0.5 GB Llama-shaped checkpoints, 3 repeats
    python benchmarks/ranks.py --quick         # a small one, one repeat: a smoke run
    python benchmarks/ranks.py --layers 16 --repeats 5

Builds a bf16 Llama-shaped model (hidden 1024, 8 heads of 128, 2 KV heads) twice: as a sharded
safetensors folder (4 shards) and as a DCP folder saved by 2 gloo ranks (the replicated state dict, which
DCP spreads over both ranks' files). Each case runs alternately with the others (copy, 1 process, 2 ranks,
copy, ...), after `sync`, `--repeats` times, and prints the median wall time, its ratio to the copy (`cp -r`
of the same folder), and the peak RSS of the largest process of the run (RUSAGE_CHILDREN of a fresh wrapper:
under torchrun that is the largest rank or the launcher). The machine may be shared: read ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_RUN = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL);"
    " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)
_DCP_SAVE = r"""
import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
dist.init_process_group("gloo")
state = {}
for f in sorted(__import__("pathlib").Path(sys.argv[1]).glob("*.safetensors")):
    state.update(load_file(f))
dcp.save(state, checkpoint_id=sys.argv[2])
dist.destroy_process_group()
"""


def build(folder: Path, layers: int, hidden: int = 1024, heads: int = 8, kv: int = 2, head_dim: int = 128) -> None:
    """A bf16 Llama-shaped checkpoint saved by transformers in 4 shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    size = sum(p.numel() * 2 for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=size // 4 + 1)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def timed(cmd: list[str]) -> tuple[float, int]:
    subprocess.run(["sync"], check=True)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _RUN, *cmd], env=env(), check=True, capture_output=True, text=True)
    return time.perf_counter() - start, int(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    layers, repeats = (2, 1) if args.quick else (args.layers, args.repeats)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    surgeon = [sys.executable, "-m", "surgeon", "reinit"]
    with tempfile.TemporaryDirectory(prefix="surgeon-ranks-bench-") as tmp:
        work = Path(tmp)
        build(work / "st", layers)
        script = work / "dcp_save.py"
        script.write_text(_DCP_SAVE)
        subprocess.run([*torchrun, str(script), str(work / "st"), str(work / "dcp")], env=env(), check=True)
        shutil.copy(work / "st" / "config.json", work / "dcp" / "config.json")
        print(f"{'case':<22} {'median s':>9} {'x copy':>7} {'spread s':>9} {'peak RSS MB':>12}")
        for name in ("st", "dcp"):
            src, out = work / name, work / f"{name}-out"
            mb = sum(p.stat().st_size for p in src.iterdir()) / 2**20
            cases = {
                "copy (cp -r)": ["cp", "-r", str(src), str(out)],
                "1 process": [*surgeon, str(src), "-o", str(out)],
                "2 ranks (torchrun)": [*torchrun, "-m", "surgeon", "reinit", str(src), "-o", str(out)],
            }
            times: dict[str, list[float]] = {c: [] for c in cases}
            rss: dict[str, int] = dict.fromkeys(cases, 0)
            for _ in range(repeats):
                for case, cmd in cases.items():  # alternating: A B C A B C ...
                    shutil.rmtree(out, ignore_errors=True)
                    seconds, peak = timed(cmd)
                    times[case].append(seconds)
                    rss[case] = max(rss[case], peak)
            shutil.rmtree(out, ignore_errors=True)
            base = statistics.median(times["copy (cp -r)"])
            print(f"{name} ({mb:.0f} MB, {len(list(src.glob('*.safetensors')) or list(src.glob('*.distcp')))} files)")
            for case in cases:
                med = statistics.median(times[case])
                spread = max(times[case]) - min(times[case])
                print(f"  {case:<20} {med:>9.2f} {med / base:>7.1f} {spread:>9.2f} {rss[case] / 1024:>12.0f}")


if __name__ == "__main__":
    main()
