"""Show a name from a file as text that stays on its line.

Shard, folder, tensor, node and journal names come from files downloaded from anywhere, and a name like
``"x\\nsurgeon: verified: all good"`` printed as it is would add a line of surgeon's own output. So every
name is shown through :func:`shown`: control characters (C0, DEL, C1 with U+0085), the Unicode line and
paragraph separators (U+2028, U+2029) and the bidirectional controls that reorder what a terminal shows
(U+202A-U+202E, U+2066-U+2069, U+200E, U+200F, U+061C) are written as ``repr`` writes them, without
quotes: ``\\n``, ``\\r``, ``\\t``, ``\\x1b``, ``\\u2028``. A backslash is left as it is (a Windows path in
an error stays readable), so a name spelled with a literal ``\\n`` looks like one holding a newline: the
point is that neither adds a line.

Display only: the Python API's fields (``Report``'s, an exception's ``tensor`` and ``path``) and JSON
keep the raw names (``json.dumps`` escapes control characters itself).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def shown(text: str) -> str:
    """``text`` with every character that could end its line or forge what a terminal shows escaped."""
    return _UNSAFE.sub(_escaped, text)


def one_line(text: str) -> str:
    """An error or warning as printed: redacted (no token), then one line whatever the names in it hold."""
    from .redact import redact

    return shown(redact(text))


def note_lines(notes: Iterable[str]) -> list[str]:
    """``note: ...`` lines, one per note, however the names in a note are spelled."""
    return [f"note: {shown(note)}" for note in notes]
