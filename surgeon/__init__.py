"""surgeon: conditioned re-initialization of attention in existing transformer checkpoints.

Names are loaded on first use (PEP 562), so that ``surgeon --help`` and the byte copies of a
reinit do not wait for torch to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

# public name -> module that defines it
_EXPORTS = {
    "inspect_checkpoint": "api",
    "reinit_checkpoint": "api",
    "inspect": "modules",
    "inspect_module": "modules",
    "reinit": "modules",
    "reinit_": "modules",
    "conditioned_init_": "init_hooks",
    "recover": "journal",
    "verify": "audit",
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
    "PushResult": "hub",
    "PushTarget": "hub",
    "Hints": "detect.config",
    "push_folder": "hub",
    "ReinitOptions": "plan",
    "Report": "report",
    "jacobian_report": "jacobian",
    "JacobianReport": "jacobian",
    "AttentionBlock": "spec",
    "Projection": "spec",
    "Rows": "spec",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
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
    from .detect.config import Hints
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
    from .hub import PushResult, PushTarget, push_folder
    from .init_hooks import conditioned_init_
    from .jacobian import JacobianReport, jacobian_report
    from .journal import recover
    from .modules import inspect, inspect_module, reinit, reinit_
    from .plan import ReinitOptions
    from .report import Report
    from .spec import AttentionBlock, Projection, Rows
