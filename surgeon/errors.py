"""One error type for everything a user can get wrong, with a subclass per cause.

Every message is a single line that says what is wrong and what to do about it; the CLI prints it
as ``surgeon: error: <message>`` and exits non-zero, without a traceback.
"""

from __future__ import annotations


class SurgeonError(Exception):
    """Base class of every error surgeon raises on bad input or a refused operation."""

    exit_code = 1

    def __str__(self) -> str:  # a token echoed by a server never reaches a message
        from .redact import redact

        return redact(super().__str__())


class CheckpointError(SurgeonError):
    """The checkpoint cannot be read: missing file or shard, corrupt header, unsafe pickle."""


class UnsupportedWeightsError(SurgeonError):
    """A projection is quantized, integer or otherwise not a float matrix surgeon can rewrite."""


class NoAttentionFoundError(SurgeonError):
    """Detection found no attention block; the message says what was looked at."""


class LayoutError(SurgeonError):
    """Attention was found but its heads or layout cannot be settled (missing or conflicting config)."""


class SelectionError(SurgeonError):
    """A --layers / --heads / --targets / --attention / --stack selection is malformed or out of range."""


class OptionError(SurgeonError):
    """Options that are invalid on their own or do not go together."""


class OutputError(SurgeonError):
    """The output cannot be written where asked (exists, is the input, wrong kind of path)."""
