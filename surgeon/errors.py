"""Every error surgeon raises, with a subclass per cause and the facts as fields.

Each class also subclasses the builtin it corresponds to (bad input: ``ValueError``; nothing found:
``LookupError``; where to write and the Hub: ``OSError`` and its kin), so ``except ValueError`` works,
and every error pickles with its fields.

A message is one line that says what is wrong and what to do about it. Options are named in it with
:func:`opt`, never spelt: the Python API shows ``num_heads=4`` (``str(exc)``), the CLI shows
``--num-heads 4`` (``surgeon.cli.commands`` spells them from :attr:`SurgeonError.options`), and prints the
result as ``surgeon: error: <message>`` without a traceback. Fields: ``tensor`` (the tensor at
fault), ``path`` (the file or folder), ``options`` (the options the message names), ``context``
(what had already happened, put before the message, e.g. "wrote OUT, but the push failed: ").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import TypedDict

    from typing_extensions import Unpack

    class _Fields(TypedDict, total=False):  # SurgeonError's keyword fields, which subclasses pass on
        tensor: str | None
        path: object
        context: str | None


# «name» or «name=value»: an option named in a message (see opt)
_OPTION = re.compile(r"«(\w+)(?:=([^»]*))?»")

Spelling = Callable[[str, "str | None"], str]


def opt(name: str, value: object = None) -> str:
    """An option (by its Python keyword) in a message, optionally with a value: spelt when shown."""
    return f"«{name}»" if value is None else f"«{name}={value}»"


def python_spelling(name: str, value: str | None) -> str:
    """How the Python API names an option: ``num_heads`` or ``num_heads=4``."""
    return name if value is None else f"{name}={value}"


# How a shell spells an option the core names by its Python keyword: --keyword-with-dashes, except these.
SHELL_FLAGS = {"output": "-o/--output"}
SHELL_WITH_VALUE = {"output": "-o"}  # "-o out/" reads best


def shell_spelling(name: str, value: str | None) -> str:
    """How the CLI names an option: ``--num-heads``, ``--num-heads 4``, ``--force-hints`` (True), ``-o PATH``; a
    keyword that takes a trailing underscore for being a Python word is spelt without it (``from_``: ``--from``)."""
    plain = "--" + name.rstrip("_").replace("_", "-")
    if value is None:
        return SHELL_FLAGS.get(name, plain)
    flag = SHELL_WITH_VALUE.get(name, plain)
    if value == "True":
        return flag
    return f"{flag}={value}" if value.startswith("-") else f"{flag} {value}"


def spell(text: str, spelling: Spelling = python_spelling) -> str:
    """``text`` with every option marker spelt by ``spelling``."""
    return _OPTION.sub(lambda m: spelling(m[1], m[2]), text)


class SurgeonError(Exception):
    """Base class of every error surgeon raises on bad input or a refused operation.

    Args:
        message: One line; options are named by their Python keyword (:func:`opt`), spelt when shown.
        tensor: The tensor it concerns, if any.
        path: The file it concerns, if any.
        context: Text put before the message (what had been done when it happened).
        follow_up: Text put after the message (the command that retries what failed).
    """

    exit_code = 1

    def __init__(
        self, message: str = "", *, tensor: str | None = None, path: object = None, context: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.tensor = tensor
        self.path = None if path is None else str(path)
        self.context = context
        self.follow_up: str | None = None
        self.options: tuple[str, ...] = tuple(dict.fromkeys(m[1] for m in _OPTION.finditer(message)))

    @property
    def option(self) -> str | None:
        """The first option the message names (its Python keyword), if any."""
        return self.options[0] if self.options else None

    def describe(self, spelling: Spelling = python_spelling) -> str:
        """The one-line message, options spelt by ``spelling``; a token echoed by a server never appears, and a
        name with a newline in it cannot add a line (:func:`surgeon.text.shown.shown`; ``tensor``/``path`` stay raw)."""
        from .text.shown import one_line

        text = spell(self.message, spelling)
        text = f"{self.context}{text}" if self.context else text
        return one_line(f"{text.rstrip('. ')}; {self.follow_up}" if self.follow_up else text)

    def __str__(self) -> str:
        return self.describe()

    def __reduce__(self) -> tuple[type, tuple[str], dict[str, Any]]:
        # (class, (message,), fields): pickles across processes (multiprocessing, DDP workers) with every field,
        # whatever the builtin base (OSError's own reduce would pass errno-style arguments).
        # path is named: on an ImportError it is a slot of the builtin, not in __dict__
        return (type(self), (self.message,), {**self.__dict__, "path": self.path})


class CheckpointError(SurgeonError, ValueError):
    """The checkpoint cannot be read: missing file or shard, corrupt header, unsafe pickle."""


class UnsupportedWeightsError(SurgeonError, ValueError):
    """A projection is quantized, integer or otherwise not a float matrix surgeon can rewrite."""


class TensorParallelError(UnsupportedWeightsError):
    """A projection's weight reaches its op as a DTensor: the forward computes each rank's local heads only."""


class NoAttentionFoundError(SurgeonError, LookupError):
    """Detection found no attention block; the message says what was looked at."""


class LayoutError(SurgeonError, ValueError):
    """Attention was found but its heads or layout cannot be settled (missing or conflicting config)."""


class SelectionError(SurgeonError, ValueError):
    """A layers / heads / targets / attention / stack selection is malformed or out of range."""


class SharedInitializerError(SelectionError):
    """An ONNX initializer the plan would change is also read by nodes the plan leaves alone."""


class OptionError(SurgeonError, ValueError):
    """Options that are invalid on their own or do not go together."""


class OutputError(SurgeonError, OSError):
    """The output cannot be written where asked (exists, is the input, wrong kind of path)."""


class HalfPatchedError(OutputError):
    """An in-place run or its rollback stopped part-way: the journal is kept for ``surgeon recover``.
    ``interrupted``: by Ctrl-C (exit code 130, as a shell reports SIGINT)."""

    def __init__(self, message: str = "", *, interrupted: bool = False, **fields: Unpack[_Fields]) -> None:
        super().__init__(message, **fields)
        self.interrupted = interrupted
        self.exit_code = 130 if interrupted else 1


class DependencyError(SurgeonError, ImportError):
    """An installed package lacks an API surgeon uses (a private or fast-moving one, see ``surgeon._compat``)."""


class HubError(SurgeonError, OSError):
    """The Hugging Face Hub could not serve or accept a request."""


class HubOfflineError(HubError, ConnectionError):
    """The model is not in the local HF cache and the Hub cannot be asked (offline mode, no connection)."""


class HubAccessError(HubError, PermissionError):
    """Repository or revision not found, private without access, gated, or no write access."""


class HubNotFoundError(HubAccessError, FileNotFoundError):
    """No such model repo, or it is private and the token in use (if any) has no access to it."""


class HubAuthError(HubError, PermissionError):
    """No token for an operation that needs one, or the Hub rejected the token."""


class PushError(HubError):
    """A push stopped part-way; the message says what reached the Hub and what did not."""

    def __init__(
        self,
        message: str = "",
        *,
        uploaded: list[str] | None = None,
        not_uploaded: list[str] | None = None,
        **fields: Unpack[_Fields],
    ) -> None:
        super().__init__(message, **fields)
        self.uploaded, self.not_uploaded = list(uploaded or []), list(not_uploaded or [])


class RankFailed(SurgeonError, RuntimeError):
    """Another rank of a torchrun reinit failed: its own error is in its output, and nothing was written."""


class VerificationError(SurgeonError, ValueError):
    """OUTPUT is not what its record says surgeon made from ORIGINAL; the message names the first mismatch."""

    exit_code = 3


class DerivedMismatch(VerificationError):
    """A re-derived value differs: what the recipe of this surgeon version gives is not what is stored."""
