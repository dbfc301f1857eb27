"""The linear layers of decoding on a CPU: one row (or a beam of a few) times each weight matrix.

Generating a token multiplies a few rows by every weight of the model, so its time is the time to
read the weights from memory. PyTorch's CPU product (``F.linear``, through MKL) reads them at 9-10
GB/s on the 2-core machine of docs/results.md whatever the thread count, llama.cpp at about 22;
``matvec.cpp``, a dot product per weight row with the rows split over torch's threads, reads them
at 18-22 GB/s on one thread and 24-28 on two (``python benchmarks/matvec.py``). It is compiled by
``torch.utils.cpp_extension`` on first use (about a minute, once; cached under
~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) and used only where it applies: float32 on
the CPU, at most ``MAX_ROWS`` rows, nothing to differentiate, not while tracing or exporting.
Everything else, and every machine where it does not compile (one warning says why), goes to
``F.linear``; so does everything with ``ATENCION_MATVEC=0`` in the environment. Both sum the same
products in different orders: outputs agree to float32 rounding.

Its int8 twin (``int8_linear``, for nn/quantize.py's layers) computes what PyTorch's dynamic int8
linear computes, in the same int32 sums, reading a quarter of the bytes: about 1.8× fbgemm's speed
at one row (``python benchmarks/matvec.py --int8``).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

MAX_ROWS = 5  # a beam of 5: still 1.4× F.linear (benchmarks/matvec.py --rows 5); at 8 rows no faster than it
_compiling = getattr(torch.compiler, "is_compiling", lambda: False)  # torch >= 2.3
_lock = threading.Lock()
_kernel = None
_kernel_int8 = None
_tried = False


def kernel():
    """The compiled ``matvec`` function, or None where it is switched off or does not compile."""
    global _kernel, _kernel_int8, _tried
    if _tried:
        return _kernel
    with _lock:
        if _tried:
            return _kernel
        if os.environ.get("ATENCION_MATVEC", "1") != "0":
            try:
                from torch.utils.cpp_extension import get_default_build_root, load

                root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
                built = any(any(root.glob(pattern)) for pattern in  # the default root gets a py311_cpu-like folder
                            ("atencion_matvec/atencion_matvec.so", "*/atencion_matvec/atencion_matvec.so"))
                (log.info if built else log.warning)(
                    "%s atencion's matrix-vector kernel for decoding on the CPU%s", "loading" if built else "compiling",
                    "" if built else " (once, about a minute; ATENCION_MATVEC=0 skips it)")
                flags = ["-O3", "-march=native", "-fopenmp"]
                module = load("atencion_matvec", [str(Path(__file__).with_suffix(".cpp"))],
                              extra_cflags=flags, extra_ldflags=["-fopenmp"])
                _kernel, _kernel_int8 = module.matvec, module.matvec_int8
            except Exception as err:  # no compiler, no ninja, another platform: F.linear, said once
                log.warning("atencion's matrix-vector kernel did not compile (%s); decoding on the CPU uses "
                            "F.linear. ATENCION_MATVEC=0 skips the attempt.", (str(err).splitlines() or [repr(err)])[0])
        _tried = True
    return _kernel


def _few_rows(x: Tensor) -> bool:
    """A few rows on the CPU, outside tracing, compiling and export."""
    return (x.device.type == "cpu" and 0 < x.numel() <= MAX_ROWS * x.size(-1)
            and not torch.jit.is_tracing() and not _compiling() and not torch.onnx.is_in_onnx_export())


def _applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (_few_rows(x) and all(t.dtype == torch.float32 for t in tensors) and weight.is_contiguous()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``; a few float32 rows on the CPU go through the kernel."""
    if _applies(x, weight, bias) and kernel() is not None:
        out = _kernel(x.reshape(-1, x.size(-1)), weight, bias)
        return out.view(*x.shape[:-1], weight.size(0))
    return F.linear(x, weight, bias)


def int8_linear(x: Tensor, weight: Tensor, scales: Tensor, sums: Tensor, bias: Tensor | None) -> Tensor | None:
    """The int8 kernel's ``x Wᵀ + b`` for float32 rows ``x`` (rows, k), ``W = weight * scales[:, None]``
    (``weight`` int8, ``sums`` its rows' int32 sums), or None where it does not apply (many rows, another
    device, tracing, switched off): the caller then runs PyTorch's ``linear_dynamic``."""
    if _few_rows(x) and kernel() is not None and _kernel_int8 is not None:
        return _kernel_int8(x, weight, scales, sums, bias)
    return None


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and state dict) whose product is ``linear`` above."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
