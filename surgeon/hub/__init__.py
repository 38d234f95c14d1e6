"""Models on the Hugging Face Hub: read them by id, push re-initialized folders back.

Reading (:mod:`.read`) resolves ``org/name`` (at a revision) with huggingface_hub into the shared HF
cache and opens the snapshot folder like a local model folder. Only what surgeon needs is fetched: the
weights in one format (the first of surgeon.formats.registry that the repo has), configs, tokenizer
files, custom code and the model card. Everything the client reads from the environment applies:
HF_HOME / HF_HUB_CACHE, HF_ENDPOINT, HF_HUB_OFFLINE and HF_TOKEN.

Pushing (:mod:`.push`) creates the repo (and branch) when needed and uploads a folder in one commit;
large files go through the client's own large-file path (Xet, or LFS where Xet is off). Tokens are
passed to the client and nowhere else: no message, card, report or file written by surgeon contains
one (:mod:`.translate` turns the client's exceptions into one-line errors).
"""

from __future__ import annotations

from ..errors import HubAccessError, HubAuthError, HubError, HubNotFoundError, HubOfflineError, PushError
from .ids import HF_PREFIX, parse_repo_id
from .push import PushResult, PushTarget, check_push, push_folder
from .read import Snapshot, download, open_model, pick_files

__all__ = [
    "HF_PREFIX",
    "HubAccessError",
    "HubAuthError",
    "HubError",
    "HubNotFoundError",
    "HubOfflineError",
    "PushError",
    "PushResult",
    "PushTarget",
    "Snapshot",
    "check_push",
    "download",
    "open_model",
    "parse_repo_id",
    "pick_files",
    "push_folder",
]
