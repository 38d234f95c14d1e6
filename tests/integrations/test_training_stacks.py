"""reinit_ inside training stacks on one process: torch.compile, PEFT/LoRA, the meta device,
conditioned init at construction time (surgeon.conditioned_init_) and the transformers Trainer callback.

(FSDP2, DTensor and DDP across processes: tests/write/test_distributed.py.)
"""

from __future__ import annotations

import pytest
import torch

import surgeon
from surgeon.errors import OptionError, UnsupportedWeightsError

from helpers.families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")

X = torch.arange(1, 13).reshape(2, 6)


def expected_state(family="llama", **options):
    model = FAMILIES[family].make()
    surgeon.reinit_(model, **options)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_compiled_model_is_reinitialized_and_its_compiled_forward_uses_the_new_weights():
    """backend="aot_eager": inductor works on this machine (g++ is there) but a tiny Llama takes ~40 s to
    compile on two shared cores; aot_eager traces and runs the same AOT graph, without the C++ build."""
    model = FAMILIES["llama"].make()
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        before = compiled(X).logits
    report = surgeon.reinit_(compiled, seed=3)
    assert report.to_dict()["projections"] and "OptimizedModule" in report.to_dict()["source"]
    assert all(torch.equal(p, expected_state(seed=3)[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        after, eager = compiled(X).logits, model(X).logits
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, eager, rtol=0, atol=1e-6)


def lora_model(family="llama"):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj"] if family == "llama" else ["c_attn"]
    torch.manual_seed(1)
    model = get_peft_model(FAMILIES[family].make(), LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_peft_lora_base_weights_reset_adapters_untouched(family):
    model = lora_model(family)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert adapters
    surgeon.reinit_(model, seed=3, layers="0-")
    expected = expected_state(family, seed=3, layers="0-")
    base = model.get_base_model()
    got = {n.replace(".base_layer", ""): p for n, p in base.named_parameters() if "lora_" not in n}
    assert set(got) == set(expected)
    assert all(torch.equal(got[n], expected[n]) for n in expected)  # same draws as the plain model (and its checkpoint)
    assert all(torch.equal(p, adapters[n]) for n, p in model.named_parameters() if "lora_" in n)
    assert any("lora_" in n for n, _ in model.named_parameters())  # the wrappers are back in place
    model(X)  # and the adapted model still runs


def test_peft_merged_adapter_is_refused_in_one_line():
    model = lora_model()
    model.merge_adapter()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(
        UnsupportedWeightsError, match=r"merged into the base weights; call model.unmerge_adapter\(\)"
    ) as err:
        surgeon.reinit_(model)
    assert "\n" not in str(err.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_peft_quantized_base_is_refused_in_one_line():
    """bitsandbytes has no wheel for this CPU-only machine; an int8 base weight is what its 8-bit layers hold."""
    model = lora_model()
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    q_proj.weight = torch.nn.Parameter(torch.zeros(q_proj.weight.shape, dtype=torch.int8), requires_grad=False)
    with pytest.raises(
        UnsupportedWeightsError,
        match=r"base layer is quantized \(Linear with int8 weights\); surgeon rewrites float weights only",
    ) as err:
        surgeon.reinit_(model)
    assert "\n" not in str(err.value)


def test_meta_device_is_refused_in_one_line():
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(FAMILIES["llama"].make().config)
    for fn in (surgeon.reinit_, surgeon.inspect):
        with pytest.raises(
            OptionError, match=r"meta device .* call surgeon\.(reinit_|inspect) after materializing"
        ) as err:
            fn(model)
        assert "\n" not in str(err.value)
    with pytest.warns(UserWarning, match=r"on the meta device .* nothing was written"):
        assert surgeon.conditioned_init_(model) == 0  # at construction on meta: nothing to write yet


def test_conditioned_init_as_the_init_weights_step():
    """A model class whose init step calls conditioned_init_ comes out of its constructor with exactly the
    weights reinit_ gives the plain model built from the same seed: no second pass in the script."""
    from transformers import LlamaForCausalLM

    config = FAMILIES["llama"].make().config

    class ConditionedLlama(LlamaForCausalLM):
        def init_weights(self):
            super().init_weights()
            self.written = surgeon.conditioned_init_(self, seed=5)

    torch.manual_seed(0)
    conditioned = ConditionedLlama(config)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    surgeon.reinit_(plain, seed=5)
    assert conditioned.written == 6 * config.num_hidden_layers  # q, k, v weights and biases per layer
    assert all(torch.equal(p, dict(plain.named_parameters())[n]) for n, p in conditioned.named_parameters())
    # one attention module at a time (a per-module _init_weights step), keyed by the whole model's names
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    torch.manual_seed(0)
    one = LlamaForCausalLM(config)
    surgeon.reinit_(one, seed=5, layers="1")
    assert surgeon.conditioned_init_(model.model.layers[1].self_attn, model=model, seed=5) == 6
    assert surgeon.conditioned_init_(model.model.layers[1].mlp, model=model, seed=5) == 0
    assert all(torch.equal(p, dict(one.named_parameters())[n]) for n, p in model.named_parameters())
    # the same options as one object
    torch.manual_seed(0)
    by_object = LlamaForCausalLM(config)
    assert surgeon.conditioned_init_(by_object, options=surgeon.ReinitOptions(seed=5, layers="1")) == 6
    assert all(torch.equal(p, dict(one.named_parameters())[n]) for n, p in by_object.named_parameters())


def test_conditioned_init_refuses_other_modes():
    model = FAMILIES["llama"].make()
    with pytest.raises(OptionError, match=r"^conditioned_init_ gives conditioned init; for mode=polar call surgeon"):
        surgeon.conditioned_init_(model, mode="polar")
    with pytest.raises(TypeError, match="unexpected keyword argument 'sed'"):
        surgeon.conditioned_init_(model, sed=5)


def test_trainer_callback_reinitializes_at_train_begin(tmp_path, capsys):
    from transformers import Trainer, TrainingArguments

    from surgeon.integrations.transformers import ReinitCallback

    model = FAMILIES["llama"].make().train()
    data = [{"input_ids": X[i % 2], "labels": X[i % 2]} for i in range(4)]
    callback = ReinitCallback(layers="-1-", seed=3)
    seen = {}

    class Watch(ReinitCallback.__mro__[1]):  # a plain TrainerCallback after ours: the weights at train begin
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            seen["q"] = model.model.layers[1].self_attn.q_proj.weight.detach().clone()
            seen["opt_state"] = len(optimizer.state)

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback, Watch()]).train()
    expected = expected_state(layers="-1-", seed=3)
    assert torch.equal(seen["q"], expected["model.layers.1.self_attn.q_proj.weight"]) and seen["opt_state"] == 0
    assert (
        callback.report is not None
        and "model.layers.1" in str(callback.report)
        and "model.layers.1" in capsys.readouterr().out
    )
    # two real steps moved the re-initialized weights on
    assert not torch.equal(
        model.model.layers[1].self_attn.q_proj.weight, expected["model.layers.1.self_attn.q_proj.weight"]
    )


def test_callback_rejects_unknown_options():
    from surgeon.integrations.transformers import ReinitCallback

    with pytest.raises(OptionError, match="unknown option.*layer\\b"):
        ReinitCallback(layer="0")
    # every keyword reinit_ takes, its own and the options' fields
    ReinitCallback(surgeon.ReinitOptions(seed=1), layers="0", num_heads=4, example_inputs=X, full=True)


def test_callback_with_an_options_object_reinitializes_as_reinit_does(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from surgeon.integrations.transformers import ReinitCallback

    model = FAMILIES["llama"].make()
    callback = ReinitCallback(surgeon.ReinitOptions(layers="0", seed=3), targets="q")
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    state = TrainerState()
    callback.on_train_begin(args, state, TrainerControl(), model=model, optimizer=None)
    expected = expected_state(layers="0", seed=3, targets="q")
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
    assert callback.report is not None and callback.report.options["targets"] == ["q"]


def test_callback_called_without_a_model_says_so(tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from surgeon.integrations.transformers import ReinitCallback

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    callback = ReinitCallback(layers="0")
    with pytest.raises(OptionError, match="without the model"):
        callback.on_train_begin(args, TrainerState(), TrainerControl())
    assert callback.report is None
