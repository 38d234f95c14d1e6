"""Models on the Hugging Face Hub: read them by id, push re-initialized folders back.

Reading resolves ``org/name`` (at a revision) with huggingface_hub into the shared HF cache and
opens the snapshot folder like a local model folder. Only what surgeon needs is fetched: the weights
in one format (safetensors when the repo has them), configs, tokenizer files, custom code and the
model card. Everything the client reads from the environment applies: HF_HOME / HF_HUB_CACHE,
HF_ENDPOINT, HF_HUB_OFFLINE and HF_TOKEN.

Pushing creates the repo (and branch) when needed and uploads a folder in one commit; large files go
through the client's own large-file path (Xet, or LFS where Xet is off). Tokens are passed to the
client and nowhere else: no message, card, report or file written by surgeon contains one.
"""

from __future__ import annotations

import glob
import re
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ._version import __version__
from .errors import (  # noqa: F401  (the Hub errors are also importable from here)
    CheckpointError,
    HubAccessError,
    HubAuthError,
    HubError,
    HubNotFoundError,
    HubOfflineError,
    OptionError,
    PushError,
    SurgeonError,
    opt,
)
from .formats.registry import OTHER_FORMAT_SUFFIXES, WEIGHT_SUFFIXES, is_weight, pick_weights
from .redact import redact, remember
from .source import Source, open_source

HF_PREFIX = "hf://"


# --- ids ---------------------------------------------------------------------------------------

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
# `sub/model.safetensors` that does not exist is a mistyped path, not a Hub id.
_PATH_SUFFIXES = WEIGHT_SUFFIXES + (".json", ".h5", ".gguf", ".msgpack")


def parse_repo_id(text: str) -> str | None:
    """``org/name`` (or ``hf://org/name``) when ``text`` is shaped like a Hub model id, else None."""
    name = text.removeprefix(HF_PREFIX).removeprefix("models/") if text.startswith(HF_PREFIX) else text
    if not _REPO_ID.fullmatch(name) or ".." in name or "--" in name or name.endswith((".", "-", "_")):
        return None
    if not text.startswith(HF_PREFIX) and name.lower().endswith(_PATH_SUFFIXES):
        return None
    return name


def _require_repo_id(text: str, what: str) -> str:
    repo_id = parse_repo_id(text if text.startswith(HF_PREFIX) else HF_PREFIX + text)
    if repo_id is None:
        raise OptionError(f"{what} {text!r} is not a Hub repository id: write it as org/name (letters, digits, '-', '_', '.')")
    return repo_id


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


def open_model(model: str | Path, *, config: str | Path | None = None, revision: str | None = None, progress: bool = False) -> Source:
    """Open MODEL: a local path when one exists by that name, otherwise a Hub id (``org/name`` or ``hf://org/name``)."""
    text = str(model)
    explicit = isinstance(model, str) and text.startswith(HF_PREFIX)
    repo_id = parse_repo_id(text) if isinstance(model, str) else None
    if explicit and repo_id is None:
        raise OptionError(f"{text!r} is not a Hub model id: write hf://org/name")
    if not explicit and (repo_id is None or Path(text).exists()):
        if revision is not None:
            hint = f"; for the Hub model of that name write hf://{repo_id}" if repo_id else ""
            raise OptionError(f"{opt('revision')} applies to Hugging Face Hub ids only, and {text} is a local path{hint}")
        source = open_source(model, config=config)
        if repo_id is not None and _in_cache(repo_id):  # only where the Hub model of that name has been used here
            kind = "folder" if Path(text).is_dir() else "file"
            source.notes.append(f"{text} is a local {kind}, so it was used (write hf://{repo_id} for the Hub model of that name)")
        return source
    assert repo_id is not None
    try:
        snap = download(repo_id, revision=revision, progress=progress)
    except (HubNotFoundError, HubOfflineError) as exc:
        if not explicit and revision is None:  # it may as well be a mistyped path: say there is none
            exc.context = f"there is no file or folder {text}, and "
        raise
    try:
        source = open_source(snap.path, config=config)
    except CheckpointError as exc:
        raise CheckpointError(f"Hub model {repo_id}: {exc}") from None
    source.hub_id, source.hub_revision, source.hub_commit = repo_id, revision, snap.commit
    where = f"the HF cache ({snap.cache_only}, nothing downloaded)" if snap.cache_only else "the HF cache"
    source.notes.append(
        f"read {repo_id} from the Hugging Face Hub, revision {snap.revision} (commit {snap.commit[:12]}): "
        f"{len(snap.files)} files in {where} at {snap.path}"
    )
    if snap.skipped_weights:
        source.notes.append(f"not fetched (same weights in another format): {_few(snap.skipped_weights)}")
    return source


def _in_cache(repo_id: str) -> bool:
    """Whether the HF cache holds anything of the Hub model ``repo_id`` (no network)."""
    from huggingface_hub import constants

    return (Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}").is_dir()


def download(repo_id: str, *, revision: str | None = None, progress: bool = False) -> Snapshot:
    """Resolve ``repo_id`` at ``revision`` and fetch the files surgeon needs (from the cache when there).

    Offline (HF_HUB_OFFLINE) or when the Hub cannot be reached, the cache is used as it is, without the
    client's retries: a cached model opens at once, an uncached one fails with one line.
    """
    from huggingface_hub import HfApi, constants, get_token, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = constants.is_offline_mode()
    remember(get_token())  # the read path's token, masked like the push path's
    api = HfApi()
    try:
        info, reachable = None, not offline
        if reachable:
            try:  # one request, no retries: the commit and every file of the repo
                info = api.model_info(repo_id, revision=revision)
            except Exception as exc:
                if not _is_connection_error(exc):
                    raise
                reachable = False
        # records branch -> commit in the cache (refs/), which is what offline runs resolve with later
        resolved = api.resolve_revision(repo_id, revision=revision, local_files_only=not reachable)
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
                f"(safetensors, PyTorch .bin/.pt or .onnx); it has {_few(files) or 'no files'}"
            )
        with _hf_progress(progress):
            path = snapshot_download(
                repo_id, revision=resolved, allow_patterns=[glob.escape(f) for f in wanted], local_files_only=not reachable,
            )
    except SurgeonError:
        raise
    except Exception as exc:  # every client error becomes one typed line; anything else is a bug
        raise _read_error(exc, repo_id, revision, offline) from None
    cache_only = "HF_HUB_OFFLINE is set" if offline else None if reachable else f"{constants.ENDPOINT} could not be reached"
    return Snapshot(repo_id, str(resolved), resolved.resolved, Path(path), wanted, skipped, cache_only=cache_only)


def _cached_files(repo_id: str, resolved) -> tuple[list[str], bool]:
    """Without the Hub: the repo's files from the cached listing (complete, True), or else the files an
    earlier download (surgeon, transformers, ...) left in the cached snapshot folder (False)."""
    from huggingface_hub import constants, get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, LocalEntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=resolved)], True
    except CachedRepoTreeNotFoundError:
        pass
    snapshot = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots" / resolved.resolved
    if snapshot.is_dir():
        return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()), False
    raise LocalEntryNotFoundError(f"no files of {repo_id} at {resolved.resolved} in the cache")


# Weights in formats surgeon does not rewrite. A top-level folder holding weights (onnx/, openvino/,
# coreml/, checkpoint-500/) is another copy or export of the model and is left out whole, except the
# numbered module folders of sentence-transformers (1_Pooling/, 2_Dense/): those belong to the model.
_OTHER_WEIGHTS = OTHER_FORMAT_SUFFIXES + (".onnx_data", ".xml", ".npz", ".keras")
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
        f.split("/", 1)[0] for f in files
        if "/" in f and (is_weight(f) or f.endswith(_OTHER_WEIGHTS) or ".mlpackage/" in f) and not _ST_MODULE.fullmatch(f.split("/", 1)[0])
    }
    chosen = set(weights)
    for f in files:
        name, folder = f.rsplit("/", 1)[-1], f.split("/", 1)[0] if "/" in f else ""
        if folder in exports or name.endswith(".index.json"):
            continue
        if _ST_MODULE.fullmatch(folder) or name.endswith(".json"):
            chosen.add(f)
        elif not folder and (
            name.startswith("tokenizer") or name in _TOKENIZER_NAMES or name.endswith((".model", ".tiktoken", ".py", ".jinja")) or name == "README.md"
        ):
            chosen.add(f)
    chosen -= {f for f in top if f.endswith(_OTHER_WEIGHTS + WEIGHT_SUFFIXES) and f not in weights}
    skipped = [f for f in top if (is_weight(f) or f.endswith(".index.json")) and f not in chosen]
    return sorted(chosen), skipped


# --- pushing -----------------------------------------------------------------------------------

# Never uploaded: version control and huggingface_hub's own bookkeeping (same as upload_folder).
_PUSH_SKIP = {".git", ".cache"}


@dataclass
class PushResult:
    """What a push did: one commit (or pull request) with these files."""

    repo_id: str
    repo_url: str
    revision: str  # the branch committed to ("main" by default)
    created_repo: bool
    commit: str
    commit_url: str
    pr_url: str | None
    files: list[str]
    large_files: list[str]  # sent through the large-file path (LFS / Xet)
    unchanged: list[str]  # already on the Hub with the same content: left out of the commit
    bytes: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "repo_id": self.repo_id, "repo_url": self.repo_url, "revision": self.revision, "created_repo": self.created_repo,
            "commit": self.commit, "commit_url": self.commit_url, "pr_url": self.pr_url, "files": self.files,
            "large_files": self.large_files, "unchanged": self.unchanged, "bytes": self.bytes, "notes": self.notes,
        }

    def summary(self) -> str:
        from .report import fmt_bytes

        changed = len(self.files) - len(self.unchanged)
        if not changed:
            return f"nothing to push: all {len(self.files)} files are on {self.repo_id} (branch {self.revision}) already, unchanged"
        what = f"{changed} files ({fmt_bytes(self.bytes)}, {len(self.large_files)} through the large-file path)"
        if self.unchanged:
            what += f" ({len(self.unchanged)} files already there unchanged)"
        if self.pr_url:
            return f"opened a pull request on {self.repo_id} with {what}: {self.pr_url}"
        return f"pushed {what} to {self.repo_id} (branch {self.revision}) in one commit: {self.commit_url}"


def check_push(repo_id: str, *, revision: str | None = None, create_pr: bool = False, token: str | None = None) -> str:
    """Everything about a push that can fail before anything is written; returns the repo id."""
    repo_id = _require_repo_id(repo_id, "push target")
    if create_pr and revision not in (None, "main"):
        raise OptionError(
            f"{opt('create_pr', True)} opens a pull request against main; leave out the branch ({opt('revision')} / {opt('push_revision')})"
        )
    if revision is not None and (not revision or revision.startswith("/") or ".." in revision or " " in revision
                                 or (revision.startswith("refs/") and not re.fullmatch(r"refs/pr/\d+", revision))):
        raise OptionError(f"{revision!r} is not a branch to push to: give a branch name (or refs/pr/N to add to a pull request)")
    _push_token(token)
    return repo_id


def _push_token(token: str | None) -> str:
    from huggingface_hub import get_token

    found = token or get_token()
    remember(found)
    if not found:
        raise HubAuthError("pushing to the Hub needs a token with write access: set HF_TOKEN or run `hf auth login`")
    return found


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    commit_description: str | None = None,
    token: str | None = None,
    progress: bool = False,
) -> PushResult:
    """Upload every file of ``folder`` to the model repo ``repo_id`` in one commit.

    Creates the repo (``private`` when asked) and the branch ``revision`` when they do not exist, or opens
    a pull request against main with ``create_pr``. Large files are uploaded before the commit, one at a
    time, so a failure can say which reached the Hub; running the same push again uploads only the rest
    (the Hub already holds the others) and commits.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    repo_id = check_push(repo_id, revision=revision, create_pr=create_pr, token=token)
    token = _push_token(token)
    folder = Path(folder)
    files = _folder_files(folder)
    _check_card(folder)
    api = HfApi(token=token)
    branch = revision or "main"
    try:
        created, notes = _ensure_repo(api, repo_id, private=private)
        if revision is not None and not create_pr and not revision.startswith("refs/pr/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
    except Exception as exc:
        raise _write_error(exc, repo_id, token, "prepare") from None
    ops = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(folder / f)) for f in files]
    done: list[str] = []
    with _hf_progress(progress):
        for i, op in enumerate(ops):
            try:
                api.preupload_lfs_files(repo_id, additions=[op], revision=revision, create_pr=create_pr)
            except Exception as exc:
                raise _partial_error(exc, repo_id, token, folder, ops, i, done, revision=revision, create_pr=create_pr, private=private) from None
            if op._upload_mode == "lfs":
                done.append(op.path_in_repo)
        message = commit_message or f"Upload {folder.resolve().name} with surgeon {__version__}"
        try:
            info = api.create_commit(repo_id, ops, commit_message=message, commit_description=commit_description, revision=revision, create_pr=create_pr)
        except Exception as exc:
            raise _partial_error(exc, repo_id, token, folder, ops, len(ops), done, revision=revision, create_pr=create_pr, private=private) from None
    unchanged = [op.path_in_repo for op in ops if op._remote_oid is not None and op._remote_oid == op._local_oid]
    large = [op.path_in_repo for op in ops if op._upload_mode == "lfs" and op.path_in_repo not in unchanged]
    sent = sum((folder / f).stat().st_size for f in files if f not in unchanged)
    return PushResult(
        repo_id, f"{api.endpoint}/{repo_id}", branch, created, info.oid, info.commit_url, info.pr_url,
        files, large, unchanged, sent, notes,
    )


def _folder_files(folder: Path) -> list[str]:
    if not folder.is_dir():
        what = "a file" if folder.is_file() else "not there"
        raise OptionError(f"{folder} is {what}: surgeon push uploads a model folder (the output of surgeon reinit)")
    files = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and not (set(p.relative_to(folder).parts[:-1]) & _PUSH_SKIP) and p.name != ".DS_Store"
    )
    if not files:
        raise OptionError(f"{folder} is empty: nothing to push")
    return files


def _check_card(folder: Path) -> None:
    """A README.md the Hub would refuse (bad YAML front matter) fails here, before any upload."""
    readme = folder / "README.md"
    if not readme.is_file():
        return
    from huggingface_hub import ModelCard

    try:
        ModelCard(readme.read_text(encoding="utf-8"))
    except Exception as exc:
        raise CheckpointError(f"{readme}: the model card's metadata does not parse ({_line(exc)}); fix or remove it before pushing") from None


def _ensure_repo(api, repo_id: str, *, private: bool) -> tuple[bool, list[str]]:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        info = api.repo_info(repo_id)
    except GatedRepoError:
        return False, []
    except RepositoryNotFoundError:
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        return True, [f"created the {'private ' if private else ''}model repo {repo_id}"]
    notes = []
    if private and info.private is False:
        notes.append(f"{repo_id} already exists and is public: {opt('private', True)} only applies to a repo surgeon creates")
    return False, notes


def _partial_error(exc, repo_id, token, folder, ops, failed_at, done, *, revision, create_pr, private) -> Exception:
    """One line: what reached the Hub, what did not, and the command that finishes the job."""
    base = _write_error(exc, repo_id, token, "push")
    if not isinstance(base, HubError) or (isinstance(base, (HubAuthError, HubAccessError)) and not done):
        return base  # refused outright: nothing reached the Hub, the plain reason is the whole story
    # the file that failed and those after it first: they are what the re-run will send
    pending = [op.path_in_repo for op in ops[failed_at:]] + [op.path_in_repo for op in ops[:failed_at] if op.path_in_repo not in done]
    flags = (f" --revision {shlex.quote(revision)}" if revision else "") + (" --create-pr" if create_pr else "") + (" --private" if private else "")
    rerun = f"surgeon push {shlex.quote(str(folder))} {repo_id}{flags}"
    if failed_at < len(ops):
        before = f"uploaded before it: {_few(done)} ({len(done)} large files)" if done else "no large file was uploaded before it"
        what = f"stopped at {ops[failed_at].path_in_repo} ({base}); {before}; not uploaded: {_few(pending)}; nothing was committed"
    else:
        what = f"failed at the commit ({base}); all {len(done)} large files were uploaded, but nothing was committed"
    return PushError(
        f"push to {repo_id} {what}: run `{rerun}` to finish (the Hub keeps what was uploaded; it is not sent again)",
        uploaded=list(done), not_uploaded=pending,
    )


# --- errors ------------------------------------------------------------------------------------


def _read_error(exc: Exception, repo_id: str, revision: str | None, offline: bool) -> Exception:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        RevisionResolutionError,
    )

    exc = _cause(exc)
    at = f" at revision {revision}" if revision else ""
    cache = constants.HF_HUB_CACHE
    if offline and isinstance(exc, (RevisionResolutionError, LocalEntryNotFoundError, OfflineModeIsEnabled)):
        return HubOfflineError(
            f"{repo_id}{at} is not (completely) in the Hugging Face cache {cache}, and HF_HUB_OFFLINE is set, so it cannot "
            "be downloaded: run once with network access, or unset HF_HUB_OFFLINE"
        )
    if isinstance(exc, (RevisionResolutionError, LocalEntryNotFoundError)) or _is_connection_error(exc):
        return HubOfflineError(
            f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} and {repo_id}{at} is not (completely) in the cache "
            f"{cache}: check the network connection or HF_ENDPOINT"
        )
    if isinstance(exc, GatedRepoError):
        return HubAccessError(
            f"{repo_id} is a gated model: accept its conditions at {constants.ENDPOINT}/{repo_id} while logged in, "
            f"then use a token of that account (HF_TOKEN or `hf auth login`){_token_hint()}"
        )
    if isinstance(exc, RevisionNotFoundError):
        return HubAccessError(f"{repo_id} has no revision {revision!r}: give a branch, tag or commit hash that exists")
    if isinstance(exc, RepositoryNotFoundError):
        if _has_token():
            return HubNotFoundError(f"no model {repo_id} on {constants.ENDPOINT}, or the token in use has no access to it: check the id")
        return HubNotFoundError(
            f"no model {repo_id} on {constants.ENDPOINT}, or it is private and no token was sent: check the id, "
            "or set HF_TOKEN / run `hf auth login`"
        )
    if isinstance(exc, DisabledRepoError):
        return HubAccessError(f"access to {repo_id} has been disabled on the Hub")
    if isinstance(exc, HfHubHTTPError) and exc.response.status_code == 401:
        return HubAuthError("the Hub rejected the token (HF_TOKEN or the saved login): check it, or run `hf auth login` again")
    if isinstance(exc, HfHubHTTPError):
        return _http_error(exc, repo_id)
    return exc


def _write_error(exc: Exception, repo_id: str, token: str, stage: str) -> Exception:
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    exc = _cause(exc)

    if _is_connection_error(exc):
        return HubError(_scrub(f"cannot reach the Hugging Face Hub at {constants.ENDPOINT}: {_line(exc)}", token))
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code
        if status == 401:
            return HubAuthError("the Hub rejected the token (HF_TOKEN or the saved login): check it, or run `hf auth login` again")
        if status == 403 or isinstance(exc, RepositoryNotFoundError):
            owner = repo_id.split("/")[0]
            return HubAccessError(f"the token in use cannot write to {repo_id}: it needs write access to {owner!r} (or push with {opt('create_pr', True)})")
        return _http_error(exc, repo_id, token)
    if isinstance(exc, (ValueError, OSError)):  # the client's own checks, a file that vanished mid-push
        return HubError(_scrub(f"{stage} of {repo_id} failed: {_line(exc)}", token))
    return exc


def _cause(exc: Exception) -> Exception:
    """The HTTP or connection error under the client's wrappers ("Error while uploading 'x'" from ...)."""
    from huggingface_hub.errors import HfHubHTTPError

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, Exception) and (isinstance(seen, HfHubHTTPError) or _is_connection_error(seen)):
            return seen
        seen = seen.__cause__
    return exc


def _http_error(exc, repo_id: str, token: str | None = None) -> HubError:
    status = exc.response.status_code
    detail = exc.server_message or exc.response.reason_phrase or ""
    return HubError(_scrub(f"the Hub answered {status} for {repo_id}: {_line(detail)}", token))


def _is_connection_error(exc: Exception) -> bool:
    import httpx2  # huggingface_hub's HTTP client

    return isinstance(exc, (httpx2.TransportError, ConnectionError)) and not isinstance(exc, httpx2.ProxyError)


def _has_token() -> bool:
    from huggingface_hub import get_token

    return bool(get_token())


def _token_hint() -> str:
    return "" if _has_token() else " (no token was sent)"


def _scrub(text: str, token: str | None) -> str:
    """Belt and braces: a token never reaches a message, even if a server echoed it (``surgeon.redact``)."""
    remember(token)
    return redact(text)


def _line(exc: object) -> str:
    """The first line of an exception or server message, without huggingface_hub's multi-line details."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    first = lines[0]
    # huggingface_hub messages start with "404 Client Error." and put the useful part on the next line
    if re.fullmatch(r"\d{3} (Client|Server) Error\.?", first) and len(lines) > 1:
        first = f"{first} {lines[1]}"
    return first


def _few(items: list[str], n: int = 3) -> str:
    if len(items) <= n:
        return ", ".join(items)
    return ", ".join(items[:n]) + f" and {len(items) - n} more"


@contextmanager
def _hf_progress(enabled: bool) -> Iterator[None]:
    """huggingface_hub's own download/upload bars only when surgeon shows progress (a terminal)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars

    if enabled or are_progress_bars_disabled():
        yield
        return
    with disable_progress_bars():  # restores the caller's setting on the way out
        yield
