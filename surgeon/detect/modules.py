"""Find the attention blocks of an ``nn.Module`` in memory.

Three routes, from the most to the least settled:

* **names** -- a Hugging Face ``PreTrainedModel`` (anywhere in the module tree) is detected exactly as
  its checkpoint would be: :func:`surgeon.detect.names.detect` on its parameter names and
  ``config.to_dict()``. Its checkpoint names (transformers 5 renames some modules in memory, e.g.
  ViT's ``attention.attention.query`` is ``attention.q_proj``) key the random draws, so a model in
  memory gets the same weights as its saved checkpoint.
* **class** -- ``torch.nn.MultiheadAttention``: its layout is fixed by torch (``in_proj_weight``
  blocked [Q; K; V], or ``q/k/v_proj_weight`` when kdim/vdim differ).
* **forward** -- everything else (timm, custom modules naming their projections freely, fused layouts
  of any order): the module's own forward is run on a small probe input and surgeon watches which
  rows of which parameter reach the query, key and value that enter the attention product
  (``F.scaled_dot_product_attention``, or softmax(Q Kᵀ) V written with matmul/bmm/einsum).

How the forward is read: a ``TorchFunctionMode`` replaces the output of every projection-like op
(``F.linear``, ``addmm``, ``matmul`` whose weight operand is a view of a 2-D parameter) with a
*code* per output feature, and records the q/k/v handed to the attention product. Four forwards
with four codings -- all ones, the feature's row index, the parameter's number, a random value --
give, for every entry of q/k/v at the first token, ``value = s * code`` for an unknown scale ``s``
(the 1/sqrt(d) some modules fold into q), so the ratios to the all-ones forward name the parameter
and row exactly, and the random coding proves the path is a plain selection (no QK-norm, no clamp,
no bias added after the op). Only the first token is read, where rotary embeddings are the
identity. Anything that does not decode exactly is reported as unresolved, never guessed.
"""

from __future__ import annotations

import functools
import inspect as _inspect
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import LayoutError, NoAttentionFoundError, SurgeonError, opt
from ..formats.base import TensorInfo
from ..spec import AttentionBlock, Projection, Rows, slot_offsets
from .config import Hints
from .names import detect, match_modules, place_matches
from .placement import join, kind

PROBE_TOKENS = 8  # tokens of a generated probe input: enough for any mask code, small for any model


@dataclass
class ModuleDetection:
    """Attention blocks of a module, with the parameters their tensor names refer to."""

    blocks: list[AttentionBlock]
    params: dict[str, nn.Parameter]  # tensor name used in blocks -> the parameter
    seed_names: dict[str, str] = field(default_factory=dict)  # tensor -> checkpoint name (draw key)
    routes: dict[str, str] = field(default_factory=dict)  # block module -> "names", "class" or "forward"
    notes: list[str] = field(default_factory=list)


def detect_module(module: nn.Module, *, hints: Hints | None = None, example_inputs: Any = None) -> ModuleDetection:
    """Every attention block of ``module``; raises a SurgeonError when some cannot be resolved."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, not {type(module).__name__}")
    hints = hints or Hints()
    params = dict(module.named_parameters())
    found = ModuleDetection([], params)
    handled: list[str] = []  # module paths whose subtree is settled
    for prefix, hf in _hf_models(module):
        handled.append(prefix)
        try:
            detection = detect(_tensor_infos(hf), hf.config.to_dict(), hints, source=f"{type(hf).__name__} (in memory)")
        except NoAttentionFoundError:
            continue  # e.g. a vision tower without attention; nothing to do there
        except LayoutError as exc:
            if hints.num_heads is not None:  # the user said how many heads: the names were the way
                raise
            try:  # names and config do not settle it: ask the forward
                blocks = probe_blocks(hf, example_inputs=example_inputs, hints=hints, prefix=prefix)
            except SurgeonError as probe_exc:
                raise LayoutError(f"{exc} (the forward did not settle it either: {probe_exc})") from None
            _add(found, blocks, "forward")
            found.notes.append(f"{type(hf).__name__}: its names and config do not settle the layout, so it was read from the forward")
            continue
        renames = checkpoint_names(hf)
        blocks = [_prefixed(b, prefix) for b in detection.blocks]
        _add(found, blocks, "names")
        for block in blocks:
            for name in block.tensors():
                rel = name[len(prefix) + 1 :] if prefix else name
                found.seed_names[name] = renames.get(rel, rel)
        found.notes += detection.notes[:5]
    own: list[AttentionBlock] = []
    for path, mha in module.named_modules():
        if isinstance(mha, nn.MultiheadAttention) and not _under(path, handled):
            own.append(_mha_block(path, mha))
            handled.append(path)
    routes = {b.module: "class" for b in own}
    rest = [n for n in params if params[n].dim() == 2 and params[n].is_floating_point() and not _under(n, handled)]
    if rest:
        probed = probe_blocks(module, example_inputs=example_inputs, hints=hints, skip=handled)
        own += probed
        routes.update({b.module: "forward" for b in probed})
        _refuse_unseen(module, rest, probed, example_inputs)
    if own:
        _add(found, _placed(own), None, routes)
    if not found.blocks:
        raise NoAttentionFoundError(_nothing(module))
    return found


def _add(found: ModuleDetection, blocks: list[AttentionBlock], route: str | None, routes: dict[str, str] | None = None) -> None:
    found.blocks += blocks
    for b in blocks:
        found.routes[b.module] = route or (routes or {}).get(b.module, "forward")


def _under(path: str, prefixes: list[str]) -> bool:
    return any(p == "" or path == p or path.startswith(p + ".") for p in prefixes)


def _tensor_infos(module: nn.Module) -> dict[str, TensorInfo]:
    return {
        n: TensorInfo(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), str(p.dtype).removeprefix("torch."), "", p.numel() * p.element_size())
        for n, p in module.named_parameters()
    }


def _prefixed(block: AttentionBlock, prefix: str) -> AttentionBlock:
    if not prefix:
        return block

    def rows(r: Rows) -> Rows:
        return replace(r, tensor=f"{prefix}.{r.tensor}")

    q, k, v = (replace(p, weight=rows(p.weight), bias=None if p.bias is None else rows(p.bias)) for p in block.projections)
    return replace(
        block, stack=f"{prefix}.{block.stack}" if block.stack else prefix, module=f"{prefix}.{block.module}" if block.module else prefix,
        q=q, k=k, v=v,
    )


def _hf_models(module: nn.Module) -> list[tuple[str, Any]]:
    """The outermost transformers ``PreTrainedModel`` submodules (the module itself included)."""
    out: list[tuple[str, Any]] = []
    for path, m in module.named_modules():
        if any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__) and hasattr(getattr(m, "config", None), "to_dict"):
            if not _under(path, [p for p, _ in out]):
                out.append((path, m))
    return out


def checkpoint_names(model: nn.Module) -> dict[str, str]:
    """In-memory parameter name -> the name ``save_pretrained`` writes (transformers' renamings undone).

    Only pure renamings are followed; a parameter that a converter splits or merges keeps its name.
    Returns {} when transformers has no conversion mapping (older versions: names are the same).
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            apply_converters,
            apply_renamings,
        )
    except ImportError:
        return {}
    try:
        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:  # built from a config: mirror revert_weight_conversion (no prefix changes)
            conversions = [c for c in get_model_conversion_mapping(cast(Any, model), add_legacy=False) if not isinstance(c, PrefixChange)]
        reverse = [c.reverse_transform() for c in list(conversions)[::-1]]
    except Exception:  # a transformers version with another mapping API: keep the in-memory names
        return {}
    renamings = [r for r in reverse if isinstance(r, WeightRenaming)]
    converters = [r for r in reverse if isinstance(r, WeightConverter)]
    out = {}
    for name, _ in model.named_parameters():
        _, pattern = apply_converters(name, converters)
        out[name] = name if pattern is not None else apply_renamings(name, renamings)
    return out


# --- torch.nn.MultiheadAttention -------------------------------------------------------------


def _mha_block(path: str, mha: nn.MultiheadAttention) -> AttentionBlock:
    heads, d = mha.num_heads, mha.head_dim
    join = (lambda leaf: f"{path}.{leaf}") if path else (lambda leaf: leaf)
    qkv = slot_offsets("qkv", heads, heads, d)
    bias = join("in_proj_bias") if mha.in_proj_bias is not None else None
    projs = {}
    for role in "qkv":
        if mha._qkv_same_embed_dim:
            weight = Rows(join("in_proj_weight"), 0, qkv[role], d)
            width = mha.embed_dim
        else:
            tensor = getattr(mha, f"{role}_proj_weight")
            weight = Rows(join(f"{role}_proj_weight"), 0, slot_offsets(role, heads, heads, d)[role], d)
            width = tensor.shape[1]
        projs[role] = Projection(role, weight, Rows(bias, 0, qkv[role], d) if bias else None, width)  # type: ignore[arg-type]
    cross = not mha._qkv_same_embed_dim or kind(path) == "cross"
    layout = "fused in_proj" if mha._qkv_same_embed_dim else "separate in_proj"
    return AttentionBlock("", 0, "cross" if cross else "self", path, layout, heads, heads, d, projs["q"], projs["k"], projs["v"])


def _placed(blocks: list[AttentionBlock]) -> list[AttentionBlock]:
    """Stack and layer numbers from the module paths, as name-based detection gives them."""
    by_module = {b.module: b for b in blocks}
    placed = place_matches(by_module)
    return [replace(block, stack=stack, layer=layer) for _, block, stack, layer, _ in placed]


def _nothing(module: nn.Module) -> str:
    names = [n for n, _ in module.named_parameters()]
    sample = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"no attention found in {type(module).__name__}: looked at {len(names)} parameters ({sample}); its forward "
        "hands nothing to scaled_dot_product_attention or softmax(Q K^T) V computed from its own parameters"
    )


# --- the probe ---------------------------------------------------------------------------------


class _Unresolved(Exception):
    """One attention product whose q/k/v cannot be traced exactly to parameter rows."""


@dataclass
class _Op:
    """One projection-like op: output feature j is row ``start + j`` of ``param`` along ``axis``."""

    pid: int
    axis: int
    start: int
    size: int
    bias: tuple[str, int] | None  # bias parameter and the index of output feature 0
    source: tuple  # identity of the op's input tensor (self- vs cross-attention)


@dataclass
class _Capture:
    module: str  # innermost module running when the attention product was called
    q: torch.Tensor  # (N, d) at the first token, float64 on the CPU
    k: torch.Tensor
    v: torch.Tensor
    heads: int | None  # q.shape[-3] when q is (..., H, L, d)
    kv_heads: int | None
    ops: list[_Op]  # projection ops seen before the capture
    via: str = "sdpa"  # or "matmul": softmax(Q Kᵀ) V recognised from the products around a softmax


class _Targets:
    """The parameters a projection op may read, found by storage."""

    def __init__(self, module: nn.Module) -> None:
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        self.weights: dict[int, list[int]] = {}
        self.biases: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, p in module.named_parameters():
            if not p.is_floating_point():
                continue
            key = p.untyped_storage().data_ptr()
            if p.dim() == 2:
                self.weights.setdefault(key, []).append(len(self.params))
                self.names.append(name)
                self.params.append(p)
            elif p.dim() == 1:
                self.biases.setdefault(key, []).append((name, p))
        self._random: dict[tuple[int, int], torch.Tensor] = {}

    def locate(self, w: Any, out_dim: int) -> tuple[int, int, int] | None:
        """(param number, axis, first row) of a 2-D view ``w`` whose ``out_dim`` indexes output features."""
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return None
        for pid in self.weights.get(w.untyped_storage().data_ptr(), ()):
            p = self.params[pid]
            rel = w.storage_offset() - p.storage_offset()
            for axis in (0, 1):
                stride, other = p.stride(axis), p.stride(1 - axis)
                if (w.stride(out_dim), w.stride(1 - out_dim)) != (stride, other) or w.shape[1 - out_dim] != p.shape[1 - axis]:
                    continue
                if rel >= 0 and rel % stride == 0 and rel // stride + w.shape[out_dim] <= p.shape[axis]:
                    if p.shape[1 - axis] == 1 and p.shape[axis] == 1:
                        continue
                    return pid, axis, rel // stride
        return None

    def locate_bias(self, b: Any, size: int) -> tuple[str, int] | None:
        if not isinstance(b, torch.Tensor) or b.dim() != 1 or b.shape[0] != size:
            return None
        for name, p in self.biases.get(b.untyped_storage().data_ptr(), ()):
            rel = b.storage_offset() - p.storage_offset()
            if b.stride(0) == p.stride(0) and rel >= 0 and rel % p.stride(0) == 0:
                return name, rel // p.stride(0)
        return None

    def random(self, pid: int, axis: int) -> torch.Tensor:
        """A fixed random value per row, bounded away from zero (float32, on the CPU)."""
        key = (pid, axis)
        if key not in self._random:
            gen = torch.Generator().manual_seed(7919 * pid + axis + 1)
            n = self.params[pid].shape[axis]
            sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
            self._random[key] = ((torch.rand(n, generator=gen, dtype=torch.float64) + 0.5) * sign).float()
        return self._random[key]


_PROJ_OPS = {"linear", "addmm", "matmul", "__matmul__", "mm"}
_PROD_OPS = {"matmul", "__matmul__", "bmm", "baddbmm", "einsum"}
_ADD_OPS = {"add", "__add__", "__radd__", "add_", "__iadd__"}
_FILLS = ("ones", "index", "param", "random")


def _source_key(x: Any) -> tuple:
    if not isinstance(x, torch.Tensor):
        return ("?",)
    return (x.untyped_storage().data_ptr(), x.storage_offset(), x.numel())


class _Watch(TorchFunctionMode):
    """Replaces projection outputs with codes and records what reaches each attention product."""

    def __init__(self, targets: _Targets, fill: str, names: dict[nn.Module, str]) -> None:
        super().__init__()
        self.targets, self.fill, self.names = targets, fill, names
        self.frames: list[tuple[nn.Module, list]] = []
        self.ops: list[_Op] = []
        self.captures: list[_Capture] = []
        self.produced: dict[int, tuple[torch.Tensor, _Op]] = {}  # coded outputs, for a bias added afterwards

    # module stack: which module's own forward an op runs in
    def pre_hook(self, module, args):
        self.frames.append((module, []))

    def post_hook(self, module, args, output):
        if not self.frames or self.frames[-1][0] is not module:
            return
        _, events = self.frames.pop()
        self._match(module, events)
        if self.frames and not any(True for _ in module.children()):
            # a leaf module such as nn.Softmax: its events belong to its caller's pattern
            self.frames[-1][1].extend(e for e in events if e[0] == "softmax")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _PROJ_OPS:
            op = self._projection(name, args, kwargs)
            if op is not None:
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out.dim() >= 1 and out.shape[-1] == op.size:
                    self.ops.append(op)
                    return self._coded(op, out)
                return out
        if name in _ADD_OPS and len(args) >= 2 and id(args[0]) in self.produced:
            # ``x @ W.T + b`` (FalconLinear and hand-written projections): the bias joins the op
            coded, op = self.produced[id(args[0])]
            bias = self.targets.locate_bias(args[1], op.size) if coded is args[0] and op.bias is None else None
            if bias is not None:
                op.bias = bias
                out = func(*args, **kwargs)
                if out is args[0]:  # in place
                    out.copy_(self._codes(op, out))
                    return out
                return self._coded(op, out)
        if name == "scaled_dot_product_attention":
            q = kwargs.get("query", args[0] if args else None)
            k = kwargs.get("key", args[1] if len(args) > 1 else None)
            v = kwargs.get("value", args[2] if len(args) > 2 else None)
            self._capture(q, k, v)
        elif name in ("softmax", "_softmax") and self.frames:
            self.frames[-1][1].append(("softmax",))
        elif name in _PROD_OPS and self.frames:
            prod = _as_matmul(name, args, kwargs)
            if prod is not None:
                self.frames[-1][1].append(("prod", *prod))
        return func(*args, **kwargs)

    def _projection(self, name: str, args, kwargs) -> _Op | None:
        if name == "linear":
            x, w = kwargs.get("input", args[0] if args else None), kwargs.get("weight", args[1] if len(args) > 1 else None)
            b, out_dim = kwargs.get("bias", args[2] if len(args) > 2 else None), 0
        elif name == "addmm":
            b, x = kwargs.get("input", args[0] if args else None), kwargs.get("mat1", args[1] if len(args) > 1 else None)
            w, out_dim = kwargs.get("mat2", args[2] if len(args) > 2 else None), 1
        else:
            x, w = kwargs.get("input", args[0] if args else None), kwargs.get("other", kwargs.get("mat2", args[1] if len(args) > 1 else None))
            b, out_dim = None, 1
        where = self.targets.locate(w, out_dim)
        if where is None:
            return None
        pid, axis, start = where
        size = w.shape[out_dim]
        return _Op(pid, axis, start, size, self.targets.locate_bias(b, size), _source_key(x))

    def _coded(self, op: _Op, out: torch.Tensor) -> torch.Tensor:
        coded = self._codes(op, out)
        self.produced[id(coded)] = (coded, op)
        return coded

    def _codes(self, op: _Op, out: torch.Tensor) -> torch.Tensor:
        if self.fill == "ones":
            codes = torch.ones(op.size, dtype=torch.float64)
        elif self.fill == "index":
            codes = torch.arange(op.start + 1, op.start + op.size + 1, dtype=torch.float64)
        elif self.fill == "param":
            codes = torch.full((op.size,), 2.0 * op.pid + op.axis + 1, dtype=torch.float64)
        else:
            codes = self.targets.random(op.pid, op.axis)[op.start : op.start + op.size]
        return codes.to(out.device, out.dtype).expand(out.shape).contiguous()

    def _match(self, module, events) -> None:
        """softmax(Q Kᵀ) V written out: the last product before a softmax and the first after it."""
        done = 0
        for i, event in enumerate(events):
            if event[0] != "softmax" or i < done:
                continue
            before = [j for j in range(done, i) if events[j][0] == "prod"]
            after = [j for j in range(i + 1, len(events)) if events[j][0] == "prod"]
            if not before or not after:
                continue
            _, q, kt = events[before[-1]]
            _, p, v = events[after[0]]
            if q.dim() >= 3 and kt.dim() >= 3 and v.dim() >= 3 and q.shape[-1] == kt.shape[-2] and kt.shape[-1] == v.shape[-2] == p.shape[-1]:
                self._capture(q, kt.transpose(-1, -2), v, module=module, via="matmul")
                done = after[0] + 1

    def _capture(self, q, k, v, module=None, via="sdpa") -> None:
        if not all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (q, k, v)):
            return
        module = module if module is not None else (self.frames[-1][0] if self.frames else None)
        first = [t[..., 0, :].reshape(-1, t.shape[-1]).detach().to("cpu", torch.float64) for t in (q, k, v)]
        heads = q.shape[-3] if q.dim() >= 4 else None
        kv_heads = k.shape[-3] if k.dim() >= 4 else None
        self.captures.append(_Capture(self.names.get(module, ""), first[0], first[1], first[2], heads, kv_heads, list(self.ops), via))


def _as_matmul(name: str, args, kwargs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a, b) with the op's result = a @ b, for matmul, bmm, baddbmm and two-operand einsum."""
    if name == "baddbmm":
        a, b = kwargs.get("batch1", args[1] if len(args) > 1 else None), kwargs.get("batch2", args[2] if len(args) > 2 else None)
    elif name == "einsum":
        return _einsum_as_matmul(args)
    else:
        a, b = kwargs.get("input", args[0] if args else None), kwargs.get("other", kwargs.get("mat2", args[1] if len(args) > 1 else None))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 2 and b.dim() >= 2:
        return a, b
    return None


def _einsum_as_matmul(args) -> tuple[torch.Tensor, torch.Tensor] | None:
    if len(args) == 2 and isinstance(args[1], (list, tuple)):
        args = (args[0], *args[1])
    if len(args) != 3 or not isinstance(args[0], str) or "..." in args[0] or "->" not in args[0]:
        return None
    spec, a, b = args[0].replace(" ", ""), args[1], args[2]
    ins, out = spec.split("->")
    if ins.count(",") != 1 or not all(isinstance(t, torch.Tensor) for t in (a, b)):
        return None
    sa, sb = ins.split(",")
    contracted = [c for c in sa if c in sb and c not in out]
    batch = [c for c in out if c in sa and c in sb]
    free_a, free_b = [c for c in sa if c not in sb], [c for c in sb if c not in sa]
    if len(contracted) != 1 or len(free_a) != 1 or len(free_b) != 1 or len(set(sa)) != len(sa) or len(set(sb)) != len(sb):
        return None
    if len(batch) + 2 != len(sa) or len(batch) + 2 != len(sb):
        return None
    c = contracted[0]
    a2 = a.permute([sa.index(x) for x in batch + free_a + [c]])
    b2 = b.permute([sb.index(x) for x in batch + [c] + free_b])
    return a2, b2


def _hooks(module: nn.Module, watch: _Watch) -> list:
    handles = []
    for m in module.modules():
        handles.append(m.register_forward_pre_hook(watch.pre_hook))
        handles.append(m.register_forward_hook(watch.post_hook, always_call=True))
    return handles


@contextmanager
def _probing(module: nn.Module) -> Iterator[None]:
    """Eval mode and float32 for the probe's forwards; modes, dtypes and buffers restored afterwards.

    Half-precision models are widened to float32 in place (exact both ways) because the row codes
    must survive the forward as exact integers.
    """
    training = {m: m.training for m in module.modules()}
    buffers = {b: b.detach().clone() for b in module.buffers()}  # caches a forward may write into
    narrow = {t: t.dtype for t in [*module.parameters(), *module.buffers()] if t.dtype in (torch.float16, torch.bfloat16)}
    module.eval()
    try:
        for t in narrow:
            t.data = t.data.float()
        yield
    finally:
        for t, dtype in narrow.items():
            t.data = t.data.to(dtype)
        with torch.no_grad():
            for b, saved in buffers.items():
                if b.shape == saved.shape:
                    b.copy_(saved)
        for m, flag in training.items():
            m.training = flag


def _run(root: nn.Module, call: Callable[[], Any], fill: str, names: dict[nn.Module, str], targets: _Targets) -> _Watch:
    watch = _Watch(targets, fill, names)
    handles = _hooks(root, watch)
    try:
        with torch.no_grad(), watch:
            call()
    finally:
        for h in handles:
            h.remove()
    return watch


def _watch_all(root: nn.Module, call: Callable[[], Any], names: dict[nn.Module, str], targets: _Targets) -> dict[str, _Watch] | None:
    """The four coded forwards; None when the call fails on the first (wrong inputs for this module)."""
    try:
        first = _run(root, call, "ones", names, targets)
    except Exception:
        return None
    runs = {"ones": first}
    if not first.captures:
        return runs
    for fill in _FILLS[1:]:
        runs[fill] = _run(root, call, fill, names, targets)
        if len(runs[fill].captures) != len(first.captures):
            raise LayoutError(f"{type(root).__name__}: its forward is not deterministic (a different number of attention calls on a second run); surgeon cannot observe it")
    return runs


# --- reading the codes back -----------------------------------------------------------------


def _decode(runs: dict[str, _Watch], i: int, role: str, targets: _Targets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(param number, axis, row) of every entry of one captured q/k/v at the first token."""
    ones, index, param, rand = (getattr(runs[f].captures[i], role) for f in _FILLS)
    if ones.shape != index.shape or ones.shape != param.shape or ones.shape != rand.shape:
        raise _Unresolved(f"its {_ROLE[role]} changes shape between forwards")
    if not torch.isfinite(ones).all() or (ones.abs() < 1e-30).any():
        raise _Unresolved(
            f"its {_ROLE[role]} is not a plain selection of projection outputs (zero or not finite where every projection "
            "output was 1): a normalization such as QK-norm, or values from outside the module's parameters"
        )
    rows, pids = index / ones, param / ones
    for ratio, what in ((rows, "row"), (pids, "parameter")):
        if ((ratio - ratio.round()).abs() > 1e-3 + 2e-7 * ratio.abs()).any() or (ratio.round() < 1).any():
            raise _Unresolved(
                f"its {_ROLE[role]} is not a plain selection of projection outputs (the {what} codes do not come through): "
                "something mixes features between the projection and the attention product (QK-norm? a bias or position "
                "term added after the projection?)"
            )
    code = pids.round().long() - 1
    pid, axis, row = code // 2, code % 2, rows.round().long() - 1
    if (pid >= len(targets.params)).any():
        raise _Unresolved(f"its {_ROLE[role]} holds codes of no parameter")
    for p in pid.unique().tolist():
        for a in (0, 1):
            mask = (pid == p) & (axis == a)
            if not mask.any():
                continue
            size = targets.params[p].shape[a]
            if (row[mask] >= size).any():
                raise _Unresolved(f"its {_ROLE[role]} holds row codes past the end of {targets.names[p]}")
            expected = ones[mask] * targets.random(p, a).double()[row[mask]]
            if not torch.allclose(rand[mask], expected, rtol=1e-4, atol=0.0):
                raise _Unresolved(
                    f"its {_ROLE[role]} is not a linear selection of projection outputs (a random coding does not come through "
                    "unchanged): a non-linearity such as QK-norm or a clamp sits between the projection and the attention product"
                )
    return pid, axis, row


_ROLE = {"q": "query", "k": "key", "v": "value"}


def _decodes(runs: dict[str, _Watch], i: int, role: str, targets: _Targets) -> bool:
    try:
        _decode(runs, i, role, targets)
    except _Unresolved:
        return False
    return True


def _head_rows(pid, axis, row, heads: int | None, sequences: int | None, role: str, names: list[str]):
    """Per head: (param number, axis, first row), given the decoded entries (N, d) of one role."""
    n, d = row.shape
    if heads is None and sequences:
        if n % sequences:
            raise _Unresolved(f"its {_ROLE[role]} has {n} head rows, not a multiple of {sequences} sequences")
        heads = n // sequences
    if heads is None:  # (batch * heads, L, d): the smallest period of the rows
        key = torch.stack([pid, axis, row], dim=-1)
        heads = next(p for p in range(1, n + 1) if n % p == 0 and torch.equal(key, key[:p].repeat(n // p, 1, 1)))
    if n % heads:
        raise _Unresolved(f"its {_ROLE[role]} has {n} rows at the first token, not a multiple of {heads} heads")
    key = torch.stack([pid, axis, row], dim=-1)
    if not torch.equal(key, key[:heads].repeat(n // heads, 1, 1)):
        raise _Unresolved(f"the {_ROLE[role]} heads of its batch entries come from different rows")
    out = []
    for h in range(heads):
        p, a, r = pid[h], axis[h], row[h]
        if not (p == p[0]).all() or not (a == a[0]).all():
            raise _Unresolved(f"{_ROLE[role]} head {h} mixes features of several tensors")
        if not torch.equal(r, r[0] + torch.arange(d)):
            raise _Unresolved(f"{_ROLE[role]} head {h} reads rows of {names[int(p[0])]} that are not consecutive; surgeon rewrites per-head blocks of consecutive rows")
        out.append((int(p[0]), int(a[0]), int(r[0])))
    return out


def _resolve(runs: dict[str, _Watch], i: int, targets: _Targets, hints: Hints) -> dict:
    cap = runs["ones"].captures[i]
    decoded = {role: _decode(runs, i, role, targets) for role in "qkv"}
    q_heads = _head_rows(*decoded["q"], cap.heads, None, "q", targets.names)
    heads = len(q_heads)
    sequences = cap.q.shape[0] // heads
    kv = {}
    for role, hint in (("k", cap.kv_heads), ("v", cap.kv_heads)):
        rows = _head_rows(*decoded[role], hint, sequences, role, targets.names)
        unique = list(dict.fromkeys(rows))
        if len(rows) == heads and len(unique) < heads:  # key/value heads repeated to the query heads
            group = heads // len(unique) if heads % len(unique) == 0 else 0
            if not group or any(unique.index(rows[h]) != h // group for h in range(heads)):
                raise _Unresolved(f"its {_ROLE[role]} heads are shared by query heads in an order other than consecutive groups")
        elif len(unique) != len(rows) or heads % len(rows):
            raise _Unresolved(f"it has {heads} query heads and {len(rows)} {_ROLE[role]} heads")
        kv[role] = unique
    if len(kv["k"]) != len(kv["v"]):
        raise _Unresolved(f"it has {len(kv['k'])} key heads but {len(kv['v'])} value heads")
    if hints.num_heads is not None and hints.num_heads != heads:
        raise LayoutError(f"{cap.module or 'the model'}: its forward uses {heads} query heads, not {hints.num_heads} ({opt('num_heads')})")
    return {"q": q_heads, "k": kv["k"], "v": kv["v"], "dims": {r: decoded[r][2].shape[1] for r in "qkv"}}


def _block_from(resolved: dict, cap: _Capture, targets: _Targets) -> AttentionBlock:
    projections = {}
    sources = {}
    for role in "qkv":
        heads = resolved[role]
        pids = {p for p, _, _ in heads}
        axes = {a for _, a, _ in heads}
        if len(pids) != 1 or len(axes) != 1:
            names = ", ".join(sorted(targets.names[p] for p in pids))
            raise _Unresolved(f"its {_ROLE[role]} heads live in several tensors ({names}); surgeon rewrites one tensor per projection")
        pid, axis = pids.pop(), axes.pop()
        name, size = targets.names[pid], resolved["dims"][role]
        offsets = tuple(r for _, _, r in heads)
        op = _covering(cap.ops, pid, axis, offsets[0])
        bias = None
        if op is not None and op.bias is not None and all(_covering(cap.ops, pid, axis, o) is op for o in offsets):
            bias = Rows(op.bias[0], 0, tuple(op.bias[1] + o - op.start for o in offsets), size)
        sources[role] = op.source if op is not None else None
        in_features = targets.params[pid].shape[1 - axis]
        projections[role] = Projection(role, Rows(name, axis, offsets, size), bias, in_features)  # type: ignore[arg-type]
    _check_disjoint(projections)
    module = _common_module(cap.module, [projections[r].weight.tensor.rpartition(".")[0] for r in "qkv"])
    tensors = [projections[r].weight.tensor for r in "qkv"]
    leaf = lambda t: t.removeprefix(module + ".") if module else t  # noqa: E731
    if len(set(tensors)) == 1:
        layout = f"forward: fused {leaf(tensors[0]).removesuffix('.weight')}"
    else:
        layout = "forward: " + ", ".join(dict.fromkeys(leaf(t).removesuffix(".weight") for t in tensors))
    kind = "self" if sources["q"] is not None and sources["q"] == sources["k"] else "cross"
    q = projections["q"]
    return AttentionBlock("", 0, kind, module, layout, q.heads, projections["k"].heads, q.head_dim, projections["q"], projections["k"], projections["v"])  # type: ignore[arg-type]


def _covering(ops: list[_Op], pid: int, axis: int, row: int) -> _Op | None:
    for op in reversed(ops):
        if op.pid == pid and op.axis == axis and op.start <= row < op.start + op.size:
            return op
    return None


def _check_disjoint(projs: dict[str, Projection]) -> None:
    seen: dict[str, set[int]] = {}
    for role, p in projs.items():
        rows = {o + i for o in p.weight.offsets for i in range(p.weight.size)}
        key = f"{p.weight.tensor}@{p.weight.axis}"
        if seen.get(key, set()) & rows:
            raise _Unresolved(f"its {_ROLE[role]} shares rows of {p.weight.tensor} with another projection")
        seen.setdefault(key, set()).update(rows)


def _common_module(start: str, owners: list[str]) -> str:
    """The innermost module at the attention call, widened until it holds every projection."""
    module = start
    while module and not all(o == module or o.startswith(module + ".") for o in owners):
        module = module.rpartition(".")[0]
    return module


def probe_blocks(
    module: nn.Module, *, example_inputs: Any = None, hints: Hints | None = None, prefix: str = "", skip: list[str] | None = None
) -> list[AttentionBlock]:
    """Attention blocks of ``module`` read from its forward alone (no names, no config).

    ``example_inputs`` (a tensor, a tuple of positional arguments or a dict of keyword arguments) is
    what the module is called with; without it, a Hugging Face model gets token ids / pixels / audio
    features built from its config, anything else a float tensor (1, tokens, width) tried on the
    module and then on its submodules. ``prefix`` is prepended to every name (``module`` sits there
    inside a larger model); modules under ``skip`` (paths inside ``module``) are ignored.
    """
    hints = hints or Hints()
    with _probing(module):
        targets = _Targets(module)
        names = {m: n for n, m in module.named_modules()}
        blocks: dict[tuple, AttentionBlock] = {}
        for runs in _call_sites(module, example_inputs, names, targets, skip or []):
            for i, cap in enumerate(runs["ones"].captures):
                if skip and _under(cap.module, skip):
                    continue
                try:
                    block = _block_from(_resolve(runs, i, targets, hints), cap, targets)
                except _Unresolved as exc:
                    if cap.via == "matmul" and not any(_decodes(runs, i, role, targets) for role in "qkv"):
                        continue  # products around a softmax that involve no projection: not attention
                    where = join(prefix, cap.module) or type(module).__name__
                    raise LayoutError(f"cannot resolve the attention in {where}: {exc}") from None
                if not (skip and _under(block.module, skip)):
                    blocks.setdefault(tuple((p.weight.tensor, p.weight.offsets) for p in block.projections), block)
    return [_prefixed(b, prefix) for b in _placed(list(blocks.values()))] if blocks else []


def _call_sites(module, example_inputs, names, targets, skip) -> list[dict[str, _Watch]]:
    """Run the coded forwards where the module can be called; one entry per successful call."""
    if example_inputs is not None:
        call = _caller(module, example_inputs)
        runs = _watch_all(module, call, names, targets)
        if runs is None:
            try:
                call()
            except Exception as exc:
                raise LayoutError(f"{type(module).__name__} fails on the example inputs given: {_short(exc)}") from None
        return [runs] if runs else []
    if any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__):
        inputs = hf_inputs(module)
        runs = _watch_all(module, lambda: module(**inputs), names, targets)
        if runs is None:
            try:
                module(**inputs)
            except Exception as exc:
                raise LayoutError(
                    f"cannot run {type(module).__name__} on a probe input ({_short(exc)}); pass example_inputs=... to observe its forward"
                ) from None
        return [runs] if runs else []
    sites: list[dict[str, _Watch]] = []
    _try_calls(module, "", names, targets, skip, sites)
    return sites


def _caller(module: nn.Module, example_inputs: Any) -> Callable[[], Any]:
    if isinstance(example_inputs, Mapping):
        return lambda: module(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return lambda: module(*example_inputs)
    return lambda: module(example_inputs)


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def _try_calls(module: nn.Module, path: str, names, targets: _Targets, skip: list[str], sites: list) -> None:
    """Call ``module`` on a float (1, tokens, width) probe; where it fails, try its children."""
    if _under(path, skip) and skip:
        return
    own = [(n, p) for n, p in module.named_parameters() if p.dim() == 2 and p.is_floating_point() and not _under(join(path, n), skip)]
    if not own:
        return
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is not nn.Module.forward:
        device = own[0][1].device
        widths = Counter(p.shape[1] for _, p in own).most_common(2) + Counter(p.shape[0] for _, p in own).most_common(1)
        for width in dict.fromkeys(w for w, _ in widths):
            x = torch.randn(1, PROBE_TOKENS, width, generator=torch.Generator().manual_seed(0)).to(device)
            runs = _watch_all(module, functools.partial(module, x), names, targets)
            if runs is not None:
                sites.append(runs)
                return
    for name, child in module.named_children():
        _try_calls(child, join(path, name), names, targets, skip, sites)


def hf_inputs(model: nn.Module, *, tokens: int = PROBE_TOKENS) -> dict:
    """Small inputs for a transformers model, built from its config (token ids, pixels or audio features)."""
    cfg = model.config
    params = _inspect.signature(model.forward).parameters
    first = next(model.parameters())
    dev, dtype = first.device, first.dtype if first.is_floating_point() else torch.float32
    gen = torch.Generator().manual_seed(0)

    def get(*keys, scope=None):
        # multimodal configs (CLIP, SigLIP) keep the text tower's numbers in text_config
        for c in (scope,) if scope is not None else (cfg, getattr(cfg, "text_config", None)):
            for k in keys:
                v = getattr(c, k, None)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
        return None

    def pixels(c):
        size = c.image_size if isinstance(c.image_size, int) else c.image_size[0]
        return torch.randn(1, get("num_channels", scope=c) or 3, size, size, generator=gen).to(dev, dtype)

    main = getattr(model, "main_input_name", "input_ids")
    cap = get("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")
    length = max(1, min(tokens, cap - 2)) if cap and cap > 2 else tokens
    vocab = get("vocab_size") or 8
    out: dict[str, Any] = {}
    if main == "input_ids":
        out["input_ids"] = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=gen).to(dev)
    elif main == "pixel_values":
        out["pixel_values"] = pixels(cfg)
    elif main == "input_features":
        frames = 2 * (get("max_source_positions") or 1500)
        out["input_features"] = torch.randn(1, get("num_mel_bins") or 80, frames, generator=gen).to(dev, dtype)
    else:
        raise LayoutError(f"cannot build a probe input for {type(model).__name__} (main input {main!r}); pass example_inputs=...")
    vision = getattr(cfg, "vision_config", None)
    if main == "input_ids" and "pixel_values" in params and getattr(vision, "image_size", None):
        out["pixel_values"] = pixels(vision)  # two-tower models run both towers
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        out["decoder_input_ids"] = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=gen).to(dev)
    if "use_cache" in params:
        out["use_cache"] = False
    return out


def _refuse_unseen(module: nn.Module, rest: list[str], probed: list[AttentionBlock], example_inputs: Any) -> None:
    """Parameters named like attention projections that no observed attention product used."""
    used = {r.tensor for b in probed for p in b.projections for r in (p.weight, p.bias) if r is not None}
    infos = {n: TensorInfo(n, (0, 0), "", None, "", 0) for n in rest if n not in used}
    for owner, rule in match_modules(infos).items():
        weights = [join(owner, part.weight) for part in rule.parts]
        if any(w in used for w in weights):
            continue
        hint = "pass example_inputs=... (the inputs of its usual forward)" if example_inputs is None else "its forward never used them on the example inputs"
        raise LayoutError(
            f"{owner or type(module).__name__} looks like attention ({', '.join(w.removeprefix(owner + '.') for w in weights)}) "
            f"but surgeon did not see it compute an attention product; {hint}"
        )
