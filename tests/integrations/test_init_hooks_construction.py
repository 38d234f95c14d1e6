"""The pre-training recipes built the way transformers builds models: constructors, ``from_config``,
``from_pretrained``, task classes. A recipe either gives conditioned init or says why it cannot, never neither.

Judged against ``surgeon.reinit_`` on the plain model built from the same seed (the heads), and by the
singular values of the heads the model's own modules hold (every one 1).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification, BertModel, LlamaConfig, LlamaModel

import surgeon
from surgeon.errors import OptionError

transformers.logging.set_verbosity_error()

BERT = dict(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8)


class HookedBert(BertModel):
    def _init_weights(self, module):
        super()._init_weights(module)
        surgeon.conditioned_init_(module, model=self, seed=3)


class HookedLlama(LlamaModel):
    def _init_weights(self, module):
        super()._init_weights(module)
        surgeon.conditioned_init_(module, model=self, seed=3)


class HookedClassifier(BertForSequenceClassification):
    def _init_weights(self, module):
        super()._init_weights(module)
        surgeon.conditioned_init_(module, model=self, seed=3)


class InitWeightsClassifier(BertForSequenceClassification):
    def init_weights(self):
        super().init_weights()
        surgeon.conditioned_init_(self, seed=3)


def _plain_reinit(cls, config, **options):
    torch.manual_seed(0)
    plain = cls(config)
    surgeon.reinit_(plain, seed=3, **options)
    return dict(plain.named_parameters())


def _assert_equal_to(model, expected) -> None:
    different = [n for n, p in model.named_parameters() if not torch.equal(p, expected[n])]
    assert not different, different[:5]


def _query_head_singular_values(attention_query: torch.nn.Linear, head_dim: int) -> torch.Tensor:
    return torch.linalg.svdvals(attention_query.weight.detach()[:head_dim].double())


@pytest.mark.parametrize("build", ["constructor", "from_config"])
def test_init_weights_hook_per_module_conditions_a_custom_base_model(build):
    """transformers hands a custom class's _init_weights only the modules with parameters of their own (the
    q/k/v Linears, never the attention module): each is conditioned right after its default init."""
    for cls, plain_cls, config, query in (
        (HookedBert, BertModel, BertConfig(**BERT), lambda m: m.encoder.layer[1].attention.self.query),
        (HookedLlama, LlamaModel, LlamaConfig(**LLAMA), lambda m: m.layers[1].self_attn.q_proj),
    ):
        torch.manual_seed(0)
        model = cls(config) if build == "constructor" else cls._from_config(config)
        _assert_equal_to(model, _plain_reinit(plain_cls, config))
        d = config.hidden_size // config.num_attention_heads
        assert torch.allclose(_query_head_singular_values(query(model), d), torch.ones(d, dtype=torch.float64))


def test_init_weights_hook_on_a_task_class_says_to_use_init_weights():
    """BertForSequenceClassification's bert is initialized with BertModel's own _init_weights: the hook never
    sees its attention, and says so instead of leaving the default init."""
    with pytest.raises(OptionError, match=r"never sees the attention of bert \(BertModel\).*init_weights\(\) instead"):
        HookedClassifier(BertConfig(**BERT))


def test_init_weights_recipe_conditions_a_task_class_built_by_from_config():
    config = BertConfig(**BERT)
    torch.manual_seed(0)
    model = InitWeightsClassifier._from_config(config)
    _assert_equal_to(model, _plain_reinit(BertForSequenceClassification, config))
    d = config.hidden_size // config.num_attention_heads
    query = model.bert.encoder.layer[0].attention.self.query
    assert torch.allclose(_query_head_singular_values(query, d), torch.ones(d, dtype=torch.float64))


def test_from_pretrained_keeps_loaded_weights_and_conditions_the_missing_ones(tmp_path):
    """from_pretrained initializes only what the checkpoint lacks: the hook conditions exactly those (layer 1's
    q/k/v, removed from the file) and leaves the loaded layer 0 as loaded."""
    from safetensors.torch import load_file, save_file

    config = BertConfig(**BERT)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    missing = [n for n in tensors if n.startswith("encoder.layer.1.attention.self.")]
    save_file({n: t for n, t in tensors.items() if n not in missing}, tmp_path / "model.safetensors")
    model = HookedBert.from_pretrained(tmp_path)
    held = dict(model.named_parameters())
    assert all(torch.equal(held[n], t) for n, t in tensors.items() if n not in missing)
    expected = BertModel.from_pretrained(tmp_path)
    with torch.no_grad():
        for n in missing:
            expected.get_parameter(n).copy_(held[n])  # whatever the default init drew ...
    surgeon.reinit_(expected, seed=3, layers="1")  # ... the conditioned heads replace entirely
    assert all(torch.equal(held[n], expected.get_parameter(n)) for n in missing if n.endswith("weight"))
    assert all(not held[n].any() for n in missing if n.endswith("bias"))


def test_init_weights_recipe_under_from_pretrained_warns_and_keeps_the_checkpoint(tmp_path):
    config = BertConfig(**BERT)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"meta device .* call surgeon\.reinit_\(model\) once it is loaded"):
        model = InitWeightsClassifier.from_pretrained(tmp_path)
    loaded = BertModel.from_pretrained(tmp_path)
    assert all(torch.equal(p, model.bert.get_parameter(n)) for n, p in loaded.named_parameters())


def test_integrations_are_reachable_after_a_plain_import_surgeon():
    code = (
        "import surgeon\n"
        "cb = surgeon.integrations.transformers.ReinitCallback(layers='-2-', seed=0)\n"
        "import transformers\n"
        "assert isinstance(cb, transformers.TrainerCallback)\n"
        "print(type(cb).__module__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "surgeon.integrations.transformers"
