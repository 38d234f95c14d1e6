"""Conditioned init at construction time: ``surgeon.conditioned_init_`` as a model's ``_init_weights`` step.

Called from a model's init step, it gives the query/key/value projections conditioned init right
after their default init, with exactly the draws ``surgeon.reinit_(model)`` would make (keyed by the
model's own tensor names), so a pre-training script gets conditioned init from the constructor::

    class ConditionedLlama(LlamaForCausalLM):
        def init_weights(self):          # what post_init() calls at the end of __init__
            super().init_weights()
            surgeon.conditioned_init_(self, seed=0)

``conditioned_init_(module, model=self)`` inside ``_init_weights(module)`` works per attention module
(only the blocks inside ``module``); note that transformers 5 initializes a composite model's inner
``PreTrainedModel`` (e.g. ``LlamaModel``) with that inner class's own ``_init_weights``, so overriding
``init_weights`` on the outer class, as above, is the dependable hook. On the meta device
(``from_pretrained`` / ``init_empty_weights``) there are no values to write and nothing happens:
call ``surgeon.reinit_`` after the weights are loaded.

The model's detection and plan are made once per model (the first call) and reused.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..compute.engine import Engine
from ..detect.hints import HintInput, Hints
from ..detect.module import ModuleDetection, detect_module
from ..errors import OptionError, opt
from ..options import ReinitOptions
from ..plan.planner import Plan, prepare

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
        How many parameters were written: 0 for a module without attention projections, or while the
        model is built on the meta device, where there are no values to write (then call
        ``surgeon.reinit_`` after materializing).

    Raises:
        OptionError: An option is out of range, or names another mode than conditioned.
        TypeError: A keyword is not an option.
    """
    chosen = ReinitOptions.build(options, **keywords)
    model = module if model is None else model
    if any(p.is_meta for p in module.parameters()):
        return 0
    if chosen.validated().mode != ReinitOptions().mode:  # the default mode is the paper's conditioned init
        raise OptionError(
            f"conditioned_init_ gives conditioned init; for {opt('mode', chosen.mode)} call surgeon.reinit_ "
            "once the model is built"
        )
    key = repr(chosen)  # every field, whatever their types (a list of layers is not hashable)
    cache = _PLANS.setdefault(model, {})
    if key not in cache:
        found = detect_module(model, hints=Hints(num_heads, num_kv_heads, head_dim))
        plan = prepare(found.blocks, chosen, depths=found.depths)
        paths = {id(m): p for p, m in model.named_modules()}
        cache[key] = (found, plan, paths, set())
    found, plan, paths, done = cache[key]
    path = paths.get(id(module))
    if path is None:
        return 0
    if module is model:  # the model itself comes last in transformers' init: finish what its submodules' calls left
        del cache[key]
        mine = [c for c in plan.changes if c.block.module not in done]
    else:
        mine = [c for c in plan.changes if c.block.module == path or c.block.module.startswith(path + ".")]
        done.update(c.block.module for c in mine)
    return _write(found, replace(plan, changes=mine)) if mine else 0


def _write(found: ModuleDetection, plan: Plan) -> int:
    """Write ``plan``'s new heads into the parameters ``found`` holds; returns how many were written."""
    device = found.params[plan.changes[0].projection.weight.tensor].device
    engine = Engine(plan, device, seed_names=found.seed_names)
    with torch.no_grad():
        for name in engine.tensor_names:
            param = found.params[name]
            param.copy_(engine.update(name, param.detach(), record=False))
    return len(engine.tensor_names)
