"""How the ONNX graph walk scales with graph size: seconds to say "no attention found" in graphs of N Softmax nodes.

    python benchmarks/bench_onnx_walker.py                         # 800, 1,600, 3,200, 6,400, 12,800 Softmax nodes
    python benchmarks/bench_onnx_walker.py --sizes 800,3200 --shapes ladder --repeats 3

Every Softmax is a candidate attention core that the walker examines and rejects. The shapes:
  chain       x -> Softmax -> Softmax -> ... (each core's walks end at once)
  ladder      a chain of Adds from one MatMul of two computed tensors (a Q·Kᵀ product), a Softmax on
              each link: each core's walk back to its Q·Kᵀ product could run down the whole chain
  forward     Softmax nodes whose outputs are multiplied together in a chain: each core's walk forward
              to its probabilities·V product could run along the whole chain
  projection  a chain of Adds from one projection (MatMul with a weight); on each link a Q·Kᵀ product
              of the link with itself, a Softmax and a probabilities·V product: each core's walk back
              from Q, K and V to their projection could run down the whole chain
The time is that of surgeon.api.inspect_checkpoint up to its NoAttentionFoundError (or, for projection,
the LayoutError of cores without heads: open the file, index the graph, shape inference, walk), in this process after a warm-up, the median of the repeats. A linear
walk shows as a constant time per node (the us/node columns).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SHAPES = ("chain", "ladder", "forward", "projection")


def _nodes(shape: str, n: int) -> tuple[list[onnx.NodeProto], list[str], list[TensorProto]]:
    node, inits = helper.make_node, []
    if shape == "chain":
        return [node("Softmax", [f"t{i}"], [f"t{i + 1}"], axis=-1) for i in range(n)], [f"t{n}"], inits
    if shape == "ladder":
        nodes = [node("MatMul", ["t0", "t0"], ["a0"])]
        for i in range(n):
            nodes += [
                node("Add", [f"a{i}", f"a{i}"], [f"a{i + 1}"]),
                node("Softmax", [f"a{i + 1}"], [f"s{i}"], axis=-1),
            ]
        return nodes, [f"a{n}"] + [f"s{i}" for i in range(n)], inits
    if shape == "forward":
        nodes = [node("MatMul", ["t0", "t0"], ["q"])] + [node("Softmax", ["q"], [f"s{i}"], axis=-1) for i in range(n)]
        nodes += [node("Mul", [f"m{i - 1}" if i > 1 else "s0", f"s{i}"], [f"m{i}"]) for i in range(1, n)]
        return nodes, [f"m{n - 1}"], inits
    inits = [numpy_helper.from_array(np.eye(8, dtype=np.float32), "w")]
    nodes = [node("MatMul", ["t0", "w"], ["a0"])]
    for i in range(n):
        nodes += [
            node("Add", [f"a{i}", f"a{i}"], [f"a{i + 1}"]),
            node("MatMul", [f"a{i + 1}", f"a{i + 1}"], [f"qk{i}"]),
            node("Softmax", [f"qk{i}"], [f"s{i}"], axis=-1),
            node("MatMul", [f"s{i}", f"a{i + 1}"], [f"o{i}"]),
        ]
    return nodes, [f"a{n}"] + [f"o{i}" for i in range(n)], inits


def build(shape: str, n: int) -> onnx.ModelProto:
    nodes, outputs, inits = _nodes(shape, n)
    graph = helper.make_graph(
        nodes,
        shape,
        [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [8, 8])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def seconds(path: Path) -> float:
    from surgeon import api
    from surgeon.errors import LayoutError, NoAttentionFoundError

    start = time.perf_counter()
    try:
        api.inspect_checkpoint(str(path))
    except (NoAttentionFoundError, LayoutError):  # LayoutError: cores resolved (projection), without heads
        return time.perf_counter() - start
    raise SystemExit(f"{path}: attention found where there is none")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="800,1600,3200,6400,12800", help="comma-separated numbers of Softmax nodes")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    sizes, shapes = [int(s) for s in args.sizes.split(",")], args.shapes.split(",")
    print(f"{'Softmax nodes':>13}" + "".join(f" {s + ' s':>13} {'us/node':>8}" for s in shapes))
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm.onnx"
        onnx.save(build("chain", 4), warm)
        seconds(warm)  # imports, once
        for n in sizes:
            row = f"{n:>13,}"
            for shape in shapes:
                path = Path(tmp) / f"{shape}{n}.onnx"
                onnx.save(build(shape, n), path)
                t = statistics.median(seconds(path) for _ in range(args.repeats))
                row += f" {t:>13.2f} {t / n * 1e6:>8.0f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
