"""Start-up cost: the CLI and the path up to the first byte copy never import torch.

`surgeon --help` must answer at once, and `surgeon reinit` starts copying bytes while torch loads;
both depend on these modules staying torch-free at import time.
"""

from __future__ import annotations

import subprocess
import sys

from helpers.paths import ROOT

TORCH_FREE = [
    "surgeon",
    "surgeon.cli.commands",
    "surgeon.api",
    "surgeon.open.source",
    "surgeon.plan.planner",
    "surgeon.options",
    "surgeon.report.report",
    "surgeon.write.output",
    "surgeon.write.staging",
    "surgeon.cli.shell",
    "surgeon.compute.per_file",
    "surgeon.write.carry_out",
    "surgeon.write.checkpoint_report",
    "surgeon.write.journal",
    "surgeon.formats.journal_file",
    "surgeon.open.recovery",
    "surgeon.files.locks",
    "surgeon.errors",
    "surgeon.open.hub_ids",
    "surgeon.hub.read",
    "surgeon.hub.push",
    "surgeon.hub.push_result",
    "surgeon.hub.failures",
    "surgeon.detect",
    "surgeon.detect.by_name",
    "surgeon.detect.config",
    "surgeon.detect.hints",
    "surgeon.detect.latent",
    "surgeon.detect.refusals",
    "surgeon.detect.families",
    "surgeon.vocab.config_keys",
    "surgeon.detect.placement",
    "surgeon.formats.registry",
    "surgeon.formats.safetensors",
    "surgeon.formats.torchfile",
]


def test_cli_and_planning_modules_do_not_import_torch():
    code = (
        "import importlib, sys\n"
        + "".join(f"importlib.import_module({m!r})\n" for m in TORCH_FREE)
        + (
            "bad = sorted(m for m in ('torch', 'numpy', 'onnx', 'transformers') if m in sys.modules)\n"
            "assert not bad, bad\n"
        )
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_help_and_version_run_without_torch():
    code = (
        "import sys\nfrom click.testing import CliRunner\nfrom surgeon.cli.commands import main\n"
        "for args in (['--help'], ['--version'], ['reinit', '--help'], ['inspect', '--help']):\n"
        "    assert CliRunner().invoke(main, args).exit_code == 0, args\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_dry_run_plans_without_torch(tmp_path):
    code = (
        "import sys\nfrom surgeon import reinit_checkpoint\n"
        f"r = reinit_checkpoint('examples/tiny-bert', output={str(tmp_path / 'out')!r}, dry_run=True)\n"
        "assert len(r.rows) == 6 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(ROOT))


def test_every_public_name_resolves():
    """Each name of ``surgeon.__all__`` is loaded on first use from the module its table names."""
    import surgeon

    missing = [name for name in surgeon.__all__ if getattr(surgeon, name, None) is None]
    assert missing == []
    from surgeon.open.recovery import recover

    assert surgeon.recover is recover
