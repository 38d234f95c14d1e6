"""Keep Hub tokens out of everything surgeon shows or writes.

A token reaches surgeon from HF_TOKEN, the saved login or the ``token=`` argument, and is handed to
huggingface_hub and nowhere else. Servers, proxies and client errors can still echo it back (an
``Authorization: Bearer hf_...`` header quoted in an error body), so every message, note, report, card
and metadata record goes through :func:`redact` on its way out: the tokens surgeon has seen, and
anything shaped like one (``hf_`` followed by a long run of token characters, ``Bearer <anything>``),
become ``***``. Credentials in URLs are secrets too: the user:password part of any ``scheme://user:pass@host``
(``HF_ENDPOINT``, ``HTTPS_PROXY``) becomes ``***@``, and the password of such a URL in the environment is
masked wherever it appears, as is its ``Basic`` header form (base64 of ``user:pass``).
"""

from __future__ import annotations

import base64
import os
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    import logging

MASK = "***"
# Hub tokens are "hf_" + 30-40 letters and digits (test tokens and org tokens add "_"/"-"); 16 or more
# characters after the prefix keeps ordinary words like "hf_hub" or "hf_cache" readable.
_TOKEN_SHAPE = re.compile(r"(?<![A-Za-z0-9])(hf_|api_org_)[A-Za-z0-9_\-]{16,}")
_BEARER = re.compile(r"(?i)\b(bearer|basic)(\s+)(?!\*\*\*)[^\s,;\"'<>)\]}]+")
_ASSIGNED = re.compile(r"(?i)\b(token|access_token|api_key|password)(\s*[=:]\s*)(?!\*\*\*)[^\s,;\"'<>)\]}]+")
# scheme://userinfo@: the userinfo (user, or user:password) has no whitespace, "/" or "@" in it
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)(?!\*\*\*@)[^\s/@]+@")
_ENV_NAMES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_API_TOKEN")
# URLs that the Hub client or its HTTP library reads from the environment, with credentials in them at times
_URL_ENV_NAMES = ("HF_ENDPOINT", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
_seen: set[str] = set()


def remember(token: str | None) -> None:
    """A token in use: its exact text is masked too, whatever its shape."""
    if token and len(token) >= 4:
        _seen.add(token)


def redact(text: str) -> str:
    """``text`` with every token, and everything shaped like one, replaced by ``***``."""
    if not text:
        return text
    for name in _ENV_NAMES:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, MASK)
    for secret in sorted(_seen | _url_secrets(), key=len, reverse=True):
        text = text.replace(secret, MASK)
    text = _URL_CREDENTIALS.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    text = _ASSIGNED.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    return _TOKEN_SHAPE.sub(lambda m: f"{m.group(1)}{MASK}", text)


def _url_secrets() -> set[str]:
    """The passwords of the URLs in the environment, as typed, decoded and as a Basic header sends them."""
    out: set[str] = set()
    for name in _URL_ENV_NAMES:
        value = os.environ.get(name)
        if not value or "@" not in value:
            continue
        try:
            parts = urlsplit(value if "://" in value else "http://" + value)
            user, password = parts.username, parts.password
        except ValueError:  # a malformed URL: the URL pattern still masks its userinfo
            continue
        if password is None:
            continue
        raw = parts.netloc.rpartition("@")[0].partition(":")[2]
        basic = base64.b64encode(f"{unquote(user or '')}:{unquote(password)}".encode()).decode()
        out |= {s for s in (raw, password, unquote(password), basic) if len(s) >= 4}
    return out


def redact_obj(value: Any) -> Any:
    """Every string in a JSON-like value (dicts, lists), redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact(k) if isinstance(k, str) else k: redact_obj(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_obj(v) for v in value)
    return value


def redact_library_output() -> None:
    """Route what libraries print on their own (logging records, warnings) through :func:`redact` too:
    huggingface_hub logs the URLs it retries, credentials included. For the CLI: it changes this process."""
    import logging
    import traceback
    import warnings

    if getattr(logging.getLogRecordFactory(), "_surgeon_redacts", False):
        return
    make_record = logging.getLogRecordFactory()

    def redacted_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            record.msg, record.args = redact(record.getMessage()), None
            if record.exc_info and record.exc_info[0] is not None:  # logger.exception: its traceback too
                record.exc_text = redact("".join(traceback.format_exception(*record.exc_info))).rstrip("\n")
        except Exception:  # noqa: BLE001 - a record that cannot format: leave it to logging's own error report
            pass
        return record

    redacted_record._surgeon_redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(redacted_record)
    format_warning = warnings.formatwarning
    warnings.formatwarning = lambda *args, **kwargs: redact(format_warning(*args, **kwargs))
