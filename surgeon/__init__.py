"""surgeon: conditioned re-initialization of attention in existing transformer checkpoints.

Names are loaded on first use (PEP 562), so that ``surgeon --help`` and the byte copies of a
reinit do not wait for torch to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> module that defines it
_EXPORTS = {
    "inspect_checkpoint": "api",
    "reinit_checkpoint": "api",
    "inspect": "in_memory",
    "inspect_module": "in_memory",
    "reinit": "in_memory",
    "reinit_": "in_memory",
    "lineage_card": "in_memory",
    "conditioned_init_": "integrations.init_hooks",
    "recover": "open.recovery",
    "verify": "audit",
    "diff": "audit.diff",
    "Verification": "audit",
    "VerificationError": "errors",
    "CheckpointError": "errors",
    "LayoutError": "errors",
    "NoAttentionFoundError": "errors",
    "OptionError": "errors",
    "OutputError": "errors",
    "HalfPatchedError": "errors",
    "SelectionError": "errors",
    "SurgeonError": "errors",
    "UnsupportedWeightsError": "errors",
    "DependencyError": "errors",
    "HubAccessError": "errors",
    "HubAuthError": "errors",
    "HubError": "errors",
    "HubNotFoundError": "errors",
    "HubOfflineError": "errors",
    "PushError": "errors",
    "PushResult": "hub.push_result",
    "PushTarget": "hub.push",
    "Hints": "detect.hints",
    "push_folder": "hub.push",
    "ReinitOptions": "options",
    "Report": "report.report",
    "jacobian_report": "compute.jacobian",
    "JacobianReport": "compute.jacobian",
    "AttentionBlock": "vocab.blocks",
    "Projection": "vocab.blocks",
    "Rows": "vocab.blocks",
}

__all__ = ["__version__", *_EXPORTS]


# subpackages reachable as attributes after a plain ``import surgeon`` (``surgeon.integrations.transformers``)
_SUBPACKAGES = ("integrations",)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'surgeon' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from .api import inspect_checkpoint, reinit_checkpoint
    from .audit import Verification, verify
    from .audit.diff import diff
    from .compute.jacobian import JacobianReport, jacobian_report
    from .detect.hints import Hints
    from .errors import (
        CheckpointError,
        HalfPatchedError,
        HubAccessError,
        HubAuthError,
        HubError,
        HubNotFoundError,
        HubOfflineError,
        LayoutError,
        NoAttentionFoundError,
        OptionError,
        OutputError,
        PushError,
        SelectionError,
        SurgeonError,
        UnsupportedWeightsError,
        VerificationError,
    )
    from .hub.push import PushTarget, push_folder
    from .hub.push_result import PushResult
    from .in_memory import inspect, inspect_module, lineage_card, reinit, reinit_
    from .integrations.init_hooks import conditioned_init_
    from .open.recovery import recover
    from .options import ReinitOptions
    from .report.report import Report
    from .vocab.blocks import AttentionBlock, Projection, Rows
