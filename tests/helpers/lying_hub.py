"""A lying Hub: a real HTTP proxy on 127.0.0.1 in front of a HubServer (``helpers.hub_server``).

It forwards every request to the Hub behind it, except those a lie is told for (``lie``: method, path regex
and Range header regex). For those it asks the Hub behind first, then answers with the Hub's own status and
headers but:

- ``ENDLESS``: a body without end (chunked: the Hub's bytes, then zeros);
- ``STALL``: no body at all after the headers, the connection held open;
- ``DRIP``: the Hub's body, one byte every ``interval`` seconds;
- ``LOOP``: a 302 to the same URL, over and over;
- ``PING_PONG``: a 302 between two URLs (the path with ``?hop=a`` and ``?hop=b``).

It counts the body bytes it sent for each lie (``Lie.sent``, what ``send`` accepted). Its lies are bounded:
each stops when the client closes the connection, when the proxy shuts down, or at a hard cap (``MAX_BYTES``
sent, ``MAX_SECONDS`` held, ``MAX_HOPS`` redirects), whichever comes first; the socket it lies on has a small
send buffer, so what it counts as sent is close to what the client took.
"""

from __future__ import annotations

import http.client
import re
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from helpers.hub_server import Loopback, Serving

ENDLESS, STALL, DRIP, LOOP, PING_PONG = "endless", "stall", "drip", "loop", "ping-pong"
MAX_BYTES = 32 * 1024 * 1024
MAX_SECONDS = 150.0  # beyond any test's hang guard: a client without a timeout is stopped by the guard first
MAX_HOPS = 200
CHUNK = 16 * 1024
SEND_BUFFER = 16 * 1024
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade"}


@dataclass
class Rule:
    kind: str
    method: str
    path: re.Pattern
    range: re.Pattern | None
    interval: float


@dataclass
class Lie:
    """One lie told: to which request, how many body bytes went out, and whether it has ended."""

    kind: str
    method: str
    path: str
    range: str
    sent: int = 0
    done: threading.Event = field(default_factory=threading.Event)


class LyingHub(Loopback):
    """``with LyingHub(hub.url) as proxy:``; ``proxy.url`` is the HF_ENDPOINT the client is given."""

    def __init__(self, upstream: str) -> None:
        split = urlsplit(upstream)
        self.upstream = (split.hostname or "127.0.0.1", split.port or 80)
        self.rules: list[Rule] = []
        self.lies: list[Lie] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self._listen(_handler(self))

    @property
    def host(self) -> str:
        """How an error names this server: ``127.0.0.1:PORT``."""
        return self.url.removeprefix("http://")

    def __exit__(self, *exc) -> None:
        self.stop.set()  # every lie still being told ends within a poll
        self.settle(5)
        super().__exit__(*exc)

    def lie(
        self, kind: str, path: str, *, range: str | None = None, method: str = "GET", interval: float = 1.0
    ) -> None:
        """Lie (``kind``) to every ``method`` request whose path matches ``path`` and, if given, whose Range
        header matches ``range`` (regexes, searched)."""
        self.rules.append(Rule(kind, method, re.compile(path), re.compile(range) if range else None, interval))

    def told(self, kind: str | None = None) -> list[Lie]:
        with self.lock:
            return [lie for lie in self.lies if kind is None or lie.kind == kind]

    def settle(self, timeout: float = 30.0) -> bool:
        """Wait until every lie has ended (the client gone, or a cap reached); whether they all have."""
        end = time.monotonic() + timeout
        return all(lie.done.wait(max(0.0, end - time.monotonic())) for lie in self.told())

    def rule_for(self, method: str, path: str, range_header: str) -> Rule | None:
        for rule in self.rules:
            if rule.method == method and rule.path.search(path):
                if rule.range is None or rule.range.search(range_header):
                    return rule
        return None


def _handler(proxy: LyingHub):
    class Handler(Serving):
        def _serve(self, method: str) -> None:
            body = self._body() if method in ("POST", "PUT") else b""
            path = urlsplit(self.path).path
            rule = proxy.rule_for(method, path, self.headers.get("Range", ""))
            if rule is not None and rule.kind in (LOOP, PING_PONG):
                self._redirect(rule, method)
                return
            status, reason, headers, data, length = self._forward(method, body)
            if rule is None:
                self.send_response(status, reason)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", length)  # for HEAD: the size a GET would send
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(data)
                return
            lie = Lie(rule.kind, method, path, self.headers.get("Range", ""))
            with proxy.lock:
                proxy.lies.append(lie)
            try:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
                self.send_response(status, reason)
                for k, v in headers:
                    self.send_header(k, v)
                if rule.kind == ENDLESS:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.flush()
                {ENDLESS: self._endless, STALL: self._stall, DRIP: self._drip}[rule.kind](lie, data, rule)
            except OSError:  # the client closed the connection: the lie is over
                pass
            finally:
                self.close_connection = True
                lie.done.set()

        def _forward(self, method: str, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes, str]:
            """The Hub behind's answer to this request: status, reason, headers, body, Content-Length."""
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                if method in ("POST", "PUT"):
                    headers["Content-Length"] = str(len(body))
                conn.request(method, self.path, body=body if method in ("POST", "PUT") else None, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                kept = [(k, v) for k, v in answer.getheaders() if k.lower() not in _HOP_BY_HOP]
                return answer.status, answer.reason, kept, data, answer.getheader("Content-Length") or str(len(data))
            finally:
                conn.close()

        def _send(self, lie: Lie, data: bytes) -> None:
            self.connection.sendall(data)
            with proxy.lock:
                lie.sent += len(data)

        def _endless(self, lie: Lie, data: bytes, rule: Rule) -> None:
            start = time.monotonic()
            payload = data + bytes(CHUNK)
            while not proxy.stop.is_set() and lie.sent < MAX_BYTES and time.monotonic() - start < MAX_SECONDS:
                part = payload[:CHUNK]
                payload = payload[CHUNK:] or bytes(CHUNK)
                self.connection.sendall(b"%x\r\n" % len(part))
                self._send(lie, part)
                self.connection.sendall(b"\r\n")
            self.connection.sendall(b"0\r\n\r\n")

        def _stall(self, lie: Lie, data: bytes, rule: Rule) -> None:
            start = time.monotonic()
            while not proxy.stop.is_set() and time.monotonic() - start < MAX_SECONDS and not self._client_gone():
                pass

        def _drip(self, lie: Lie, data: bytes, rule: Rule) -> None:
            start = time.monotonic()
            for i in range(len(data)):
                if proxy.stop.is_set() or time.monotonic() - start > MAX_SECONDS or self._client_gone(rule.interval):
                    return
                self._send(lie, data[i : i + 1])

        def _client_gone(self, wait: float = 0.1) -> bool:
            """Whether the client closed its end, waiting up to ``wait`` seconds to see."""
            readable, _, _ = select.select([self.connection], [], [], wait)
            if not readable:
                return False
            try:
                return self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def _redirect(self, rule: Rule, method: str) -> None:
            lie = Lie(rule.kind, method, urlsplit(self.path).path, self.headers.get("Range", ""))
            with proxy.lock:
                proxy.lies.append(lie)
                hops = sum(1 for told in proxy.lies if told.kind == rule.kind)
            lie.done.set()
            if hops > MAX_HOPS or proxy.stop.is_set():
                self.send_response(508, "Loop Detected")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            split = urlsplit(self.path)
            target = split.path if rule.kind == LOOP else f"{split.path}?hop={'b' if 'hop=a' in split.query else 'a'}"
            if rule.kind == LOOP and split.query:
                target += f"?{split.query}"
            self.send_response(302, "Found")
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler
