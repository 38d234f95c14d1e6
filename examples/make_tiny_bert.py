"""Build examples/tiny-bert: the small checkpoint the README's first command runs on.

A randomly initialized BERT (2 layers, 4 heads, width 64) saved with transformers, so it is a real
Hugging Face model folder (config.json + model.safetensors) of about 300 KB. Re-run to rebuild:

    python examples/make_tiny_bert.py
"""

from pathlib import Path

import torch
from transformers import BertConfig, BertModel

HERE = Path(__file__).parent


def main() -> None:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    model = BertModel(config)
    for name, param in model.named_parameters():  # non-zero biases, as a trained model has
        if name.endswith("bias"):
            torch.nn.init.normal_(param, std=0.02)
    model.save_pretrained(HERE / "tiny-bert")
    print(f"wrote {HERE / 'tiny-bert'}")


if __name__ == "__main__":
    main()
