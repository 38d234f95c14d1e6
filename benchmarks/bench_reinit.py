"""surgeon against a file copy: wall time and peak memory on Llama-shaped checkpoints.

    python benchmarks/bench_reinit.py                 # the full table (~10 min on 2 cores, ~8 GB of /tmp)
    python benchmarks/bench_reinit.py --quick         # small checkpoints, one repeat: a smoke run
    python benchmarks/bench_reinit.py --only a-all,b-all --repeats 5

Builds synthetic bf16 checkpoints shaped like Llama (embeddings, q/k/v/o, MLP, norms; GQA):
  A: hidden 2048, 16 layers, 32 heads, 8 KV heads, vocab 32000 (1.7 GB)
  B: hidden 4096, 4 layers, 32 heads of 128, 8 KV heads, vocab 32000 (2.0 GB); B1: the same with 1 layer
  A4: A with 64 layers (6.6 GB), for memory against size (--scale)
Each case runs alternately with its reference (`cp -r` of the same folder, or `onnx.load`+`onnx.save`)
A B A B ..., `--repeats` times, after `sync`, and prints the median wall time of each, their ratio, and
the peak RSS of each process (RUSAGE_CHILDREN of a fresh wrapper process). The machine is shared: read
ratios, not absolute times, and rerun when the spread column is wide.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

VOCAB = 32000

# The naive approach people write by hand: load everything, replace q/k, save everything.
BY_HAND = r"""
import sys, torch
from safetensors.torch import load_file, save_file
from surgeon.modes.conditioning import semi_orthogonal_batch
src, dst = sys.argv[1], sys.argv[2]
sd = load_file(src)
for name, t in sd.items():
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = t.shape[0] // 64
        sd[name] = semi_orthogonal_batch(64, t.shape[1], list(range(heads))).reshape(t.shape).to(t.dtype)
save_file(sd, dst, metadata={"format": "pt"})
"""

ONNX_COPY = "import onnx, sys; onnx.save(onnx.load(sys.argv[1]), sys.argv[2])"

# Runs one command and prints its own peak RSS: RUSAGE_CHILDREN of a fresh process covers that
# command alone (in this script it would be the maximum over every child so far).
_RUN = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL);"
    " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def build(folder: Path, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> Path:
    """A Llama-shaped bf16 checkpoint folder (model.safetensors + config.json)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden)}
    for i in range(layers):
        shapes |= layer_shapes(f"model.layers.{i}", hidden, heads, kv_heads, head_dim)
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (VOCAB, hidden)}
    sd = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    write_config(folder, hidden, layers, heads, kv_heads, head_dim)
    return folder


def layer_shapes(p: str, hidden: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """One Llama decoder layer's tensors (under the prefix ``p``) and their shapes."""
    inter = hidden * 8 // 3
    return {
        f"{p}.input_layernorm.weight": (hidden,),
        f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
        f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
        f"{p}.post_attention_layernorm.weight": (hidden,),
        f"{p}.mlp.gate_proj.weight": (inter, hidden),
        f"{p}.mlp.up_proj.weight": (inter, hidden),
        f"{p}.mlp.down_proj.weight": (hidden, inter),
    }


def write_config(
    folder: Path, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, *, vocab: int = VOCAB
) -> None:
    """The config.json of the Llama-shaped checkpoint these benchmarks build."""
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def build_onnx(path: Path) -> Path:
    """BERT-base (12 layers, 768 wide) built from its config, perturbed, exported with torch.onnx (fp32)."""
    import torch
    from transformers import BertConfig, BertModel

    class Wrap(torch.nn.Module):  # positional inputs for the exporter, hidden states back
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask, return_dict=False)[0]

    torch.manual_seed(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = BertModel(BertConfig(attn_implementation="eager")).eval()
    with torch.no_grad():  # as if trained: a fresh model's zero biases are all one initializer once exported
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    ids = torch.ones(1, 16, dtype=torch.long)
    torch.onnx.export(
        Wrap(model).eval(),
        (ids, torch.ones_like(ids)),
        str(path),
        input_names=["input_ids", "attention_mask"],
        dynamo=False,
        opset_version=18,
    )
    (path.parent / "config.json").write_text(json.dumps(BertConfig().to_dict()))
    return path


def measure(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one command."""
    os.sync()  # earlier outputs are written back before the clock starts
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _RUN, *argv], check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - start, int(out.split()[-1]) / 1024


@dataclass
class Case:
    key: str
    label: str
    command: list[str]
    reference: list[str]
    reference_label: str
    cleanup: list[Path] = field(default_factory=list)  # removed before each run of either command
    target: str = ""


def run_case(case: Case, repeats: int) -> dict:
    ours, theirs = [], []
    for _ in range(repeats):  # alternate A B A B: drift on a shared machine hits both alike
        for argv, into in ((case.command, ours), (case.reference, theirs)):
            for p in case.cleanup:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            into.append(measure(argv))
    t_ours, t_ref = statistics.median(t for t, _ in ours), statistics.median(t for t, _ in theirs)
    spread = (max(t for t, _ in ours) - min(t for t, _ in ours)) / t_ours if t_ours else 0.0
    return {
        "case": case.key,
        "what": case.label,
        "reference": case.reference_label,
        "surgeon_s": t_ours,
        "reference_s": t_ref,
        "ratio": t_ours / t_ref,
        "spread": spread,
        "surgeon_rss_mib": max(m for _, m in ours),
        "reference_rss_mib": max(m for _, m in theirs),
        "target": case.target,
        "runs": repeats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small checkpoints and one repeat (a smoke run)")
    ap.add_argument("--only", help="comma-separated case keys (see the table's first column)")
    ap.add_argument("--scale", action="store_true", help="also the 4x larger A4 checkpoint (memory against size)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats
    only = set(args.only.split(",")) if args.only else None
    surgeon = [sys.executable, "-m", "surgeon"]
    dev = ["--device", args.device]

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        a_layers, b_layers = (2, 1) if args.quick else (16, 4)
        a = build(tmp / "A", 2048, a_layers, 32, 8, 64)
        b = build(tmp / "B", 4096, b_layers, 32, 8, 128)
        b1 = build(tmp / "B1", 4096, 1, 32, 8, 128)
        in_place = tmp / "A-inplace"
        shutil.copytree(a, in_place)
        out, cp_out = tmp / "out", tmp / "cp-out"
        size = lambda p: sum(f.stat().st_size for f in p.iterdir()) / 1e9  # noqa: E731
        print(
            f"A: {size(a):.2f} GB, hidden 2048, {a_layers} layers; B: {size(b):.2f} GB, hidden 4096, {b_layers} layers; "
            f"B1: {size(b1):.2f} GB; device {args.device}; {repeats} alternating runs each\n"
        )
        cp = lambda src: ["cp", "-r", str(src), str(cp_out)]  # noqa: E731
        clean = [out, cp_out, tmp / "by-hand.safetensors"]
        reinit = lambda src, *extra: surgeon + ["reinit", str(src), "-o", str(out), *extra, *dev]  # noqa: E731
        last = "0-11" if a_layers > 11 else "all"
        cases = [
            Case("a-all", "A reinit --layers all", reinit(a), cp(a), "cp -r", clean, "<= 1.3x"),
            Case(
                "a-q0",
                "A reinit --layers 0 --targets q",
                reinit(a, "--layers", "0", "--targets", "q"),
                cp(a),
                "cp -r",
                clean,
                "<= 1.1x",
            ),
            Case("a-0", "A reinit --layers 0", reinit(a, "--layers", "0"), cp(a), "cp -r", clean, "<= 1.1x"),
            Case(
                "a-inplace",
                f"A reinit --in-place --layers {last}",
                surgeon + ["reinit", str(in_place), "--in-place", "--layers", last, *dev],
                cp(a),
                "cp -r",
                clean,
                "<= 0.2x",
            ),
            Case(
                "a-dry",
                "A reinit --dry-run",
                surgeon + ["reinit", str(a), "--dry-run", "-o", str(out)],
                cp(a),
                "cp -r",
                clean,
                "< 1.5x",
            ),
            Case("a-inspect", "A inspect", surgeon + ["inspect", str(a), *dev], cp(a), "cp -r", clean),
            Case(
                "a-hand",
                "A by-hand load/replace/save (q,k)",
                [sys.executable, "-c", BY_HAND, str(a / "model.safetensors"), str(tmp / "by-hand.safetensors")],
                cp(a),
                "cp -r",
                clean,
            ),
            Case("b-all", "B reinit --layers all", reinit(b), cp(b), "cp -r", clean, "<= 1.5x"),
            Case("b-0", "B reinit --layers 0", reinit(b, "--layers", "0"), cp(b), "cp -r", clean, "<= 1.1x"),
            Case("b-inspect", "B inspect", surgeon + ["inspect", str(b), *dev], cp(b), "cp -r", clean),
            Case("b1-inspect", "B1 inspect (1 layer)", surgeon + ["inspect", str(b1), *dev], cp(b1), "cp -r", clean),
            Case("help", "surgeon --help", surgeon + ["--help"], ["true"], "true", [], "< 0.5 s"),
        ]
        if shutil.which("mergekit-yaml"):
            cfg = tmp / "passthrough.yml"
            cfg.write_text(
                f"slices:\n  - sources:\n      - model: {a}\n        layer_range: [0, {a_layers}]\nmerge_method: passthrough\ndtype: bfloat16\n"
            )
            cases.append(
                Case(
                    "a-mergekit",
                    "A mergekit passthrough (a copy)",
                    ["mergekit-yaml", str(cfg), str(out), "--copy-tokenizer", "false"],
                    cp(a),
                    "cp -r",
                    clean,
                )
            )
        try:
            import transformers  # noqa: F401

            onnx_path = build_onnx(tmp / "onnx" / "model.onnx")
            onnx_out = tmp / "out.onnx"
            cases.append(
                Case(
                    "onnx-all",
                    "BERT-base ONNX reinit --layers all",
                    surgeon + ["reinit", str(onnx_path), "-o", str(onnx_out), *dev],
                    [sys.executable, "-c", ONNX_COPY, str(onnx_path), str(onnx_out)],
                    "onnx.load+save",
                    [onnx_out],
                    "<= 1.5x",
                )
            )
        except ImportError:
            print("(transformers not installed: no ONNX case)")
        if args.scale and not args.quick:
            a4 = build(tmp / "A4", 2048, 64, 32, 8, 64)
            cases.append(
                Case(
                    "a4-all", "A4 (4x A) reinit --layers all", reinit(a4), cp(a4), "cp -r", clean, "RSS within 10% of A"
                )
            )
        if only:
            cases = [c for c in cases if c.key in only]

        rows = []
        header = f"{'case':<11} {'what':<38} {'surgeon':>8} {'ref':>7} {'ratio':>6} {'spread':>6} {'RSS MiB':>8} {'ref RSS':>8}  target"
        print(header + "\n" + "-" * len(header))
        for case in cases:
            row = run_case(case, repeats)
            rows.append(row)
            print(
                f"{row['case']:<11} {row['what']:<38} {row['surgeon_s']:7.2f}s {row['reference_s']:6.2f}s {row['ratio']:5.2f}x "
                f"{row['spread']:5.0%} {row['surgeon_rss_mib']:8.0f} {row['reference_rss_mib']:8.0f}  {row['target']} ({row['reference']})",
                flush=True,
            )
        by = {r["case"]: r for r in rows}
        if "b-inspect" in by and "b1-inspect" in by:
            per_layer = (
                (by["b-inspect"]["surgeon_s"] - by["b1-inspect"]["surgeon_s"]) / (b_layers - 1) if b_layers > 1 else 0.0
            )
            fixed = by["b1-inspect"]["surgeon_s"] - per_layer
            print(
                f"\ninspect of a 32-layer 4096-wide model, extrapolated from B and B1 (fixed {fixed:.2f} s + 32 x {per_layer:.2f} s "
                f"per layer): {fixed + 32 * per_layer:.1f} s (target < 60 s)"
            )
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
