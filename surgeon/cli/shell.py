"""How the ``surgeon`` command talks: one-line errors and the guard around every command, output on stdout,
and the option groups its commands share (made from the core's own fields, spelled by errors.shell_spelling)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from ..errors import OptionError, SurgeonError, opt, spell
from ..errors import shell_spelling as cli_spelling  # how the shell names an option the core names by keyword

if TYPE_CHECKING:
    from ..detect.hints import HintInput, Hints

HINTS_SECTION = "Hints (when config.json does not say)"
HINT_OPTIONS = ("config", "num_heads", "num_kv_heads", "head_dim", "force_hints", "layout")  # reinit's and inspect's
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _fail(message: str, code: int = 1) -> None:
    """An error is one line: no token in it, and no name from a file can start another (surgeon.text.shown)."""
    from ..text.shown import one_line

    click.echo(f"surgeon: error: {one_line(message)}", err=True)
    sys.exit(code)


def _out(text: str) -> None:
    """Reports and notes on stdout, never with a token in them."""
    from ..text.redact import redact

    click.echo(redact(spell(text, cli_spelling)))


full_option = click.option(
    "--full",
    is_flag=True,
    help="Also the kappa and spectral norm of each whole projection (one D x D eigensolve each: "
    "~15 s for D = 4096 on a CPU). Per-head kappas are always computed.",
)


plot_option = click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    metavar="FILE.png",
    help="Also draw, per layer, each head's kappa of q/k/v (before and after, for reinit) into FILE.png (needs matplotlib).",
)


class _Hint(click.ParamType):
    """A head count: ``16``, or one per stack, ``encoder=16,decoder=4`` (read by surgeon.detect.hints)."""

    name = "N|STACK=N,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ..detect.hints import parse_hint

        try:
            return parse_hint(param.name if param else "num_heads", value)
        except OptionError:
            self.fail(f"{value!r} is not a count of 1 or more, nor one per stack (encoder=16,decoder=4)", param, ctx)


HINT = _Hint()


@dataclass(frozen=True)
class ModelFlags:
    """How to read MODEL (the flags of :func:`model_options`), as the Python API's keywords of the same names."""

    revision: str | None
    config: str | None
    hints: Hints
    device: str

    def keywords(self, **replaced: Any) -> dict[str, Any]:
        """The keywords for surgeon.api's functions and verify, with ``replaced`` put in."""
        return {"revision": self.revision, "config": self.config, "hints": self.hints, "device": self.device} | replaced


def model_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Options that tell surgeon how to read the checkpoint, and what its config.json does not say. The command
    gets them as one ``model_flags`` argument (a :class:`ModelFlags`), and ``as_json``."""

    command = fn

    @functools.wraps(command)
    def with_hints(
        *args: Any,
        revision: str | None,
        config: str | None,
        num_heads: HintInput,
        num_kv_heads: HintInput,
        head_dim: HintInput,
        force_hints: bool,
        layout: str | None,
        device: str,
        **kwargs: Any,
    ) -> Any:
        from ..detect.hints import Hints

        hints = Hints(num_heads, num_kv_heads, head_dim, force_hints, layout)  # a layout file is read here
        return command(*args, model_flags=ModelFlags(revision, config, hints, device), **kwargs)

    fn = with_hints
    for decorator in reversed(
        [
            click.option(
                "--revision",
                metavar="REV",
                help="Branch, tag or commit hash of a Hub MODEL (default: its main branch).",
            ),
            click.option(
                "--config",
                "config",
                type=click.Path(dir_okay=False),
                help="config.json to read heads from (default: the one beside the weights).",
            ),
            click.option(
                "--num-heads",
                type=HINT,
                help="Number of query heads, when there is no config.json; one per stack: encoder=16,decoder=4.",
            ),
            click.option(
                "--num-kv-heads",
                type=HINT,
                help="Number of key/value heads (grouped-query attention); may be per stack.",
            ),
            click.option(
                "--head-dim", type=HINT, help="Head dimension, when it is not width / heads; may be per stack."
            ),
            click.option(
                "--force-hints",
                is_flag=True,
                help="Use --num-heads/--num-kv-heads/--head-dim even where config.json says otherwise.",
            ),
            click.option(
                "--layout",
                type=click.Path(dir_okay=False),
                help="A JSON layout file naming your attention projections (see docs/formats.md, and "
                "`surgeon inspect --emit-layout`): its rules are tried before the built-in ones.",
            ),
            click.option(
                "--device",
                default="auto",
                show_default=True,
                help="Where generation and factorizations run: auto, cpu, cuda, cuda:N.",
            ),
            click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout."),
        ]
    ):
        fn = decorator(fn)
    return fn


def reinit_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The fields of surgeon.options.ReinitOptions as --flags, made from their OptionInfo (one spelling). The
    command gets them as one ``options`` argument (a ReinitOptions), as the Python API takes them."""
    from ..options import AS_FIELD, ReinitOptions, option_infos

    names = [name for name, _ in option_infos()]

    @functools.wraps(fn)
    def with_options(*args: Any, recipe: str | None, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in names}
        try:  # read and checked when made: a bad option is one line, before any model is opened or fetched
            options: Any = ReinitOptions.build(**{k: v for k, v in given.items() if v is not None})
            if recipe is not None:  # a recipe holds every step's options: none of them may come as flags too
                from ..plan.planner import read_recipe

                ctx = click.get_current_context()
                typed = [n for n in names if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
                if typed:
                    raise OptionError(f"{opt('recipe', recipe)} holds each step's options: give {opt(typed[0])} there")
                options = read_recipe(recipe)
        except SurgeonError as exc:
            _fail(exc.describe(cli_spelling), exc.exit_code)
        return fn(*args, options=options, **kwargs)

    defaults = ReinitOptions()
    for name, info in reversed(option_infos()):
        default = getattr(defaults, name) if info.shell_default == AS_FIELD else info.shell_default
        flag: dict = {"help": info.help}
        if info.switch:
            flag["is_flag"] = True
        else:
            flag["default"] = default
            flag["show_default"] = default is not None
            if info.choices:
                flag["type"] = click.Choice(list(info.choices))
            elif info.kind is not None:
                flag["type"] = info.kind
            if info.metavar:
                flag["metavar"] = info.metavar
        with_options = click.option(cli_spelling(name, None), name, **flag)(with_options)
    return click.option(
        "--recipe",
        type=click.Path(dir_okay=False),
        metavar="FILE",
        help="Several steps in one pass over the bytes, each with the selection and mode options above, in a .toml "
        "([[step]] tables) or .yaml (steps: a list) file; steps on the same tensor compose in order "
        "(see `surgeon inspect --emit-recipe`).",
    )(with_options)


def _debugging(args: list[str]) -> tuple[list[str], bool]:
    """``args`` without ``--debug`` (accepted anywhere before ``--``), and whether it or SURGEON_DEBUG asks for tracebacks."""
    end = args.index("--") if "--" in args else len(args)
    debug = "--debug" in args[:end] or os.environ.get("SURGEON_DEBUG", "") not in ("", "0")
    return [a for i, a in enumerate(args) if i >= end or a != "--debug"], debug


def _internal_error(exc: Exception, debug: bool) -> None:
    """A bug (an exception no code path expects) is one redacted line too; its traceback only when asked."""
    import traceback

    from ..text.redact import redact
    from ..text.shown import one_line

    if debug:
        click.echo(redact("".join(traceback.format_exception(exc))).rstrip("\n"), err=True)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    what = f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__
    hint = "the traceback is above" if debug else "run with --debug (or SURGEON_DEBUG=1) for the traceback"
    click.echo(one_line(f"surgeon: internal error: {what} (this is a bug: please report it; {hint})"), err=True)
    sys.exit(1)


class OneLineErrors(click.Group):
    """The one guard around every command: bad input ends in one line on stderr and a non-zero exit code, never a
    traceback.

    surgeon's own errors (a SurgeonError) print their message with their exit code; an OSError (disk full,
    permission denied, ... while reading or writing) its reason and file, with 1; an interrupt "interrupted", with
    130. Usage errors (a bad option value, a missing argument, an unknown command) are one line too: click prints a
    usage block and a hint around them; surgeon prints ``surgeon: error: ...`` with the command's ``--help`` to look
    at, and exits 2 as click does. Anything else that escapes a command (a bug, or a third-party library failing in
    a way surgeon does not translate) is one line, redacted, with exit code 1; ``--debug`` or SURGEON_DEBUG=1 adds
    the (redacted) traceback.
    """

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command, its errors turned into one line (inside click's own handling, which would otherwise
        turn an interrupt or a broken pipe into its own output)."""
        try:
            return super().invoke(ctx)
        except SurgeonError as exc:
            _fail(exc.describe(cli_spelling), exc.exit_code)
        except OSError as exc:  # disk full, permission denied, ... while reading or writing
            where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
            _fail(f"{exc.strerror or exc}{where}")
        except KeyboardInterrupt:
            _fail("interrupted; nothing was written", 130)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        from ..text.redact import redact_library_output

        redact_library_output()
        args, debug = _debugging(list(sys.argv[1:] if args is None else args))
        try:
            rv = super().main(args, "surgeon", complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            # bare `surgeon`: the help alone, without click's "Error:" line, and click's exit code for it
            click.echo(exc.ctx.get_help() if exc.ctx else "", err=True)
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            message = " ".join(line.strip() for line in exc.format_message().splitlines() if line.strip())
            path = exc.ctx.command_path if exc.ctx is not None else "surgeon"
            _fail(f"{message[:1].lower()}{message[1:].rstrip('.')} (see {path} --help)", exc.exit_code)
        except click.ClickException as exc:
            _fail(" ".join(exc.format_message().split()), exc.exit_code)
        except click.Abort:
            _fail("interrupted; nothing was written", 130)
        except Exception as exc:  # noqa: BLE001 - the one guard: never a traceback, never a secret
            _internal_error(exc, debug)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


# the push flags besides --push-to-hub -> the PushTarget field each sets
PUSH_SETTINGS = {
    "private": "private",
    "push_branch": "branch",
    "create_pr": "create_pr",
    "commit_message": "commit_message",
    "no_server_copy": "no_server_copy",
    "staging": "staging",
    "keep_other_weights": "keep_other_weights",
}


def push_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--push-to-hub and its companions (surgeon.hub.push.PushTarget's fields). The command gets them as one
    ``push`` argument (a PushTarget, or None), as the Python API takes them."""

    @functools.wraps(fn)
    def with_push(*args: Any, push_to_hub: str | None, **kwargs: Any) -> Any:
        settings = {field: kwargs.pop(flag) for flag, field in PUSH_SETTINGS.items()}
        if push_to_hub is None and all(v is None or v is False for v in settings.values()):
            return fn(*args, push=None, **kwargs)  # no push flag: the push module (70 ms of imports) stays unloaded
        from ..hub.push import PushTarget

        push = PushTarget.build(push_to_hub, **settings)  # checked here, before anything is opened
        return fn(*args, push=push, **kwargs)

    for decorator in reversed(
        [
            click.option(
                "--push-to-hub",
                "push_to_hub",
                metavar="ORG/NAME",
                help="Upload the output folder to this Hub model repo (created if needed) in one commit.",
            ),
            click.option("--private", is_flag=True, help="With --push-to-hub: create the repo as private."),
            click.option(
                "--push-branch",
                metavar="BRANCH",
                help="With --push-to-hub: commit to this branch (created from main if missing).",
            ),
            click.option(
                "--create-pr",
                is_flag=True,
                help="With --push-to-hub: open a pull request against main instead of committing.",
            ),
            click.option(
                "--commit-message", help="With --push-to-hub: the commit message (default: what was re-initialized)."
            ),
            click.option(
                "--no-server-copy",
                is_flag=True,
                help="With --push-to-hub: upload every file, even those a Hub source holds unchanged "
                "(default: copy those server-side from the source's commit).",
            ),
            click.option(
                "--staging",
                metavar="DIR",
                type=click.Path(),
                help="With --push-to-hub and no -o: stage the changed shards and the card in DIR "
                "(default: ./NAME-reinit).",
            ),
            click.option(
                "--keep-other-weights",
                is_flag=True,
                help="With --push-to-hub: keep the repo's files a loader would read instead of or beside the new "
                "weights (another layout, a stale index, shards of another count), with a warning "
                "(default: delete them in the same commit).",
            ),
        ]
    ):
        with_push = decorator(with_push)
    return with_push


SELECTION = ("layers", "targets", "heads", "attention", "stack")


def _how() -> tuple[str, ...]:
    """The options that say how: every field of ReinitOptions but the selection, the modes' parameters included."""
    from ..options import option_infos

    return tuple(name for name, _ in option_infos() if name not in SELECTION)


REINIT_SECTIONS = {  # `surgeon reinit --help`, by what a flag decides
    "Selection (what to re-initialize)": SELECTION,
    "Mode (how)": (*_how(), "recipe"),
    "Output": ("output", "overwrite", "in_place", "dry_run", "as_json", "full", "plot", "device"),
    "Hub": (
        "revision",
        "push_to_hub",
        "private",
        "push_branch",
        "create_pr",
        "commit_message",
        "no_server_copy",
        "staging",
        "keep_other_weights",
        "base_model",
    ),
    HINTS_SECTION: HINT_OPTIONS,
}


def _list_names(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``inspect --list-names``: the q/k/v projection names of the built-in rules, one set a line (no MODEL needed)."""
    if not value or ctx.resilient_parsing:
        return
    from ..detect.families import projection_names

    click.echo("\n".join(projection_names()))
    ctx.exit()


class SectionedCommand(click.Command):
    """A command whose ``--help`` lists its options in named sections (click has one flat list).

    ``sections``: title -> the parameter names (as the command function takes them) it lists, in order. An option
    in no section is listed under "Other options", so none is ever left out of the help.
    """

    def __init__(self, *args: Any, sections: dict[str, tuple[str, ...]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sections = sections

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx) if isinstance(p, click.Option)}
        placed = {name for names in self.sections.values() for name in names}
        titled = [(title, [records.get(n) for n in names]) for title, names in self.sections.items()]
        titled.append(("Other options", [r for n, r in records.items() if n not in placed]))  # -h/--help
        for title, rows in titled:
            shown_rows = [r for r in rows if r is not None]  # hidden options have no record
            if shown_rows:
                with formatter.section(title):
                    formatter.write_dl(shown_rows)
