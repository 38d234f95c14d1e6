"""Tiny random transformer checkpoints, built offline from transformers configs.

Every factory is deterministic (``torch.manual_seed`` inside), returns a float32
model in ``eval()`` mode and builds in well under a second.  Sizes are tiny
(hidden 32-64, 2-3 layers, vocab <= 128) but keep ``head_dim >= 4``; where the
family supports it the config uses grouped-query attention
(``num_key_value_heads < num_attention_heads``), attention biases, and for
Gemma a ``head_dim`` that is *not* ``hidden_size // num_attention_heads``.
transformers initialises biases to zero, so ``_build`` re-draws every bias
from N(0, 0.05^2) (deterministically) to make bias handling observable.

``FAMILIES[name].make()`` builds a model; ``FAMILIES[name].load(path)`` reloads
one saved with ``save_pretrained(path)`` through the matching ``AutoModel*``
class (offline: the directory holds everything).

All requested families build with the installed transformers (5.24), so none
is left out.  Notes on the ones that needed care:

* ``swin``: builds offline from ``SwinConfig`` alone (no hub access needed);
  ``image_size=32, patch_size=2, window_size=4``, two stages (dims 16 and 32).
* ``gpt_bigcode``: ``multi_query=True`` is the only KV-sharing option it has
  (one key/value head for all query heads).
* ``phi3``: a fused ``qkv_proj`` laid out ``[Q (H*d) | K (KV*d) | V (KV*d)]``.
* ``falcon_*``: ``FalconLinear`` projections; ``bias=True`` so the biases are
  exercised, rotary position embeddings (``alibi=False``, the default).
* ``mpt``: ALiBi (the default) and ``clip_qkv=None`` (clipping would be a
  non-linearity between the projection and the attention product).
* ``modernbert``: alternating global/local (sliding window) layers, rotary.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSpeechSeq2Seq,
)

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

SEED = 0
VOCAB = 96


@dataclass(frozen=True)
class Family:
    name: str
    make: Callable[[], transformers.PreTrainedModel]
    encoder_decoder: bool = False
    # ``AutoModel*`` class used to reload a saved checkpoint of this family.
    auto_class: type = field(default=AutoModel, repr=False)

    def load(self, path) -> transformers.PreTrainedModel:
        """Reload a model of this family saved with ``save_pretrained(path)``."""
        model = self.auto_class.from_pretrained(str(path), local_files_only=True)
        return model.float().eval()


def _build(model_cls, config, seed: int = SEED):
    torch.manual_seed(seed)
    model = model_cls(config)
    # transformers initialises biases to zero; give them random values so that
    # bias handling is actually exercised (and visible when re-initialised).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.05)
    return model.float().eval()


# --------------------------------------------------------------------- decoders


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        attention_bias=True,
    )
    return _build(transformers.LlamaForCausalLM, cfg)


def _mistral():
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        sliding_window=64,
    )
    return _build(transformers.MistralForCausalLM, cfg)


def _qwen2():
    # Qwen2 always has q/k/v biases (and no o_proj bias).
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    return _build(transformers.Qwen2ForCausalLM, cfg)


def _gemma():
    # head_dim=12 while hidden/heads = 48/4 = 12 would coincide -> use 16.
    cfg = transformers.GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        attention_bias=True,
    )
    return _build(transformers.GemmaForCausalLM, cfg)


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=48,
        n_layer=2,
        n_head=4,
        n_positions=128,
    )
    return _build(transformers.GPT2LMHeadModel, cfg)


def _gpt_neox():
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        rotary_pct=0.5,
        max_position_embeddings=128,
        attention_bias=True,
    )
    return _build(transformers.GPTNeoXForCausalLM, cfg)


def _bloom():
    cfg = transformers.BloomConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        n_layer=2,
        n_head=4,
    )
    return _build(transformers.BloomForCausalLM, cfg)


def _falcon(**kw):
    def make():
        cfg = transformers.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=8,
            max_position_embeddings=128,
            bias=True,
            alibi=False,
            **kw,
        )
        return _build(transformers.FalconForCausalLM, cfg)

    return make


def _mpt():
    cfg = transformers.MptConfig(
        vocab_size=VOCAB,
        d_model=48,
        n_layers=2,
        n_heads=4,
        expansion_ratio=2,
        max_seq_len=128,
    )
    return _build(transformers.MptForCausalLM, cfg)


def _phi3():
    cfg = transformers.Phi3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _build(transformers.Phi3ForCausalLM, cfg)


def _opt():
    cfg = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        ffn_dim=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=48,
        max_position_embeddings=128,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )
    return _build(transformers.OPTForCausalLM, cfg)


def _gptj():
    cfg = transformers.GPTJConfig(
        vocab_size=VOCAB,
        n_embd=48,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        n_positions=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _build(transformers.GPTJForCausalLM, cfg)


def _gpt_bigcode():
    cfg = transformers.GPTBigCodeConfig(
        vocab_size=VOCAB,
        n_embd=48,
        n_layer=2,
        n_head=4,
        n_positions=128,
        multi_query=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _build(transformers.GPTBigCodeForCausalLM, cfg)


# --------------------------------------------------------------------- encoders


def _modernbert():
    cfg = transformers.ModernBertConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=128,
        global_attn_every_n_layers=2,
        local_attention=16,
        attention_bias=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    return _build(transformers.ModernBertModel, cfg)


def _bert_kwargs():
    return dict(
        vocab_size=VOCAB,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=128,
    )


def _bert():
    return _build(transformers.BertModel, transformers.BertConfig(**_bert_kwargs()))


def _roberta():
    cfg = transformers.RobertaConfig(**_bert_kwargs(), pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return _build(transformers.RobertaModel, cfg)


def _distilbert():
    cfg = transformers.DistilBertConfig(
        vocab_size=VOCAB,
        dim=48,
        n_layers=2,
        n_heads=4,
        hidden_dim=96,
        max_position_embeddings=128,
    )
    return _build(transformers.DistilBertModel, cfg)


def _vit():
    cfg = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
    )
    return _build(transformers.ViTModel, cfg)


def _swin(depths=(2, 1)):
    cfg = transformers.SwinConfig(
        image_size=32,
        patch_size=2,
        num_channels=3,
        embed_dim=16,
        depths=list(depths),
        num_heads=[2, 4],
        window_size=4,
        mlp_ratio=2.0,
    )
    return _build(transformers.SwinModel, cfg)


def _clip_text():
    cfg = transformers.CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        projection_dim=32,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    return _build(transformers.CLIPTextModel, cfg)


# ------------------------------------------------------------- encoder-decoder


def _t5():
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=48,
        d_kv=8,  # inner dim 4*8 = 32 != d_model (48)
        d_ff=96,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return _build(transformers.T5ForConditionalGeneration, cfg)


def _bart():
    cfg = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=48,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
        max_position_embeddings=128,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
    )
    return _build(transformers.BartForConditionalGeneration, cfg)


def _whisper():
    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=16,
        d_model=48,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
        max_source_positions=32,
        max_target_positions=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    return _build(transformers.WhisperForConditionalGeneration, cfg)


_CLM = AutoModelForCausalLM

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("llama", _llama, auto_class=_CLM),
        Family("mistral", _mistral, auto_class=_CLM),
        Family("qwen2", _qwen2, auto_class=_CLM),
        Family("gemma", _gemma, auto_class=_CLM),
        Family("gpt2", _gpt2, auto_class=_CLM),
        Family("gpt_neox", _gpt_neox, auto_class=_CLM),
        Family("bloom", _bloom, auto_class=_CLM),
        Family("falcon_new", _falcon(new_decoder_architecture=True, num_kv_heads=2), auto_class=_CLM),
        Family("falcon_mqa", _falcon(new_decoder_architecture=False, multi_query=True), auto_class=_CLM),
        Family("falcon_mha", _falcon(new_decoder_architecture=False, multi_query=False), auto_class=_CLM),
        Family("mpt", _mpt, auto_class=_CLM),
        Family("modernbert", _modernbert),
        Family("phi3", _phi3, auto_class=_CLM),
        Family("opt", _opt, auto_class=_CLM),
        Family("gptj", _gptj, auto_class=_CLM),
        Family("bert", _bert),
        Family("roberta", _roberta),
        Family("distilbert", _distilbert),
        Family("vit", _vit),
        Family("t5", _t5, encoder_decoder=True, auto_class=AutoModelForSeq2SeqLM),
        Family("bart", _bart, encoder_decoder=True, auto_class=AutoModelForSeq2SeqLM),
        Family("whisper", _whisper, encoder_decoder=True, auto_class=AutoModelForSpeechSeq2Seq),
        Family("clip_text", _clip_text),
        Family("swin", _swin),
        Family("gpt_bigcode", _gpt_bigcode, auto_class=_CLM),
    ]
}

__all__ = ["Family", "FAMILIES"]
