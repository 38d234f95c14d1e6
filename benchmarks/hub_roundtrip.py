"""The Hub round trip, old path vs new: bytes moved and time for `reinit org/M --push-to-hub me/M2`.

    python benchmarks/hub_roundtrip.py          # the 8-shard tiny Llama on the loopback Hub, then Llama-3-70B shapes

Old path: `reinit org/M -o out --push-to-hub --no-server-copy` (every shard downloaded, every file uploaded).
Whole output: `reinit org/M -o out --push-to-hub` (every shard downloaded; the files its record's source commit
holds unchanged copied server-side, as `surgeon push out` does). New path: `reinit org/M --push-to-hub`
(headers read by Range, the changed shards downloaded and uploaded, the rest copied server-side from the
source's commit). Measured on the loopback Hub (tests/helpers/hub_server.py, a
real HTTP server driven by the real huggingface_hub client), counting the bodies at the server. Then the
same bytes computed for Llama-3-70B's shapes: its tensors in transformers' order, bf16, grouped into 5 GB
shards the way save_pretrained groups them (no number assumed: all from the shapes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def measured() -> None:
    from helpers.hub import TOKEN, make_llama_shards
    from helpers.hub_server import HubServer

    base = Path(tempfile.mkdtemp())
    src = make_llama_shards(base / "m")
    weights = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"8-shard Llama-shaped repo: {weights:,} bytes of weights")
    print(f"{'run':<34}{'downloaded':>12}{'by Range':>10}{'uploaded':>12}{'copied':>12}{'seconds':>9}")
    for layers in ("-1", "all"):
        for path in ("old", "whole output", "new"):
            with HubServer() as hub:
                hub.add_token(TOKEN, "me", ("org",))
                hub.add_model("org/M", src)
                sizes = {c: len(b) for c, b in hub.lfs["org/M"].items()}
                work = Path(tempfile.mkdtemp())
                env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
                env.update(HF_HOME=str(work / "hf"), HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_TOKEN=TOKEN)
                args = ["reinit", "org/M", f"--layers={layers}", "--push-to-hub", "me/M2"]
                args += ["-o", str(work / "out")] if path != "new" else []
                args += ["--no-server-copy"] if path == "old" else []
                start = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "surgeon", *args], cwd=work, env=env, check=True, capture_output=True
                )
                seconds = time.perf_counter() - start
                down = sum(
                    r.sent for r in hub.requests if r.method == "GET" and r.status == 200 and "/resolve/" in r.path
                )
                ranged = sum(r.sent for r in hub.requests if r.status == 206)
                up = hub.received(r"^/__lfs/[0-9a-f]{64}$") + hub.received(r"/commit/")
                copied = sum(sizes[d["sha256"]] for d in hub.duplicated())
                print(
                    f"{f'--layers {layers}, {path}':<34}{down:>12,}{ranged:>10,}{up:>12,}{copied:>12,}{seconds:>9.1f}"
                )


def llama3_70b() -> None:
    import json
    import math

    hidden, layers, heads, kv, head_dim, ffn, vocab, bf16 = 8192, 80, 64, 8, 128, 28672, 128256, 2
    tensors = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", [hidden]),
            (p + "mlp.down_proj.weight", [hidden, ffn]),
            (p + "mlp.gate_proj.weight", [ffn, hidden]),
            (p + "mlp.up_proj.weight", [ffn, hidden]),
            (p + "post_attention_layernorm.weight", [hidden]),
            (p + "self_attn.k_proj.weight", [kv * head_dim, hidden]),
            (p + "self_attn.o_proj.weight", [hidden, heads * head_dim]),
            (p + "self_attn.q_proj.weight", [heads * head_dim, hidden]),
            (p + "self_attn.v_proj.weight", [kv * head_dim, hidden]),
        ]
    tensors += [("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]
    shards: list[list[tuple[str, list[int], int]]] = [[]]
    for name, shape in tensors:  # save_pretrained's grouping: a new shard when the next tensor would pass 5 GB
        size = math.prod(shape) * bf16
        if shards[-1] and sum(b for _, _, b in shards[-1]) + size > 5_000_000_000:
            shards.append([])
        shards[-1].append((name, shape, size))

    def header(shard: list[tuple[str, list[int], int]]) -> int:  # 8 + the JSON header, padded to 8
        entries, at = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, size in shard:
            entries[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + size]}
            at += size
        raw = len(json.dumps(entries, separators=(",", ":")))
        return 8 + raw + (-raw % 8)

    total = sum(b for s in shards for _, _, b in s)
    headers = sum(header(s) for s in shards)
    print(f"\nLlama-3-70B shapes (bf16): {total / 1e9:.1f} GB in {len(shards)} shards of at most 5 GB")
    print(f"headers read by Range: {headers:,} bytes")
    print(f"{'run':<34}{'downloaded GB':>14}{'uploaded GB':>13}{'copied GB':>11}")
    for label, chosen in (("-1", {layers - 1}), ("all", set(range(layers)))):
        qkv = {f"model.layers.{i}.self_attn.{r}_proj.weight" for i in chosen for r in "qkv"}
        changed = [s for s in shards if any(n in qkv for n, _, _ in s)]
        moved = sum(b for s in changed for _, _, b in s)
        for path, down, up in (
            ("old", total, total),
            ("whole output", total, moved),
            ("new", moved + headers, moved),
        ):
            print(f"{f'--layers {label}, {path}':<34}{down / 1e9:>14.2f}{up / 1e9:>13.2f}{(total - up) / 1e9:>11.2f}")
        changed_qkv = sum(b for s in shards for n, _, b in s if n in qkv)
        print(f"  (q/k/v changed: {changed_qkv / 1e9:.2f} GB in {len(changed)} shards)")


if __name__ == "__main__":
    measured()
    llama3_70b()
