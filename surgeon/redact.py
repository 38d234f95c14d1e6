"""Keep Hub tokens out of everything surgeon shows or writes.

A token reaches surgeon from HF_TOKEN, the saved login or the ``token=`` argument, and is handed to
huggingface_hub and nowhere else. Servers, proxies and client errors can still echo it back (an
``Authorization: Bearer hf_...`` header quoted in an error body), so every message, note, report, card
and metadata record goes through :func:`redact` on its way out: the tokens surgeon has seen, and
anything shaped like one (``hf_`` followed by a long run of token characters, ``Bearer <anything>``),
become ``***``.
"""

from __future__ import annotations

import os
import re

MASK = "***"
# Hub tokens are "hf_" + 30-40 letters and digits (test tokens and org tokens add "_"/"-"); 16 or more
# characters after the prefix keeps ordinary words like "hf_hub" or "hf_cache" readable.
_TOKEN_SHAPE = re.compile(r"(?<![A-Za-z0-9])(hf_|api_org_)[A-Za-z0-9_\-]{16,}")
_BEARER = re.compile(r"(?i)\b(bearer)(\s+)(?!\*\*\*)[^\s,;\"'<>)\]}]+")
_ASSIGNED = re.compile(r"(?i)\b(token|access_token|api_key|password)(\s*[=:]\s*)(?!\*\*\*)[^\s,;\"'<>)\]}]+")
_ENV_NAMES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_API_TOKEN")
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
    for token in sorted(_seen, key=len, reverse=True):
        text = text.replace(token, MASK)
    text = _BEARER.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    text = _ASSIGNED.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    return _TOKEN_SHAPE.sub(lambda m: f"{m.group(1)}{MASK}", text)


def redact_obj(value):
    """Every string in a JSON-like value (dicts, lists), redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact(k) if isinstance(k, str) else k: redact_obj(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_obj(v) for v in value)
    return value
