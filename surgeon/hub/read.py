"""Reading a Hub model by id into the HF cache: which files, from where, what went wrong."""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    CheckpointError,
    HubNotFoundError,
    HubOfflineError,
    OptionError,
    SurgeonError,
    opt,
)
from ..formats.registry import (
    DATA_SUFFIXES,
    EXPORT_SUFFIXES,
    OTHER_FORMAT_SUFFIXES,
    WEIGHT_SUFFIXES,
    is_weight,
    pick_weights,
)
from ..open.hub_ids import HF_PREFIX, check_commit, check_revision, hf_progress, parse_repo_id
from ..open.source import Source, open_source
from ..text.redact import remember
from .failures import few, is_connection_error, read_error
from .http import use_policy
from .remote import remote_layout

if TYPE_CHECKING:
    from huggingface_hub import HfApi

    from ..formats.safetensors import SafetensorsWeights

# --- reading -----------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """A Hub model resolved to a commit, with the files surgeon fetched into the HF cache."""

    repo_id: str
    revision: str  # as asked for, "main" by default
    commit: str
    path: Path
    files: list[str]
    skipped_weights: list[str] = field(default_factory=list)  # other formats of the same weights, not fetched
    cache_only: str | None = None  # why the Hub was not asked, when it was not
    remote: tuple[list[str], str | None] | None = None  # safetensors left on the Hub, read by Range: (files, index)


def _not_there(text: str, repo_id: str) -> str:
    """A path whose first part is a local folder is a local path: it is not there; the near names in that folder."""
    import difflib

    path = Path(text)
    near = (
        difflib.get_close_matches(path.name, [p.name for p in path.parent.iterdir()], n=1)
        if path.parent.is_dir()
        else []
    )
    did = f" (did you mean {path.parent / near[0]}?)" if near else ""
    return f"no such file or folder: {text}{did}; {path.parts[0]}/ is a local folder (hf://{repo_id} for the Hub model)"


def open_model(
    model: str | Path,
    *,
    config: str | Path | None = None,
    revision: str | None = None,
    progress: bool = False,
    recover: bool = False,
    whole: bool = False,
) -> Source:
    """Open MODEL: a local path when one exists by that name, otherwise a Hub id (``org/name`` or ``hf://org/name``).

    ``recover``: roll back an interrupted in-place run on a local checkpoint first (see ``source.open_source``).
    A Hub model's safetensors stay on the Hub, their headers read by Range (:mod:`surgeon.hub.remote`) and a shard fetched
    the first time a writer needs it; ``whole`` (or offline): every weight file is fetched now."""
    revision = check_revision(revision)  # before anything else sees it: it becomes a path in the HF cache
    text = str(model)
    explicit = isinstance(model, str) and text.startswith(HF_PREFIX)
    repo_id = parse_repo_id(text) if isinstance(model, str) else None
    if explicit and repo_id is None:
        raise OptionError(f"{text!r} is not a Hub model id: write hf://org/name")
    if not explicit and repo_id is not None and not Path(text).exists() and Path(repo_id.split("/")[0]).is_dir():
        raise CheckpointError(_not_there(text, repo_id))  # `minilm/model.safetensor` beside a folder minilm/
    if not explicit and (repo_id is None or Path(text).exists()):
        if revision is not None:
            hint = f"; for the Hub model of that name write hf://{repo_id}" if repo_id else ""
            raise OptionError(
                f"{opt('revision')} applies to Hugging Face Hub ids only, and {text} is a local path{hint}"
            )
        source = open_source(model, config=config, recover=recover)
        if repo_id is not None and _in_cache(repo_id):  # only where the Hub model of that name has been used here
            kind = "folder" if Path(text).is_dir() else "file"
            used = f"{text} is a local {kind}, so it was used (write hf://{repo_id} for the Hub model of that name)"
            source = replace(source, notes=(*source.notes, used))
        return source
    assert repo_id is not None
    try:
        snap = download(repo_id, revision=revision, progress=progress, remote=not whole)
    except (HubNotFoundError, HubOfflineError) as exc:
        if not explicit and revision is None:  # it may as well be a mistyped path: say there is none
            exc.context = f"there is no file or folder {text}, and "
        raise
    try:
        weights = None if snap.remote is None else _open_remote(repo_id, snap, revision)
        source = open_source(snap.path, config=config, weights=weights)
    except CheckpointError as exc:
        raise CheckpointError(f"Hub model {repo_id}: {exc}") from None
    where = f"the HF cache ({snap.cache_only}, nothing downloaded)" if snap.cache_only else "the HF cache"
    kept = "" if weights is None else f", the headers of its {len(weights.files)} safetensors files read by HTTP Range"
    read = (
        f"read {repo_id} from the Hugging Face Hub, revision {snap.revision} (commit {snap.commit[:12]}): "
        f"{len(snap.files) - len(weights.files if weights else [])} files in {where} at {snap.path}{kept}"
    )
    skipped = (
        [f"not fetched (same weights in another format): {few(snap.skipped_weights)}"] if snap.skipped_weights else []
    )
    return replace(
        source,
        hub_id=repo_id,
        hub_revision=revision,
        hub_commit=snap.commit,
        notes=(*source.notes, read, *skipped),
    )


def _open_remote(repo_id: str, snap: Snapshot, revision: str | None) -> SafetensorsWeights:
    """The Hub model's safetensors, their headers read by Range at the snapshot's commit."""
    from .remote import RemoteRepo, open_remote

    assert snap.remote is not None
    try:
        return open_remote(snap.path, RemoteRepo(repo_id, snap.commit), *snap.remote)
    except SurgeonError:
        raise
    except Exception as exc:  # the client's errors, as for a download
        raise read_error(exc, repo_id, revision, False) from None


def _in_cache(repo_id: str) -> bool:
    """Whether the HF cache holds anything of the Hub model ``repo_id`` (no network)."""
    from huggingface_hub import constants

    return (Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}").is_dir()


def download(repo_id: str, *, revision: str | None = None, progress: bool = False, remote: bool = False) -> Snapshot:
    """Resolve ``repo_id`` at ``revision`` and fetch the files surgeon needs (from the cache when there);
    ``remote``: safetensors weights are left on the Hub (``Snapshot.remote``) when it can be reached.

    Offline (HF_HUB_OFFLINE) or when the Hub cannot be reached, the cache is used as it is, without the
    client's retries: a cached model opens at once, an uncached one fails with one line.
    """
    from huggingface_hub import HfApi, constants, get_token, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = constants.is_offline_mode() if hasattr(constants, "is_offline_mode") else constants.HF_HUB_OFFLINE
    remember(get_token())  # the read path's token, masked like the push path's
    use_policy()  # every request below, the client's included, runs under the Hub HTTP policy
    api = HfApi()
    try:
        info, reachable = None, not offline
        if reachable:
            try:  # one request, no retries: the commit and every file of the repo
                info = api.model_info(repo_id, revision=revision)
            except Exception as exc:
                if not is_connection_error(exc):
                    raise
                reachable = False
        # records branch -> commit in the cache (refs/), which is what offline runs resolve with later
        resolved = _resolve_revision(api, repo_id, revision, info if reachable else None)
        check_commit(resolved.resolved, repo_id)  # the answer (or the cache's refs/ file) names a snapshot folder
        if info is not None and info.sha != resolved.resolved:  # the branch moved in between
            info = api.model_info(repo_id, revision=resolved.resolved)
        if info is not None:
            files, complete = [s.rfilename for s in info.siblings or []], True
        else:
            files, complete = _cached_files(repo_id, resolved)
        wanted, skipped = pick_files(files)
        if not any(is_weight(f) for f in wanted):
            if not complete:
                raise LocalEntryNotFoundError(f"the cached snapshot of {repo_id} holds no weights")
            raise CheckpointError(
                f"Hub model {repo_id} (revision {resolved}) has no weights surgeon reads at its top level "
                f"(safetensors, PyTorch .bin/.pt or .onnx); it has {few(files) or 'no files'}"
            )
        layout = remote_layout(wanted) if remote and info is not None else None
        fetched = [f for f in wanted if layout is None or f not in layout[0]]
        with hf_progress(progress):
            path = snapshot_download(
                repo_id,
                revision=resolved.resolved if isinstance(resolved, _Resolved) else resolved,  # pinned either way
                allow_patterns=[glob.escape(f) for f in fetched],
                local_files_only=not reachable,
            )
    except SurgeonError:
        raise
    except Exception as exc:  # every client error becomes one typed line; anything else is a bug
        raise read_error(exc, repo_id, revision, offline) from None
    cache_only = (
        "HF_HUB_OFFLINE is set" if offline else None if reachable else f"{constants.ENDPOINT} could not be reached"
    )
    return Snapshot(
        repo_id, str(resolved), resolved.resolved, Path(path), wanted, skipped, cache_only=cache_only, remote=layout
    )


class _Resolved(str):
    """A revision as asked for (its string value, "main" by default) with the commit it resolved to, as
    huggingface_hub 2.0's ``ResolvedRevision`` is."""

    resolved: str

    def __new__(cls, initial: str | None, commit: str) -> _Resolved:
        made = super().__new__(cls, initial or "main")
        made.resolved = commit
        return made


def _resolve_revision(api: HfApi, repo_id: str, revision: str | None, info: Any) -> Any:
    """The revision with the commit it points to (``.resolved``). ``info``: the Hub's answer when it was
    reached (None: resolve from the cache's refs/ only). Records branch -> commit in the cache's refs/, which
    is what offline runs resolve with later."""
    if hasattr(api, "resolve_revision"):  # huggingface_hub 2.0+
        return api.resolve_revision(repo_id, revision=revision, local_files_only=info is None)
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    from .._compat import cache_commit_hash, repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    if revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision):
        return _Resolved(revision, revision)
    ref = revision or "main"
    if info is not None:
        try:  # best effort, as the client does: a read-only cache still downloads
            cache_commit_hash(str(storage), ref, info.sha)
        except OSError:
            pass
        return _Resolved(revision, info.sha)
    ref_file = storage / "refs" / ref  # the revision was checked (check_revision): it cannot walk out of refs/
    if ref_file.is_file():
        return _Resolved(revision, ref_file.read_text().strip())
    raise LocalEntryNotFoundError(f"no commit of {repo_id} at {ref} in the cache's refs/")


def _cached_files(repo_id: str, resolved: Any) -> tuple[list[str], bool]:
    """Without the Hub: the repo's files from the cached listing (complete, True), or else the files an
    earlier download (surgeon, transformers, ...) left in the cached snapshot folder (False)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    from .._compat import CachedRepoTreeNotFoundError, get_cached_repo_tree, repo_folder_name

    if get_cached_repo_tree is not None:  # huggingface_hub 2.0+ caches the repo's listing
        try:
            return [f.path for f in get_cached_repo_tree(repo_id, revision=resolved)], True
        except CachedRepoTreeNotFoundError:
            pass
    snapshot = (
        Path(constants.HF_HUB_CACHE)
        / repo_folder_name(repo_id=repo_id, repo_type="model")
        / "snapshots"
        / resolved.resolved
    )
    if snapshot.is_dir():
        return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()), False
    raise LocalEntryNotFoundError(f"no files of {repo_id} at {resolved.resolved} in the cache")


# Weights in formats surgeon does not rewrite. A top-level folder holding weights (onnx/, openvino/,
# coreml/, checkpoint-500/) is another copy or export of the model and is left out whole, except the
# numbered module folders of sentence-transformers (1_Pooling/, 2_Dense/): those belong to the model.
_OTHER_WEIGHTS = OTHER_FORMAT_SUFFIXES + DATA_SUFFIXES + EXPORT_SUFFIXES
_ST_MODULE = re.compile(r"\d+_\w+")
_TOKENIZER_NAMES = {"vocab.txt", "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json"}


def pick_files(files: list[str]) -> tuple[list[str], list[str]]:
    """The files to fetch for re-initialization, and weight files skipped as other copies of the same weights.

    Weights: one format, the one ``source.open_source`` would read first (safetensors, else PyTorch,
    else ONNX), top level only. Also configs (``*.json``), tokenizer files, custom code (``*.py``, needed
    by ``auto_map`` configs), chat templates, the model card (README.md) and sentence-transformers module
    folders; never other formats of the weights or folders of exports and checkpoints.
    """
    top = [f for f in files if "/" not in f]
    weights = pick_weights(top)
    exports = {
        f.split("/", 1)[0]
        for f in files
        if "/" in f
        and (is_weight(f) or f.endswith(_OTHER_WEIGHTS) or ".mlpackage/" in f)
        and not _ST_MODULE.fullmatch(f.split("/", 1)[0])
    }
    chosen = set(weights)
    for f in files:
        name, folder = f.rsplit("/", 1)[-1], f.split("/", 1)[0] if "/" in f else ""
        if folder in exports or name.endswith(".index.json"):
            continue
        if _ST_MODULE.fullmatch(folder) or name.endswith(".json"):
            chosen.add(f)
        elif not folder and (
            name.startswith("tokenizer")
            or name in _TOKENIZER_NAMES
            or name.endswith((".model", ".tiktoken", ".py", ".jinja"))
            or name == "README.md"
        ):
            chosen.add(f)
    chosen -= {f for f in top if f.endswith(_OTHER_WEIGHTS + WEIGHT_SUFFIXES) and f not in weights}
    skipped = [f for f in top if (is_weight(f) or f.endswith(".index.json")) and f not in chosen]
    return sorted(chosen), skipped
