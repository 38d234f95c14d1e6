"""The per-head math of a reinit against its floor, measured on the same run.

    python benchmarks/bench_math_floor.py                  # A: hidden 2048, 16 layers, 32 heads of 64, 8 KV heads
    python benchmarks/bench_math_floor.py --shape B        # hidden 4096, 4 layers, 32 heads of 128, 8 KV heads
    python benchmarks/bench_math_floor.py --shape 70b      # one Llama-3-70B layer (hidden 8192, 64 heads of 128, 8 KV)
    python benchmarks/bench_math_floor.py --repeats 7 --json floor.json

surgeon's math for a conditioned reset of every layer (``--layers all``, the default mode) is: for each
query and key head a Gaussian draw (numpy's SFC64, keyed per head) and its orthonormalization (Cholesky QR:
a Gram GEMM, a Cholesky, a triangular inverse, a second GEMM, in float64); the new heads rounded to the
tensor's dtype; and each head's condition number before and after (the eigenvalues of a float32 Gram
matrix, for 16-bit weights). This script times:

  surgeon  surgeon's Engine.update on every planned tensor, the tensors already in memory (no I/O);
  floor    the same operations on the same shapes, each at its best: the draws into a buffer made once,
           on every core (numpy's rate); the Gram matrices, Cholesky factors, triangular inverses and
           GEMMs batched per tensor into buffers made once, with every core in BLAS (the BLAS rate); the
           Gram eigenvalues batched per tensor; the rounding to the stored dtype. No copies, no checks,
           no Python between heads.

It alternates them (surgeon, floor, surgeon, floor, ...), prints the median wall and CPU seconds of each and
their ratio, split by operation for the floor (draws / orthonormalization / kappas / rounding), and the
numpy and BLAS rates they ran at. The checkpoint is built in memory-sized pieces under a temporary folder
(the attention tensors and what detection needs; no MLP), read once. The machine may be shared: read the
ratio, which both sides of one run share, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_reinit import layer_shapes, write_config

SHAPES = {  # hidden, layers, heads, KV heads, head dim
    "A": (2048, 16, 32, 8, 64),
    "B": (4096, 4, 32, 8, 128),
    "70b": (8192, 1, 64, 8, 128),
}


def build(folder: Path, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> Path:
    """A Llama-shaped bf16 checkpoint with only what attention detection reads (no MLP, a 256-token vocab)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (256, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):  # attention only: the MLP is no part of the math
        layer = layer_shapes(f"model.layers.{i}", hidden, heads, kv_heads, head_dim)
        shapes |= {name: shape for name, shape in layer.items() if ".mlp." not in name}
    sd = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    write_config(folder, hidden, layers, heads, kv_heads, head_dim, vocab=256)
    return folder


class Work:
    """The planned tensors in memory, and per tensor what the math does to it (heads drawn, heads measured)."""

    def __init__(self, folder: Path, layers: str) -> None:
        from surgeon.detect import detect_source
        from surgeon.open.source import open_source
        from surgeon.options import ReinitOptions
        from surgeon.plan.planner import prepare_checkpoint

        source = open_source(folder)
        self.plan = prepare_checkpoint(source, detect_source(source), ReinitOptions(layers=layers))
        self.tensors = {name: source.primary.read(name) for name in self.plan.tensors()}
        # per tensor: (heads, head_dim, in_features, drawn) for each projection in it
        self.items = []
        for change in self.plan.changes:
            proj = change.projection
            tensor = self.tensors[proj.weight.tensor]
            self.items.append((tensor, proj.heads, proj.head_dim, proj.in_features, change.role != "v", change))
        self.normals = sum(len(c.heads) * h * d for _, _, h, d, drawn, c in self.items if drawn)


def surgeon_math(work: Work) -> None:
    import torch

    from surgeon.compute.engine import Engine

    engine = Engine(work.plan, torch.device("cpu"))
    for name, tensor in work.tensors.items():
        engine.update(name, tensor)


class Floor:
    """The same operations at their best, buffers made once (and touched) before the clock starts."""

    def __init__(self, work: Work, threads: int) -> None:
        import numpy as np
        import torch

        self.work, self.threads = work, threads
        self.pool = ThreadPoolExecutor(threads)
        self.buffers = []
        for tensor, _heads, d, n_in, drawn, change in work.items:
            drawn_heads = len(change.heads) if drawn else 0
            tall, short = max(d, n_in), min(d, n_in)
            gauss = np.zeros((drawn_heads, tall, short))
            out = torch.zeros(drawn_heads, d, n_in, dtype=torch.float64)
            stored = torch.zeros(drawn_heads, d, n_in, dtype=tensor.dtype)
            self.buffers.append((gauss, out, stored))
        self.seconds = {"draws": 0.0, "orthonormalization": 0.0, "kappas": 0.0, "rounding": 0.0}

    def run(self) -> None:
        import numpy as np
        import torch

        torch.set_num_threads(self.threads)
        for (tensor, heads, d, n_in, drawn, change), (gauss, out, stored) in zip(self.work.items, self.buffers):
            start = time.perf_counter()
            if drawn:  # one generator per head, as the draws are keyed; every core
                chunks = np.array_split(np.arange(len(gauss)), self.threads)

                def draw(idx, gauss=gauss):
                    for i in idx:
                        np.random.Generator(np.random.SFC64(int(i) + 1)).standard_normal(out=gauss[i])

                list(self.pool.map(draw, chunks))
            t1 = time.perf_counter()
            if drawn:
                x = torch.from_numpy(gauss)
                chol, _ = torch.linalg.cholesky_ex(x.mT @ x)
                eye = torch.eye(chol.shape[-1], dtype=chol.dtype).expand_as(chol)
                r_inv = torch.linalg.solve_triangular(chol.mT, eye, upper=True)
                torch.matmul(r_inv.mT, x.mT, out=out) if d < n_in else torch.matmul(x, r_inv, out=out)
            t2 = time.perf_counter()
            if drawn:
                stored.copy_(out)
            t3 = time.perf_counter()
            # the condition numbers: every head before, the changed ones after (float32 Gram for 16-bit weights)
            before = tensor.view(heads, d, n_in) if change.projection.weight.axis == 0 else None
            kappa_dtype = torch.float32 if tensor.dtype.itemsize <= 2 else torch.float64
            for mats in ([before] if before is not None else []) + ([stored] if drawn else [before]):
                if mats is None:
                    continue
                m = mats.to(kappa_dtype)
                torch.linalg.eigvalsh(m @ m.mT if d <= n_in else m.mT @ m)
            t4 = time.perf_counter()
            for key, seconds in zip(self.seconds, (t1 - start, t2 - t1, t4 - t3, t3 - t2)):
                self.seconds[key] += seconds


def rates(threads: int) -> dict[str, float]:
    """numpy's normals per second (one generator, one core) and the float64 GEMM rate (all cores), now."""
    import numpy as np
    import torch

    buf = np.zeros(1 << 22)
    gen = np.random.Generator(np.random.SFC64(0))
    best = min(_timed(lambda: gen.standard_normal(out=buf))[0] for _ in range(5))
    torch.set_num_threads(threads)
    a = torch.randn(1024, 1024, dtype=torch.float64)
    gemm = min(_timed(lambda: a @ a)[0] for _ in range(5))
    return {"normals_per_s_per_core": len(buf) / best, "dgemm_gflops": 2 * 1024**3 / gemm / 1e9}


def _timed(fn) -> tuple[float, float]:
    """(wall, CPU of every thread of this process) seconds of ``fn()``."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return wall, (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="A")
    ap.add_argument("--layers", type=int, help="override the shape's layer count")
    ap.add_argument("--select", default="all", help="the --layers a reinit is given (default: all)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    hidden, layers, heads, kv, head_dim = SHAPES[args.shape]
    layers = args.layers or layers
    from surgeon import _compat

    # as a reinit does before torch's first tensor (both sides run with it; an older surgeon, with --baseline
    # runs of benchmarks/bench_cow.py, has no such step)
    getattr(_compat, "prefer_huge_pages", lambda: None)()
    from surgeon.modes.conditioning import workers

    threads = workers()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        work = Work(build(Path(tmp) / "m", hidden, layers, heads, kv, head_dim), args.select)
    floor = Floor(work, threads)
    floor.run()  # warm: buffers touched, BLAS and the pools started
    surgeon_math(work)
    floor.seconds = dict.fromkeys(floor.seconds, 0.0)
    ours, theirs = [], []
    for _ in range(args.repeats):  # alternate: drift on a shared machine hits both alike
        ours.append(_timed(lambda: surgeon_math(work)))
        theirs.append(_timed(floor.run))
    parts = {k: v / args.repeats for k, v in floor.seconds.items()}
    now = rates(threads)
    wall = statistics.median(w for w, _ in ours), statistics.median(w for w, _ in theirs)
    cpu = statistics.median(c for _, c in ours), statistics.median(c for _, c in theirs)
    row = {
        "shape": args.shape,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv,
        "head_dim": head_dim,
        "select": args.select,
        "threads": threads,
        "normals": work.normals,
        "surgeon_wall_s": wall[0],
        "floor_wall_s": wall[1],
        "ratio_wall": wall[0] / wall[1],
        "surgeon_cpu_s": cpu[0],
        "floor_cpu_s": cpu[1],
        "ratio_cpu": cpu[0] / cpu[1],
        "floor_parts_s": parts,
        **now,
    }
    print(
        f"{args.shape}: hidden {hidden}, {layers} layers, {heads} heads of {head_dim}, {kv} KV heads, --layers {args.select}; "
        f"{threads} threads, {args.repeats} alternating runs (medians)\n"
        f"  surgeon  {wall[0]:7.3f} s wall  {cpu[0]:7.3f} s CPU\n"
        f"  floor    {wall[1]:7.3f} s wall  {cpu[1]:7.3f} s CPU   ("
        + ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
        + f")\n  ratio    {wall[0] / wall[1]:7.2f}x wall {cpu[0] / cpu[1]:7.2f}x CPU\n"
        f"  rates: numpy {now['normals_per_s_per_core'] / 1e6:.0f} M normals/s per core, "
        f"float64 GEMM {now['dgemm_gflops']:.1f} GFLOP/s on {threads} threads",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    sys.exit(main())
