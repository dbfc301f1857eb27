"""The small products of decoding on a CPU: a few rows (one, a beam, a batch of up to 16) times
each weight matrix, the step's normalisations and rotations, and its attention over the cache.

Generating a token multiplies a few rows by every weight of the model, so its time is the time to
read the weights from memory. ``matvec.cpp``'s dot products (a dot product per weight row, the rows
split over torch's threads) read them at 12-23 GB/s on the 2-core machines of docs/results.md,
and 28-29 taking four weight rows at a time with AVX-512 on a third; PyTorch's CPU product (``F.linear``,
through MKL) at 9-10 GB/s on one of them and 27-28 on the others. From
6 to 16 rows the product is bound by arithmetic instead, and ``matmul_panels`` does it on a
copy of the weight laid out in panels of 16 rows (``panels``: made on first use, a second copy of that
weight in memory), asking for the weights 2 KB ahead of use: 1.6× ``F.linear``'s GFLOP/s at 16 rows
(``python benchmarks/matvec.py --rows 16``).

The kernels are compiled by ``torch.utils.cpp_extension`` on first use (about a minute, once; cached
under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) and used only where they apply: float32
on the CPU, at most ``PANEL_ROWS`` rows, nothing to differentiate, not while tracing or exporting.
Everything else, and every machine where they do not compile (one warning says why), goes to
``F.linear``; so does everything with ``ATENCION_MATVEC=0`` in the environment. Both sum the same
products in different orders: outputs agree to float32 rounding.

The int8 twins (``int8_linear``, for nn/quantize.py's layers, up to ``PANEL_ROWS`` rows) compute what
PyTorch's dynamic int8 linear computes, in the same int32 sums: on VNNI panels of the int8 weight
where the CPU has AVX-512 VNNI (about 1.5× fbgemm's speed at 16 rows, 1.5-2× at one: ``--int8``), by dot
products otherwise. Three more kernels do in one call what PyTorch does in several for a decoding
step's few numbers: ``RMSNorm``, ``rotate_`` (RoPE on the queries and keys in place) and
``attend_one`` (the attention of one query per head over the cache, read where it lies: with the
cache's buffers, nn/cache.py, a step copies nothing but its own keys). ``decoder_step`` runs all of
them for every layer of a Llama-style decoder in one call (nn/fused.py).

The float32 kernels (dot products, panels, ``attend_one``, ``decoder_step``) are written once over a
vector type: AVX-512's 16 floats, or AVX2's 8 (with FMA) on a CPU without AVX-512, as most laptops'
are. The int8 products use VNNI's ``vpdpbusd`` where the CPU has it and AVX2's ``vpmaddubsw`` otherwise."""

from __future__ import annotations

import logging
import os
import shlex
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

log = logging.getLogger(__name__)

MAX_ROWS = 5  # a beam of 5: still 1.4× F.linear (benchmarks/matvec.py --rows 5); at 8 rows no faster than it
_compiling = getattr(torch.compiler, "is_compiling", lambda: False)  # torch >= 2.3
_lock = threading.Lock()
_kernel = None
_kernel_int8 = None
_rms_norm = None
_rotate = None
_panels_kernel = None  # matmul_panels, where the kernel was compiled with AVX-512 or AVX2
_int8_panels_kernel = None  # matmul_int8_panels, with AVX-512 VNNI or AVX2
_int8_panels_from = 1  # the fewest rows it takes: where the panels beat the dot products (VNNI 1, AVX2 3)
_attend_one = None  # attend_one, with AVX-512 or AVX2
_decoder_step = None  # decoder_step (nn/fused.py), with AVX-512 or AVX2
_tried = False
PANEL_ROWS = 16  # 6-16 rows: matmul_panels on a copy of the weight in panels (benchmarks/matvec.py --rows 16)
SMALL_ROWS = 64  # rms_norm's and rotate_'s kernels (one thread): a decoding step's rows; more go to PyTorch
SOURCE = Path(__file__).with_suffix(".cpp")  # the kernels' C++, compiled on first use


def kernel():
    """The compiled ``matvec`` function, or None where it is switched off or does not compile."""
    global _kernel, _kernel_int8, _rms_norm, _rotate, _panels_kernel, _int8_panels_kernel, _int8_panels_from, \
        _attend_one, _decoder_step, _tried
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
                # ATENCION_MATVEC_CFLAGS: more compiler flags (tests/test_matvec.py builds the AVX-512 branches so)
                flags = ["-O3", "-march=native", "-fopenmp", *shlex.split(os.environ.get("ATENCION_MATVEC_CFLAGS", ""))]
                module = load("atencion_matvec", [str(SOURCE)],
                              extra_cflags=flags, extra_ldflags=["-fopenmp"])
                _kernel, _kernel_int8, _rms_norm, _rotate = module.matvec, module.matvec_int8, module.rms_norm, \
                    module.rotate_
                _panels_kernel = module.matmul_panels if module.simd else None
                _attend_one = module.attend_one if module.simd else None
                _decoder_step = module.decoder_step if module.simd else None
                _int8_panels_kernel = module.matmul_int8_panels if module.int8_panels_from else None
                _int8_panels_from = module.int8_panels_from
            except Exception as err:  # no compiler, no ninja, another platform: F.linear, said once
                log.warning("atencion's matrix-vector kernel did not compile (%s); decoding on the CPU uses "
                            "F.linear. ATENCION_MATVEC=0 skips the attempt.", (str(err).splitlines() or [repr(err)])[0])
        _tried = True
    return _kernel


def _onnx_exporting():
    """``torch.onnx.is_in_onnx_export`` without the two imports it makes at every call (``eager`` is
    asked before every kernel, a dozen times a layer): its two flags read directly, or, in a PyTorch
    that keeps them elsewhere, the function itself."""
    try:
        from torch.onnx._internal.exporter import _flags
        from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
    except ImportError:
        return torch.onnx.is_in_onnx_export
    return lambda: GLOBALS.in_onnx_export or _flags._is_onnx_exporting


_exporting = _onnx_exporting()


def eager() -> bool:
    """Not tracing, compiling or exporting: the kernels (and nn/cache.py's buffers) stay out of graphs."""
    return not (torch.jit.is_tracing() or _compiling() or _exporting())


def _few_rows(x: Tensor, most: int = MAX_ROWS) -> bool:
    """At most ``most`` rows on the CPU, outside tracing, compiling and export."""
    return x.is_cpu and 0 < x.numel() <= most * x.size(-1) and eager()


def _inference(*tensors: Tensor) -> bool:
    """float32 tensors, none of which needs its gradient."""
    for t in tensors:  # (a loop, not all() over a generator: asked before every kernel)
        if t.dtype is not torch.float32:
            return False
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def _applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return _few_rows(x, PANEL_ROWS) and _inference(*tensors) and weight.is_contiguous()


_steps = 0  # optimizer steps taken in this process: fused Adam changes weights without bumping their _version


def _count_step(optimizer, args, kwargs) -> None:
    global _steps
    _steps += 1


register_optimizer_step_post_hook(_count_step)


def panels(weight: Tensor) -> Tensor:
    """``weight`` (n, k) in panels of 16 rows stored column by column, (ceil(n / 16), k, 16), zero
    rows padding the last: the layout of ``matmul_panels``. Made on first use and kept on the
    weight (a second copy of it: memory for speed, and only where 6-16 rows are multiplied); made
    again when the weight changes: its version, or any optimizer's step since (fused Adam writes
    weights without bumping their version)."""
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor keeps no version: the one made first stays
        version = None
    kept = getattr(weight, "_atencion_panels", None)
    if kept is not None and kept[0] == (version, _steps) and kept[1] == weight.data_ptr():
        return kept[2]
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // 16) * 16, k)
    padded[:n] = weight
    made = padded.view(-1, 16, k).transpose(1, 2).contiguous()
    weight._atencion_panels = ((version, _steps), weight.data_ptr(), made)
    return made


def _panels_of(weight: Tensor) -> Tensor | None:
    """``panels(weight)``; for rows ``start:stop`` of a larger matrix (cross-attention's projections),
    the whole matrix's panels that hold them where ``start`` is a multiple of 16 (the last panel may
    hold rows past ``stop``: the kernel stores ``stop − start`` outputs only), else None."""
    base = weight._base
    if base is None:
        return panels(weight)
    if base.dim() == 2 and base.is_contiguous() and base.size(1) == weight.size(1):
        start, rest = divmod(weight.data_ptr() - base.data_ptr(), weight.element_size() * weight.size(1))
        if rest == 0 and start % 16 == 0:
            return panels(base)[start // 16: start // 16 + -(-weight.size(0) // 16)]
    return None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``; a few float32 rows on the CPU go through the kernel."""
    if _applies(x, weight, bias) and kernel() is not None:  # (the kernels take x (..., k) and give (..., n))
        if x.numel() <= MAX_ROWS * x.size(-1):
            return _kernel(x, weight, bias)
        if _panels_kernel is not None and (laid_out := _panels_of(weight)) is not None:
            return _panels_kernel(x, laid_out, weight.size(0), bias)
    return F.linear(x, weight, bias)


def int8_linear(x: Tensor, weight: Tensor, scales: Tensor, sums: Tensor, bias: Tensor | None) -> Tensor | None:
    """The int8 kernels' ``x Wᵀ + b`` for float32 ``x`` (..., k), ``W = weight * scales[:, None]``
    (``weight`` int8, ``sums`` its rows' int32 sums): up to ``MAX_ROWS`` rows by dot products, up to
    ``PANEL_ROWS`` on ``int8_panels(weight)`` (AVX-512 VNNI from one row on, AVX2 from 3: where they beat
    the dot products). None where neither applies (more rows, another device, tracing, switched off):
    the caller then runs PyTorch's ``linear_dynamic``."""
    if not (_few_rows(x, PANEL_ROWS) and kernel() is not None):
        return None
    rows = x.numel() // x.size(-1)
    if _int8_panels_kernel is not None and rows >= _int8_panels_from:  # no sums across a vector
        return _int8_panels_kernel(x, int8_panels(weight), weight.size(0), scales, sums, bias)
    if rows <= MAX_ROWS and _kernel_int8 is not None:
        return _kernel_int8(x, weight, scales, sums, bias)
    return None


def int8_panels(weight: Tensor) -> Tensor:
    """An int8 ``weight`` (n, k) in VNNI's panels, (ceil(n / 16), ceil(k / 4), 16, 4): 4 consecutive
    weights of each of 16 rows in every 64 bytes, zeros padding rows and columns. Made on first use
    and kept on the weight (int8 weights do not change)."""
    kept = getattr(weight, "_atencion_panels", None)
    if kept is None:
        n, k = weight.shape
        padded = weight.new_zeros(-(-n // 16) * 16, -(-k // 4) * 4)
        padded[:n, :k] = weight
        kept = padded.view(-1, 16, padded.size(1) // 4, 4).transpose(1, 2).contiguous()
        weight._atencion_panels = kept
    return kept


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and state dict) whose product is ``linear`` above."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (the same parameter and state dict); up to ``SMALL_ROWS`` float32 rows on the CPU,
    in inference, are normalised by the kernel in one call instead of PyTorch's several."""

    def forward(self, x: Tensor) -> Tensor:
        if (_few_rows(x, SMALL_ROWS) and x.is_contiguous() and _inference(x, self.weight)
                and kernel() is not None and _rms_norm is not None):
            eps = torch.finfo(torch.float32).eps if self.eps is None else self.eps
            return _rms_norm(x, self.weight, eps)
        return super().forward(x)


def rotate_(projected: Tensor, heads: int, d_k: int, cos: Tensor, sin: Tensor) -> bool:
    """Turn the first ``heads`` heads of each position of ``projected`` (batch, length, n) by RoPE
    in place (the queries' and keys' heads, which the attention layer's projection puts first), with
    ``cos``, ``sin`` (length, d_k); True if done, False where the kernel does not apply (the caller
    then turns its queries and keys with PyTorch)."""
    if (projected.dim() == 3 and _few_rows(projected, SMALL_ROWS) and projected.is_contiguous()
            and _inference(projected, cos, sin) and cos.shape == sin.shape == (projected.size(1), d_k)
            and cos.is_contiguous() and sin.is_contiguous() and kernel() is not None and _rotate is not None):
        _rotate(projected, heads, d_k, cos, sin)
        return True
    return False


def attend_one(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor | None:
    """Eq. (1) for one query per head, ``q`` (batch, h, 1, d_k), over cached keys and values
    (batch, g, length, d_k) with g dividing h (grouped-query attention), by the kernel: the
    attention of a generation step, without copying the cache. ``scale`` None is 1/√d_k. None where
    the kernel does not apply (the caller then runs PyTorch's)."""
    if (q.dim() == 4 and q.size(2) == 1 and k.dim() == 4 and k.size(2) > 0 and q.size(1) % k.size(1) == 0
            and _few_rows(q, SMALL_ROWS * q.size(1))  # at most SMALL_ROWS rows of h queries
            and _inference(q, k, v) and kernel() is not None
            and _attend_one is not None and q.stride(3) == k.stride(3) == v.stride(3) == 1
            and q.size(3) % 16 == 0 and q.size(3) <= 256):
        return _attend_one(q, k, v, q.size(3) ** -0.5 if scale is None else scale)
    return None
