"""The ``surgeon`` command: a thin shell over :mod:`surgeon.api`."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

import click

from .._version import __version__
from ..errors import OptionError
from ..text.shown import note_lines, shown
from .shell import (
    CONTEXT,
    HINT_OPTIONS,
    HINTS_SECTION,
    REINIT_SECTIONS,
    OneLineErrors,
    SectionedCommand,
    _list_names,
    _out,
    cli_spelling,
    full_option,
    model_options,
    plot_option,
    push_options,
    reinit_options,
)

if TYPE_CHECKING:
    from ..hub.push import PushTarget
    from ..options import Recipe, ReinitOptions
    from ..report.report import Report
    from .shell import ModelFlags

__all__ = ["cli_spelling", "main"]

# The commands import surgeon.api (and through it torch) when they run, so that --help and
# --version answer at once.


def _show(report: Report, *, plot: str | None, as_json: bool) -> None:
    """Print ``report`` (as JSON, or its table), after drawing its plot where one is asked for."""
    if plot:
        from dataclasses import replace

        from ..report.plot import plot_kappas

        report = replace(report, notes=(*report.notes, f"wrote {plot_kappas(report, plot)}"))
    _out(report.to_json(cli_spelling) if as_json else report.render(cli_spelling))


@click.group(cls=OneLineErrors, context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="surgeon")
@click.option(
    "--debug",
    is_flag=True,
    help="On an internal error, show its traceback (also SURGEON_DEBUG=1). Accepted after the command too.",
)
def main(debug: bool) -> None:
    """Re-initialize the attention of transformer checkpoints with conditioned initialization.

    Per head: semi-orthogonal query and key, rectangular-identity value, so every condition
    number is 1 (Saratchandran & Lucey, "Conditioned Initialization for Attention").
    Reads and writes safetensors (single or sharded), PyTorch state dicts, ONNX models (.onnx,
    embedded or with external data; attention found by walking the graph) and model folders;
    every tensor it does not re-initialize is left byte for byte as it was.
    """


INSPECT_SECTIONS = {  # `surgeon inspect --help`, grouped as reinit's
    "What to report": ("full", "jacobian", "inputs", "verify_layout", "emit_layout", "list_names"),
    "Output": ("as_json", "plot", "device"),
    "Hub": ("revision",),
    HINTS_SECTION: HINT_OPTIONS,
}


@main.command(
    cls=SectionedCommand,
    sections=INSPECT_SECTIONS,
    context_settings=CONTEXT,
    epilog="""\b
Examples:
  surgeon inspect model.safetensors
  surgeon inspect ./my-model --json > report.json
  surgeon inspect encoder.pt --num-heads 8
  surgeon inspect model.onnx                                       # an ONNX export (graph walked)
  surgeon inspect sentence-transformers/all-MiniLM-L6-v2           # a Hugging Face Hub model
  surgeon inspect org/model --revision v1.0                        # at a branch, tag or commit
  surgeon inspect ./my-model --verify-layout                       # names vs the real forward
  surgeon inspect ./my-model --emit-layout layout.json             # the layout found, to edit
  surgeon inspect ./my-model --layout layout.json                  # your projection names
  surgeon inspect ./model-reinit --emit-recipe recipe.toml         # the recipe of a surgeon output
""",
)
@click.argument("model")
@click.option(
    "--list-names",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_list_names,
    help="List the projection names surgeon recognizes (a layout file names others) and exit.",
)
@click.option(
    "--emit-layout",
    type=click.Path(dir_okay=False),
    help="Write the detected layout (the rules that matched, heads, head size) as a layout file for --layout.",
)
@click.option(
    "--emit-recipe",
    type=click.Path(dir_okay=False),
    help="MODEL being a surgeon output: write the recipe its record holds (its steps, or its one run) as a TOML "
    "file for reinit --recipe, to replay or edit the run.",
)
@click.option(
    "--verify-layout",
    is_flag=True,
    help="Build the architecture from config.json with transformers (random init, no download) and check "
    "that its forward uses the q/k/v rows that names say.",
)
@click.option(
    "--jacobian",
    is_flag=True,
    help="Build the architecture from config.json, load these weights, run real inputs and report, per layer, "
    "the terms of the paper's Theorem 3.1 bound on the attention Jacobian's kappa (exact kappa(J) when small).",
)
@click.option(
    "--inputs",
    type=click.Path(dir_okay=False, exists=True),
    help="With --jacobian: text lines (tokenized with the model's tokenizer) or a .pt tensor of token ids. "
    "Default: a built-in English sample.",
)
@plot_option
@model_options
@full_option
def inspect(
    model: str,
    emit_layout: str | None,
    emit_recipe: str | None,
    verify_layout: bool,
    jacobian: bool,
    inputs: str | None,
    plot: str | None,
    model_flags: ModelFlags,
    full: bool,
    as_json: bool,
) -> None:
    """List the attention blocks of MODEL and the condition numbers of their projections.

    MODEL is a .safetensors/.bin/.pt/.onnx file, a sharded *.index.json, a model folder, or a Hugging
    Face Hub id org/name (a local path of the same name wins; write hf://org/name for the Hub).
    ONNX: blocks are found by walking the graph; stacks and layers come from the exporter's scopes.
    """
    from .. import api

    report = api.inspect_checkpoint(
        model,
        **model_flags.keywords(),
        full=full,
        progress=not as_json and sys.stderr.isatty(),
        verify_layout=verify_layout,
        jacobian=jacobian,
        inputs=inputs,
        emit_layout=emit_layout,
        emit_recipe=emit_recipe,
    )
    _show(report, plot=plot, as_json=as_json)


@main.command(
    cls=SectionedCommand,
    sections=REINIT_SECTIONS,
    context_settings=CONTEXT,
    epilog="""\b
Examples:
  surgeon reinit model.safetensors --layers 0-11
  surgeon reinit ./bert --layers -2- -o ./bert-top2-reset          # the last two layers
  surgeon reinit ./llama --targets q,k --heads 0-7 --seed 1
  surgeon reinit ./t5 --attention cross --stack decoder
  surgeon reinit model.onnx --layers -2- -o out.onnx               # ONNX: out.onnx (+ out.onnx.data)
  surgeon reinit ./model --mode polar --strength 0.5 --keep-scale   # halve log-kappa, keep scale
  surgeon reinit ./model --strength 0.3                             # 30% of the way to a fresh draw
  surgeon reinit ./model --layers -4- --strength 0.2:1              # a per-layer ramp, softest first
  surgeon reinit ./tuned --mode restore --from ./base --layers 0-3  # layers 0-3 back to ./base's
  surgeon reinit ./model --recipe recipe.toml                       # several steps in one pass
  surgeon reinit model.safetensors --dry-run                        # print the plan only
  surgeon reinit org/model --revision v1.0 -o ./model-reset         # read a Hub model at a tag
  surgeon reinit org/model --push-to-hub me/model-reset --private   # then publish the output
  surgeon reinit ./bert --push-to-hub org/bert-reset --create-pr    # as a pull request
\b
Layer and head specs: all, N, A-B (inclusive), A- (to the last), lists like 0,3,5-7;
negative numbers count from the end (-1 is the last). Each stack of layers is numbered from 0.
""",
)
@click.argument("model")
@click.option(
    "-o",
    "--output",
    type=click.Path(),
    help="Output file (file input; an .onnx with external data writes its data files beside it) or folder "
    "(folder input, or a path without .onnx for an .onnx with external data). Default: beside the input.",
)
@reinit_options
@click.option("--overwrite", is_flag=True, help="Replace an existing output.")
@click.option(
    "--in-place",
    is_flag=True,
    help="Change the input itself. safetensors: only the changed bytes are rewritten, after their old bytes are "
    "saved to a journal (an interrupted run is rolled back by `surgeon recover` or the next --in-place run; "
    "other commands refuse the checkpoint until then); "
    "other formats: the files are replaced atomically.",
)
@click.option("--dry-run", is_flag=True, help="Print the plan and write nothing.")
@click.option(
    "--base-model",
    metavar="ORG/NAME",
    help="The Hub model a local MODEL comes from: the model card's base_model and first line name it "
    "(default: the base_model of MODEL's own card).",
)
@plot_option
@push_options
@model_options
@full_option
def reinit(
    model: str,
    output: str | None,
    overwrite: bool,
    in_place: bool,
    dry_run: bool,
    base_model: str | None,
    plot: str | None,
    push: PushTarget | None,
    model_flags: ModelFlags,
    full: bool,
    as_json: bool,
    options: ReinitOptions | Recipe,
) -> None:
    """Re-initialize query/key/value projections of MODEL with conditioned initialization.

    Writes a new checkpoint in the same format and layout; every tensor that is not
    re-initialized keeps its bytes. Prints condition numbers before and after. A folder
    output also gets a model card (README.md): what was done, the condition numbers, the
    command to reproduce it, and the source's own card below.

    MODEL is a file (.safetensors, .bin/.pt, .onnx), an *.index.json, a model folder or a Hub id
    org/name (--revision picks its branch, tag or commit). The Hub token comes from HF_TOKEN or
    `hf auth login`. ONNX: only initializer bytes change; a shared initializer that must change is
    given to the chosen projections as a copy of their own (the report says so).
    """
    from .. import api
    from ..write.ranks import under_torchrun

    distributed = under_torchrun()  # every rank of torchrun runs this command: each writes its share

    if plot and dry_run:
        raise OptionError("--plot draws the condition numbers before and after, and a --dry-run computes none")
    from ..options import Recipe

    recipe, one = (options, None) if isinstance(options, Recipe) else (None, options)
    report = api.reinit_checkpoint(
        model,
        options=one,
        recipe=recipe,
        **model_flags.keywords(),
        output=output,
        in_place=in_place,
        overwrite=overwrite,
        dry_run=dry_run,
        push=push,
        full=full,
        progress=not as_json and sys.stderr.isatty() and not distributed,
        distributed=distributed,
        base_model=base_model,
    )
    if distributed and os.environ.get("RANK", "0") != "0":
        return  # rank 0 prints the report (and draws the plot) for all ranks
    _show(report, plot=plot, as_json=as_json)


@main.command(
    context_settings=CONTEXT,
    epilog="""\b
Examples:
  surgeon push ./llama-reinit me/llama-reinit
  surgeon push ./llama-reinit org/llama-reinit --private
  surgeon push ./llama-reinit org/llama-reinit --branch reset-v2     # to a branch
  surgeon push ./llama-reinit org/llama-reinit --create-pr           # as a pull request
  surgeon push ./llama-reinit org/llama-reinit --dry-run             # the files it would upload
  surgeon push ./finetuned me/finetuned --exclude '*.onnx'           # leave out more
  surgeon push ./finetuned me/finetuned --include 'checkpoint-500/*' # only these files
\b
The token comes from HF_TOKEN or `hf auth login`; HF_ENDPOINT selects another Hub.
""",
)
@click.argument("folder", type=click.Path(file_okay=False))
@click.argument("repo_id", metavar="ORG/NAME")
@click.option("--private", is_flag=True, help="Create the repo as private (an existing repo keeps its visibility).")
@click.option("--branch", metavar="BRANCH", help="Commit to this branch, created from main if missing (default: main).")
@click.option("--create-pr", is_flag=True, help="Open a pull request against main instead of committing.")
@click.option("--commit-message", help="The commit message (default: Upload FOLDER with surgeon VERSION).")
@click.option(
    "--no-server-copy",
    is_flag=True,
    help="Upload every file, even those the Hub model FOLDER was made from holds unchanged "
    "(default: copy those server-side from its commit).",
)
@click.option(
    "--keep-other-weights",
    is_flag=True,
    help="Keep the repo's files a loader would read instead of or beside FOLDER's weights (another layout, a "
    "stale index, shards of another count), with a warning (default: delete them in the same commit).",
)
@click.option(
    "--include",
    multiple=True,
    metavar="GLOB",
    help="Push only the files matching GLOB (repeatable; as in `hf upload`), in place of the default: the model's "
    "files, without checkpoint-*/, optimizer, scheduler and RNG state, training_args.bin and logs.",
)
@click.option("--exclude", multiple=True, metavar="GLOB", help="Leave out the files matching GLOB (repeatable).")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the files that would be uploaded, copied, deleted and left out, and where, and send nothing.",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was pushed as JSON on stdout.")
def push(
    folder: str,
    repo_id: str,
    private: bool,
    branch: str | None,
    create_pr: bool,
    commit_message: str | None,
    no_server_copy: bool,
    keep_other_weights: bool,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    dry_run: bool,
    as_json: bool,
) -> None:
    """Upload the model in FOLDER (an output of surgeon reinit, a fine-tuned model) to the Hub model repo ORG/NAME.

    Creates the repo if needed and uploads the model's files in one commit, large files through
    the Hub client's large-file path, and prints the files uploaded. What training leaves beside
    a model (Trainer checkpoints, optimizer, scheduler and RNG state, training_args.bin, logs) is
    left out, with a note naming it and its size (--include / --exclude choose). Only the folder's own
    files go: a link that leads out of it is refused, and so is a folder that is part of a
    model (the staging folder of a push by changes). A folder made from a Hub model names
    it and its commit in its record: the files it holds unchanged are copied server-side
    from there, not uploaded. Files of the repo that a loader would read instead of or
    beside the new weights are deleted in the same commit; after it, what the repo holds is
    checked file by file. If the push stops part-way, running it again sends only what is
    missing and commits.
    """
    from ..hub.push import push_folder

    result = push_folder(
        folder,
        repo_id,
        private=private,
        branch=branch,
        create_pr=create_pr,
        commit_message=commit_message,
        progress=not as_json and sys.stderr.isatty(),
        dry_run=dry_run,
        server_copy=not no_server_copy,
        keep_other_weights=keep_other_weights,
        include=list(include) or None,
        exclude=list(exclude) or None,
    )
    if as_json:
        _out(json.dumps(result.to_dict(), indent=2))
    else:
        _out("\n".join([*note_lines(result.notes), result.summary(), *result.listing()]))


@main.command(
    context_settings=CONTEXT,
    epilog="""\b
Examples:
  surgeon verify model.safetensors model.reinit.safetensors
  surgeon verify ./bert ./bert-reinit                 # a folder output (PyTorch: the record is in README.md)
  surgeon verify model.onnx model.reinit.onnx --json
  surgeon verify encoder.safetensors out.safetensors --num-heads 8   # the hints the run needed
  surgeon verify ./tuned ./tuned-restored --from ./base               # a restore from a checkpoint on disk
\b
Exit status: 0 verified, 3 OUTPUT differs from what its record says, 1 cannot verify (no record, a
malformed one, bad input, or another surgeon version's output whose draws differ: the line names the version).
""",
)
@click.argument("original")
@click.argument("output", type=click.Path())
@click.option(
    "--from",
    "from_",
    metavar="SOURCE",
    help="For an output of --mode restore from a checkpoint on disk: that checkpoint (its files must have the "
    "sha256 digests the record names; a Hub SOURCE is read from the Hub at the recorded commit).",
)
@model_options
def verify(original: str, output: str, from_: str | None, model_flags: ModelFlags, as_json: bool) -> None:
    """Check that OUTPUT is exactly what surgeon made from ORIGINAL, by the record surgeon wrote in it.

    Every file of a folder output must be one surgeon writes (carried-over files byte for byte, nothing
    added), an ONNX graph the original's node for node, every tensor outside the recorded selection
    byte-identical, and every re-initialized one what the recipe gives (re-derived byte for byte from
    the seed; in polar mode within one ulp of the dtype, semi-orthogonal with strength 1). Prints a
    one-line verdict; at the first mismatch, says what differs and exits non-zero.
    """
    from ..audit import verify as check

    device = "cpu" if model_flags.device == "auto" else model_flags.device
    result = check(original, output, from_=from_, **model_flags.keywords(device=device))
    _out(json.dumps(result.to_dict(), indent=2) if as_json else result.summary())


@main.command(
    context_settings=CONTEXT,
    epilog="""\b
Examples:
  surgeon diff ./reset ./finetuned             # what fine-tuning changed since the reset
  surgeon diff org/model ./resaved             # did the loader re-initialize something?
  surgeon diff ./reset ./finetuned --json
\b
Exit status: 0 whether or not they differ; 1 when A or B cannot be read.
""",
)
@click.argument("a")
@click.argument("b")
@model_options
def diff(a: str, b: str, model_flags: ModelFlags, as_json: bool) -> None:
    """Compare checkpoints A and B tensor by tensor: identical or changed (and how much).

    For each attention projection that changed (found in A as inspect finds it), each head's
    relative change ||B - A|| / ||A|| and its condition number in A and in B. The options
    say how to read A.
    """
    from ..audit.diff import diff as compare

    result = compare(a, b, **model_flags.keywords())
    _out(json.dumps(result.to_dict(), indent=2) if as_json else str(result))


@main.command(
    context_settings=CONTEXT,
    epilog="""\b
Examples:
  surgeon recover model.safetensors
  surgeon recover ./llama                      # a sharded checkpoint folder
  surgeon recover model.safetensors --json     # what was done, as JSON
\b
Until then every other command refuses the checkpoint; `surgeon reinit --in-place` on the same
checkpoint rolls back first, and says so.
""",
)
@click.argument("path", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print what was recovered as JSON on stdout.")
def recover(path: str, as_json: bool) -> None:
    """Roll back an interrupted `surgeon reinit --in-place` on the checkpoint at PATH.

    --in-place saves the old bytes of every range it patches to a journal
    (.NAME.surgeon-journal) before changing anything; this checks that the journal belongs
    to the files as they are now (same files, headers, and every range holding its old or its
    new bytes), then writes them back, so the checkpoint is exactly as it was before that run.
    A journal that fails a check is refused and left in place. Does nothing if there is no journal.
    """
    from ..open.recovery import recover_journals

    done = recover_journals(path)
    notes = [d.note() for d in done]
    if as_json:
        _out(json.dumps({"path": path, "journals": [d.to_dict() for d in done], "notes": notes}, indent=2))
    else:
        _out("\n".join(note_lines(notes)) if notes else shown(f"nothing to recover at {path}"))


if __name__ == "__main__":
    main()
