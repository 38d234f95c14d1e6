"""surgeon: conditioned re-initialization of attention in existing transformer checkpoints."""

from ._version import __version__
from .api import inspect_checkpoint, reinit_checkpoint
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
from .plan import ReinitOptions
from .report import Report
from .spec import AttentionBlock, Projection, Rows

__all__ = [
    "__version__",
    "inspect_checkpoint",
    "reinit_checkpoint",
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
]
