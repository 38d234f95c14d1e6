"""surgeon inside training stacks: wrappers around the model and parameters sharded over processes.

* **Wrappers** -- ``DistributedDataParallel`` / ``DataParallel`` (``.module``), ``torch.compile``'s
  ``OptimizedModule`` (``._orig_mod``) and PEFT's ``PeftModel`` are looked through; PEFT/LoRA layers
  are swapped for their base layers while surgeon works, so the base Q/K/V weights are the ones
  re-initialized (with the draws of the checkpoint's own names) and the adapters are left as they are.
* **DTensor / FSDP2** (``fully_shard``, or DTensor parameters over a device mesh) -- each rank writes
  only the rows it owns. Every head's draw is keyed by (seed, tensor, role, head), so a rank builds its
  rows from the same float64 values the single-process path computes, with no communication. The
  only collective is the gather of one projection at a time for the report's spectra (and, in polar
  mode or with keep_scale, for the old values): each rank puts its owned elements into a zero buffer
  seen as integers and one integer all-reduce per sharded mesh dimension assembles the exact bits.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from .apply import Engine, ProjectionResult, _row_index, head_matrices, needs_old_values, new_heads
from .conditioning import Spectrum, head_kappas, single_threaded
from .errors import OptionError, UnsupportedWeightsError
from .spec import AttentionBlock, Rows

_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# --------------------------------------------------------------------------- wrappers


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel, ``torch.compile`` and PEFT wrappers (any nesting)."""
    while True:
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = module.module
        elif type(module).__name__ == "OptimizedModule":
            inner = getattr(module, "_orig_mod", None)
        elif _is_peft_model(module):
            inner = getattr(module, "get_base_model")()  # noqa: B009  (peft is optional: no static type)
        else:
            return module
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def _is_peft_model(module: nn.Module) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, getattr(peft, "PeftModel", ()))


def _tuner_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    if "peft" not in sys.modules:  # no PEFT layer can exist before peft is imported
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(path, m) for path, m in module.named_modules() if isinstance(m, BaseTunerLayer) and isinstance(m, nn.Module)]


def _quantized(layer: nn.Module) -> str | None:
    weight = getattr(layer, "weight", None)
    cls = type(layer)
    where = f"{cls.__module__}.{cls.__name__}"
    if "bitsandbytes" in where or "gptq" in where.lower() or "QuantLinear" in cls.__name__ or type(weight).__name__ in ("Params4bit", "Int8Params"):
        return cls.__name__
    if isinstance(weight, torch.Tensor) and not weight.is_floating_point():
        return f"{cls.__name__} with {str(weight.dtype).removeprefix('torch.')} weights"
    return None


@contextmanager
def unwrapped(module: nn.Module) -> Iterator[nn.Module]:
    """The model inside its wrappers, with every PEFT tuner layer replaced by its base layer until exit.

    A merged adapter or a quantized base is refused (one line): the base weights are not the
    float matrices surgeon would write.
    """
    inner = unwrap(module)
    layers = _tuner_layers(inner)
    for path, layer in layers:
        if getattr(layer, "merged", False):
            raise UnsupportedWeightsError(
                f"{path}: adapter(s) {', '.join(getattr(layer, 'merged_adapters', []))} are merged into the base weights; "
                "call model.unmerge_adapter() before surgeon.reinit_, or re-initialize the base model before merging"
            )
        kind = _quantized(getattr(layer, "get_base_layer")())  # noqa: B009  (a peft BaseTunerLayer)
        if kind:
            raise UnsupportedWeightsError(
                f"{path}: the adapter's base layer is quantized ({kind}); surgeon rewrites float weights only: "
                "re-initialize the unquantized model, then quantize it and add the adapters"
            )
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for path, layer in layers:
            parent_path, _, leaf = path.rpartition(".")
            parent = inner.get_submodule(parent_path)
            if getattr(parent, leaf, None) is layer:  # nested tuner layers: the outermost is swapped
                swapped.append((parent, leaf, layer))
                setattr(parent, leaf, layer.get_base_layer())
        yield inner
    finally:
        for parent, leaf, layer in reversed(swapped):
            setattr(parent, leaf, layer)


# --------------------------------------------------------------------------- DTensor


def is_dtensor(t: torch.Tensor) -> bool:
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from ._compat import DTensor

    return isinstance(t, DTensor)


def any_sharded(params: Mapping[str, torch.Tensor], names) -> bool:
    return any(is_dtensor(params[n]) for n in names)


def _local(param) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The local tensor of a DTensor, its shape and its offset in the global tensor."""
    from ._compat import Partial, Replicate, Shard, compute_local_shape_and_global_offset

    for p in param.placements:
        if not isinstance(p, (Shard, Replicate)) or isinstance(p, Partial):
            raise UnsupportedWeightsError(f"a parameter is placed as {p} on its device mesh; surgeon writes Shard and Replicate placements only")
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):  # padded local storage: not something surgeon can address
        raise UnsupportedWeightsError(f"a DTensor's local shard is {tuple(local.shape)}, not the {tuple(shape)} its placements give; surgeon cannot address its rows")
    return local, tuple(shape), tuple(offset)


def _owned(rows: Rows, idx: torch.Tensor, shape, offset):
    """Positions in ``idx`` (global rows along ``rows.axis``) that this rank owns, their local rows, and its column range."""
    a, b = rows.axis, 1 - rows.axis if len(shape) == 2 else None
    lo, hi = offset[a], offset[a] + shape[a]
    pos = ((idx >= lo) & (idx < hi)).nonzero().flatten()
    cols = slice(offset[b], offset[b] + shape[b]) if b is not None else None
    return pos, idx[pos] - lo, cols


def gather_heads(param, rows: Rows, heads=None) -> torch.Tensor:
    """``head_matrices(param.full_tensor(), rows, heads)``, gathering only those heads' rows (exact bits)."""
    if not is_dtensor(param):
        return head_matrices(param.detach(), rows, heads)
    import torch.distributed as dist

    from ._compat import Shard

    heads = list(range(len(rows.offsets))) if heads is None else list(heads)
    local, shape, offset = _local(param.detach())
    idx = _row_index(rows, heads, "cpu")
    n_in = param.shape[1 - rows.axis]
    buf = torch.zeros(len(idx), n_in, dtype=local.dtype, device=local.device)
    pos, local_rows, cols = _owned(rows, idx, shape, offset)
    if len(pos):
        mat = local if rows.axis == 0 else local.transpose(0, 1)
        buf[pos.to(buf.device), cols] = mat.index_select(0, local_rows.to(local.device))
    # one owner per element within each sharded mesh dimension: an integer sum of the bit patterns is exact
    bits = buf.view(_INT_OF[buf.element_size()])
    wide = bits.to(torch.int32) if bits.element_size() < 4 else bits
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
    if wide is not bits:
        bits = wide.to(bits.dtype)
    return bits.view(local.dtype).reshape(len(heads), rows.size, n_in)


def _write_rows(param, rows: Rows, heads, values: torch.Tensor) -> None:
    """Store the rounded ``values`` (len(heads), d, in) into the rows of ``heads`` that this rank owns."""
    local, shape, offset = _local(param.detach())
    idx = _row_index(rows, heads, "cpu")
    pos, local_rows, cols = _owned(rows, idx, shape, offset)
    if not len(pos):
        return
    values = values.to(local.device, local.dtype).reshape(len(idx), -1)  # round first, as apply._set_heads
    mat = local if rows.axis == 0 else local.transpose(0, 1)
    mat.index_copy_(0, local_rows.to(local.device), values.index_select(0, pos.to(values.device))[:, cols])


def _zero_rows(param, rows: Rows, heads) -> None:
    local, shape, offset = _local(param.detach())
    idx = _row_index(rows, heads, "cpu")
    lo, hi = offset[0], offset[0] + shape[0]
    mine = idx[(idx >= lo) & (idx < hi)] - lo
    if len(mine):
        local.index_fill_(0, mine.to(local.device), 0)


def write_sharded(engine: Engine, params: Mapping[str, torch.Tensor]) -> None:
    """What ``param.copy_(engine.update(name, param))`` does for every tensor, on DTensor (or plain) parameters.

    Each rank writes its own rows; ``engine.results`` gets the same spectra on every rank.
    """
    with single_threaded(), torch.no_grad():
        if needs_old_values(engine.plan):  # refusals first (one projection gathered at a time): nothing changes unless everything can
            for name in engine.tensor_names:
                param = params[name]
                for change, what in engine.edits[name]:
                    if what == "weight":
                        rows = change.projection.weight
                        heads = gather_heads(param, rows) if is_dtensor(param) else head_matrices(param.detach(), rows)
                        engine.refuse_nonfinite(name, change, heads[list(change.heads)])
        for name in engine.tensor_names:
            param = params[name]
            if not is_dtensor(param):
                param.copy_(engine.update(name, param.detach()))
                continue
            for change, what in engine.edits[name]:
                proj = change.projection
                key = (change.block.module, change.role)
                if what == "bias":
                    assert proj.bias is not None  # Engine edits a bias only where the projection has one
                    _zero_rows(param, proj.bias, change.heads)
                    prev = engine.results.get(key)
                    if prev is not None:
                        prev.bias_zeroed = True
                    else:  # the weight comes later (another tensor): mark it for then
                        engine.results[key] = ProjectionResult(change.block, change.role, change.heads, "", None, None, True)  # type: ignore[arg-type]
                    continue
                original = gather_heads(param, proj.weight)  # the report's spectra need every head whole
                old = None
                if needs_old_values(engine.plan):
                    old = original[list(change.heads)].to(engine.device, torch.float64)
                new = new_heads(change, old, engine.plan, seed_name=engine.seed_names.get(name), device=engine.device)
                rounded = new.to(original.dtype)
                if change.heads:
                    _write_rows(param, proj.weight, change.heads, rounded)
                _record(engine, change, original, rounded)


def _record(engine: Engine, change, original: torch.Tensor, rounded: torch.Tensor) -> None:
    """The spectra Engine._record computes, from the gathered projection and the rounded new heads."""
    key = (change.block.module, change.role)
    before = engine._spectrum(original)
    kappas = list(before.head_kappas)
    stored = original.clone()
    if change.heads:
        stored[list(change.heads)] = rounded.to(stored.device)
        for h, k in zip(change.heads, head_kappas(rounded.to(engine.device))):
            kappas[h] = k
    after = engine._spectrum(stored, tuple(kappas)) if before.kappa is not None else Spectrum(None, tuple(kappas), None)
    prev = engine.results.get(key)
    engine.results[key] = ProjectionResult(
        change.block, change.role, change.heads, str(original.dtype).removeprefix("torch."), before, after, prev.bias_zeroed if prev else False
    )


def inspect_sharded(blocks: list[AttentionBlock], params: Mapping[str, torch.Tensor], device: torch.device, *, whole: bool = False) -> dict[tuple[str, str], Spectrum]:
    """``apply.inspect_blocks`` on DTensor parameters: one projection gathered at a time."""
    from .conditioning import spectrum

    out: dict[tuple[str, str], Spectrum] = {}
    with single_threaded(), torch.no_grad():
        for block in blocks:
            for proj in block.projections:
                out[(block.module, proj.role)] = spectrum(gather_heads(params[proj.weight.tensor], proj.weight).to(device), whole=whole)
    return out


def refuse_meta(module: nn.Module, fn: str) -> None:
    if any(p.is_meta for p in module.parameters()):
        raise OptionError(
            f"{type(module).__name__} has parameters on the meta device (no values yet): call surgeon.{fn} after materializing them "
            "(to_empty() and load, or from_pretrained), or use surgeon.conditioned_init_ as the model's init step"
        )
