"""Helpers for the ONNX tests: real exports, and an independent way to check what surgeon did.

The PyTorch model is the reference. Its query/key/value parameters are found by module name (the
model code's own layout, see ../shared/layouts.md), and each is located among the ONNX initializers
by value (equal to the parameter or to its transpose): that mapping does not use surgeon at all, so
comparing it with surgeon's detection, and reading the re-initialized values back through it, tests
the walker and the writer against the model code.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch

SEQ, DEC_SEQ = 7, 5
ROLE_LEAVES = {
    "query": "q",
    "key": "k",
    "value": "v",
    "q_lin": "q",
    "k_lin": "k",
    "v_lin": "v",
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "q": "q",
    "k": "k",
    "v": "v",
}
CROSS_WORDS = ("EncDecAttention", "encoder_attn")


class Wrap(torch.nn.Module):
    """Positional inputs for the exporters, the first output back (hidden states or logits)."""

    def __init__(self, model, names):
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *args):
        kwargs = dict(zip(self.names, args))
        if "pixel_values" not in kwargs:
            kwargs["use_cache"] = False
        return self.model(**kwargs, return_dict=False)[0]


def example_inputs(family: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if family == "vit":
        return {"pixel_values": torch.randn(1, 3, 16, 16, generator=g)}
    # an explicit attention mask: without one the legacy exporter fails on decoder-only models (aten::diff)
    feeds = {
        "input_ids": torch.randint(3, 90, (1, SEQ), generator=g),
        "attention_mask": torch.ones(1, SEQ, dtype=torch.long),
    }
    if family in ("t5", "bart"):
        feeds["decoder_input_ids"] = torch.randint(3, 90, (1, DEC_SEQ), generator=g)
    return feeds


def export(
    model, family: str, path: Path, *, dynamo: bool, opset: int | None = None, dynamic: bool = False
) -> dict[str, np.ndarray]:
    """Export ``model`` to ``path`` the way a user would; returns the example inputs as numpy.

    ``dynamic`` (legacy exporter): batch and sequence axes are dynamic, as optimum exports them,
    so head-split shapes are computed in the graph (Shape/Gather/Concat) instead of constants.
    """
    feeds = example_inputs(family)
    axes = {name: {0: "batch", 1: "sequence"} for name in feeds} if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(  # an eval() wrapper: the legacy exporter restores the wrapper's mode on every submodule
            Wrap(model, list(feeds)).eval(),
            tuple(feeds.values()),
            str(path),
            input_names=list(feeds),
            output_names=["out"],
            dynamo=dynamo,
            opset_version=opset or (18 if not dynamo else None),
            dynamic_axes=axes,
        )
    return {k: v.numpy() for k, v in feeds.items()}


def export_one_input(
    model: torch.nn.Module, shape: tuple[int, ...], path: Path, *, exporter: str
) -> dict[str, np.ndarray]:
    """Give ``model``'s parameters distinct, non-zero values, then export it with one random input "x" of
    ``shape`` to ``path`` (the ``legacy`` or the ``dynamo`` exporter); returns the feeds."""
    with torch.no_grad():  # distinct layers (TransformerEncoder deep-copies one) and non-zero biases
        for p in model.parameters():
            p.normal_(0.0, 0.05 if p.ndim == 1 else 0.2)
    x = torch.randn(*shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            str(path),
            input_names=["x"],
            dynamo=exporter == "dynamo",
            opset_version=18 if exporter == "legacy" else None,
        )
    return {"x": x.numpy()}


def weights_as_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its matrices moved from initializers into Constant nodes, as some exporters write them."""
    moved = [t for t in model.graph.initializer if len(t.dims) == 2]
    for t in moved:
        model.graph.initializer.remove(t)
    nodes = [
        onnx.helper.make_node("Constant", [], [t.name], value=t, name=f"const_{i}") for i, t in enumerate(moved)
    ] + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def torch_forward(model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return Wrap(model, list(feeds)).eval()(*(torch.from_numpy(v) for v in feeds.values())).numpy()


def ort_run(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in names})[0]


def initializers(path: Path) -> dict[str, np.ndarray]:
    """Every initializer of a model, external data included, as numpy arrays."""
    model = onnx.load(str(path))
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


# --- the PyTorch side ---------------------------------------------------------------------------
@dataclass
class TorchProj:
    """One role's projection in the PyTorch model: (out, in) rows of a parameter."""

    module: str  # the attention module, e.g. "encoder.layer.0.attention.self"
    role: str
    weight: str  # parameter name
    conv1d: bool  # GPT-2 Conv1D: the parameter is (in, out)
    cols: slice  # the role's output features inside the parameter
    bias: str | None

    def rows(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        w = params[self.weight]
        return (w[:, self.cols].T if self.conv1d else w[self.cols]).double()


@dataclass
class TorchBlock:
    module: str
    kind: str
    heads: int
    kv_heads: int
    head_dim: int
    roles: dict[str, TorchProj] = field(default_factory=dict)


def torch_blocks(model) -> list[TorchBlock]:
    """The attention blocks of a PyTorch model from its module names (never from surgeon).

    Heads come from the Hugging Face config, or from the attention module's own ``num_heads``
    (nn.MultiheadAttention, the custom test modules)."""
    cfg = getattr(model, "config", None)
    if cfg is not None:
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        d = getattr(cfg, "head_dim", None) or getattr(cfg, "d_kv", None) or cfg.hidden_size // heads
    blocks: dict[str, TorchBlock] = {}

    def block(parent: str, kind: str) -> TorchBlock:
        if parent not in blocks:
            if cfg is not None:
                blocks[parent] = TorchBlock(parent, kind, heads, kv, d)
            else:
                owner = model.get_submodule(parent)
                blocks[parent] = TorchBlock(parent, kind, owner.num_heads, owner.num_heads, owner.head_dim)
        return blocks[parent]

    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        kind = "cross" if any(w in parent for w in CROSS_WORDS) else "self"
        if isinstance(module, torch.nn.Linear) and leaf in ROLE_LEAVES:
            role = ROLE_LEAVES[leaf]
            block(parent, kind).roles[role] = TorchProj(
                parent, role, f"{name}.weight", False, slice(None), f"{name}.bias" if module.bias is not None else None
            )
        elif leaf == "c_attn" and type(module).__name__ == "Conv1D":  # GPT-2: (in, 3D), columns [Q | K | V]
            b = block(parent, kind)
            width = b.heads * b.head_dim
            for i, role in enumerate("qkv"):
                b.roles[role] = TorchProj(
                    parent, role, f"{name}.weight", True, slice(i * width, (i + 1) * width), f"{name}.bias"
                )
        elif (
            isinstance(module, torch.nn.MultiheadAttention) and module.in_proj_weight is not None
        ):  # (3E, E), rows [Q; K; V]
            b = blocks.setdefault(name, TorchBlock(name, "self", module.num_heads, module.num_heads, module.head_dim))
            e = module.embed_dim
            for i, role in enumerate("qkv"):
                b.roles[role] = TorchProj(
                    name, role, f"{name}.in_proj_weight", False, slice(i * e, (i + 1) * e), f"{name}.in_proj_bias"
                )
    return [b for b in blocks.values() if len(b.roles) == 3]


def locate(params: dict[str, torch.Tensor], inits: dict[str, np.ndarray], name: str) -> tuple[str, bool]:
    """The initializer that holds parameter ``name``: (initializer, stored transposed?)."""
    p = params[name].detach().numpy()
    for init, a in inits.items():
        if a.shape == p.shape and np.array_equal(a, p):
            return init, False
        if p.ndim == 2 and a.shape == p.T.shape and np.array_equal(a, p.T):
            return init, True
    raise AssertionError(f"no initializer holds {name}")


def as_param(inits: dict[str, np.ndarray], where: tuple[str, bool]) -> torch.Tensor:
    """An initializer's value in the PyTorch parameter's orientation."""
    a = inits[where[0]]
    return torch.from_numpy(np.ascontiguousarray(a.T if where[1] else a).copy())


# --- checks ---------------------------------------------------------------------------------------
def assert_semi_orthogonal(w: torch.Tensor, head_dim: int, what: str) -> None:
    for h in range(w.shape[0] // head_dim):
        head = w[h * head_dim : (h + 1) * head_dim].double()
        gram = head @ head.T if head.shape[0] <= head.shape[1] else head.T @ head
        assert torch.allclose(gram, torch.eye(gram.shape[0], dtype=torch.float64), atol=1e-5), (
            f"{what} head {h} is not semi-orthogonal"
        )


def assert_value_identity(w: torch.Tensor, what: str) -> None:
    eye = torch.zeros_like(w, dtype=torch.float64)
    n = min(w.shape)
    eye[range(n), range(n)] = 1.0
    assert torch.equal(w.double(), eye), f"{what} is not the rectangular identity"


def changed_byte_ranges(before: bytes, after: bytes) -> list[tuple[int, int]]:
    """Maximal runs of differing bytes between two equally long byte strings."""
    a = np.frombuffer(before, np.uint8)
    b = np.frombuffer(after, np.uint8)
    assert a.shape == b.shape
    idx = np.nonzero(a != b)[0]
    if not idx.size:
        return []
    breaks = np.nonzero(np.diff(idx) > 1)[0]
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks], [idx[-1]]]) + 1
    return list(zip(starts.tolist(), ends.tolist()))


def tensor_ranges(path: Path) -> dict[str, tuple[str, int, int]]:
    """Where each initializer's bytes are: (file, start, end); for embedded ones found by content."""
    model = onnx.load(str(path), load_external_data=False)
    raw = Path(path).read_bytes()
    out = {}
    for t in model.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        if info:
            off = int(info.get("offset", 0))
            out[t.name] = (info["location"], off, off + int(info["length"]))
        elif t.raw_data:
            start = raw.find(t.raw_data)
            out[t.name] = (Path(path).name, start, start + len(t.raw_data))
    return out


def check_against_pytorch(model, params, inits_before, inits_after, chosen) -> tuple[set[str], torch.nn.Module]:
    """Read every q/k/v projection back through the PyTorch parameters: the chosen blocks' Q/K heads
    are semi-orthogonal, V is the identity, their biases are zero; the others are unchanged.
    Returns the initializers that changed, and ``model`` with the new weights loaded."""
    changed: set[str] = set()
    reference = copy.deepcopy(model)
    for tb in torch_blocks(model):
        for role, tp in tb.roles.items():
            where = locate(params, inits_before, tp.weight)
            value = as_param(inits_after, where)
            rows = (value[:, tp.cols].T if tp.conv1d else value[tp.cols]).double()
            what = f"{tb.module} {role}"
            if not chosen(tb):
                assert torch.equal(rows, tp.rows(params)), what
                continue
            changed.add(where[0])
            if role == "v":
                assert_value_identity(rows, what)
            else:
                assert_semi_orthogonal(rows, tb.head_dim, what)
            with torch.no_grad():
                reference.get_parameter(tp.weight).copy_(value)
                if tp.bias is not None:
                    bias_where = locate(params, inits_before, tp.bias)
                    bias = as_param(inits_after, bias_where)
                    assert torch.count_nonzero(bias[tp.cols]) == 0, f"{what} bias not zeroed"
                    changed.add(bias_where[0])
                    reference.get_parameter(tp.bias).copy_(bias)
    assert inits_after.keys() == inits_before.keys()
    for name, before in inits_before.items():
        if name not in changed:
            assert inits_after[name].dtype == before.dtype and inits_after[name].tobytes() == before.tobytes(), name
    return changed, reference


def assert_only_changed_bytes_differ(old_path: Path, new_path: Path, changed: set[str]) -> None:
    """Byte for byte: the .onnx and its data files differ only inside the changed initializers'
    data; the .onnx gains surgeon's metadata entry at its end."""
    ranges = tensor_ranges(old_path)
    files = {r[0] for r in ranges.values()} | {old_path.name}
    for file in files:
        before = (old_path.parent / file).read_bytes()
        after = (new_path if file == old_path.name else new_path.parent / file).read_bytes()
        if file == old_path.name:
            entry = onnx.ModelProto.FromString(after[len(before) :])  # one appended metadata_props field
            assert [p.key for p in entry.metadata_props] == ["surgeon"] and not entry.HasField("graph")
            after = after[: len(before)]
        assert len(after) == len(before), file
        allowed = np.zeros(len(before), dtype=bool)
        for name, (f, start, end) in ranges.items():
            if f == file and name in changed:
                allowed[start:end] = True
        for start, end in changed_byte_ranges(before, after):
            assert allowed[start:end].all(), f"{file}: bytes {start}-{end} changed outside the re-initialized tensors"


def save_variant(source: Path, folder: Path, kind: str) -> Path:
    """``source`` re-saved with its initializers embedded or in external data files."""
    model = onnx.load(str(source))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    if kind == "embedded":
        onnx.save_model(model, str(path))
    elif kind == "one-file":
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="model.onnx.data",
            size_threshold=0,
        )
    elif kind == "per-tensor":
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=256)
    elif kind == "split":  # over three files in a subfolder, round robin
        (folder / "weights").mkdir()
        big = [t for t in model.graph.initializer if len(t.raw_data) >= 256]
        for i, t in enumerate(big):
            onnx.external_data_helper.set_external_data(t, location=f"weights/part{i % 3}.bin")
        onnx.save_model(model, str(path))
    return path
