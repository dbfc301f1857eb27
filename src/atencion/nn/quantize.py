"""Dynamic int8 quantization for decoding on a CPU.

Every linear layer's weight is stored as int8 with one scale per output row (symmetric, the
row's largest magnitude maps to 127); at run time each input is quantized to 8 bits with its
own range and the product accumulates in int32 (PyTorch's fbgemm/oneDNN ``linear_dynamic``
kernels, or for a few rows nn/matvec.cpp's, which computes the same sums faster), then is rescaled
to float32. Layer norms, softmax, attention scores and the
embeddings stay in float32. The cost in BLEU is measured in docs/results.md; the speed in
benchmarks/speed.py.

    model = quantize_int8(load_model(path).eval())   # a copy; the original is unchanged

The quantized copy decodes only (no gradients) and is never saved: quantize after loading.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import Tensor, nn

from ..errors import AtencionError
from . import matvec
from .layers import Generator


class Int8Linear(nn.Module):
    """``F.linear(x, weight, bias)`` with an int8 weight and a dynamically quantized input.
    ``weight`` and ``bias`` stay readable in float32 for the cross-attention projections, which
    take a slice of the rows (``rows``)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight.detach().float().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        scales = (self.weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        zero_points = torch.zeros(self.weight.size(0), dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(self.weight, scales, zero_points, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, self.bias)
            # the same int8 rows and scales for matvec's kernel of a few rows (buffers, not saved: a quantized
            # model is never saved; as buffers they go where the module goes, and onto huge pages with it)
            int8 = qweight.int_repr()
            self.register_buffer("_int8", int8, persistent=False)
            self.register_buffer("_scales", qweight.q_per_channel_scales().float(), persistent=False)
            self.register_buffer("_sums", int8.sum(dim=1, dtype=torch.int32), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x.float()
        out = matvec.int8_linear(x, self._int8, self._scales, self._sums, self.bias)  # (..., n), or None
        if out is None:  # reduce_range: 7-bit inputs, so AVX2's 16-bit pairwise sums cannot saturate
            out = torch.ops.quantized.linear_dynamic(x.reshape(-1, x.size(-1)), self._packed, True)
            out = out.view(*x.shape[:-1], out.size(-1))
        return out

    def rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features ``start:stop`` in float32 (the cross-attention projections slice them)."""
        bias = None if self.bias is None else self.bias[start:stop]
        return torch.nn.functional.linear(x, self.weight[start:stop], bias)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.size(1)}, out_features={self.weight.size(0)}, int8"


def quantize_int8(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (on the CPU, in eval mode) whose linear layers and generator are int8."""
    if next(model.parameters()).device.type != "cpu":
        raise AtencionError("int8 quantization runs on the CPU; load the model with map_location='cpu'")
    if "fbgemm" not in torch.backends.quantized.supported_engines and \
            "x86" not in torch.backends.quantized.supported_engines:
        raise RuntimeError(f"this PyTorch build has no x86 int8 kernels "
                           f"(quantized engines: {torch.backends.quantized.supported_engines})")
    quantized = copy.deepcopy(model).eval()
    for module in list(quantized.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (nn.Linear, Generator)):
                setattr(module, name, Int8Linear(child.weight, child.bias))
    for p in quantized.parameters():
        p.requires_grad_(False)
    return quantized
