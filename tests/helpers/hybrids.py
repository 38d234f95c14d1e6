"""Tiny hybrid, gated and latent-attention models built offline, and a forward-level probe.

Every builder is deterministic and returns a float32 causal LM in eval mode whose attention sits in
only some layers (Mamba, convolution, recurrent or linear-attention layers elsewhere), or whose
attention departs from plain q/k/v (Qwen3-Next's gated queries, DeepSeek's latent attention).

``attention_calls(model, modules)`` runs the model's own forward once and returns, per attention
module, the output of each call of it, with that module's hidden-states input replaced by a fixed
Gaussian probe: a changed output then means that module's own weights changed, not those upstream.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers as tf  # noqa: E402

tf.logging.set_verbosity_error()

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48)


def _jamba():
    return tf.JambaForCausalLM(
        tf.JambaConfig(
            **_SMALL,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            mamba_d_state=4,
            mamba_d_conv=2,
            mamba_expand=2,
            mamba_dt_rank=4,
            use_mamba_kernels=False,
        )
    )


def _bamba():
    return tf.BambaForCausalLM(
        tf.BambaConfig(
            **_SMALL,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_indices=[1, 3],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=4,
            mamba_d_conv=2,
            mamba_expand=2,
            mamba_chunk_size=16,
        )
    )


def zamba2(**overrides):  # one shared transformer block, run by layers 1 and 3
    return tf.Zamba2ForCausalLM(
        tf.Zamba2Config(
            **_SMALL,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
            mamba_d_state=4,
            mamba_d_conv=2,
            mamba_expand=2,
            mamba_ngroups=1,
            mamba_headdim=8,
            n_mamba_heads=8,
            num_mem_blocks=1,
            chunk_size=16,
            **overrides,
        )
    )


def _lfm2():
    return tf.Lfm2ForCausalLM(
        tf.Lfm2Config(
            **_SMALL,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
        )
    )


def _recurrent_gemma():
    return tf.RecurrentGemmaForCausalLM(
        tf.RecurrentGemmaConfig(
            **_SMALL,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            lru_width=32,
            attention_window_size=16,
            block_types=["recurrent", "attention", "recurrent"],
            head_dim=8,
        )
    )


def _qwen3_next():  # gated attention: q_proj holds per head [query | gate]
    return tf.Qwen3NextForCausalLM(
        tf.Qwen3NextConfig(
            **_SMALL,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        )
    )


def _deepseek_v3():  # multi-head latent attention, q through a low-rank q_a_proj / q_b_proj
    return tf.DeepseekV3ForCausalLM(
        tf.DeepseekV3Config(
            **_SMALL,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            first_k_dense_replace=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=6,
            n_routed_experts=2,
            num_experts_per_tok=1,
            n_group=1,
            topk_group=1,
        )
    )


def _deepseek_v2():  # multi-head latent attention, q_proj full rank (q_lora_rank None)
    return tf.DeepseekV2ForCausalLM(
        tf.DeepseekV2Config(
            **_SMALL,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            first_k_dense_replace=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=6,
            n_routed_experts=2,
            num_experts_per_tok=1,
            n_group=1,
            topk_group=1,
        )
    )


BUILDERS = {
    "jamba": _jamba,
    "bamba": _bamba,
    "zamba2": zamba2,
    "lfm2": _lfm2,
    "recurrent_gemma": _recurrent_gemma,
    "qwen3_next": _qwen3_next,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v2": _deepseek_v2,
}
# family -> (the attention modules, by layer; the layers without attention)
HYBRIDS = {
    "jamba": ({1: "model.layers.1.self_attn", 3: "model.layers.3.self_attn"}, [0, 2]),
    "bamba": ({1: "model.layers.1.self_attn", 3: "model.layers.3.self_attn"}, [0, 2]),
    # (transformers ties the parameters of the two modules; the checkpoint stores them once, under layer 1)
    "zamba2": (
        {1: "model.layers.1.shared_transformer.self_attn", 3: "model.layers.3.shared_transformer.self_attn"},
        [0, 2],
    ),
    "lfm2": ({1: "model.layers.1.self_attn", 3: "model.layers.3.self_attn"}, [0, 2]),
    "recurrent_gemma": ({1: "model.layers.1.temporal_block"}, [0, 2]),
    "qwen3_next": ({1: "model.layers.1.self_attn", 3: "model.layers.3.self_attn"}, [0, 2]),
}


def build(name: str):
    torch.manual_seed(0)
    return BUILDERS[name]().float().eval()


def load(path):
    return tf.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).float().eval()


def attention_calls(model, modules: list[str], seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """Each call's output of each module in ``modules``, its hidden states replaced by a fixed probe."""
    found = dict(model.named_modules())
    out: dict[str, list[torch.Tensor]] = {m: [] for m in modules}
    handles = []
    for name in dict.fromkeys(modules):
        module = found[name]

        def pre(mod, args, kwargs, name=name):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            g = torch.Generator().manual_seed(seed + len(out[name]))
            probe = torch.randn(x.shape, generator=g, dtype=x.dtype)
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": probe}
            return (probe, *args[1:]), kwargs

        def post(mod, args, output, name=name):
            out[name].append((output[0] if isinstance(output, tuple) else output).detach().clone())

        handles += [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(1, 9).view(1, 8) % model.config.vocab_size, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return out
