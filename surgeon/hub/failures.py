"""huggingface_hub's exceptions, turned into one-line HubErrors without a token in them."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..errors import (
    HubAccessError,
    HubAuthError,
    HubError,
    HubNotFoundError,
    HubOfflineError,
    SurgeonError,
    opt,
)
from ..text.redact import redact, remember
from .http import transport_error

if TYPE_CHECKING:
    from huggingface_hub.errors import HfHubHTTPError

# --- errors ------------------------------------------------------------------------------------


def read_error(exc: Exception, repo_id: str, revision: str | None, offline: bool) -> Exception:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from .._compat import RevisionResolutionError  # huggingface_hub 2.0+; before it, LocalEntryNotFoundError

    unresolved = (LocalEntryNotFoundError, RevisionResolutionError or LocalEntryNotFoundError)
    exc = _cause(exc)
    if isinstance(exc, SurgeonError):  # the HTTP policy's own refusals, raised inside the client's calls
        return exc
    at = f" at revision {revision}" if revision else ""
    cache = constants.HF_HUB_CACHE
    if offline and isinstance(exc, (*unresolved, OfflineModeIsEnabled)):
        return HubOfflineError(
            f"{repo_id}{at} is not (completely) in the Hugging Face cache {cache}, and HF_HUB_OFFLINE is set, so it cannot "
            "be downloaded: run once with network access, or unset HF_HUB_OFFLINE"
        )
    if is_timeout_or_loop(exc):
        return transport_error(exc)
    if isinstance(exc, unresolved) or is_connection_error(exc):
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
            return HubNotFoundError(
                f"no model {repo_id} on {constants.ENDPOINT}, or the token in use has no access to it: check the id"
            )
        return HubNotFoundError(
            f"no model {repo_id} on {constants.ENDPOINT}, or it is private and no token was sent: check the id, "
            "or set HF_TOKEN / run `hf auth login`"
        )
    if isinstance(exc, DisabledRepoError):
        return HubAccessError(f"access to {repo_id} has been disabled on the Hub")
    if isinstance(exc, HfHubHTTPError) and exc.response.status_code == 401:
        return HubAuthError(
            "the Hub rejected the token (HF_TOKEN or the saved login): check it, or run `hf auth login` again"
        )
    if isinstance(exc, HfHubHTTPError):
        return _http_error(exc, repo_id)
    if _raised_in_client(exc):  # a 200 answer the client cannot parse (a field holding garbage, or an echoed header)
        return HubError(
            f"the Hub at {constants.ENDPOINT} answered for {repo_id}{at} with something huggingface_hub cannot read "
            f"({type(exc).__name__}: {_scrub(one_line(exc), None)}); check HF_ENDPOINT, or try again later"
        )
    return exc


def _raised_in_client(exc: BaseException) -> bool:
    """Whether huggingface_hub's own code was running when ``exc`` was raised (not surgeon's)."""
    tb = exc.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("huggingface_hub."):
            return True
        tb = tb.tb_next
    return False


def write_error(exc: Exception, repo_id: str, token: str, stage: str) -> Exception:
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    exc = _cause(exc)
    if isinstance(exc, SurgeonError):  # the HTTP policy's own refusals, raised inside the client's calls
        return exc
    if is_timeout_or_loop(exc):
        return transport_error(exc)
    if is_connection_error(exc):
        return HubError(_scrub(f"cannot reach the Hugging Face Hub at {constants.ENDPOINT}: {one_line(exc)}", token))
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code
        if status == 401:
            return HubAuthError(
                "the Hub rejected the token (HF_TOKEN or the saved login): check it, or run `hf auth login` again"
            )
        if status == 403 or isinstance(exc, RepositoryNotFoundError):
            owner = repo_id.split("/")[0]
            return HubAccessError(
                f"the token in use cannot write to {repo_id}: it needs write access to {owner!r} (or push with {opt('create_pr', True)})"
            )
        return _http_error(exc, repo_id, token)
    if isinstance(exc, (ValueError, OSError)):  # the client's own checks, a file that vanished mid-push
        return HubError(_scrub(f"{stage} of {repo_id} failed: {one_line(exc)}", token))
    return exc


def _cause(exc: Exception) -> Exception:
    """The HTTP or connection error under the client's wrappers ("Error while uploading 'x'" from ...), or the
    HTTP policy's own error (``hub.http``)."""
    from huggingface_hub.errors import HfHubHTTPError

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, Exception) and (
            isinstance(seen, (HfHubHTTPError, SurgeonError)) or is_connection_error(seen) or is_timeout_or_loop(seen)
        ):
            return seen
        seen = seen.__cause__
    return exc


def _http_error(exc: HfHubHTTPError, repo_id: str, token: str | None = None) -> HubError:
    status = exc.response.status_code
    detail = exc.server_message or exc.response.reason_phrase or ""
    return HubError(_scrub(f"the Hub answered {status} for {repo_id}: {one_line(detail)}", token))


def is_timeout_or_loop(exc: Exception) -> bool:
    """Whether ``exc`` is the HTTP client's timeout or its redirect cap (``hub.http`` sets both)."""
    from .._compat import hub_http

    http = hub_http()
    return isinstance(exc, (http.TimeoutException, http.TooManyRedirects))


def is_connection_error(exc: Exception) -> bool:
    from .._compat import hub_http

    http = hub_http()  # huggingface_hub's HTTP client (httpx2, or httpx before 2.0)
    return isinstance(exc, (http.TransportError, ConnectionError)) and not isinstance(exc, http.ProxyError)


def _has_token() -> bool:
    from huggingface_hub import get_token

    return bool(get_token())


def _token_hint() -> str:
    return "" if _has_token() else " (no token was sent)"


def _scrub(text: str, token: str | None) -> str:
    """Belt and braces: a token never reaches a message, even if a server echoed it (``surgeon.text.redact``)."""
    remember(token)
    return redact(text)


def one_line(exc: object) -> str:
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


def few(items: list[str], n: int = 3) -> str:
    if len(items) <= n:
        return ", ".join(items)
    return ", ".join(items[:n]) + f" and {len(items) - n} more"
