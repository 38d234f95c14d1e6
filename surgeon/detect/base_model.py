"""The names draws are keyed by: each tensor's name relative to the model's own base model.

A transformers task class holds its base model under ``base_model_prefix`` (``bert.`` in
BertForSequenceClassification, ``model.`` in LlamaForCausalLM, ``transformer.`` in GPT2LMHeadModel and in
T5ForSequenceClassification), and saves its tensors under that prefix. Keying the draws by the name with that
prefix taken off gives the same heads for the same seed whichever class holds the weights: the CLI on a base
checkpoint, on a task checkpoint of the same model, and ``reinit_`` on either class in memory (where the
wrappers around it, DDP, torch.compile, PEFT and sentence-transformers, are looked through already).

The prefix is the model's own, never guessed from the names: in memory, the path of ``model.base_model`` in the
module tree; on disk, ``base_model_prefix`` of the class config.json names (``architectures``), taken off the
names that carry it, as transformers' own loader does when it loads a base model from a task checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any


def base_path(model: Any) -> str:
    """The path of a transformers model's base model inside it ("" when the model is its own base)."""
    base = getattr(model, "base_model", model)
    if base is model or not hasattr(model, "named_modules"):
        return ""
    return next((path for path, m in model.named_modules() if m is base), "")


def relative_to(name: str, base: str) -> str:
    """``name`` without the base model's path (unchanged when it lies outside the base model)."""
    return name[len(base) + 1 :] if base and name.startswith(base + ".") else name


class CheckpointDrawKeys(Mapping[str | tuple[str, str], str]):
    """Tensor name -> draw key, for the tensors of a checkpoint whose names carry its class's base-model prefix.

    The prefix is looked up on first use, in the compute stage: it imports the class's transformers module (and
    torch), which planning, a dry run and the first byte copies do not wait for.
    """

    def __init__(self, tensors: Iterable[str], config: Mapping[str, Any] | None) -> None:
        self._tensors, self._architecture = tuple(tensors), _architecture(config)
        self._keys: dict[str | tuple[str, str], str] | None = None

    def _resolved(self) -> dict[str | tuple[str, str], str]:
        if self._keys is None:
            prefix = _prefix_of(self._architecture)
            self._keys = {n: relative_to(n, prefix) for n in self._tensors if prefix and n.startswith(prefix + ".")}
        return self._keys

    def __getitem__(self, name: str | tuple[str, str]) -> str:
        return self._resolved()[name]

    def __iter__(self) -> Iterator[str | tuple[str, str]]:
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._resolved())


def _architecture(config: Mapping[str, Any] | None) -> str | None:
    names = (config or {}).get("architectures")
    if isinstance(names, list) and names and isinstance(names[0], str) and names[0].isidentifier():
        return names[0]
    return None


@functools.lru_cache(maxsize=64)
def _prefix_of(architecture: str | None) -> str:
    """``base_model_prefix`` of a transformers class by name; "" for a class transformers does not have."""
    if architecture is None:
        return ""
    try:
        import transformers

        prefix = getattr(getattr(transformers, architecture), "base_model_prefix", "")
    except Exception:  # no transformers, a class it does not have (remote code), a class that fails to import
        return ""
    return prefix if isinstance(prefix, str) and prefix.isidentifier() else ""
