"""The README's two set-up commands stay true: CI runs the second, the first's job works."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

from helpers.paths import ROOT


def setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_exactly_two_setup_commands_and_ci_runs_the_second():
    commands = setup_commands()
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()
    assert "pip install torch==2.13.0 &&" in commands[0] and "pip install torch==2.13.0 &&" in commands[1]


def test_first_command_runs_the_main_job(tmp_path):
    job = setup_commands()[0].split(" && ")[-1]
    argv = shlex.split(job)
    assert argv[:2] == ["surgeon", "reinit"]
    argv[argv.index("-o") + 1] = str(tmp_path / "out")
    result = subprocess.run(
        [sys.executable, "-m", "surgeon", *argv[1:]], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "re-initialized: 6 projections in 2 blocks" in result.stdout
    assert re.search(r"encoder\.layer\.1 self +v +all +[\d.]+/[\d.]+/[\d.]+ -> 1\.00/1\.00/1\.00", result.stdout)
    assert (tmp_path / "out" / "model.safetensors").is_file()


MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def test_the_readme_is_a_start_not_the_reference():
    """About 250 lines at most (the reference is the site under docs/), with the three quick starts."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    headings = re.findall(r"^## (Quick start \d)", text, re.M)
    assert headings == ["Quick start 1", "Quick start 2", "Quick start 3"]


def _head_kappas(weight, head_dim: int) -> list[float]:
    """Condition number of each head's rows of a projection, by torch's own SVD (not surgeon's)."""
    import torch

    heads = weight.double().reshape(-1, head_dim, weight.shape[1])
    s = torch.linalg.svdvals(heads)
    return (s[:, 0] / s[:, -1]).tolist()


def test_newcomer_follows_the_quick_starts(tmp_path, minilm_dir):
    """README's three quick starts, verbatim, in a fresh folder: the real MiniLM from a Hub on loopback,
    reset from the command line, fine-tuned with the Trainer, wrapped by PEFT, pushed back to the Hub."""
    import hashlib

    from safetensors.torch import load_file

    from helpers.docs import blocks, environment, run_page
    from helpers.hub import TOKEN
    from helpers.hub_server import HubServer

    readme = blocks(ROOT / "README.md")
    assert [b.how for b in readme].count("run") >= 5  # the quick starts' blocks, not only the set-up ones
    cwd = tmp_path / "work"
    cwd.mkdir()
    with HubServer() as hub:
        hub.add_token(TOKEN, "me")
        hub.add_model(MINILM, minilm_dir)
        printed = run_page(readme, cwd, environment(tmp_path, hub.url, TOKEN), tmp_path / "blocks")

        # 1: the last two layers reset, every other tensor as it was (read with the reference reader)
        before, after = (
            load_file(minilm_dir / "model.safetensors"),
            load_file(cwd / "minilm-reset" / "model.safetensors"),
        )
        assert before.keys() == after.keys()
        changed = {k for k in before if not before[k].equal(after[k])}
        assert changed == {
            f"encoder.layer.{i}.attention.self.{p}.{w}"
            for i in (4, 5)
            for p in ("query", "key", "value")
            for w in ("weight", "bias")
        }
        for i in (4, 5):
            for p in ("query", "key", "value"):
                assert max(_head_kappas(after[f"encoder.layer.{i}.attention.self.{p}.weight"], 32)) < 1 + 1e-4
        assert min(_head_kappas(before["encoder.layer.5.attention.self.query.weight"], 32)) > 1.5

        # 2: the Trainer started from the reset (the trained heads are still near kappa 1, the others not)
        tuned = load_file(cwd / "minilm-finetuned" / "model.safetensors")
        assert max(_head_kappas(tuned["bert.encoder.layer.5.attention.self.query.weight"], 32)) < 1.2
        assert min(_head_kappas(tuned["bert.encoder.layer.0.attention.self.query.weight"], 32)) > 3
        trainer_out, peft_out = (
            out
            for line, out in printed.items()
            if "re-initialized" in out and "python" in [b.lang for b in readme if b.line == line]
        )
        assert "encoder.layer.5" in trainer_out and "encoder.layer.5" in peft_out

        # 3: one private repo holding exactly the files of the reset folder, its card naming the base model
        repo = hub.repos["me/minilm-reset"]
        assert repo.private and len(hub.pushed) == 1
        pushed = {
            p: hashlib.sha256(c).hexdigest() for p, c in hub.files("me/minilm-reset").items() if p != ".gitattributes"
        }
        local = {
            p.relative_to(cwd / "minilm-reset").as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in (cwd / "minilm-reset").rglob("*")
            if p.is_file()
        }
        assert pushed == local
        assert f"base_model: {MINILM}" in hub.files("me/minilm-reset")["README.md"].decode()
