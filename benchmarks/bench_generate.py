"""Generation alone (no I/O): the new q/k/v values of a whole model shape, as surgeon draws them.

    python benchmarks/bench_generate.py                          # 70B-shaped: 80 layers, 8192 wide, 64 heads, 8 KV heads
    python benchmarks/bench_generate.py --device cuda            # on a GPU (the draws stay on the CPU, by design)
    python benchmarks/bench_generate.py --measure-layers 2       # time 2 layers, extrapolate to --layers

For each layer: the 64 query heads and 8 key heads are drawn (seeded Gaussians on the CPU, Cholesky QR on
``--device``), the 8 value heads are rectangular identities, and everything is rounded to bf16, the way
`surgeon reinit` makes them. Prints the time per layer and the total for the model, measured on
``--measure-layers`` layers after one warm-up layer and extrapolated linearly (each layer is the same work).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--measure-layers", type=int, default=2)
    args = ap.parse_args()

    import torch

    from surgeon.modes.conditioning import head_seed, semi_orthogonal_batch, single_threaded, value_identity

    device = torch.device(args.device)
    d = args.hidden // args.heads

    def layer(i: int) -> None:
        for role, heads in (("q", args.heads), ("k", args.kv_heads)):
            name = f"model.layers.{i}.self_attn.{role}_proj.weight"
            new = semi_orthogonal_batch(
                d, args.hidden, [head_seed(0, name, role, h) for h in range(heads)], device=device
            )
            new.to(torch.bfloat16)
        torch.stack([value_identity(h, d, args.hidden, "block", device=device) for h in range(args.kv_heads)]).to(
            torch.bfloat16
        )
        if device.type == "cuda":
            torch.cuda.synchronize()

    with single_threaded():
        layer(0)  # warm-up: thread pool, CUDA context, kernels
        start = time.perf_counter()
        for i in range(1, 1 + args.measure_layers):
            layer(i)
        per_layer = (time.perf_counter() - start) / args.measure_layers
    print(
        f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, {args.kv_heads} KV heads, device {device}: "
        f"{per_layer:.3f} s per layer (measured on {args.measure_layers}), {per_layer * args.layers:.1f} s for the model"
    )


if __name__ == "__main__":
    main()
