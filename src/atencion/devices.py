"""Device names from the command line and configs, checked before anything is loaded."""

from __future__ import annotations

import re

import torch

from .errors import AtencionError


def resolve_device(name: str, what: str = "--device") -> torch.device:
    """``name`` ("cpu", "cuda", "cuda:N") as a device this machine has; ``what`` names the option."""
    if not isinstance(name, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise AtencionError(f"{what}: expected cpu, cuda or cuda:N, got {name!r}")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise AtencionError(f"{what} {name}: this machine has no CUDA device (torch.cuda.is_available() "
                                f"is false); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise AtencionError(f"{what} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
