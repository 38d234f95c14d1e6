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

Two tensors whose keys would be one (``bert.encoder...`` beside ``encoder...`` in one checkpoint, two models of
one kind in one module) would draw the same heads: the plan refuses them (surgeon.plan.planner).
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
        model_type = (config or {}).get("model_type")
        self._model_type = model_type if isinstance(model_type, str) and model_type.isidentifier() else None
        self._keys: dict[str | tuple[str, str], str] | None = None

    def may_share(self) -> bool:
        """Whether two of the tensors could be keyed alike: only where one's name is another's with one more
        leading part (``bert.x`` beside ``x``; a prefix is one identifier). Else the prefix need not be looked up
        to know the keys are distinct."""
        names = set(self._tensors)
        return any(n.partition(".")[2] in names for n in self._tensors)

    def _resolved(self) -> dict[str | tuple[str, str], str]:
        if self._keys is None:
            prefix = _prefix_of(self._architecture, self._model_type)
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
def _prefix_of(architecture: str | None, model_type: str | None = None) -> str:
    """``base_model_prefix`` of a transformers class by name; "" for a class transformers does not have.

    Read first from the class's own source (``models/TYPE/modeling_TYPE.py``, parsed, not imported: importing it
    imports torch and transformers' model registry, seconds before the first draw); else from the class itself."""
    if architecture is None:
        return ""
    read = _prefix_in_source(architecture, model_type) if model_type else None
    if read is not None:
        return read
    try:
        import transformers

        prefix = getattr(getattr(transformers, architecture), "base_model_prefix", "")
    except Exception:  # no transformers, a class it does not have (remote code), a class that fails to import
        return ""
    return prefix if isinstance(prefix, str) and prefix.isidentifier() else ""


def _prefix_in_source(architecture: str, model_type: str) -> str | None:
    """``base_model_prefix`` as the class and its bases in its modeling file assign it; None when the file, the
    class or an assignment cannot be followed there (a base defined elsewhere): then the class is imported."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / model_type / f"modeling_{model_type}.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    name: str | None = architecture
    while name is not None and name in classes:
        node = classes[name]
        for statement in node.body:
            if isinstance(statement, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "base_model_prefix" for t in statement.targets
            ):
                value = statement.value
                return value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None
        bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
        if "PreTrainedModel" in bases:
            return ""  # transformers' own default
        name = next((b for b in bases if b in classes), None)
    return None
