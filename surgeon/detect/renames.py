"""A checkpoint's stack names as the model's modules spell them, through transformers' own conversion mappings.

transformers 5 saves some models under other key names than its modules hold (Qwen2-VL's language model under
``model.layers.N``, its modules under ``model.language_model.layers.N``) and renames them at load. The config that
owns a stack's heads is found from the module names (``language_model`` names ``text_config``), so where the
checkpoint's own names lead to no heads, detection tries the names transformers loads them as (and, for a
checkpoint saved in the modules' names, the names it saves them as).

Nothing here imports torch or transformers at import time; transformers is imported on first use, only when a
stack's heads could not be told from its own name.
"""

from __future__ import annotations

from collections.abc import Iterable


def stack_aliases(config: dict | None, tensors: Iterable[str], stacks: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Each stack of ``stacks`` -> its other spellings (load direction first, then save direction), from the
    conversion mappings transformers keeps for the config's architecture and model type; {} without
    transformers or a mapping. A stack's spelling is read off a tensor under it: the tensor renamed, less the
    same tail."""
    renamings = _renamings(config)
    if not renamings:
        return {}
    names = list(tensors)
    out: dict[str, tuple[str, ...]] = {}
    for stack in stacks:
        tensor = next((n for n in names if stack and n.startswith(stack + ".")), None)
        if tensor is None:
            continue
        tail = tensor[len(stack) :]
        spelled = []
        for direction in renamings:
            renamed = _renamed(tensor, direction)
            if renamed is not None and renamed.endswith(tail) and renamed[: -len(tail)] not in (stack, ""):
                spelled.append(renamed[: -len(tail)])
        if spelled:
            out[stack] = tuple(dict.fromkeys(spelled))
    return out


def _renamings(config: dict | None) -> list[list]:
    """[load-direction renamings, save-direction renamings] of the config's architecture (its class name first,
    then its model type), pure renamings only (a converter that splits or merges tensors is not a name)."""
    if not config:
        return []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # no transformers, or one without conversion mappings: the names are the modules'
        return []
    architectures = config.get("architectures")
    keys = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    keys += [config["model_type"]] if isinstance(config.get("model_type"), str) else []
    try:
        mapping = next((m for m in (get_checkpoint_conversion_mapping(k) for k in keys) if m), None)
        if not mapping:
            return []
        load = [t for t in mapping if isinstance(t, WeightRenaming) and not isinstance(t, WeightConverter)]
        save = [t.reverse_transform() for t in load[::-1]]
    except Exception:  # noqa: BLE001 - a transformers release with another mapping API: no aliases
        return []
    return [load, save]


def _renamed(name: str, renamings: list) -> str | None:
    try:
        from transformers.core_model_loading import apply_renamings

        return apply_renamings(name, renamings)
    except Exception:  # noqa: BLE001 - a rename that cannot apply to this name
        return None
