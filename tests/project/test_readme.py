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
