"""Conditioned init at construction time: ``surgeon.conditioned_init_`` as a model's ``_init_weights`` step.

Called from a model's init step, it gives the query/key/value projections conditioned init right
after their default init, with exactly the draws ``surgeon.reinit_(model)`` would make (keyed by the
model's own tensor names), so a pre-training script gets conditioned init from the constructor::

    class ConditionedLlama(LlamaForCausalLM):
        def init_weights(self):          # what post_init() calls at the end of __init__
            super().init_weights()
            surgeon.conditioned_init_(self, seed=0)

``conditioned_init_(module, model=self)`` inside ``_init_weights(module)`` writes the projections held by
``module``: the attention module or, as transformers hands a user's (custom) model only the modules with
parameters of their own, each q/k/v Linear. transformers initializes a model nested in another (a task class's
``bert`` or ``model``) with the inner class's own ``_init_weights``, so a hook there never sees that attention:
the first call says so (an OptionError naming ``init_weights``, the dependable hook) instead of leaving the
default init in place. Weights ``from_pretrained`` loaded are left as loaded, as transformers' own init leaves
them; on the meta device there are no values to write: a warning says to call ``surgeon.reinit_`` once loaded.

The model's detection and plan are made once per model (the first call) and reused.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import replace
from typing import Any

from torch import nn

from ..compute.distributed import write_params
from ..compute.engine import Engine
from ..detect.hints import HintInput, Hints
from ..detect.module import ModuleDetection, detect_module
from ..errors import OptionError, opt
from ..options import ReinitOptions
from ..plan.planner import Plan, prepare
from ..vocab.change import Change

_PLANS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def conditioned_init_(
    module: nn.Module,
    *,
    model: nn.Module | None = None,
    options: ReinitOptions | None = None,
    num_heads: HintInput = None,
    num_kv_heads: HintInput = None,
    head_dim: HintInput = None,
    **keywords: Any,
) -> int:
    """Give the attention blocks inside ``module`` (all of ``model``'s when ``module is model``) conditioned init.

    Args:
        module: The module being initialized: the whole model, or one of its attention modules.
        model: The whole model ``module`` belongs to (default: ``module`` itself); its tensor names key
            the draws and its layers are what ``layers`` counts.
        options: Which heads, as for :func:`surgeon.reinit_`; the mode is the conditioned one.
        num_heads: Query heads, where the model does not say.
        num_kv_heads: Key/value heads, where the model does not say.
        head_dim: Head size, where it is not width / heads.
        **keywords: Fields of :class:`surgeon.ReinitOptions` (``seed=0``, ``layers="-2-"``, ...), replacing
            those of ``options``.

    Returns:
        How many parameters were written: 0 for a module without attention projections, for weights
        ``from_pretrained`` loaded, or on the meta device (with a warning: call ``surgeon.reinit_`` once loaded).

    Raises:
        OptionError: An option is out of range, or names another mode than conditioned; or called per module
            from ``_init_weights`` of a model whose attention transformers initializes with another model's
            ``_init_weights`` (a task class): the message says to use ``init_weights``.
        TypeError: A keyword is not an option.
    """
    chosen = ReinitOptions.build(options, **keywords)
    model = module if model is None else model
    if chosen.mode != ReinitOptions().mode:  # the default mode is the paper's conditioned init
        raise OptionError(
            f"conditioned_init_ gives conditioned init; for {opt('mode', chosen.mode)} call surgeon.reinit_ "
            "once the model is built"
        )
    if any(p.is_meta for p in module.parameters()):
        if module is model:  # once per model (the init_weights recipe); the per-module hook is not called on meta
            warnings.warn(_ON_META.format(type(model).__name__), stacklevel=2)
        return 0
    cache = _PLANS.setdefault(model, {})
    if chosen not in cache:  # the options are a hashable value: the cache is keyed by them
        found = detect_module(model, hints=Hints(num_heads, num_kv_heads, head_dim))
        plan = prepare(found.blocks, chosen, depths=found.depths, draw_keys=found.seed_names)
        paths = {id(m): p for p, m in model.named_modules()}
        if module is not model:  # the per-module hook: refuse attention it will never be handed
            _refuse_unreachable(model, plan)
        cache[chosen] = (found, plan, paths, set())
    found, plan, paths, done = cache[chosen]
    path = paths.get(id(module))
    if path is None:
        return 0
    if module is model:  # the whole model (the init_weights recipe, or the last call of the per-module hook)
        del cache[chosen]
        mine = [c for c in plan.changes if _change_id(c) not in done]
    else:
        mine = [c for c in plan.changes if _inside(c, path) and _change_id(c) not in done]
        done.update(_change_id(c) for c in mine)
        if len(done) == len(plan.changes):  # all written: a later call on the model plans afresh
            del cache[chosen]
    mine = [c for c in mine if not _loaded(found, c)]  # what from_pretrained loaded stays as loaded
    if not mine:
        return 0
    written = _write(found, replace(plan, changes=mine))
    if module is model or path_done(cache, chosen):  # the model's init is complete: its config says how it was made
        from ..in_memory import leave_record

        leave_record(model, plan, Hints(num_heads, num_kv_heads, head_dim), after=CONSTRUCTED)
    return written


CONSTRUCTED = "conditioned init when the model was built (surgeon.conditioned_init_), not a reset of trained weights"


def path_done(cache: dict, chosen: ReinitOptions) -> bool:
    """Whether the per-module hook has written every change of the plan (its cache entry is gone then)."""
    return chosen not in cache


_ON_META = (
    "surgeon.conditioned_init_: {} is on the meta device (from_pretrained, init_empty_weights), so nothing was "
    "written; weights loaded into it stay as loaded: to reset them, call surgeon.reinit_(model) once it is loaded"
)


def _change_id(change: Change) -> tuple[str, str]:
    return change.projection.weight.tensor, change.role


def _inside(change: Change, path: str) -> bool:
    """Whether the module at ``path`` holds ``change``: its block, a module around it, or the projection's own
    parameters (transformers hands a custom model's ``_init_weights`` only modules with parameters of their own,
    i.e. the q/k/v Linears, not the attention module around them)."""
    if not path:
        return True
    tensors = [r.tensor for r in (change.projection.weight, change.projection.bias) if r is not None]
    return any(n == path or n.startswith(path + ".") for n in (change.block.module, *tensors))


def _loaded(found: ModuleDetection, change: Change) -> bool:
    """A weight transformers' from_pretrained loaded (it marks them): its own init leaves it alone, so do we."""
    return bool(getattr(found.params[change.projection.weight.tensor], "_is_hf_initialized", False))


def _refuse_unreachable(model: nn.Module, plan: Plan) -> None:
    """transformers initializes a model nested in ``model`` (a task class's ``bert``, ``model``, ...) with that
    inner model's own ``_init_weights``: a hook in ``type(model)._init_weights`` never sees its attention."""
    hook = getattr(type(model), "_init_weights", None)
    params = dict(model.named_parameters())
    for path, inner in model.named_modules():
        if not path or not hasattr(inner, "_initialize_weights") or getattr(type(inner), "_init_weights", None) is hook:
            continue
        loaded = [getattr(params[c.projection.weight.tensor], "_is_hf_initialized", False) for c in plan.changes]
        if any(_inside(c, path) and not was for c, was in zip(plan.changes, loaded, strict=True)):
            raise OptionError(
                f"conditioned_init_ in {type(model).__name__}._init_weights never sees the attention of {path} "
                f"({type(inner).__name__}): transformers initializes it with {type(inner).__name__}'s own _init_weights. "
                f"Call it from {type(model).__name__}.init_weights() instead: super().init_weights(), then "
                "surgeon.conditioned_init_(self, ...)"
            )


def _write(found: ModuleDetection, plan: Plan) -> int:
    """Write ``plan``'s new heads into the parameters ``found`` holds; returns how many were written."""
    device = found.params[plan.changes[0].projection.weight.tensor].device
    return write_params(Engine(plan, device), found.params, record=False)
