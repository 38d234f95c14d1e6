"""One HTTP policy for every request surgeon makes to a Hub: its own Range reads and those huggingface_hub makes
for it (model info, downloads, listings, uploads, commits), so that a server that lies, stalls or loops can
neither hang surgeon nor fill its memory.

- Time: a connection must open within ``connect`` seconds, and no wait for the next byte (either way) may pass
  ``read``; a whole request, from sending it to its answer's last byte, must end within ``deadline`` seconds
  plus one second per ``min_speed`` bytes it moves (its body and its answer's, as declared or as received).
- Size: the answer to a Range read of N bytes is refused as soon as more than N arrive; an answer read into
  memory (the API's JSON, an error's body, anything of undeclared size) stops at ``max_answer``; a file's
  body stops at the length it declared.
- Redirects: followed to any host, as the client does for ``resolve`` URLs (they lead to the CDN), at most
  ``redirects`` of them for one request.

Every limit comes from an environment variable (``ENV``, docs/hub.md "Limits"), read when the policy is made:
:func:`use_policy`, called where surgeon first talks to a Hub, installs it in huggingface_hub's shared client
(its public ``set_client_factory``, wrapping whichever factory was in place). A fault is one line, a
:class:`~surgeon.errors.HubError` naming the host: raised here as an answer arrives, or made by
:func:`transport_error` from the HTTP client's own timeouts and redirect cap (``hub.failures`` sends them here).
"""

from __future__ import annotations

import functools
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..errors import HubError, OptionError

MiB = 1024 * 1024

# field -> the environment variable that sets it
ENV = {
    "connect": "SURGEON_HUB_CONNECT_TIMEOUT",
    "read": "SURGEON_HUB_READ_TIMEOUT",
    "deadline": "SURGEON_HUB_DEADLINE",
    "min_speed": "SURGEON_HUB_MIN_SPEED",
    "redirects": "SURGEON_HUB_MAX_REDIRECTS",
    "max_answer": "SURGEON_HUB_MAX_ANSWER",
}

# request extensions the policy's hooks read (httpx passes a request's extensions on to its redirects)
RANGE_ASKED = "surgeon.range_asked"  # the bytes a Range read asked for: its 206 answer may not hold more
_STARTED = "surgeon.started"  # (when the request was sent, the bytes of its body)


@dataclass(frozen=True)
class Policy:
    """The limits every Hub request runs under (seconds, bytes, bytes per second, hops)."""

    connect: float = 10.0
    read: float = 30.0  # between two bytes, either way
    deadline: float = 120.0  # a whole request, plus its size at min_speed
    min_speed: float = 32 * 1024
    redirects: int = 10
    max_answer: int = 256 * MiB

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Policy:
        """The defaults, with each limit the environment sets (a bad value: one-line OptionError)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV[f.name], "").strip()
            if raw:
                values[f.name] = _limit(ENV[f.name], raw, whole=f.type == "int", zero_ok=f.name == "redirects")
        return cls(**values)

    def allowed(self, size: int) -> float:
        """Seconds a request that moves ``size`` bytes may take, first byte sent to last byte received."""
        return self.deadline + size / self.min_speed

    def timeouts(self) -> dict[str, float]:
        """httpx's per-request timeouts (a request's ``timeout`` extension)."""
        return {"connect": self.connect, "read": self.read, "write": self.read, "pool": self.connect}


def _limit(name: str, raw: str, *, whole: bool, zero_ok: bool) -> float:
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        kind, bound = ("a whole number" if whole else "a number"), ("of 0 or more" if zero_ok else "above 0")
        raise OptionError(f"{name}={raw!r} is not {kind} {bound}: set it to one, or unset it")
    return value


def use_policy() -> Policy:
    """The policy the environment sets, installed in huggingface_hub's shared client (once; again only if the
    environment changed, or something else replaced the client's factory since)."""
    from huggingface_hub import set_client_factory

    from .._compat import hub_client_factory

    policy = Policy.from_env()
    current = hub_client_factory()
    if isinstance(current, _Factory) and current.policy == policy:
        return policy
    base = current.base if isinstance(current, _Factory) else current  # the user's own factory, or the client's
    set_client_factory(_Factory(base, policy))  # closes the shared client: the next request makes one from this
    return policy


@dataclass(frozen=True)
class _Factory:
    """huggingface_hub's client factory under the policy: ``base``'s client (the client's own request hook:
    offline mode, request ids; a user's proxies or certificates), with the policy's timeouts, redirect cap and
    hooks."""

    base: Callable[[], Any]
    policy: Policy

    def __call__(self) -> Any:
        from .._compat import hub_http

        client = self.base()
        client.timeout = hub_http().Timeout(**self.policy.timeouts())
        client.max_redirects = self.policy.redirects
        hooks = client.event_hooks
        client.event_hooks = {
            "request": [*hooks.get("request", []), functools.partial(_on_request, self.policy)],
            "response": [functools.partial(_on_response, self.policy), *hooks.get("response", [])],
        }
        return client


def _on_request(policy: Policy, request: Any) -> None:
    """Every request (and each redirect it follows): the policy's timeouts, or the caller's where tighter (the
    client passes None, no limit, for most API calls), and when it was sent."""
    asked = request.extensions.get("timeout") or {}
    request.extensions["timeout"] = {
        k: mine if asked.get(k) is None else min(asked[k], mine) for k, mine in policy.timeouts().items()
    }
    body = request.headers.get("content-length", "")
    # a body of undeclared length (a chunked upload) is timed by the write timeout only: the clock starts at its answer
    started = None if request.headers.get("transfer-encoding") else time.monotonic()
    request.extensions[_STARTED] = (started, int(body) if body.isdigit() else 0)


def _on_response(policy: Policy, response: Any) -> None:
    """Every answer, before its body is read: the body is read through a stream that stops at its cap and at
    the request's deadline."""
    request = response.request
    started, sent = request.extensions.get(_STARTED, (None, 0))
    started = time.monotonic() if started is None else started
    length = response.headers.get("content-length", "")
    declared = int(length) if length.isdigit() and request.method != "HEAD" else None  # HEAD: a GET's length
    asked = request.extensions.get(RANGE_ASKED)
    path = request.url.path
    is_file = request.method == "GET" and response.is_success and ("/resolve/" in path or "/api/" not in path)
    if asked is not None and response.status_code == 206:
        cap, kind = asked, "range"
    elif is_file and declared is not None:
        cap, kind = declared, "file"
    else:
        cap, kind = policy.max_answer, "answer"
    limits = _Limits(policy, _host(request.url), path, kind, cap, started, sent, declared or 0)
    limits.check(0)  # the time it took to get here counts
    response.stream = _bounded_stream()(response.stream, limits)


class _Limits:
    """One answer's cap and deadline, checked as its body arrives. ``kind``: what the cap is (the bytes a Range
    read asked for, the length a file declared, or the cap on an answer read into memory)."""

    def __init__(
        self, policy: Policy, host: str, path: str, kind: str, cap: int, started: float, sent: int, declared: int
    ) -> None:
        self.policy, self.host, self.path, self.kind, self.cap = policy, host, path, kind, cap
        self.started, self.sent, self.declared, self.received = started, sent, declared, 0

    def check(self, arrived: int) -> None:
        self.received += arrived
        if self.received > self.cap:
            raise HubError(f"the Hub at {self.host} {self._too_much()}, and was cut off; check HF_ENDPOINT")
        # the size the time scales with: what was declared or has come, never past the cap (a lie about the
        # length cannot buy time)
        allowed = self.policy.allowed(self.sent + min(self.cap, max(self.declared, self.received)))
        if time.monotonic() - self.started > allowed:
            raise HubError(
                f"the Hub at {self.host} did not finish answering {self.path} within {allowed:.0f} s "
                f"({self.received} bytes had arrived; {ENV['deadline']} and {ENV['min_speed']} set the limit): "
                "check the network or HF_ENDPOINT"
            )

    def _too_much(self) -> str:
        if self.kind == "range":
            return f"sent more than {self.cap} bytes for a range of {self.cap} bytes of {self.path}"
        if self.kind == "file":
            return f"sent more than the {self.cap} bytes it declared for {self.path}"
        return f"sent more than {self.cap} bytes for {self.path} (the cap on an answer, {ENV['max_answer']})"


@functools.cache
def _bounded_stream() -> type:
    """The stream an answer's body is read through (a subclass of the client's ``SyncByteStream``, made on first
    use: importing surgeon imports no HTTP client)."""
    from .._compat import hub_http

    class Bounded(hub_http().SyncByteStream):  # type: ignore[misc]
        def __init__(self, inner: Any, limits: _Limits) -> None:
            self.inner, self.limits = inner, limits

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self.inner:
                self.limits.check(len(chunk))
                yield chunk

        def close(self) -> None:
            self.inner.close()

    return Bounded


def _host(url: Any) -> str:
    return f"{url.host}:{url.port}" if url.port else str(url.host)


@dataclass(frozen=True)
class RangeAnswer:
    """A Range read's answer: its status, Content-Range, and body (empty unless the status is 206)."""

    status: int
    content_range: str
    data: bytes


def get_range(url: str, headers: Mapping[str, str], start: int, length: int) -> RangeAnswer:
    """``length`` bytes of ``url`` from ``start``, under the policy: the body is read only from a 206 answer
    (a 200 would be the whole file), and refused as soon as it holds more than ``length`` bytes. An error
    status raises the client's HTTP error; a transport fault a one-line HubError."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    from .._compat import hub_http

    use_policy()
    http = hub_http()
    asked = {**headers, "range": f"bytes={start}-{start + length - 1}"}
    try:
        with get_session().stream(
            "GET", url, headers=asked, follow_redirects=True, extensions={RANGE_ASKED: length}
        ) as response:
            hf_raise_for_status(response)  # reads an error's body, capped by the policy
            if response.status_code != 206:
                return RangeAnswer(response.status_code, "", b"")
            data = response.read()
            return RangeAnswer(206, response.headers.get("content-range", ""), data)
    except (http.TransportError, http.TooManyRedirects) as exc:
        raise transport_error(exc) from None


def transport_error(exc: Exception) -> HubError:
    """A fault of the HTTP client, surgeon's request or the client's own (a timeout, a redirect loop, a
    connection lost), as one line naming the host and the limit it ran into."""
    from huggingface_hub import constants

    from .._compat import hub_http

    http = hub_http()
    try:  # the request it happened to (the client sets it on every error it raises while sending one)
        url = exc.request.url  # type: ignore[attr-defined]
        host, path = _host(url), url.path
        asked = exc.request.extensions.get("timeout") or {}  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        host, path, asked = constants.ENDPOINT, "", {}
    policy = Policy.from_env()
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, http.TooManyRedirects):
        hops = re.search(r"(\d+) redirects", detail)  # the client's own loop (HEAD .../resolve) stops at 20
        return HubError(
            f"the Hub at {host} redirected {path} more than {hops[1] if hops else policy.redirects} times (a "
            f"redirect loop); check HF_ENDPOINT, or allow more with {ENV['redirects']}"
        )
    if isinstance(exc, http.ConnectTimeout):
        seconds, what, name = asked.get("connect") or policy.connect, "accept a connection", ENV["connect"]
    elif isinstance(exc, http.TimeoutException):  # the timeout in force: the policy's, or the client's if tighter
        seconds, what, name = asked.get("read") or policy.read, f"answer {path}", ENV["read"]
    elif isinstance(exc, http.ConnectError):
        return HubError(f"cannot reach the Hub at {host}: {detail}; check the network or HF_ENDPOINT")
    else:
        return HubError(f"the Hub at {host} broke off answering {path} ({detail}); check the network or HF_ENDPOINT")
    return HubError(f"the Hub at {host} did not {what} within {seconds:g} s ({name}); check the network or HF_ENDPOINT")
