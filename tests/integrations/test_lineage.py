"""A reset in memory travels with the model: the record on its config (config.json once saved), the tags, and the
card the Trainer callback writes; its reproduce command makes the reset point again, byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

import surgeon
from surgeon import __version__

from helpers.cli import Cli
from helpers.hub import build_cache
from helpers.tiny import tiny_llama
from helpers.training import train

ROOT = str(Path(surgeon.__file__).parents[1])


def base_folder(tmp_path):
    folder = tmp_path / "base"
    tiny_llama().save_pretrained(folder)
    return folder


def test_a_trainer_run_after_the_reset_saves_the_record_and_the_card(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from surgeon.integrations.transformers import ReinitCallback

    base = base_folder(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(base)
    seen = {}

    class Watch(ReinitCallback.__mro__[1]):  # the weights just after the reset, before any step
        def on_train_begin(self, args, state, control, model=None, **kw):
            seen.update({k: v.detach().clone() for k, v in model.state_dict().items()})

    out = tmp_path / "finetuned"
    train(model, out, callbacks=[ReinitCallback(layers="1", seed=5), Watch()])
    (record,) = json.loads((out / "config.json").read_text())["surgeon"]
    assert record["base"] == {
        "model": "base",
        "file": "base/model.safetensors",
        "sha256": hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest(),
    }
    assert record["version"] == __version__ and record["options"]["seed"] == 5
    assert record["options"]["mode"] == "conditioned" and [b["layer"] for b in record["blocks"]] == [1]
    assert record["after"] == "trained 3 steps with the transformers Trainer"
    card = (out / "README.md").read_text()
    assert "- surgeon\n" in card and "- conditioned-initialization\n" in card
    assert "sha256 `" + record["base"]["sha256"] in card and record["reproduce"] in card and "then trained 3" in card
    # the command in the record makes the reset point again: the weights as they were when training began
    monkeypatch.chdir(tmp_path)
    args = shlex.split(record["reproduce"])
    assert args[:3] == ["surgeon", "reinit", "base"]
    Cli()(*args[1:])
    reset = load_file(tmp_path / "RESET" / "model.safetensors")
    assert all(torch.equal(reset[k], seen[k]) for k in reset)
    # verify says how to compare it with its reset point
    refused = Cli()("verify", "base", "finetuned", ok=False)
    assert refused.exit_code == 1 and f"`{record['reproduce']}`" in refused.stderr
    assert "`surgeon diff RESET finetuned`" in refused.stderr
    # a model loaded from the fine-tuned folder carries the record on
    again = AutoModelForCausalLM.from_pretrained(out)
    assert surgeon.lineage_card(again) is not None


def test_a_model_from_the_hub_cache_names_its_base_model_and_commit(tmp_path):
    """from_pretrained("org/tiny") from the HF cache (a fresh process: HF_HOME is read at import)."""
    source = base_folder(tmp_path)
    commit = build_cache(tmp_path / "home", "org/tiny", {p.name: p.read_bytes() for p in source.iterdir()})
    script = (
        "import json, surgeon\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained('org/tiny')\n"
        "surgeon.reinit_(model, layers='0', seed=1)\n"
        "model.save_pretrained('saved')\n"
        "print(json.dumps({'card': surgeon.lineage_card(model), 'tags': model.model_tags}))\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    said = json.loads(run.stdout.strip().splitlines()[-1])
    (record,) = json.loads((tmp_path / "saved" / "config.json").read_text())["surgeon"]
    assert record["base"] == {"repo": "org/tiny", "commit": commit}
    assert record["reproduce"].startswith(f"surgeon reinit org/tiny --revision {commit} --layers=0 ")
    assert "base_model: org/tiny\n" in said["card"] and f"(commit `{commit[:12]}`)" in said["card"]
    assert said["tags"] == ["surgeon", "conditioned-initialization"]


def test_a_model_never_reset_gets_nothing_of_surgeon(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "plain")
    assert "surgeon" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert surgeon.lineage_card(model) is None and not model.model_tags


def test_conditioned_init_at_construction_leaves_its_record_on_the_config(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from surgeon.integrations.init_hooks import CONSTRUCTED

    class ConditionedLlama(LlamaForCausalLM):
        def init_weights(self):
            super().init_weights()
            surgeon.conditioned_init_(self, seed=0)

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
    model = ConditionedLlama(config)
    model.save_pretrained(tmp_path / "built")
    (record,) = json.loads((tmp_path / "built" / "config.json").read_text())["surgeon"]
    assert record["after"] == CONSTRUCTED and record["base"] == {} and record["options"]["seed"] == 0
    assert [b["layer"] for b in record["blocks"]] == [0, 1] and model.model_tags == [
        "surgeon",
        "conditioned-initialization",
    ]
