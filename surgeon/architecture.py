"""A checkpoint's transformers architecture, built from its config.json (random init, nothing downloaded).

Shared by ``inspect --verify-layout`` (surgeon.layout_check) and ``inspect --jacobian`` (surgeon.jacobian):
the built model, and the map from its in-memory parameter names to the checkpoint's tensor names.
"""

from __future__ import annotations

import torch

from .errors import OptionError


def build_architecture(config: dict, *, purpose: str) -> torch.nn.Module:
    """The transformers model that config.json describes, randomly initialized in float32, in eval mode.

    ``purpose``: what needs it, as messages name it (``opt("verify_layout", True)``).
    """
    try:
        import transformers
    except ImportError:
        raise OptionError(f"{purpose} needs transformers to build the architecture: pip install transformers") from None
    model_type = config.get("model_type")
    if not model_type:
        raise OptionError(f"{purpose} needs config.json to name its model_type (a transformers architecture)")
    settings = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **settings)
    except (ValueError, KeyError) as exc:
        raise OptionError(
            f"{purpose}: transformers {transformers.__version__} does not know model_type {model_type!r} ({exc})"
        ) from None
    names = config.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        cls = transformers.AutoModel
        build = lambda: cls.from_config(cfg, dtype=torch.float32)  # noqa: E731
    else:
        build = lambda: cls._from_config(cfg, dtype=torch.float32)  # noqa: E731
    transformers.logging.set_verbosity_error()
    try:
        with torch.device("cpu"):
            model = build()
    except Exception as exc:  # an architecture transformers cannot build from this config
        raise OptionError(
            f"{purpose}: cannot build {names[0] if names else model_type} from config.json: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    return model.float().eval()


class CheckpointNames:
    """In-memory parameter names of the built model -> tensor names of the checkpoint."""

    def __init__(self, renames: dict[str, str], tensors: set[str]) -> None:
        self.renames, self.tensors = renames, tensors

    def __call__(self, name: str) -> str:
        name = self.renames.get(name, name)
        if name in self.tensors:
            return name
        # the checkpoint of a base model under a head model's class, or the other way round
        hits = [t for t in self.tensors if t.endswith("." + name) or name.endswith("." + t)]
        return hits[0] if len(hits) == 1 else name
