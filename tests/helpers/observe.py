"""Recover the effective per-head query/key/value linear maps of every attention
block of a transformers model, *through the model's own forward code*.

Public API
----------
``observe(model) -> dict[str, ObservedBlock]`` keyed by the qualified name of
each attention module (the parent module of its q/k/v projection(s)), in
``model.named_modules()`` order.  ``ObservedBlock`` holds, per head, the map
``q_head_h = q[h] @ x + q_bias[h]`` (and likewise for k and v, with one entry
per *key/value* head for GQA/MQA models); ``ObservedBlock.capture`` says where
q/k/v were caught (``"attention-interface"``, ``"sdpa"`` or
``"matmul/softmax"``).  ``ObservationError`` is raised when the maps cannot be
recovered honestly.  The model must be float32 (float64 also accepted); the
forwards run single-threaded (``torch.set_num_threads(1)``, restored), which
keeps a call well under a second for the tiny test models.

How it works
------------
Nothing here reads a weight tensor or knows how a family splits its fused
projections.  ``observe`` runs the whole model forward twice under
``torch.no_grad``:

1. *Discovery*: a plain forward (batch 1) finds the attention modules, i.e.
   the modules that hand q/k/v to an attention kernel (see "capture" below),
   and how many tokens each one sees.
2. *Capture*: a forward pre-hook (``with_kwargs=True``) on every attention
   module *replaces* its hidden-states input -- and, for cross-attention, its
   encoder-states input (``key_value_states`` / ``encoder_hidden_states``) --
   with a known Gaussian probe of the same shape.  The batch is enlarged so
   that each probe has at least ``3*D + 8`` full-rank rows (real LayerNorm
   outputs are rank deficient, hence the replacement).  The q/k/v tensors that
   then reach the attention product are captured, and ``W, b`` are solved by
   least squares from ``[X, 1] -> q/k/v`` (float64).  The relative residual of
   every fit is checked (``< 1e-4``): anything non-linear or position dependent
   between the projection and the attention product is detected and raised,
   never silently averaged.

Capture, per family group:

* Families whose attention modules call ``ALL_ATTENTION_FUNCTIONS`` (llama,
  mistral, qwen2, gemma, phi3, gpt2, gpt_neox, gptj, gpt_bigcode, opt, bert,
  roberta, distilbert, modernbert, vit, swin, clip, t5, bart, whisper ...): an
  attention function is registered in ``transformers.AttentionInterface``
  under ``"surgeon_observe"`` and the model's (sub-)configs are switched to it
  for the duration of the call (restored afterwards).  It receives
  ``(module, query, key, value, ...)`` exactly as the kernel would -- keys and
  values *before* ``repeat_kv``, i.e. already per key/value head -- records
  them and returns a plain softmax(QK^T)V output so the forward continues.
* Families that compute attention inline (bloom, mpt; falcon before transformers 5.25): a
  ``torch.overrides.TorchFunctionMode`` plus a module stack (forward pre/post
  hooks on every module) attributes the tensor ops executed *directly* in each
  module's own forward (ops inside child modules, e.g. the projection's matmul,
  are ignored).  A module that calls ``scaled_dot_product_attention`` gives
  ``(q, k, v)`` directly (falcon under sdpa, before 5.25); otherwise the eager pattern is
  recognised: the last ``matmul/bmm/baddbmm`` before the first ``softmax`` is
  ``Q @ K^T`` (bloom: ``alibi.baddbmm(batch1=Q, batch2=K^T)``; falcon/mpt
  eager before 5.25: ``Q @ K^T``) and the first product after it is ``P @ V`` (a softmax
  done by a leaf module such as ``nn.Softmax`` counts for its caller).
  Batch-major ``(B*H, L, d)`` tensors (bloom) are viewed as ``(B, H, L, d)``.

Neutralised: rotary embeddings (``position_ids`` all zero, so cos=1/sin=0 and
RoPE is the identity -- a rotary ``attention_scaling != 1`` would scale only
the rotary part of the head and is refused), k/v caching (``use_cache=False``,
no cache object), dropout (eval mode, restored afterwards), attention masks
(the observing kernel ignores them; masks never touch q/k/v -- and since
``"surgeon_observe"`` has no mask function registered, transformers skips
building them).  That RoPE really is the identity is not assumed: the fit's
residual check would fail for any position-dependent map.

Keys/values that a family repeats to the query heads *before* the capture
point (falcon ``new_decoder_architecture`` uses ``broadcast_to``) are
de-duplicated back to the module's declared number of key/value heads
(``num_key_value_heads`` / ``num_kv_heads`` / ``kv_heads`` /
``num_key_value_groups``), asserting that the repeats are bit-identical.

Scaling undone between projection and capture point
---------------------------------------------------

=================  ==========================================================
family / module    what is done to q before the kernel, and what is undone
=================  ==========================================================
OPTAttention       ``q = q_proj(x) * self.scaling`` (then kernel scaling=1.0):
                   captured q divided by ``module.scaling``.
WhisperAttention   same as OPT: ``q_proj(x) * self.scaling``, kernel
                   scaling=1.0: captured q divided by ``module.scaling``.
T5Attention        none (T5 has no 1/sqrt(d) at all, kernel scaling=1.0).
GPT2, GPTBigCode   none: scale (incl. ``scale_attn_by_inverse_layer_idx``)
                   is passed to the kernel as ``scaling=``.
BERT, RoBERTa,     none: ``scaling=head_dim**-0.5`` passed to the kernel.
DistilBERT, ViT,
Swin, CLIP, BART
Llama, Mistral,    none: scaling passed to the kernel; RoPE neutralised
Qwen2, Gemma,      (position 0), default rope ``attention_scaling == 1``.
Phi3, GPT-NeoX,
GPT-J, ModernBERT
Bloom              none: ``alpha=inv_norm_factor`` of ``baddbmm`` scales the
                   scores; ``batch1`` (= q) is unscaled.
Falcon             none: scores divided by sqrt(d) / sdpa default scale.
MPT                none: scores multiplied by ``softmax_scale``.
=================  ==========================================================

Refused with ``ObservationError`` (non-linear, cannot be neutralised): QK-norm
(an attention module with a ``q_norm``/``k_norm``/``q_layernorm``/... child,
e.g. Qwen3, OLMo-2, Gemma-3, Persimmon/StableLM ``q_layernorm``), MPT
``clip_qkv`` (clamp of the fused qkv), rotary ``attention_scaling != 1``, a
forward that visibly multiplies a projection output by a scale but is not in
the table above, and any fit whose residual is not ~0.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
from dataclasses import dataclass

import torch
import transformers
from torch.overrides import TorchFunctionMode

__all__ = ["ObservedBlock", "ObservationError", "observe", "ATTN_IMPL_NAME"]

ATTN_IMPL_NAME = "surgeon_observe"
_RESIDUAL_RTOL = 1e-4
_CROSS_PARAM_NAMES = ("key_value_states", "encoder_hidden_states")
_QK_NORM_CHILD_NAMES = {
    "q_norm",
    "k_norm",
    "q_layernorm",
    "k_layernorm",
    "query_layernorm",
    "key_layernorm",
    "q_ln",
    "k_ln",
    "query_norm",
    "key_norm",
}
# class name -> function(module) giving the factor that the family multiplies the
# projected query by before handing it to the attention kernel (undone here).
_Q_PRESCALE = {
    "OPTAttention": lambda m: float(m.scaling),
    "WhisperAttention": lambda m: float(m.scaling),
}
_PRESCALE_SOURCE_RE = re.compile(r"(q_proj|q_lin|query|\.q)\([^()]*\)\s*\)?\s*\*\s*self\.scal")


class ObservationError(RuntimeError):
    """The q/k/v maps of a module cannot be recovered as an exact linear map."""


@dataclass
class ObservedBlock:
    module: str  # qualified name of the attention module
    cross: bool
    q: torch.Tensor  # (H, d, D_q_in)
    q_bias: torch.Tensor  # (H, d)
    k: torch.Tensor  # (KV, d, D_kv_in)
    k_bias: torch.Tensor  # (KV, d)
    v: torch.Tensor  # (KV, d_v, D_kv_in)
    v_bias: torch.Tensor  # (KV, d_v)
    # where q/k/v were captured: "attention-interface", "sdpa" or "matmul/softmax"
    capture: str = ""

    @property
    def num_heads(self) -> int:
        return self.q.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[0]

    @property
    def head_dim(self) -> int:
        return self.q.shape[1]


# ----------------------------------------------------------------------------- state

_ACTIVE: _Recorder | None = None


class _Call:
    """One forward call of one attention module."""

    __slots__ = ("module", "args", "kwargs", "x", "y", "q", "k", "v", "via")

    def __init__(self, module, args, kwargs):
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.x = self.y = None  # probes (capture pass)
        self.q = self.k = self.v = None
        self.via = None


class _Recorder(TorchFunctionMode):
    def __init__(self, model, probe_modules=None, seed=0):
        super().__init__()
        self.model = model
        self.probe_modules = probe_modules  # None -> discovery pass
        self.seed = seed
        self.stack: list[tuple[torch.nn.Module, list, _Call | None]] = []
        self.calls: dict[torch.nn.Module, list[_Call]] = {}
        self.current: dict[torch.nn.Module, _Call] = {}
        self.suppress = 0
        self.probe_count = 0

    # -- module stack ------------------------------------------------------
    def pre_hook(self, module, args, kwargs):
        call = None
        new = None
        if self.probe_modules is not None and module in self.probe_modules:
            call = _Call(module, args, kwargs)
            new = self._replace_inputs(module, call, args, kwargs)
        elif self.probe_modules is None:
            call = _Call(module, args, kwargs)  # kept only if it turns out to be attention
        if call is not None:
            self.current[module] = call
        self.stack.append((module, [], call))
        return new

    def post_hook(self, module, args, kwargs, output):
        if not self.stack or self.stack[-1][0] is not module:
            raise ObservationError(f"module stack out of sync at {type(module).__name__}")
        _, events, call = self.stack.pop()
        if events and call is not None:
            match = _match_kernel_pattern(events)
            if match is not None:
                self._record(module, *match)
        if events and self.stack and not any(True for _ in module.children()):
            # a leaf module such as nn.Softmax: its softmax belongs to the caller's pattern
            parent_events = self.stack[-1][1]
            parent_events.extend(e for e in events if e[0] in ("softmax", "sdpa"))
        self.current.pop(module, None)
        return None

    # -- probe replacement -------------------------------------------------
    def _replace_inputs(self, module, call, args, kwargs):
        bound = _bind(module, args, kwargs)
        hid_name = next(iter(bound.signature.parameters))
        hid = _get_arg(bound, hid_name)
        if not torch.is_tensor(hid):
            raise ObservationError(f"first forward argument of {type(module).__name__} is not a tensor")
        call.x = self._probe(hid)
        _set_arg(bound, hid_name, call.x)
        for name in _CROSS_PARAM_NAMES:
            val = _get_arg(bound, name)
            if torch.is_tensor(val):
                call.y = self._probe(val)
                _set_arg(bound, name, call.y)
                break
        return bound.args, bound.kwargs

    def _probe(self, like: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.probe_count)
        self.probe_count += 1
        x = torch.randn(like.shape, generator=g, dtype=torch.float32)
        return x.to(device=like.device, dtype=like.dtype)

    # -- capture -------------------------------------------------------------
    def _record(self, module, q, k, v, via):
        call = self.current.get(module)
        if call is None:
            return
        if call.q is not None:
            raise ObservationError(
                f"{type(module).__name__} handed q/k/v to an attention kernel twice in one forward call"
            )
        call.q, call.k, call.v, call.via = q, k, v, via
        self.calls.setdefault(module, []).append(call)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.suppress and self.stack:
            ev = _classify(func, args, kwargs)
            if ev is not None:
                self.stack[-1][1].append(ev)
        return func(*args, **kwargs)


def _classify(func, args, kwargs):
    name = getattr(func, "__name__", "")
    if name == "scaled_dot_product_attention":
        q = kwargs.get("query", args[0] if len(args) > 0 else None)
        k = kwargs.get("key", args[1] if len(args) > 1 else None)
        v = kwargs.get("value", args[2] if len(args) > 2 else None)
        return ("sdpa", q, k, v)
    if name in ("softmax", "_softmax"):
        return ("softmax",)
    if name in ("matmul", "__matmul__", "bmm"):
        a = kwargs.get("input", args[0] if len(args) > 0 else None)
        b = kwargs.get("other", kwargs.get("mat2", args[1] if len(args) > 1 else None))
        return ("prod", a, b)
    if name == "__rmatmul__":
        return ("prod", args[1], args[0])
    if name == "baddbmm":
        a = kwargs.get("batch1", args[1] if len(args) > 1 else None)
        b = kwargs.get("batch2", args[2] if len(args) > 2 else None)
        return ("prod", a, b)
    return None


def _match_kernel_pattern(events):
    sdpa = [e for e in events if e[0] == "sdpa"]
    if sdpa:
        if len(sdpa) > 1:
            raise ObservationError("several scaled_dot_product_attention calls in one module forward")
        _, q, k, v = sdpa[0]
        return q, k, v, "sdpa"
    soft = [i for i, e in enumerate(events) if e[0] == "softmax"]
    if not soft:
        return None
    s = soft[0]
    before = [e for e in events[:s] if e[0] == "prod"]
    after = [e for e in events[s + 1 :] if e[0] == "prod"]
    if not before or not after:
        return None
    _, q, kt = before[-1]
    _, _, v = after[0]
    if not all(torch.is_tensor(t) for t in (q, kt, v)) or q.dim() < 3 or kt.dim() < 3:
        return None
    return q, kt.transpose(-1, -2), v, "matmul/softmax"


_SIG_CACHE: dict = {}


def _bind(module, args, kwargs):
    fwd = module.forward
    key = getattr(fwd, "__func__", fwd)
    sig = _SIG_CACHE.get(key)
    if sig is None:
        sig = inspect.signature(fwd)
        _SIG_CACHE[key] = sig
    return sig.bind(*args, **kwargs)


def _var_kw(bound):
    for p in bound.signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return p.name
    return None


def _get_arg(bound, name):
    if name in bound.arguments:
        return bound.arguments[name]
    vk = _var_kw(bound)
    return bound.arguments.get(vk, {}).get(name) if vk else None


def _set_arg(bound, name, value):
    if name in bound.arguments:
        bound.arguments[name] = value
        return
    vk = _var_kw(bound)
    if vk and name in bound.arguments.get(vk, {}):
        bound.arguments[vk] = {**bound.arguments[vk], name: value}
        return
    raise KeyError(name)


def _observe_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered in transformers' AttentionInterface.

    Records (q, k, v) exactly as the model hands them to its kernel and returns
    a plain (unmasked) softmax(QK^T)V so that the forward can continue.
    """
    rec = _ACTIVE
    if rec is not None:
        rec._record(module, query, key, value, via="attention-interface")
        rec.suppress += 1
    try:
        h, kvh = query.shape[1], key.shape[1]
        k_, v_ = key, value
        if kvh != h:
            k_ = key.repeat_interleave(h // kvh, dim=1)
            v_ = value.repeat_interleave(h // kvh, dim=1)
        s = query.shape[-1] ** -0.5 if scaling is None else scaling
        w = torch.softmax((query.float() @ k_.float().transpose(-1, -2)) * s, dim=-1)
        out = (w @ v_.float()).to(value.dtype).transpose(1, 2).contiguous()
    finally:
        if rec is not None:
            rec.suppress -= 1
    return out, None


def _register_attention_function():
    if ATTN_IMPL_NAME not in transformers.AttentionInterface._global_mapping:
        transformers.AttentionInterface.register(ATTN_IMPL_NAME, _observe_attention)


# ----------------------------------------------------------------------------- model plumbing


def _uses_attention_interface(pm) -> bool:
    fn = getattr(type(pm), "_can_set_attn_implementation", None)
    if fn is not None:
        try:
            return bool(fn())
        except Exception:  # pragma: no cover - defensive
            pass
    import sys

    mod = sys.modules.get(type(pm).__module__)
    try:
        return "ALL_ATTENTION_FUNCTIONS.get_interface(" in inspect.getsource(mod)
    except (OSError, TypeError):
        return False


@contextlib.contextmanager
def _observing_attn_impl(model):
    """Switch every config used by an interface-based (sub)model to our kernel."""
    _register_attention_function()
    configs = {}

    def add(cfg):
        if isinstance(cfg, transformers.PretrainedConfig) and id(cfg) not in configs:
            configs[id(cfg)] = (cfg, getattr(cfg, "_attn_implementation_internal", None))
            for sub in getattr(cfg, "sub_configs", {}) or {}:
                add(getattr(cfg, sub, None))

    for pm in model.modules():
        if isinstance(pm, transformers.PreTrainedModel) and _uses_attention_interface(pm):
            for m in pm.modules():
                add(getattr(m, "config", None))
    try:
        for cfg, _ in configs.values():
            cfg._attn_implementation_internal = ATTN_IMPL_NAME
        yield
    finally:
        for cfg, old in configs.values():
            cfg._attn_implementation_internal = old


def _cfg_get(cfg, *names):
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _make_inputs(model, batch: int, seq: int = 16) -> dict:
    cfg = model.config
    fwd_params = inspect.signature(model.forward).parameters
    g = torch.Generator().manual_seed(1234)
    dev = next(model.parameters()).device
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    inputs = {}
    main = getattr(model, "main_input_name", "input_ids")
    vocab = _cfg_get(cfg, "vocab_size") or 8
    cap = _cfg_get(cfg, "max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")
    s = min(seq, cap - 2) if cap else seq
    if main == "input_ids":
        inputs["input_ids"] = torch.randint(3, max(vocab, 4), (batch, s), generator=g).to(dev)
    elif main == "pixel_values":
        size = cfg.image_size if isinstance(cfg.image_size, int) else cfg.image_size[0]
        inputs["pixel_values"] = torch.randn(batch, cfg.num_channels, size, size, generator=g).to(dev, dtype)
    elif main == "input_features":
        frames = 2 * cfg.max_source_positions
        inputs["input_features"] = torch.randn(batch, cfg.num_mel_bins, frames, generator=g).to(dev, dtype)
    else:
        raise ObservationError(f"don't know how to build inputs for main_input_name={main!r}")
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in fwd_params:
        dcap = _cfg_get(cfg, "max_target_positions", "max_position_embeddings", "n_positions")
        ds = min(seq, dcap - 2) if dcap else seq
        inputs["decoder_input_ids"] = torch.randint(3, max(vocab, 4), (batch, ds), generator=g).to(dev)
    if main == "input_ids" and "position_ids" in fwd_params:
        # all positions 0: rotary embeddings become the identity (cos=1, sin=0)
        inputs["position_ids"] = torch.zeros_like(inputs["input_ids"])
    if "use_cache" in fwd_params:
        inputs["use_cache"] = False
    return inputs


def _check_refusals(model, modules, names):
    for m in modules:
        for child_name, _ in m.named_children():
            if child_name in _QK_NORM_CHILD_NAMES:
                raise ObservationError(
                    f"{names[m]} ({type(m).__name__}) applies QK-norm ({child_name}) between the projection and "
                    "the attention product; this is non-linear and cannot be neutralised"
                )
        if getattr(m, "clip_qkv", None):
            raise ObservationError(
                f"{names[m]} ({type(m).__name__}) clamps the fused qkv (clip_qkv={m.clip_qkv}); "
                "non-linear, cannot be neutralised"
            )
        cls = type(m).__name__
        if cls not in _Q_PRESCALE:
            try:
                src = inspect.getsource(type(m).forward)
            except (OSError, TypeError):
                src = ""
            if _PRESCALE_SOURCE_RE.search(src):
                raise ObservationError(
                    f"{cls}.forward appears to pre-scale the projected query; add it to _Q_PRESCALE "
                    "after checking what it does"
                )
    for m in model.modules():
        for attr, val in vars(m).items():
            if attr.endswith("attention_scaling") and isinstance(val, (int, float)) and not math.isclose(val, 1.0):
                raise ObservationError(
                    f"rotary embedding {type(m).__name__}.{attr}={val} != 1 scales q/k at position 0 "
                    "(only the rotary part of each head): not supported"
                )


def _declared_kv_heads(module, num_heads):
    for attr in ("num_key_value_heads", "num_kv_heads", "kv_heads"):
        v = getattr(module, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    groups = getattr(module, "num_key_value_groups", None)
    if isinstance(groups, int) and groups > 0 and num_heads % groups == 0:
        return num_heads // groups
    return None


def _to_bhld(t, x, what, name):
    """View a captured tensor as (B, heads, L, d) given its probe x of shape (B, L, D)."""
    if x.dim() != 3:
        raise ObservationError(f"{name}: module input of shape {tuple(x.shape)} is not (batch, tokens, features)")
    b, length = x.shape[0], x.shape[1]
    if t.dim() == 4:
        if t.shape[0] != b or t.shape[2] != length:
            raise ObservationError(
                f"{name}: captured {what} of shape {tuple(t.shape)} does not match probe {tuple(x.shape)}"
            )
        return t
    if t.dim() == 3:  # (B*heads, L, d), batch-major
        if t.shape[0] % b or t.shape[1] != length:
            raise ObservationError(
                f"{name}: captured {what} of shape {tuple(t.shape)} does not match probe {tuple(x.shape)}"
            )
        return t.reshape(b, t.shape[0] // b, length, t.shape[2])
    raise ObservationError(f"{name}: captured {what} has unexpected shape {tuple(t.shape)}")


def _dedup_kv(t, kv, name, what):
    heads = t.shape[1]
    if kv is None or heads == kv:
        return t
    if heads % kv:
        raise ObservationError(f"{name}: {what} has {heads} heads, not a multiple of the declared {kv} kv heads")
    g = heads // kv
    blocks = t.reshape(t.shape[0], kv, g, *t.shape[2:])
    if not torch.equal(blocks, blocks[:, :, :1].expand_as(blocks)):
        raise ObservationError(f"{name}: {what} heads repeated to the query heads are not identical copies")
    return blocks[:, :, 0]


def _solve(x_list, t_list, name, what):
    x = torch.cat([xx.reshape(-1, xx.shape[-1]) for xx in x_list]).double().cpu()
    ys = []
    for t in t_list:  # (B, heads, L, d) -> (B*L, heads*d)
        ys.append(t.permute(0, 2, 1, 3).reshape(-1, t.shape[1] * t.shape[3]).double().cpu())
    y = torch.cat(ys)
    heads, d = t_list[0].shape[1], t_list[0].shape[3]
    n, din = x.shape
    if n < din + 1:
        raise ObservationError(f"{name}: only {n} probe rows for a {din}-dim input")
    a = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], dim=1)
    sol = torch.linalg.lstsq(a, y).solution  # (din+1, heads*d)
    res = (a @ sol - y).norm()
    scale = y.norm()
    if res > _RESIDUAL_RTOL * scale + 1e-9 * math.sqrt(y.numel()):
        raise ObservationError(
            f"{name}: {what} is not an exact affine function of the module input "
            f"(relative residual {float(res / max(scale, 1e-30)):.2e}); something non-linear, position dependent "
            "or token mixing sits between the projection and the attention product"
        )
    w = sol[:din].T.reshape(heads, d, din).float().contiguous()
    b = sol[din].reshape(heads, d).float().contiguous()
    return w, b


# ----------------------------------------------------------------------------- entry point


def _run(model, recorder, batch):
    global _ACTIVE
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(recorder.pre_hook, with_kwargs=True))
        handles.append(m.register_forward_hook(recorder.post_hook, with_kwargs=True, always_call=True))
    inputs = _make_inputs(model, batch)
    _ACTIVE = recorder
    try:
        with torch.no_grad(), recorder:
            model(**inputs)
    finally:
        _ACTIVE = None
        for h in handles:
            h.remove()


def observe(model, *, seed: int = 0) -> dict[str, ObservedBlock]:
    """Effective per-head q/k/v maps of every attention block of ``model``.

    See the module docstring for the method.  The model is left unchanged
    (training flags, attention implementation, hooks are all restored; the
    forwards run with ``torch.set_num_threads(1)``, restored afterwards).
    """
    bad = {p.dtype for p in model.parameters() if p.is_floating_point()} - {torch.float32, torch.float64}
    if bad:
        raise ObservationError(f"observe() needs a float32 model (found {sorted(map(str, bad))}); call model.float()")
    names = {m: n for n, m in model.named_modules()}
    training = {m: m.training for m in model.modules()}
    threads = torch.get_num_threads()
    # These forwards are tiny: intra-op threading only costs (badly so when the
    # CPU is shared with other processes), so run single-threaded.
    torch.set_num_threads(1)
    model.eval()
    try:
        with _observing_attn_impl(model):
            # 1. discovery
            disc = _Recorder(model, probe_modules=None, seed=seed)
            _run(model, disc, batch=1)
            attn = [m for m in model.modules() if m in disc.calls]
            if not attn:
                raise ObservationError(f"no attention module found in {type(model).__name__}")
            _check_refusals(model, attn, names)
            need = 1
            for m in attn:
                for call in disc.calls[m]:
                    bound = _bind(m, call.args, call.kwargs)
                    tensors = [_get_arg(bound, next(iter(bound.signature.parameters)))]
                    for nm in _CROSS_PARAM_NAMES:
                        val = _get_arg(bound, nm)
                        if torch.is_tensor(val):
                            tensors.append(val)
                    for t in tensors:
                        din = t.shape[-1]
                        rows = t.numel() // din
                        need = max(need, math.ceil((3 * din + 8) / (rows * len(disc.calls[m]))))
            # 2. capture
            rec = _Recorder(model, probe_modules=set(attn), seed=seed)
            _run(model, rec, batch=need)
    finally:
        for m, t in training.items():
            m.training = t
        torch.set_num_threads(threads)

    out: dict[str, ObservedBlock] = {}
    for m in attn:
        name = names[m]
        calls = rec.calls.get(m, [])
        if not calls:
            raise ObservationError(f"{name}: attention seen during discovery but not during capture")
        cross = calls[0].y is not None
        if any((c.y is not None) != cross for c in calls):
            raise ObservationError(f"{name}: used both as self- and cross-attention")
        prescale = _Q_PRESCALE.get(type(m).__name__, lambda _m: 1.0)(m)
        xs, ys, qs, ks, vs = [], [], [], [], []
        for c in calls:
            kv_in = c.y if cross else c.x
            q = _to_bhld(c.q, c.x, "q", name) / prescale
            k = _to_bhld(c.k, kv_in, "k", name)
            v = _to_bhld(c.v, kv_in, "v", name)
            kvh = _declared_kv_heads(m, q.shape[1])
            k = _dedup_kv(k, kvh, name, "k")
            v = _dedup_kv(v, kvh, name, "v")
            xs.append(c.x)
            ys.append(kv_in)
            qs.append(q)
            ks.append(k)
            vs.append(v)
        qw, qb = _solve(xs, qs, name, "q")
        kw, kb = _solve(ys, ks, name, "k")
        vw, vb = _solve(ys, vs, name, "v")
        out[name] = ObservedBlock(name, cross, qw, qb, kw, kb, vw, vb, capture=calls[0].via)
    return out
