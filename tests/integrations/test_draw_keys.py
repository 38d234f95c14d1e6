"""Same seed, same heads, whichever class or wrapper holds the weights.

The CLI on a base checkpoint, the CLI on a task checkpoint of the same model (its names carry ``bert.``,
``model.``, ``transformer.``), ``reinit_`` on any task class in memory, a PEFT-wrapped model and a
sentence-transformers model all draw the same heads for the same seed. Judged by the weights the models' own
modules hold, loaded back with transformers.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import surgeon

transformers.logging.set_verbosity_error()

SEED = 7
SMALL = dict(vocab_size=96, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)
FAMILIES = {
    "bert": (
        dict(hidden_size=48, intermediate_size=64),
        [AutoModelForSequenceClassification, AutoModelForQuestionAnswering],
    ),
    "llama": (
        dict(hidden_size=64, intermediate_size=96, num_key_value_heads=2, pad_token_id=0),
        [AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForQuestionAnswering],
    ),
    "qwen3": (
        dict(hidden_size=32, intermediate_size=48, num_key_value_heads=2, head_dim=8, pad_token_id=0),
        [AutoModelForCausalLM, AutoModelForQuestionAnswering],
    ),
    "mistral": (
        dict(hidden_size=64, intermediate_size=96, num_key_value_heads=2, pad_token_id=0),
        [AutoModelForCausalLM, AutoModelForTokenClassification],
    ),
    "gpt2": (
        dict(n_embd=48, n_layer=2, n_head=4, n_positions=32, pad_token_id=0),
        [AutoModelForCausalLM, AutoModelForSequenceClassification],
    ),
    "t5": (
        dict(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, decoder_start_token_id=0),
        [AutoModelForSeq2SeqLM, AutoModelForSequenceClassification],
    ),
}


def _config(family: str):
    extra, _ = FAMILIES[family]
    keys = dict(SMALL) if family not in ("gpt2", "t5") else {"vocab_size": 96}
    return AutoConfig.for_model(family, **{**keys, **extra})


def _base_dir(tmp_path, family: str):
    torch.manual_seed(0)
    base = AutoModel.from_config(_config(family))
    path = tmp_path / f"{family}-base"
    base.save_pretrained(path)
    return path


def _held(model) -> dict[str, torch.Tensor]:
    """The weights the model's base modules hold, by their path inside the base model (through LoRA layers)."""
    base = model.base_model
    out = {}
    for name, _ in base.named_parameters():
        path, _, leaf = name.rpartition(".")
        path = path.replace(".base_layer", "")
        if "lora_" in name:
            continue
        out[f"{path}.{leaf}"] = getattr(base.get_submodule(path), leaf).detach().clone()
    return out


def _assert_same_heads(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> None:
    shared = [n for n in reference if n in other]
    assert len(shared) >= len(reference) - 2, sorted(set(reference) - set(other))[:5]  # the base's pooler may go
    different = [n for n in shared if not torch.equal(reference[n], other[n])]
    assert not different, different[:5]


@pytest.fixture
def cli_heads(tmp_path, cli):
    """family -> (base folder, the weights a model loaded from the CLI's output of the base checkpoint holds)."""

    def make(family: str):
        base = _base_dir(tmp_path, family)
        out = tmp_path / f"{family}-cli"
        cli("reinit", base, "-o", out, "--seed", SEED)
        before = _held(AutoModel.from_pretrained(base))
        after = _held(AutoModel.from_pretrained(out))
        changed = [n for n in after if not torch.equal(before[n], after[n])]
        assert len(changed) >= 2, changed  # both layers changed (fused in GPT-2): the comparison means something
        return base, after

    return make


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reinit_on_every_task_class_draws_the_heads_the_cli_wrote_on_the_base_checkpoint(family, cli_heads):
    base, reference = cli_heads(family)
    for auto in FAMILIES[family][1]:
        task = auto.from_pretrained(base)
        surgeon.reinit_(task, seed=SEED)
        _assert_same_heads(reference, _held(task))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cli_on_a_task_checkpoint_draws_the_heads_it_draws_on_the_base_checkpoint(family, cli_heads, tmp_path, cli):
    base, reference = cli_heads(family)
    auto = FAMILIES[family][1][-1]
    task_dir, out = tmp_path / f"{family}-task", tmp_path / f"{family}-task-cli"
    auto.from_pretrained(base).save_pretrained(task_dir)
    cli("reinit", task_dir, "-o", out, "--seed", SEED)
    _assert_same_heads(reference, _held(auto.from_pretrained(out)))
    cli("verify", task_dir, out)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_a_peft_lora_model_draws_the_heads_of_the_plain_model(family, cli_heads):
    from peft import LoraConfig, get_peft_model

    base, reference = cli_heads(family)
    targets = ["q_proj", "v_proj"] if family == "llama" else ["query", "value"]
    auto = AutoModelForCausalLM if family == "llama" else AutoModelForSequenceClassification
    wrapped = get_peft_model(auto.from_pretrained(base), LoraConfig(r=2, target_modules=targets))
    assert any(".base_layer." in n for n, _ in wrapped.named_parameters())  # the names the draws must not see
    surgeon.reinit_(wrapped, seed=SEED)
    _assert_same_heads(reference, _held(wrapped.get_base_model()))


def test_real_minilm_cli_sentence_transformers_and_a_classifier_draw_the_same_heads(minilm_dir, tmp_path, cli):
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "minilm-top2"
    cli("reinit", minilm_dir, "--layers", "-2-", "-o", out, "--seed", SEED)
    reference = _held(AutoModel.from_pretrained(out))
    st = SentenceTransformer(str(minilm_dir), device="cpu")
    surgeon.reinit_(st, layers="-2-", seed=SEED)
    _assert_same_heads(reference, _held(st[0].auto_model))
    classifier = AutoModelForSequenceClassification.from_pretrained(minilm_dir, num_labels=2)
    surgeon.reinit_(classifier, layers="-2-", seed=SEED)
    _assert_same_heads(reference, _held(classifier))
