"""The attention Jacobian's conditioning on real inputs: the terms of the paper's Theorem 3.1, per head.

For one head, A(X) = softmax(X W_Q W_K^T X^T / sqrt(d)) X W_V (X: the N x D tokens entering the
attention layer, W_*: D x d), and J = d vec(A) / d (W_Q, W_K, W_V). Theorem 3.1 bounds

    kappa(J) <= kappa(X)^3 kappa(Lambda(P)) kappa(W_V) (kappa(W_Q) + kappa(W_K)) + kappa(X) kappa(P)

with P the row-wise softmax and Lambda(P) the block-diagonal of Diag(p_i) - p_i p_i^T over the rows
p_i of P. Every block of Lambda(P) is singular (the all-ones vector is in its null space), so
kappa(Lambda(P)) is the pseudo-condition number: largest over smallest singular value above the
tolerance sigma_max * n * eps(float64), n = N^2 the size of Lambda(P) (numpy's matrix_rank default).
Every other kappa is sigma_max / sigma_min over all min(rows, cols) singular values.

What is measured: X is captured with a forward pre-hook on each detected self-attention module
(the hidden states it receives, after any pre-norm), the weights are the model's own per-head
matrices, all in float64. The head function above is the paper's: no bias, no mask, no rotary
embedding, no dropout, scale 1/sqrt(d). When N*d*3*D*d is small (``exact_limit`` entries), the exact
kappa(J) is also computed with ``torch.func.jacrev`` (pseudo-kappa with the same kind of tolerance
if J is rank-deficient, and said so), so the bound is checked against the truth.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    import torch
    from torch import nn

    from ..detect.hints import HintInput
    from ..open.source import Source
    from ..vocab.blocks import AttentionBlock

    # One forward's arguments: token ids, or a custom module's positional / keyword arguments (whatever its
    # forward takes, hence Any).
    ModelCall = torch.Tensor | tuple[Any, ...] | dict[str, Any]
    ModelInputs = ModelCall | list[torch.Tensor] | list[ModelCall]  # one call, or a list: one forward each

EXACT_LIMIT = 4_000_000  # entries of J (N*d x 3*D*d) up to which the exact kappa(J) is computed


@dataclass
class HeadJacobian:
    input: int  # which input (sequence)
    module: str
    layer: int
    head: int
    tokens: int
    kappa_x: float
    kappa_lambda: float  # pseudo-condition number of Lambda(P)
    kappa_p: float
    kappa_q: float
    kappa_k: float
    kappa_v: float
    bound: float  # Theorem 3.1's right-hand side
    exact: float | None = None  # kappa(J) from jacrev, when small enough
    exact_pseudo: bool = False  # J was rank-deficient: exact is its pseudo-condition number


@dataclass(frozen=True)
class JacobianReport:
    """The Theorem 3.1 terms per head and input (``rows``), with per-layer summaries (:meth:`by_layer`).

    A value, made once (lists given are made tuples); a note added makes a new one (``dataclasses.replace``)."""

    rows: tuple[HeadJacobian, ...]
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple(self.rows))
        object.__setattr__(self, "notes", tuple(self.notes))

    def to_dict(self) -> dict:
        return {"rows": [asdict(r) for r in self.rows], "notes": list(self.notes), "layers": self.by_layer()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=True)

    def by_layer(self) -> list[dict]:
        """Per attention module: medians over heads and inputs, the largest bound, and how many exact values hold."""
        out = []
        for module in dict.fromkeys(r.module for r in self.rows):
            rows = [r for r in self.rows if r.module == module]
            entry: dict[str, Any] = {"module": module, "layer": rows[0].layer}
            for key in ("kappa_x", "kappa_lambda", "kappa_p", "kappa_q", "kappa_k", "kappa_v", "bound"):
                entry[key] = statistics.median(getattr(r, key) for r in rows)
            exact = [(r.exact, r.bound) for r in rows if r.exact is not None]
            entry["exact"] = statistics.median(e for e, _ in exact) if exact else None
            entry["bound_holds"] = f"{sum(e <= b for e, b in exact)}/{len(exact)}" if exact else None
            out.append(entry)
        return out

    def render(self) -> str:
        from ..text.shown import note_lines, shown

        head = ["module", "kX", "kLambda", "kP", "kWq", "kWk", "kWv", "bound", "exact kJ", "holds"]
        table = []
        for e in self.by_layer():
            table.append(
                [
                    shown(e["module"]),
                    *(
                        _fmt(e[k])
                        for k in ("kappa_x", "kappa_lambda", "kappa_p", "kappa_q", "kappa_k", "kappa_v", "bound")
                    ),
                    _fmt(e["exact"]) if e["exact"] is not None else "-",
                    e["bound_holds"] or "-",
                ]
            )
        widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
        lines = [
            "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()
            for row in [head, ["-" * w for w in widths], *table]
        ]
        legend = (
            "attention Jacobian (Theorem 3.1), medians over heads and inputs: bound = kX^3 kLambda kWv (kWq + kWk) + kX kP; "
            "kLambda is a pseudo-condition number (tolerance sigma_max * N^2 * eps); exact kJ from torch.func.jacrev "
            "where small enough, holds = heads whose exact kJ <= bound"
        )
        return "\n".join([*lines, "", legend, *note_lines(self.notes)])


def _fmt(x: float) -> str:
    if x is None or not math.isfinite(x):
        return str(x)
    return f"{x:.3g}" if x < 1e4 else f"{x:.2e}"


def kappa_of(values: torch.Tensor) -> float:
    hi, lo = float(values.max()), float(values.min())
    return math.inf if lo <= 0 else hi / lo


def pseudo_kappa(values: torch.Tensor, size: int) -> float:
    import torch

    hi = float(values.max())
    keep = values[values > hi * size * torch.finfo(torch.float64).eps]
    return hi / float(keep.min()) if keep.numel() else math.nan


def head_terms(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, *, exact: bool) -> dict:
    """The Theorem 3.1 terms for one head: ``x`` (N, D), ``w*`` (D, d), float64 tensors."""
    import torch

    n, d = x.shape[0], wq.shape[1]
    sv = torch.linalg.svdvals
    p = torch.softmax(x @ wq @ wk.T @ x.T / math.sqrt(d), dim=-1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # the N blocks of Lambda(P)
    lam_sv = torch.linalg.eigvalsh(lam).abs().flatten()  # symmetric blocks: singular values = |eigenvalues|
    out = {
        "kappa_x": kappa_of(sv(x)),
        "kappa_lambda": pseudo_kappa(lam_sv, n * n),
        "kappa_p": kappa_of(sv(p)),
        "kappa_q": kappa_of(sv(wq)),
        "kappa_k": kappa_of(sv(wk)),
        "kappa_v": kappa_of(sv(wv)),
    }
    out["bound"] = (
        out["kappa_x"] ** 3 * out["kappa_lambda"] * out["kappa_v"] * (out["kappa_q"] + out["kappa_k"])
        + out["kappa_x"] * out["kappa_p"]
    )
    if exact:

        def head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x @ q @ k.T @ x.T / math.sqrt(d), dim=-1) @ x @ v

        parts = torch.func.jacrev(head, argnums=(0, 1, 2))(wq, wk, wv)
        jac = torch.cat([j.reshape(n * d, -1) for j in parts], dim=1)
        values = sv(jac)
        full = kappa_of(values)
        tol = float(values.max()) * max(jac.shape) * torch.finfo(torch.float64).eps
        out["exact_pseudo"] = float(values.min()) <= tol
        out["exact"] = pseudo_kappa(values, max(jac.shape)) if out["exact_pseudo"] else full
    return out


def jacobian_report(
    model: nn.Module,
    inputs: ModelInputs,
    *,
    exact: bool | None = None,
    exact_limit: int = EXACT_LIMIT,
    num_heads: HintInput = None,
    num_kv_heads: HintInput = None,
    head_dim: HintInput = None,
) -> JacobianReport:
    """The Theorem 3.1 terms of every self-attention head of ``model`` on real ``inputs``.

    The model is run in eval mode without gradients and left unchanged.

    Args:
        model: The model (a module).
        inputs: A tensor of token ids (each row of a 2-D tensor is one input), a list of such tensors, or
            for a custom module a tuple of positional arguments or a dict of keyword arguments (one forward
            each; a list of them for several).
        exact: Compute the exact kappa(J) (default: when J has at most ``exact_limit`` entries).
        exact_limit: The size of J up to which the exact kappa is computed by default.
        num_heads: Query heads, where the model does not say.
        num_kv_heads: Key/value heads, where the model does not say.
        head_dim: Head size, where it is not width / heads.

    Returns:
        The report: per head and input, the terms and the bound.

    Raises:
        NoAttentionFoundError: No attention projection was found.
    """
    from ..detect.hints import Hints
    from ..detect.module import detect_module

    calls = _calls(inputs)
    found = detect_module(model, hints=Hints(num_heads, num_kv_heads, head_dim), example_inputs=calls[0])
    blocks, notes = _self_attention(found.blocks)
    captured = _run_captured(model, blocks, calls)
    rows = _head_rows(found.params, blocks, captured, exact, exact_limit)
    if exact is None and not any(r.exact is not None for r in rows):
        notes.append(f"exact kappa(J) skipped: J has more than {exact_limit:,} entries (shorter inputs, or exact=True)")
    notes.append(
        "head function: softmax(X Wq Wk^T X^T / sqrt(d)) X Wv, float64, without the model's biases, masks or rotary embeddings"
    )
    return JacobianReport(tuple(rows), tuple(notes))


def _self_attention(detected: Sequence[AttentionBlock]) -> tuple[list[AttentionBlock], list[str]]:
    """The self-attention blocks the theorem is about, and the report's notes on what else was skipped."""
    from ..errors import OptionError
    from ..vocab.blocks import split_module

    streams = [b for b in detected if split_module(b.module)[1]]  # a joint block's second stream: not a module
    blocks = [b for b in detected if b.kind == "self" and not split_module(b.module)[1]]
    notes = []
    if streams:
        notes.append(
            f"{len(streams)} joint-attention context streams skipped: their heads attend together with their block's"
        )
    if len(blocks) + len(streams) < len(detected):
        notes.append(
            f"{len(detected) - len(blocks) - len(streams)} cross-attention blocks skipped: the theorem is about self-attention"
        )
    if not blocks:
        raise OptionError("the Jacobian report needs self-attention blocks, and this model has only cross-attention")
    return blocks, notes


def _run_captured(
    model: nn.Module, blocks: list[AttentionBlock], calls: list[ModelCall]
) -> dict[str, list[list[torch.Tensor]]]:
    """Run ``model`` on every call (eval mode, no gradients) and return each block's captured inputs."""
    import torch

    captured: dict[str, list[list[torch.Tensor]]] = {b.module: [] for b in blocks}
    hooks = []
    for b in blocks:
        mod = model.get_submodule(b.module)
        hooks.append(mod.register_forward_pre_hook(_capture(captured[b.module], mod), with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for call in calls:
                if isinstance(call, dict):
                    model(**call)
                elif isinstance(call, tuple):
                    model(*call)
                else:
                    model(call)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return captured


def _head_rows(
    params: Mapping[str, torch.Tensor],
    blocks: list[AttentionBlock],
    captured: dict[str, list[list[torch.Tensor]]],
    exact: bool | None,
    exact_limit: int,
) -> list[HeadJacobian]:
    """One row per (input, block, head): the Theorem 3.1 terms of that head on that input."""
    import torch

    from .engine import head_matrices

    rows = []
    with torch.no_grad():
        for b in blocks:
            mats = {
                p.role: head_matrices(params[p.weight.tensor].detach(), p.weight).to(torch.float64)
                for p in b.projections
            }
            xs = [x for batch in captured[b.module] for x in batch]
            for i, x in enumerate(xs):
                n, width = x.shape
                do_exact = (n * b.head_dim * 3 * width * b.head_dim <= exact_limit) if exact is None else exact
                for h in range(b.heads):
                    g = b.kv_head(h)
                    terms = head_terms(x, mats["q"][h].T, mats["k"][g].T, mats["v"][g].T, exact=do_exact)
                    rows.append(HeadJacobian(i, b.module, b.layer, h, n, **terms))
    return rows


def _calls(inputs: ModelInputs) -> list[ModelCall]:
    import torch

    if isinstance(inputs, torch.Tensor):
        return [inputs[None] if inputs.dim() == 1 else inputs]
    if isinstance(inputs, list):  # several inputs: token-id tensors, or argument tuples / keyword dicts
        return [t[None] if isinstance(t, torch.Tensor) and t.dim() == 1 else t for t in inputs]
    return [inputs]  # one tuple of positional arguments or one dict of keyword arguments


def _capture(
    store: list[list[torch.Tensor]], module: nn.Module
) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    import torch

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # a self-attention module gets its hidden states first, or by one of these names
        x = cast("torch.Tensor", args[0] if args else kwargs.get("hidden_states", kwargs.get("query")))
        if isinstance(module, torch.nn.MultiheadAttention) and not module.batch_first and x.dim() == 3:
            x = x.transpose(0, 1)
        x = x.detach().to(torch.float64)
        store.append(list(x) if x.dim() == 3 else [x])

    return hook


def source_jacobian(source: Source, *, inputs: str | Path | None = None, exact: bool | None = None) -> JacobianReport:
    """``surgeon inspect MODEL --jacobian`` on a checkpoint already opened (a :class:`surgeon.open.source.Source`):
    build the architecture from config.json (random init, nothing downloaded), load the checkpoint's weights into
    it, and run :func:`jacobian_report` on real text.

    ``inputs``: a file of text lines (needs a tokenizer in the model folder) or a ``.pt`` tensor of token
    ids; default: a small built-in English sample, tokenized with the folder's tokenizer.
    """
    import torch

    from ..detect.architecture import CheckpointNames, build_architecture, config_name
    from ..detect.module import checkpoint_names
    from ..errors import CheckpointError, OptionError, opt
    from .jacobian_inputs import check_ids, token_ids

    if not source.config:
        raise OptionError(
            f"{opt('jacobian', True)} builds the architecture from config.json, and {source.path} has none; pass {opt('config', 'PATH')}"
        )
    ids = token_ids(source, inputs)  # a bad --inputs is refused before anything is built
    arch = build_architecture(
        source.config, purpose=opt("jacobian", True), tensors=source.primary.tensors, where=config_name(source)
    )
    names = CheckpointNames(checkpoint_names(arch), set(source.primary.tensors))
    state = arch.state_dict()
    loaded = 0
    with torch.no_grad():
        for name, value in state.items():
            tensor = names(name)
            if tensor in source.primary.tensors:
                value.copy_(source.primary.read(tensor).to(value.dtype))
                loaded += 1
    if loaded == 0:
        raise CheckpointError(
            f"{opt('jacobian', True)}: none of {type(arch).__name__}'s parameters are in {source.path}; is config.json this checkpoint's?"
        )
    check_ids(ids, arch, inputs)
    report = jacobian_report(arch, ids, exact=exact)
    built = (
        f"{type(arch).__name__} built from config.json, {loaded} of its {len(state)} tensors loaded from the checkpoint; "
        f"{len(ids)} inputs of {', '.join(str(t.shape[-1]) for t in ids)} tokens"
    )
    return replace(report, notes=(built, *report.notes))
