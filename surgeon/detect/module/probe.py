"""The forward probe: every projection-like op's output replaced by a coding, products around the softmax captured."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ...errors import LayoutError, SurgeonError
from .targets import Targets, is_dtensor

PROBE_TOKENS = 8  # tokens of a generated probe input: enough for any mask code, small for any model

# --- the probe ---------------------------------------------------------------------------------


class Unresolved(Exception):
    """One attention product whose q/k/v cannot be traced exactly to parameter rows."""


@dataclass
class Op:
    """One projection-like op: output feature j is row ``start + j`` of ``param`` along ``axis``."""

    pid: int
    axis: int
    start: int
    size: int
    bias: tuple[str, int] | None  # bias parameter and the index of output feature 0
    source: tuple  # identity of the op's input tensor (self- vs cross-attention)


@dataclass
class Capture:
    module: str  # innermost module running when the attention product was called
    q: torch.Tensor  # (N, d) at the first token, float64 on the CPU
    k: torch.Tensor
    v: torch.Tensor
    heads: int | None  # q.shape[-3] when q is (..., H, L, d)
    kv_heads: int | None
    ops: list[Op]  # projection ops seen before the capture
    via: str = "sdpa"  # or "matmul": softmax(Q Kᵀ) V recognised from the products around a softmax
    # the query's first feature of its first head at every token, float64 on the CPU: where its tokens start to
    # come from another projection (joint attention's streams), read by stream_starts
    streams: torch.Tensor | None = None
    # (q, k, v) at more tokens, as q/k/v are at the first: the first token of each later stream (Watch.positions)
    at: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)


# Normalization modules (torch's LayerNorm/RMSNorm, transformers' Qwen3RMSNorm, diffusers' RMSNorm, timm's
# LayerNorm) by class name. Applied to a projection's output (timm qk_norm, Qwen3 q_norm/k_norm) they are part
# of the model, not a mixing of features: the probe passes the codes through them and notes them (kept_norms).
NORMS = re.compile(r"(LayerNorm|RMSNorm)$")
_PROJ_OPS = {"linear", "addmm", "matmul", "__matmul__", "mm"}
_PROD_OPS = {"matmul", "__matmul__", "bmm", "baddbmm", "einsum"}
# the operator flex_attention calls (torch.nn.attention.flex_attention) takes (query, key, value) first too
_ATTENTION_OPS = {"scaled_dot_product_attention", "flex_attention"}
# ops that move or copy values without mixing them: their output of coded outputs is still coded (for norm_hook)
_SHAPE_OPS = {"contiguous", "reshape", "view", "clone", "split", "transpose", "permute", "flatten", "unflatten"}
_ADD_OPS = {"add", "__add__", "__radd__", "add_", "__iadd__"}
FILLS = ("ones", "index", "param", "random")


def _source_key(x: Any) -> tuple:
    if not isinstance(x, torch.Tensor):
        return ("?",)
    return (x.untyped_storage().data_ptr(), x.storage_offset(), x.numel())


class Watch(TorchFunctionMode):
    """Replaces projection outputs with codes and records what reaches each attention product."""

    def __init__(
        self,
        targets: Targets,
        fill: str,
        names: dict[nn.Module, str],
        positions: Mapping[int, tuple[int, ...]] | None = None,
    ) -> None:
        super().__init__()
        self.targets, self.fill, self.names = targets, fill, names
        self.positions = dict(positions or {})  # capture number -> more tokens whose q/k/v it keeps
        self.frames: list[tuple[nn.Module, list]] = []
        self.ops: list[Op] = []
        self.captures: list[Capture] = []
        self.produced: dict[int, tuple[torch.Tensor, Op]] = {}  # coded outputs, for a bias added afterwards
        self.coded: dict[int, Op] = {}  # storage of every coded output (views of it share it) -> its op
        self.kept_norms: list[tuple[str, int]] = []  # (norm module, parameter number) passed through

    # module stack: which module's own forward an op runs in
    def pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.frames.append((module, []))

    def post_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.frames or self.frames[-1][0] is not module:
            return
        _, events = self.frames.pop()
        self._match(module, events)
        if self.frames and not any(True for _ in module.children()):
            # a leaf module such as nn.Softmax: its events belong to its caller's pattern
            self.frames[-1][1].extend(e for e in events if e[0] == "softmax")

    def norm_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> torch.Tensor | None:
        """A normalization applied to a projection's codes (or a view of them) hands them on unchanged."""
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            return None
        op = self.coded.get(x.untyped_storage().data_ptr())
        if op is None or not isinstance(output, torch.Tensor) or output.shape != x.shape:
            return None
        self.kept_norms.append((self.names.get(module, ""), op.pid))
        return x

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
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
        if name in _ATTENTION_OPS:  # (query, key, value, ...): SDPA, and flex attention's operator
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
        out = func(*args, **kwargs)
        if name in _SHAPE_OPS and args and isinstance(args[0], torch.Tensor) and self.coded:
            self._carry(args[0], out)
        return out

    def _carry(self, source: torch.Tensor, out: Any) -> None:
        """A copy of coded outputs in a new shape (torchtitan's split heads made contiguous) is still them."""
        op = self.coded.get(source.untyped_storage().data_ptr())
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if op is not None and isinstance(t, torch.Tensor) and not is_dtensor(t):
                self.coded[t.untyped_storage().data_ptr()] = op

    def _projection(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Op | None:
        if name == "linear":
            x, w = (
                kwargs.get("input", args[0] if args else None),
                kwargs.get("weight", args[1] if len(args) > 1 else None),
            )
            b, out_dim = kwargs.get("bias", args[2] if len(args) > 2 else None), 0
        elif name == "addmm":
            b, x = (
                kwargs.get("input", args[0] if args else None),
                kwargs.get("mat1", args[1] if len(args) > 1 else None),
            )
            w, out_dim = kwargs.get("mat2", args[2] if len(args) > 2 else None), 1
        else:
            x, w = (
                kwargs.get("input", args[0] if args else None),
                kwargs.get("other", kwargs.get("mat2", args[1] if len(args) > 1 else None)),
            )
            b, out_dim = None, 1
        where = self.targets.locate(w, out_dim)
        if where is None or not isinstance(w, torch.Tensor):  # located: a tensor (the check tells mypy)
            return None
        pid, axis, start = where
        size = w.shape[out_dim]
        return Op(pid, axis, start, size, self.targets.locate_bias(b, size), _source_key(x))

    def _coded(self, op: Op, out: torch.Tensor) -> torch.Tensor:
        coded = self._codes(op, out)
        self.produced[id(coded)] = (coded, op)
        self.coded[coded.untyped_storage().data_ptr()] = op
        return coded

    def _codes(self, op: Op, out: torch.Tensor) -> torch.Tensor:
        if self.fill == "ones":
            codes = torch.ones(op.size, dtype=torch.float64)
        elif self.fill == "index":
            codes = torch.arange(op.start + 1, op.start + op.size + 1, dtype=torch.float64)
        elif self.fill == "param":
            codes = torch.full((op.size,), 2.0 * op.pid + op.axis + 1, dtype=torch.float64)
        else:
            codes = self.targets.random(op.pid, op.axis)[op.start : op.start + op.size]
        return codes.to(out.device, out.dtype).expand(out.shape).contiguous()

    def _match(self, module: nn.Module, events: list[tuple[Any, ...]]) -> None:
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
            if (
                q.dim() >= 3
                and kt.dim() >= 3
                and v.dim() >= 3
                and q.shape[-1] == kt.shape[-2]
                and kt.shape[-1] == v.shape[-2] == p.shape[-1]
            ):
                self._capture(q, kt.transpose(-1, -2), v, module=module, via="matmul")
                done = after[0] + 1

    def _capture(self, q: Any, k: Any, v: Any, module: nn.Module | None = None, via: str = "sdpa") -> None:
        if not all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (q, k, v)):
            return
        module = module if module is not None else (self.frames[-1][0] if self.frames else None)
        more = [p for p in self.positions.get(len(self.captures), ()) if all(p < t.shape[-2] for t in (q, k, v))]
        first = [_rows(t, 0) for t in (q, k, v)]
        heads = q.shape[-3] if q.dim() >= 4 else None
        kv_heads = k.shape[-3] if k.dim() >= 4 else None
        self.captures.append(
            Capture(
                self.names.get(module, "") if module is not None else "",
                first[0],
                first[1],
                first[2],
                heads,
                kv_heads,
                list(self.ops),
                via,
                q.reshape(-1, *q.shape[-2:])[0, :, 0].detach().to("cpu", torch.float64),
                {p: (_rows(q, p), _rows(k, p), _rows(v, p)) for p in more},
            )
        )


def _rows(t: torch.Tensor, token: int) -> torch.Tensor:
    """(N, d): every row of ``t`` (..., L, d) at one token, float64 on the CPU."""
    return t[..., token, :].reshape(-1, t.shape[-1]).detach().to("cpu", torch.float64)


def stream_starts(runs: Mapping[str, Watch], i: int) -> tuple[int, ...]:
    """The tokens where the query of attention product ``i`` starts to come from another parameter: token 0, then
    the first token of each later stream (joint attention: Flux's processor puts the context's tokens before
    the image's, SD3's after them). A token's parameter is its "param" code over its "ones" code, which a
    rotary embedding (linear, the same in both runs) leaves whole; a token whose ratio is no code says nothing."""
    ones, param = runs["ones"].captures[i].streams, runs["param"].captures[i].streams
    if ones is None or param is None or ones.shape != param.shape:
        return (0,)
    code = param / ones
    clean = torch.isfinite(code) & (ones.abs() > 1e-6) & ((code - code.round()).abs() < 1e-3) & (code.round() >= 1)
    starts, last = [0], None
    for t in range(len(code)):
        if not clean[t]:
            continue
        now = int(code[t].round())
        if last is not None and now != last:
            starts.append(t)
        last = now
    return tuple(starts)


def _as_matmul(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a, b) with the op's result = a @ b, for matmul, bmm, baddbmm and two-operand einsum."""
    if name == "baddbmm":
        a, b = (
            kwargs.get("batch1", args[1] if len(args) > 1 else None),
            kwargs.get("batch2", args[2] if len(args) > 2 else None),
        )
    elif name == "einsum":
        return _einsum_as_matmul(args)
    else:
        a, b = (
            kwargs.get("input", args[0] if args else None),
            kwargs.get("other", kwargs.get("mat2", args[1] if len(args) > 1 else None)),
        )
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 2 and b.dim() >= 2:
        return a, b
    return None


def _einsum_as_matmul(args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
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
    if (
        len(contracted) != 1
        or len(free_a) != 1
        or len(free_b) != 1
        or len(set(sa)) != len(sa)
        or len(set(sb)) != len(sb)
    ):
        return None
    if len(batch) + 2 != len(sa) or len(batch) + 2 != len(sb):
        return None
    c = contracted[0]
    a2 = a.permute([sa.index(x) for x in batch + free_a + [c]])
    b2 = b.permute([sb.index(x) for x in batch + [c] + free_b])
    return a2, b2


def _hooks(module: nn.Module, watch: Watch) -> list:
    handles = []
    for m in module.modules():
        handles.append(m.register_forward_pre_hook(watch.pre_hook))
        handles.append(m.register_forward_hook(watch.post_hook, always_call=True))
        if NORMS.search(type(m).__name__):
            handles.append(m.register_forward_hook(watch.norm_hook))
    return handles


@contextmanager
def probing(module: nn.Module) -> Iterator[None]:
    """Eval mode and float32 for the probe's forwards; modes, dtypes and buffers restored afterwards.

    Half-precision models are widened to float32 in place (exact both ways) because the row codes
    must survive the forward as exact integers.
    """
    training = {m: m.training for m in module.modules()}
    buffers = {b: b.detach().clone() for b in module.buffers()}  # caches a forward may write into
    narrow = {  # not a sharded (DTensor) parameter: FSDP2 keeps its own reference to the shard
        t: t.dtype
        for t in [*module.parameters(), *module.buffers()]
        if t.dtype in (torch.float16, torch.bfloat16) and not is_dtensor(t)
    }
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


def _run(
    root: nn.Module,
    call: Callable[[], Any],
    fill: str,
    names: dict[nn.Module, str],
    targets: Targets,
    positions: Mapping[int, tuple[int, ...]] | None = None,
) -> Watch:
    watch = Watch(targets, fill, names, positions)
    handles = _hooks(root, watch)
    try:  # compiled regions (torchtitan's compiled flex attention) run eagerly, where the mode sees each op
        with torch.no_grad(), torch.compiler.set_stance("force_eager"), watch:
            call()
    finally:
        for h in handles:
            h.remove()
    return watch


def watch_all(
    root: nn.Module, call: Callable[[], Any], names: dict[nn.Module, str], targets: Targets
) -> dict[str, Watch] | None:
    """The four coded forwards; None when the call fails on the first (wrong inputs for this module). Where an
    attention product's queries come from several projections by token (joint attention), the four again,
    keeping q/k/v at the first token of each stream too (stream_starts)."""
    try:
        first = _run(root, call, "ones", names, targets)
    except SurgeonError:  # a refusal from the probe itself (tensor parallelism), not wrong inputs
        raise
    except Exception:
        return None
    runs = {"ones": first}
    if not first.captures:
        return runs
    for fill in FILLS[1:]:
        runs[fill] = _run(root, call, fill, names, targets)
        _check_same_calls(root, first, runs[fill])
    streams = {i: s[1:] for i in range(len(first.captures)) if len(s := stream_starts(runs, i)) > 1}
    if streams:
        runs = {fill: _run(root, call, fill, names, targets, streams) for fill in FILLS}
        for watch in runs.values():
            _check_same_calls(root, first, watch)
    return runs


def _check_same_calls(root: nn.Module, first: Watch, other: Watch) -> None:
    if len(other.captures) != len(first.captures):
        raise LayoutError(
            f"{type(root).__name__}: its forward is not deterministic (a different number of attention calls on a second run); surgeon cannot observe it"
        )
