"""The Python API on models in memory: ``surgeon.reinit_(model)`` and ``surgeon.inspect(model)``.

The same plan, engine and report as the checkpoint path (:mod:`surgeon.api`): same options, same
defaults and, for the same seed, the same weights as ``reinit_checkpoint`` on the model's saved file.
Weights change in place under ``torch.no_grad()``, on the device and in the dtype they live in
(computed in float64 on that device, stored back in the parameter's own dtype).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .compute.distributed import (
    any_sharded,
    inspect_sharded,
    refuse_meta,
    refuse_tensor_parallel,
    unwrapped,
    write_params,
)
from .compute.engine import Engine, inspect_blocks
from .detect.hints import HintInput, Hints
from .detect.module import ModuleDetection, detect_module
from .errors import OptionError, opt
from .modes import get_mode
from .options import ReinitOptions
from .plan.planner import Plan, prepare
from .report.report import Report
from .vocab.spectrum import ProjectionRow


def reinit_(
    module: nn.Module,
    *,
    options: ReinitOptions | None = None,
    num_heads: HintInput = None,
    num_kv_heads: HintInput = None,
    head_dim: HintInput = None,
    example_inputs: Any = None,
    full: bool = False,
    **keywords: Any,
) -> Report:
    """Re-initialize the chosen query/key/value projections of ``module`` in place.

    Args:
        module: The model (or any module holding attention), on any device; DDP, torch.compile and PEFT
            wrappers are looked through.
        options: What to re-initialize and how (default: the conditioned reset of every layer).
        num_heads: Query heads, where the module does not say (one count, or one per stack).
        num_kv_heads: Key/value heads (grouped-query attention), where the module does not say.
        head_dim: Head size, where it is not width / heads.
        example_inputs: A tensor, a tuple of arguments or a dict of keyword arguments for ``module(...)``;
            needed only for a custom module whose forward cannot be called with a (batch, tokens, width) tensor.
        full: Also measure each whole projection's kappa and spectral norm.
        **keywords: Fields of :class:`ReinitOptions` (``layers="0-11"``, ``seed=1``, ...), replacing
            those of ``options``.

    Returns:
        The report: the blocks found and each projection's condition numbers before and after.

    Raises:
        OptionError: An option is out of range, or ``module`` is not a module surgeon can change in place.
        NoAttentionFoundError: No attention projection was found.
        TypeError: A keyword is not an option.
    """
    _check(module, "reinit_")
    chosen = ReinitOptions.build(options, **keywords)
    start = time.perf_counter()
    hints = Hints(num_heads, num_kv_heads, head_dim)
    with _detected(module, hints, example_inputs) as (inner, found):
        plan, engine, device = _change_in_place(inner, found, chosen, full)
        leave_record(inner, plan, hints)
    return _reinit_report(module, found, plan, engine, device, start)


# Where a reset in memory leaves its record: the model's config, which save_pretrained, Trainer.save_model and
# push_to_hub write as config.json (a model loaded from it carries it on); the Hub tags go on the model's
# ``model_tags``, which transformers puts in the card it writes. A model never reset gets neither.
CONFIG_KEY = "surgeon"
TRAINED = "reset in memory; the weights saved with this record are those of the model when it was saved"


def leave_record(model: nn.Module, plan: Plan, hints: Hints, *, after: str = TRAINED) -> None:
    """Add what this reset did to ``model.config`` (a list: one entry per reset) and surgeon's tags to the model's;
    ``after``: what the record says came after it."""
    import sys

    config = getattr(model, "config", None)
    loaded = sys.modules.get("transformers")  # a transformers config is only there where transformers is loaded
    config_class = getattr(loaded, "PreTrainedConfig", None) or getattr(loaded, "PretrainedConfig", None)
    if config_class is None or not isinstance(config, config_class):  # nothing saves a record with the weights
        return
    from .modes import get_mode
    from .report.card import TAG, reproduce_command

    base = _base(config)
    where = base.get("repo") or base.get("model") or "MODEL"
    record = {
        **plan.record(),
        "base": base,
        "reproduce": reproduce_command(
            where, revision=base.get("commit"), options=plan.options.to_dict(), hints=hints, output="RESET"
        ),
        "after": after,
    }
    earlier = getattr(config, CONFIG_KEY, None)
    setattr(config, CONFIG_KEY, [*(earlier if isinstance(earlier, list) else []), record])
    add_tags = getattr(model, "add_model_tags", None)
    if callable(add_tags):
        add_tags([TAG, get_mode(plan.options.mode).tag])


def _base(config: Any) -> dict:
    """What the model was loaded from, by its config: a Hub id and commit, or a local file's name and sha256
    (a local path is not published); {} for a model built in memory."""
    from .open.hub_ids import parse_repo_id

    name = str(getattr(config, "_name_or_path", "") or "")
    if not name:
        return {}
    path = Path(name)
    if path.exists():
        weights = path if path.is_file() else _weights_file(path)
        found = {"model": path.name}
        if weights is None:
            return found
        return {**found, "file": weights.relative_to(path.parent).as_posix(), "sha256": sha256_file(weights)}
    if parse_repo_id(f"hf://{name}") == name:
        commit = getattr(config, "_commit_hash", None) or _cached_commit(name)
        return {"repo": name, **({"commit": commit} if isinstance(commit, str) else {})}
    return {"model": path.name}


def _cached_commit(repo_id: str) -> str | None:
    """The commit of ``repo_id``'s main in the Hub cache (what from_pretrained loaded), if it is there."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # a malformed cache entry: the record names the repo without a commit
        return None
    return Path(found).parent.name if isinstance(found, str) else None


def sha256_file(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _after(record: dict) -> str:
    after = record.get("after")
    return "trained" if after == TRAINED or not isinstance(after, str) else after


def _weights_file(folder: Path) -> Path | None:
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        if (folder / name).is_file():
            return folder / name
    return None


def reset_records(model: Any) -> list[dict]:
    """The records the resets in memory of ``model`` (or of the model it was loaded from) left on its config."""
    config = getattr(model, "config", None)
    found = getattr(config, CONFIG_KEY, None) if config is not None else None
    return [r for r in found if isinstance(r, dict)] if isinstance(found, list) else []


def mark_trained(model: Any, how: str) -> None:
    """Say in the last reset record of ``model`` how it was trained since."""
    records = reset_records(model)
    if records:
        records[-1]["after"] = how


def lineage_card(model: Any, *, trained: str | None = None) -> str | None:
    """A model card (README.md text) for a model reset in memory and trained since: its base model, surgeon's
    tags, what the reset did and the command that makes the reset point again. None for a model never reset.

    Args:
        model: The model (its config carries the records :func:`reinit_` left).
        trained: How it was trained since (default: the record's words).
    """
    from huggingface_hub import ModelCardData, constants

    from .modes import get_mode
    from .report.card import TAG

    records = reset_records(model)
    if not records:
        return None
    last = records[-1]
    base, options = last.get("base") or {}, last.get("options") or {}
    repo = base.get("repo")
    mode = str(options.get("mode", "conditioned"))
    tags = list(dict.fromkeys([TAG, get_mode(mode).tag, *(getattr(model, "model_tags", None) or [])]))
    data = ModelCardData(base_model=repo, tags=tags, library_name="transformers")
    if repo:
        commit = f" (commit `{base['commit'][:12]}`)" if base.get("commit") else ""
        origin = f"[`{repo}`]({constants.ENDPOINT.rstrip('/')}/{repo}){commit}"
    elif base.get("model"):
        origin = f"`{base.get('file', base['model'])}`" + (
            f" (sha256 `{base['sha256']}`)" if base.get("sha256") else ""
        )
    else:
        origin = "a model built in memory"
    layers = sorted({b.get("layer") for b in last.get("blocks", []) if isinstance(b.get("layer"), int)})
    body = "\n".join(
        [
            "# Fine-tuned after an attention reset",
            "",
            f"Reset from {origin} by surgeon {last.get('version')}: the attention query/key/value projections of "
            f"{len(last.get('blocks', []))} block{'s' if len(last.get('blocks', [])) != 1 else ''} (layers {', '.join(map(str, layers)) or '-'}) re-initialized "
            f"({last.get('method')}, mode `{mode}`, seed {options.get('seed')}, targets "
            f"`{','.join(options.get('targets') or [])}`); then {trained or _after(last)}.",
            "",
            "The reset point, made again from the base model (the same weights, byte for byte):",
            "",
            "```bash",
            str(last.get("reproduce")),
            "```",
            "",
            "What training changed since the reset: `surgeon diff RESET THIS-FOLDER`.",
            "",
            "The full record is the `surgeon` entry of `config.json`.",
            "",
        ]
    )
    return f"---\n{data.to_yaml()}\n---\n\n{body}"


def _change_in_place(
    inner: nn.Module, found: ModuleDetection, options: ReinitOptions, full: bool
) -> tuple[Plan, Engine, torch.device]:
    """Plan on the detected blocks and write the new heads into ``found``'s parameters."""
    plan = prepare(
        found.blocks,
        options,
        config=getattr(inner, "config", None),
        shapes={n: tuple(p.shape) for n, p in found.params.items()},
        depths=found.depths,
        draw_keys=found.seed_names,
    )
    options = plan.options
    device = found.params[plan.changes[0].projection.weight.tensor].device
    engine = Engine(plan, device, whole=full)
    if any_sharded(found.params, engine.tensor_names) and not get_mode(options.mode).sharded:  # FSDP2 / DTensor
        raise OptionError(
            f"{opt('mode', options.mode)} on sharded (FSDP2/DTensor) parameters is not supported: reinit before sharding"
        )
    write_params(engine, found.params)
    return plan, engine, device


def _reinit_report(
    module: nn.Module, found: ModuleDetection, plan: Plan, engine: Engine, device: torch.device, start: float
) -> Report:
    rows = engine.ordered_results()
    seconds = time.perf_counter() - start
    notes = [*_notes(found), *plan.notes] + [
        f"changed {len(engine.tensor_names)} parameters in place in {seconds:.2f} s on {device}"
    ]
    return Report(
        "reinit",
        _label(module),
        _describe(module),
        found.blocks,
        tuple(rows),
        options=plan.options.to_dict(),
        seconds=seconds,
        device=str(device),
        notes=tuple(notes),
    )


def inspect_module(
    module: nn.Module,
    *,
    num_heads: HintInput = None,
    num_kv_heads: HintInput = None,
    head_dim: HintInput = None,
    example_inputs: Any = None,
    full: bool = False,
) -> Report:
    """The attention blocks of ``module`` and the condition numbers of their projections; changes nothing.

    Args:
        module: The model (or any module holding attention); wrappers as for :func:`reinit_`.
        num_heads: Query heads, where the module does not say.
        num_kv_heads: Key/value heads, where the module does not say.
        head_dim: Head size, where it is not width / heads.
        example_inputs: Arguments for ``module(...)``, as for :func:`reinit_`.
        full: Also measure each whole projection's kappa and spectral norm.

    Returns:
        The report: the blocks found and each projection's condition numbers.

    Raises:
        OptionError: ``module`` is not a module surgeon can read (e.g. on the meta device).
        NoAttentionFoundError: No attention projection was found.
    """
    _check(module, "inspect")
    start = time.perf_counter()
    with _detected(module, Hints(num_heads, num_kv_heads, head_dim), example_inputs) as (_, found):
        first = found.params[found.blocks[0].q.weight.tensor]
        if any_sharded(found.params, found.params):
            spectra = inspect_sharded(found.blocks, found.params, first.device, whole=full)
        else:
            with torch.no_grad():
                spectra = inspect_blocks(
                    found.blocks, lambda name: found.params[name].detach(), first.device, whole=full
                )
    rows = [
        ProjectionRow(
            block,
            proj.role,
            spectra[(block.module, proj.role)],
            dtype=str(found.params[proj.weight.tensor].dtype).removeprefix("torch."),
        )
        for block in found.blocks
        for proj in block.projections
    ]
    return Report(
        "inspect",
        _label(module),
        _describe(module),
        found.blocks,
        tuple(rows),
        seconds=time.perf_counter() - start,
        device=str(first.device),
        notes=tuple(_notes(found)),
    )


def inspect(model: nn.Module | str | Path, /, **options: Any) -> Report:
    """Inspect a model in memory or a checkpoint; changes nothing.

    Args:
        model: A module (:func:`inspect_module`), or a path or Hub id (:func:`surgeon.api.inspect_checkpoint`).
        **options: The keywords of the function it goes to.

    Returns:
        The report: the blocks found and each projection's condition numbers.

    Raises:
        SurgeonError: As the function it goes to raises.
    """
    if isinstance(model, nn.Module):
        return inspect_module(model, **options)
    from .api import inspect_checkpoint

    return inspect_checkpoint(model, **options)


def reinit(model: str | Path, /, **options: Any) -> Report:
    """Re-initialize a checkpoint into a new one (:func:`surgeon.api.reinit_checkpoint`).

    A model in memory is changed in place by :func:`reinit_` instead; the trailing underscore says so.

    Args:
        model: A checkpoint path or Hub id.
        **options: The keywords of :func:`surgeon.api.reinit_checkpoint` (``options=``, ``output=``,
            ``layers=``, ...).

    Returns:
        The report.

    Raises:
        OptionError: ``model`` is a module (use :func:`reinit_`).
        SurgeonError: As :func:`surgeon.api.reinit_checkpoint` raises.
    """
    if isinstance(model, nn.Module):
        raise OptionError(
            "surgeon.reinit writes a new checkpoint from a path or Hub id; to change a model in memory, call surgeon.reinit_(model, ...)"
        )
    from .api import reinit_checkpoint

    return reinit_checkpoint(model, **options)


@contextmanager
def _detected(module: nn.Module, hints: Hints, example_inputs: Any) -> Iterator[tuple[nn.Module, ModuleDetection]]:
    """The model inside ``module``'s wrappers (DDP, torch.compile, PEFT: LoRA bases in place) and its blocks."""
    with unwrapped(module) as inner:
        yield inner, detect_module(inner, hints=hints, example_inputs=example_inputs)


def _check(module: Any, fn: str) -> None:
    if not isinstance(module, nn.Module):
        other = "surgeon.reinit(path)" if fn == "reinit_" else "surgeon.inspect(path)"
        raise OptionError(
            f"surgeon.{fn} takes a torch.nn.Module, not {type(module).__name__}; for a checkpoint path or Hub id use {other}"
        )
    refuse_meta(module, fn)
    refuse_tensor_parallel(module, fn)


def _label(module: nn.Module) -> str:
    return f"{type(module).__name__} (in memory)"


def _describe(module: nn.Module) -> str:
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters() if p.is_floating_point()})
    devices = sorted({str(p.device) for p in module.parameters()})
    return f"nn.Module, {'/'.join(dtypes) or 'no float parameters'} on {'/'.join(devices)}"


def _notes(found: ModuleDetection) -> list[str]:
    notes = list(found.notes)
    by_route: dict[str, int] = {}
    for route in found.routes.values():
        by_route[route] = by_route.get(route, 0) + 1
    if by_route.get("forward"):
        notes.append(
            f"layout of {by_route['forward']} block(s) read from the module's own forward (which rows reach q, k and v)"
        )
    return notes
