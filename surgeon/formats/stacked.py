"""Stacked-layer tensors: one stored tensor holding every layer of a stack, its leading dimension the layer.

Megatron-Core's distributed checkpoints (``torch_dist``) key each layer's tensors without the layer's number,
``decoder.layers.self_attention.linear_qkv.weight``, and prepend the layer as axis 0 (TransformerBlock.
sharded_state_dict gives each layer the sharded offset ``(0, layer, num_layers)``); ``dcp_to_torch_save`` of
such a folder keeps them stacked. surgeon offers each layer's slice under the name the model itself gives it
(``decoder.layers.1.self_attention.linear_qkv.weight``, Megatron's own ``state_dict`` name), so detection,
``--layers``, the report's rows and the draws are those of the same model saved layer by layer; writing puts
the changed slices back into their stored tensor, every other slice as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from ..errors import CheckpointError
from .base import TensorInfo

# The word Megatron-Core's TransformerBlock keys its stacked layers under (f"{prefix}layers."), and the
# submodules of its TransformerLayer that follow it in a stacked key. A name of that shape only (``layers.`` then
# one of these words) is read as every layer stacked: ``encoder.layers.encoder_layer_0.ln_1.weight`` (torchvision's
# ViT) is one tensor of one layer, whatever comes after ``layers.``.
STACK_WORD = "layers"
MEGATRON_LAYER_PARTS = frozenset(
    ("input_layernorm", "self_attention", "pre_cross_attn_layernorm", "cross_attention", "pre_mlp_layernorm", "mlp")
)
# A stacked tensor's layer count is read from the file: real models have up to some hundreds of layers, and each
# layer becomes a tensor entry here, so a count beyond this is refused before any entry is made.
MAX_STACKED_LAYERS = 4096


@dataclass(frozen=True)
class Slice:
    """The per-layer tensor ``layer`` of the stored tensor ``stacked`` (its index along axis 0)."""

    stacked: str
    layer: int


def _split(name: str) -> tuple[str, str] | None:
    """(``prefix.layers``, the rest) of a stacked tensor's name, or None for any other name."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == STACK_WORD and parts[i + 1] in MEGATRON_LAYER_PARTS:
            return ".".join(parts[: i + 1]), ".".join(parts[i + 1 :])
    return None


def unstack(
    infos: Mapping[str, TensorInfo], where: object, file_of: Callable[[str, int], str] | None = None
) -> tuple[dict[str, TensorInfo], dict[str, Slice]]:
    """The tensors as the model names them (each stacked tensor replaced by its layers, in its place) and the
    slice each per-layer name is. ``file_of(stacked, layer)``: the file holding that layer (default: the
    stacked tensor's). A stack whose tensors disagree on their number of layers, or whose per-layer names
    are also stored, is refused: which slice is which layer would be a guess."""
    stacks: dict[str, dict[str, int]] = {}
    for name, info in infos.items():
        split = _split(name)
        if split is not None:
            stacks.setdefault(split[0], {})[name] = info.shape[0] if len(info.shape) >= 2 else 0
    if not stacks:
        return dict(infos), {}
    for stack, depths in stacks.items():
        _check_sizes(stack, depths, infos, where)
        if len(set(depths.values())) != 1 or 0 in depths.values():
            shown = ", ".join(f"{n} {infos[n].shape}" for n in list(depths)[:3])
            raise CheckpointError(
                f"{where}: the tensors under {stack}. hold every layer stacked (Megatron-Core's torch_dist keys) "
                f"but do not agree on the number of layers ({shown}); surgeon cannot tell which slice is which layer"
            )
    out: dict[str, TensorInfo] = {}
    slices: dict[str, Slice] = {}
    for name, info in infos.items():
        split = _split(name)
        if split is None:
            out[name] = info
            continue
        stack, rest = split
        for layer in range(info.shape[0]):
            per_layer = f"{stack}.{layer}.{rest}"
            if per_layer in infos:
                raise CheckpointError(
                    f"{where}: holds both {name} (every layer stacked) and {per_layer}: two values for one tensor"
                )
            slices[per_layer] = Slice(name, layer)
            file = file_of(name, layer) if file_of else info.file
            out[per_layer] = replace(
                info, name=per_layer, shape=info.shape[1:], file=file, nbytes=info.nbytes // info.shape[0]
            )
    return out, slices


def _check_sizes(stack: str, depths: Mapping[str, int], infos: Mapping[str, TensorInfo], where: object) -> None:
    """Each stacked tensor's layer count bounded, and every layer holding values: a file's number alone
    (10^9 layers of zero elements each) would otherwise make that many per-layer entries."""
    for name, depth in depths.items():
        shape = infos[name].shape
        if depth and 0 in shape[1:]:
            raise CheckpointError(
                f"{where}: {name} stacks {depth} layers of zero elements each (shape {list(shape)}): no layer holds "
                "a value; the file is not a model's checkpoint"
            )
        if depth > MAX_STACKED_LAYERS:
            raise CheckpointError(
                f"{where}: {name} claims {depth} stacked layers (shape {list(shape)}); surgeon reads at most "
                f"{MAX_STACKED_LAYERS}: the file is not a model's checkpoint"
            )


def check_layer_count(slices: Mapping[str, Slice], counts: Mapping[str, int], where: object) -> None:
    """The stacked tensors' layer count (the same for every stack, checked in :func:`unstack`) agrees with one
    the model's config gives (``counts``: its layer-count fields and their values; none: nothing to compare)."""
    if not slices or not counts:
        return
    by_stack: dict[str, set[int]] = {}
    for per_layer, part in slices.items():
        by_stack.setdefault(per_layer.split(f".{STACK_WORD}.")[0], set()).add(part.layer)
    for stack, layers in by_stack.items():
        if len(layers) not in counts.values():
            said = ", ".join(f"{k}={v}" for k, v in counts.items())
            raise CheckpointError(
                f"{where}: the tensors under {stack}.{STACK_WORD} stack {len(layers)} layers and the model's config "
                f"says {said}: the weights are not this config's model; give the config the weights were saved with"
            )


def stacked_note(slices: Mapping[str, Slice]) -> list[str]:
    """The report's line on how stacked tensors were read (none when there were none)."""
    if not slices:
        return []
    stored = sorted({s.stacked for s in slices.values()})
    stacks = sorted({s.stacked.split(f".{STACK_WORD}.")[0] + f".{STACK_WORD}" for s in slices.values()})
    layers = len({s.layer for s in slices.values()})
    return [
        f"{len(stored)} stacked-layer tensors under {', '.join(stacks)} (Megatron-Core torch_dist keys, {layers} "
        f"layers along axis 0): each layer read and written as its slice, named as the model names it "
        f"({stacks[0]}.N.…); the slices of layers left alone are kept as they are"
    ]
