"""Where the engine computes: the one device check, by spelling before anything is opened (torch-free), then
against the machine when torch is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import OptionError, opt

if TYPE_CHECKING:
    import torch


def check_device(device: str | torch.device | None) -> None:
    """Refuse a misspelt device before anything is opened (whether it exists is checked by :func:`resolve_device`)."""
    text = "auto" if device is None else str(device)
    kind, _, index = text.partition(":")
    if kind in ("meta", "mps", "xpu", "xla", "hpu", "mtia", "privateuseone"):
        raise OptionError(f"unsupported device {text!r}: use auto, cpu, cuda or cuda:N")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not (index.isascii() and index.isdigit()))):
        raise OptionError(f"unknown device {text!r}: use auto, cpu, cuda or cuda:N")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto`` (GPU when there is one), ``cpu``, ``cuda`` or ``cuda:N``, spelt as :func:`check_device` takes it and
    present on this machine."""
    import torch

    check_device(device)
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise OptionError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError(
                f"{opt('device', device)}: no CUDA device is available here; use {opt('device', 'cpu')} or auto"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise OptionError(f"{opt('device', device)}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev
