"""The surgeon command run in-process, and the judge of a refused command line."""

from __future__ import annotations

from pathlib import Path

from helpers.digests import tree_digest


class Cli:
    """Runs the real click command in-process and keeps stdout and stderr apart."""

    def __call__(self, *args: str, ok: bool = True):
        from click.testing import CliRunner

        from surgeon.cli.commands import main

        result = CliRunner().invoke(main, [str(a) for a in args])
        if ok and result.exit_code != 0:
            raise AssertionError(
                f"surgeon {' '.join(map(str, args))} failed ({result.exit_code}):\n{result.stderr}\n{result.output}"
            )
        return result


def expect_cli_error(cli, folder: Path, *args, match: str) -> str:
    """One line on stderr, a non-zero exit, no traceback, nothing written or changed under ``folder``."""
    before = tree_digest(folder)
    result = cli(*args, ok=False)
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("surgeon: error: "), lines[0]
    assert "Traceback" not in result.stderr + result.output
    assert match in lines[0], lines[0]
    assert tree_digest(folder) == before
    return lines[0]
