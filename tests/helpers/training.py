"""A real transformers Trainer run on a tiny model: the output folder a fine-tune leaves (the model saved by
``trainer.save_model`` beside ``checkpoint-N/`` folders with optimizer, scheduler and RNG state, and logs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from helpers.tiny import tiny_llama

# Two token sequences the tiny Llama (vocabulary 96) learns to repeat.
SEQUENCES = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29], [2, 6, 10, 14, 18, 22, 26, 30]])


def train(model: Any, output_dir: Path, *, steps: int = 3, save_steps: int = 2, callbacks: list | None = None) -> Any:
    """Train ``model`` a few steps with the Trainer, saving a checkpoint every ``save_steps`` into ``output_dir``,
    then ``trainer.save_model()`` there, as a fine-tuning script does. Returns the trainer."""
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": SEQUENCES[i % 2], "labels": SEQUENCES[i % 2]} for i in range(8)]
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="steps",
        save_steps=save_steps,
        logging_steps=1,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model.train(), args=args, train_dataset=data, callbacks=callbacks or [])
    trainer.train()
    trainer.save_model()
    trainer.save_state()  # trainer_state.json beside the model, as example scripts do
    return trainer


def trainer_output(output_dir: Path) -> Path:
    """A fine-tuned tiny Llama's Trainer output folder, with a training log beside it."""
    train(tiny_llama(), output_dir)
    (output_dir / "train.log").write_text("step 1 loss 4.5\n")
    return output_dir
