"""surgeon: conditioned re-initialization of attention in existing transformer checkpoints."""

from ._version import __version__
from .api import inspect_checkpoint, reinit_checkpoint
from . import verify as _verify_layout_module  # noqa: F401  (loaded first, so that `surgeon.verify` stays the function below)
from .audit import Verification, VerificationError, verify
from .modules import inspect, inspect_module, reinit, reinit_
from .errors import (
    CheckpointError,
    LayoutError,
    NoAttentionFoundError,
    OptionError,
    OutputError,
    SelectionError,
    SurgeonError,
    UnsupportedWeightsError,
)
from .hub import HubAccessError, HubAuthError, HubError, HubNotFoundError, HubOfflineError, PushError, PushResult, push_folder
from .plan import ReinitOptions
from .report import Report
from .spec import AttentionBlock, Projection, Rows

__all__ = [
    "__version__",
    "inspect_checkpoint",
    "reinit_checkpoint",
    "verify",
    "Verification",
    "VerificationError",
    "push_folder",
    "PushResult",
    "inspect",
    "inspect_module",
    "reinit",
    "reinit_",
    "ReinitOptions",
    "Report",
    "AttentionBlock",
    "Projection",
    "Rows",
    "SurgeonError",
    "CheckpointError",
    "LayoutError",
    "NoAttentionFoundError",
    "OptionError",
    "OutputError",
    "SelectionError",
    "UnsupportedWeightsError",
    "HubError",
    "HubOfflineError",
    "HubAccessError",
    "HubNotFoundError",
    "HubAuthError",
    "PushError",
]
