"""The base-model prefix of a checkpoint's class, as its modeling source assigns it, is the one the class itself has.

surgeon reads ``base_model_prefix`` from the class's source (parsed, not imported, so a reinit does not wait for
transformers' model registry); judged against the classes themselves, every task class of these families.
"""

from __future__ import annotations

import pytest
import transformers
from transformers.models.auto import modeling_auto

from surgeon.detect.base_model import _prefix_in_source, _prefix_of

FAMILIES = ("bert", "roberta", "llama", "qwen2", "qwen3", "mistral", "gpt2", "t5", "bart", "gemma", "phi3", "opt")


def _classes(model_type: str) -> list[str]:
    names: set[str] = set()
    for attr in dir(modeling_auto):
        if attr.startswith("MODEL_") and attr.endswith("_MAPPING_NAMES"):
            found = getattr(modeling_auto, attr).get(model_type)
            names.update([found] if isinstance(found, str) else found or [])
    return sorted(names)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_prefix_read_from_source_is_the_class_attribute(model_type):
    classes = _classes(model_type)
    assert len(classes) >= 2, classes
    for name in classes:
        expected = getattr(transformers, name).base_model_prefix
        assert _prefix_in_source(name, model_type) in (expected, None), name  # None: the class is imported instead
        assert _prefix_of(name, model_type) == expected, name


def test_a_class_transformers_does_not_have_keys_by_full_names():
    assert _prefix_of("NoSuchModelForAnything", "bert") == "" and _prefix_of(None) == ""
