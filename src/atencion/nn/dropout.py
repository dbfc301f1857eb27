"""Dropout (§5.4: "we apply dropout to the output of each sub-layer … [and] to the sums of the
embeddings and the positional encodings") with a faster mask on the CPU.

torch's CPU dropout draws one random number per element from its (serial) Mersenne Twister:
5.6 ms for a 5,000 × 128 activation on this project's CPU, about 12% of a Transformer-Tiny
training step. Here each 64-bit draw gives four 16-bit uniform integers u, and an element is
dropped when u < round(p · 65536): four times fewer draws and one comparison (1.2 ms for the same
tensor; benchmarks/dropout.py compares the two at the shapes training uses). The drop
probability is therefore p rounded to a multiple of 1/65536 (0.1 becomes 0.100006), and kept
elements are scaled by 1 / (1 − that probability), so the expectation is exact. On other devices
(CUDA's dropout is one fused kernel, which this mask is not expected to beat; not measured) and
for p whose rounding would be 0 or 1, torch's dropout runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import AtencionError

LEVELS = 1 << 16  # 16-bit uniform integers


def fast_dropout(x: Tensor, p: float) -> Tensor:
    """Training-mode dropout of ``x`` with drop probability round(p · 65536) / 65536 (CPU)."""
    dropped = round(p * LEVELS)
    if x.device.type != "cpu" or not 0 < dropped < LEVELS:
        return F.dropout(x, p, training=True)
    n = x.numel()
    words = torch.randint(-2 ** 63, 2 ** 63 - 1, ((n + 3) // 4,), dtype=torch.int64, device=x.device)
    u = words.view(torch.int16)[:n].view(x.shape)  # uniform in [-32768, 32768): u + 32768 ~ U[0, 65536)
    keep = u >= dropped - LEVELS // 2
    return x * keep.to(x.dtype).mul_(LEVELS / (LEVELS - dropped))


class Dropout(nn.Module):
    """``nn.Dropout`` with :func:`fast_dropout` in training mode; the identity in eval mode."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0 <= p <= 1:
            raise AtencionError(f"dropout probability must be in [0, 1], got {p!r}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        return fast_dropout(x, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"
