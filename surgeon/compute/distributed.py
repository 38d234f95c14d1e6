"""surgeon inside training stacks: wrappers around the model and parameters sharded over processes.

* **Wrappers** -- ``DistributedDataParallel`` / ``DataParallel`` (``.module``), ``torch.compile``'s
  ``OptimizedModule`` (``._orig_mod``) and PEFT's ``PeftModel`` are looked through; PEFT/LoRA layers
  are swapped for their base layers while surgeon works, so the base Q/K/V weights are the ones
  re-initialized (with the draws of the checkpoint's own names) and the adapters are left as they are.
* **Megatron tensor parallel** (parameters marked ``tensor_model_parallel``, each rank holding a slice of
  the query groups along ``partition_dim``) -- refused before anything is read: detection would see one rank's
  heads and every rank would draw its slice as if it were the whole tensor.
* **DTensor / FSDP2** (``fully_shard``, or DTensor parameters over a device mesh) -- each rank writes
  only the rows it owns. Every head's draw is keyed by (seed, tensor, role, head), so a rank builds its
  rows from the same float64 values the single-process path computes, with no communication. The
  only collective is the gather of one projection at a time for the report's spectra (and, in polar
  mode or with keep_scale, for the old values): each rank puts its owned elements into a zero buffer
  seen as integers and one integer all-reduce per sharded mesh dimension assembles the exact bits.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
from torch import nn

from ..errors import OptionError, UnsupportedWeightsError
from ..modes.conditioning import Spectrum, single_threaded
from ..vocab.blocks import AttentionBlock, Rows
from .engine import Engine, TensorCopy, TensorStore, _row_index, head_matrices

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

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

    return [
        (path, m) for path, m in module.named_modules() if isinstance(m, BaseTunerLayer) and isinstance(m, nn.Module)
    ]


def _quantized(layer: nn.Module) -> str | None:
    weight = getattr(layer, "weight", None)
    cls = type(layer)
    where = f"{cls.__module__}.{cls.__name__}"
    if (
        "bitsandbytes" in where
        or "gptq" in where.lower()
        or "QuantLinear" in cls.__name__
        or type(weight).__name__ in ("Params4bit", "Int8Params")
    ):
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


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from .._compat import DTensor

    return isinstance(t, DTensor)


def any_sharded(params: Mapping[str, torch.Tensor], names: Iterable[str]) -> bool:
    return any(is_dtensor(params[n]) for n in names)


def _local(param: DTensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The local tensor of a DTensor, its shape and its offset in the global tensor."""
    from .._compat import Partial, Replicate, Shard, compute_local_shape_and_global_offset

    for p in param.placements:
        if not isinstance(p, (Shard, Replicate)) or isinstance(p, Partial):
            raise UnsupportedWeightsError(
                f"a parameter is placed as {p} on its device mesh; surgeon writes Shard and Replicate placements only"
            )
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):  # padded local storage: not something surgeon can address
        raise UnsupportedWeightsError(
            f"a DTensor's local shard is {tuple(local.shape)}, not the {tuple(shape)} its placements give; surgeon cannot address its rows"
        )
    return local, tuple(shape), tuple(offset)


def _detached(param: DTensor) -> DTensor:
    return cast("DTensor", param.detach())  # a DTensor's detach() is a DTensor; torch's stubs say Tensor


def _owned(
    rows: Rows, idx: torch.Tensor, shape: tuple[int, ...], offset: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, slice | None]:
    """Positions in ``idx`` (global rows along ``rows.axis``) that this rank owns, their local rows, and its column range."""
    a, b = rows.axis, 1 - rows.axis if len(shape) == 2 else None
    lo, hi = offset[a], offset[a] + shape[a]
    pos = ((idx >= lo) & (idx < hi)).nonzero().flatten()
    cols = slice(offset[b], offset[b] + shape[b]) if b is not None else None
    return pos, idx[pos] - lo, cols


def gather_heads(param: torch.Tensor, rows: Rows, heads: Sequence[int] | None = None) -> torch.Tensor:
    """``head_matrices(param.full_tensor(), rows, heads)``, gathering only those heads' rows (exact bits)."""
    if not is_dtensor(param):
        return head_matrices(param.detach(), rows, heads)
    import torch.distributed as dist

    from .._compat import Shard

    heads = list(range(len(rows.offsets))) if heads is None else list(heads)
    local, shape, offset = _local(_detached(param))
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


def _write_rows(param: DTensor, rows: Rows, heads: Sequence[int], values: torch.Tensor) -> None:
    """Store the rounded ``values`` (len(heads), d, in) into the rows of ``heads`` that this rank owns."""
    local, shape, offset = _local(_detached(param))
    idx = _row_index(rows, heads, "cpu")
    pos, local_rows, cols = _owned(rows, idx, shape, offset)
    if not len(pos):
        return
    values = values.to(local.device, local.dtype).reshape(len(idx), -1)  # round first, as apply._set_heads
    mat = local if rows.axis == 0 else local.transpose(0, 1)
    mat.index_copy_(0, local_rows.to(local.device), values.index_select(0, pos.to(values.device))[:, cols])


def _zero_rows(param: DTensor, rows: Rows, heads: Sequence[int]) -> None:
    local, shape, offset = _local(_detached(param))
    idx = _row_index(rows, heads, "cpu")
    lo, hi = offset[0], offset[0] + shape[0]
    mine = idx[(idx >= lo) & (idx < hi)] - lo
    if len(mine):
        local.index_fill_(0, mine.to(local.device), 0)


class ShardedTensor:
    """A DTensor parameter as the engine's tensor store: heads gathered exactly, each rank writing the rows it owns."""

    def __init__(self, param: DTensor) -> None:
        self.param = param

    def heads(self, rows: Rows, heads: Sequence[int] | None = None) -> torch.Tensor:
        return gather_heads(self.param, rows, heads)

    def set_heads(self, rows: Rows, heads: tuple[int, ...], values: torch.Tensor) -> torch.Tensor:
        rounded = values.to(self.param.dtype)  # as apply._set_heads: round first
        if heads:
            _write_rows(self.param, rows, heads, rounded)
        return rounded

    def zero_heads(self, rows: Rows, heads: tuple[int, ...]) -> None:
        _zero_rows(self.param, rows, heads)

    def fill(
        self, values: torch.Tensor
    ) -> None:  # only modes that write whole tensors (W_O) need it; they refuse sharding
        raise UnsupportedWeightsError(
            "surgeon does not rewrite a whole sharded (DTensor) parameter: reinit before sharding"
        )


def write_params(engine: Engine, params: Mapping[str, torch.Tensor], *, record: bool = True) -> int:
    """Carry out the engine's plan on parameters in memory, in place: plain tensors and DTensors alike. The one
    writer of parameters in memory (``surgeon.reinit_``, the init hooks, the Trainer callback through them).

    Every refusal comes before the first write. A DTensor is written through :class:`ShardedTensor`
    (each rank its own rows; ``engine.results`` gets the same spectra on every rank). ``record``: measure the
    before/after spectra for the report (an init hook does not). Returns how many parameters were written.
    """

    def store(param: torch.Tensor) -> TensorStore:
        return ShardedTensor(param) if is_dtensor(param) else TensorCopy(param.detach(), copy=False)

    with single_threaded(), torch.no_grad():
        for name in (
            engine.tensor_names
        ):  # refusals first (one projection gathered at a time): nothing changes unless everything can
            engine.check_values(name, store(params[name]))
        for name in engine.tensor_names:
            engine.update_store(name, store(params[name]), record=record)
    return len(engine.tensor_names)


def inspect_sharded(
    blocks: Sequence[AttentionBlock], params: Mapping[str, torch.Tensor], device: torch.device, *, whole: bool = False
) -> dict[tuple[str, str], Spectrum]:
    """``apply.inspect_blocks`` on DTensor parameters: one projection gathered at a time."""
    from ..modes.conditioning import spectrum

    out: dict[tuple[str, str], Spectrum] = {}
    with single_threaded(), torch.no_grad():
        for block in blocks:
            for proj in block.projections:
                out[(block.module, proj.role)] = spectrum(
                    gather_heads(params[proj.weight.tensor], proj.weight).to(device), whole=whole
                )
    return out


def _tensor_parallel_ranks(owner: nn.Module) -> int | None:
    """How many ranks share the parameters of ``owner``, a Megatron tensor-parallel layer, as it says itself:
    its ``tp_group`` (Megatron-Core), else its whole and per-rank sizes; None when it says neither."""
    size_of_group = getattr(getattr(owner, "tp_group", None), "size", None)
    if callable(size_of_group):
        return int(size_of_group())
    for whole, part in (("output_size", "output_size_per_partition"), ("input_size", "input_size_per_partition")):
        size, per_rank = getattr(owner, whole, None), getattr(owner, part, None)
        if isinstance(size, int) and isinstance(per_rank, int) and per_rank:
            if size != per_rank:
                return size // per_rank
    return None


def refuse_tensor_parallel(module: nn.Module, fn: str) -> None:
    """Refuse a model whose parameters are Megatron tensor-parallel slices (``tensor_model_parallel=True`` on a
    layer split over more than one rank, or one whose split surgeon cannot read while several ranks run)."""
    import torch.distributed as dist

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    for path, owner in module.named_modules():
        for leaf, param in owner.named_parameters(recurse=False):
            if getattr(param, "tensor_model_parallel", False) is not True:
                continue
            ranks = _tensor_parallel_ranks(owner)
            if (ranks is None and several) or (ranks or 1) > 1:
                split = f"{ranks} ranks" if ranks else "over an unknown number of ranks"
                raise UnsupportedWeightsError(
                    f"{path}.{leaf} is one rank's slice of a Megatron tensor-parallel parameter (partition_dim "
                    f"{getattr(param, 'partition_dim', '?')}, {split}): surgeon.{fn} does not work on tensor "
                    "parallelism; re-initialize the model built with tensor_model_parallel_size=1, or its checkpoint "
                    "(surgeon reinit on the torch_dist folder), and load that into the tensor-parallel run"
                )


def refuse_meta(module: nn.Module, fn: str) -> None:
    if any(p.is_meta for p in module.parameters()):
        raise OptionError(
            f"{type(module).__name__} has parameters on the meta device (no values yet): call surgeon.{fn} after materializing them "
            "(to_empty() and load, or from_pretrained), or use surgeon.conditioned_init_ as the model's init step"
        )
