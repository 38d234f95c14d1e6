"""Time and peak memory of `surgeon reinit` on a synthetic Llama-shaped checkpoint, against the
naive approach (load every tensor, modify, save everything).

    python benchmarks/bench_reinit.py [--hidden 2048] [--layers 16] [--dtype bf16] [--device cpu]

Prints one line per measurement; the ratios are from one run on one machine, so compare them
within a run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NAIVE = r"""
import sys, torch
from safetensors.torch import load_file, save_file
from surgeon.conditioning import semi_orthogonal
src, dst, heads = sys.argv[1], sys.argv[2], int(sys.argv[3])
sd = load_file(src)
for name, t in sd.items():
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        d = t.shape[0] // (heads if "q_proj" in name else heads // 4)
        w = torch.cat([semi_orthogonal(d, t.shape[1], seed=h).to(t.dtype) for h in range(t.shape[0] // d)])
        sd[name] = w
save_file(sd, dst, metadata={"format": "pt"})
"""


def build(folder: Path, hidden: int, layers: int, dtype: str) -> Path:
    import torch
    from safetensors.torch import save_file

    heads, kv = hidden // 64, hidden // 256
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes = {
            f"{p}.self_attn.q_proj.weight": (hidden, hidden),
            f"{p}.self_attn.k_proj.weight": (kv * 64, hidden),
            f"{p}.self_attn.v_proj.weight": (kv * 64, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, hidden),
            f"{p}.mlp.gate_proj.weight": (hidden * 8 // 3, hidden),
            f"{p}.mlp.up_proj.weight": (hidden * 8 // 3, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, hidden * 8 // 3),
        }
        for name, shape in shapes.items():
            sd[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch_dtype)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    config = {"model_type": "llama", "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": 64, "num_hidden_layers": layers}
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "model.safetensors"


# Runs one command and prints its own peak RSS: RUSAGE_CHILDREN of a fresh process covers that
# command alone (in this script it would be the maximum over every child so far).
_RUN = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"


def measure(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of a command."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _RUN, *argv], check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - start, int(out.split()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-naive", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        src = build(tmp, args.hidden, args.layers, args.dtype)
        size = src.stat().st_size / 1e6
        print(f"checkpoint: {size:,.0f} MB ({args.layers} layers, hidden {args.hidden}, {args.dtype}), device {args.device}")
        surgeon = [sys.executable, "-m", "surgeon"]
        t, mem = measure(surgeon + ["inspect", str(tmp), "--device", args.device])
        print(f"surgeon inspect (all q/k/v):       {t:7.2f} s  peak RSS {mem:8,.0f} MB")
        t, mem = measure(surgeon + ["reinit", str(src), "-o", str(tmp / "a.safetensors"), "--targets", "q,k", "--device", args.device])
        print(f"surgeon reinit q,k (all layers):   {t:7.2f} s  peak RSS {mem:8,.0f} MB  ({size / t:,.0f} MB/s)")
        surgeon_t = t
        t, mem = measure(surgeon + ["reinit", str(src), "-o", str(tmp / "b.safetensors"), "--layers", "0", "--targets", "q", "--device", args.device])
        print(f"surgeon reinit q of one layer:     {t:7.2f} s  peak RSS {mem:8,.0f} MB  ({size / t:,.0f} MB/s)")
        if not args.skip_naive:
            heads = args.hidden // 64
            t, mem = measure([sys.executable, "-c", NAIVE, str(src), str(tmp / "naive.safetensors"), str(heads)])
            print(f"naive load_file/modify/save_file:  {t:7.2f} s  peak RSS {mem:8,.0f} MB")
            print(f"ratio naive / surgeon (reinit q,k): {t / surgeon_t:.2f}x time")


if __name__ == "__main__":
    main()
