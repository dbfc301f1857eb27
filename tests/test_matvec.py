"""The matrix-vector kernels of decoding on the CPU (atencion/nn/matvec.cpp): the float32 one gives
F.linear's products to float32 rounding, the int8 one PyTorch's dynamic int8 linear's; each is used
exactly where it applies, and decoding with it equals decoding without it."""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from atencion.nn import matvec
from atencion.nn.transformer import Transformer
from conftest import small_config


def x86_compiler() -> str:
    """The C++ compiler that builds the kernels, on an x86-64 machine (their instruction sets are x86's); else skip."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("no C++ compiler, or not an x86-64 machine")
    return compiler


@pytest.mark.parametrize("arch", ["icelake-server", "skylake-avx512", "x86-64"])
def test_the_kernels_compile_for_every_instruction_set(arch):
    """Every branch of matvec.cpp compiles, whatever this machine's CPU builds for itself: AVX-512 with
    VNNI (int8 panels by vpdpbusd), AVX-512 without it (16-float vectors, AVX2's int8 products), and no
    SIMD at all (the portable loops). Syntax and every template used (-fsyntax-only instantiates them);
    the AVX-512 branches also run, emulated, in the next test."""
    compiler = x86_compiler()
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{path}" for path in (*include_paths(), sysconfig.get_paths()["include"])]
    result = subprocess.run([compiler, "-std=c++17", f"-march={arch}", "-fopenmp", "-fsyntax-only",
                             "-DTORCH_EXTENSION_NAME=atencion_matvec", *includes, str(matvec.SOURCE)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


def test_the_avx512_kernels_run_emulated(tmp_path):
    """The AVX-512 and VNNI branches run, on any x86-64 CPU: matvec.cpp built with SIMDe emulating those
    instructions (tests/avx512_by_simde.h, through ATENCION_MATVEC_CFLAGS, in a build folder of its own),
    and this file's and test_fused.py's kernel tests run against that build, none of them skipped for want
    of an instruction. Slow (about a minute to compile, emulated vectors), and only where SIMDe is installed."""
    if os.environ.get("ATENCION_MATVEC_CFLAGS"):
        pytest.skip("this run is the emulated build's own")
    if os.environ.get("ATENCION_MATVEC", "1") == "0":
        pytest.skip("ATENCION_MATVEC=0: the kernels are switched off")
    compiler = x86_compiler()
    header = Path(__file__).with_name("avx512_by_simde.h")
    found = subprocess.run([compiler, "-std=c++17", "-fsyntax-only", "-x", "c++", "-include", str(header), "-"],
                           input="", capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip("SIMDe's headers are not installed (Debian's libsimde-dev): " + found.stderr.strip()[:200])
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
           "ATENCION_MATVEC_CFLAGS": f"-include {shlex.quote(str(header))}"}
    tests = [str(Path(__file__)), str(Path(__file__).with_name("test_fused.py"))]
    result = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider",
                             "-k", "not every_instruction_set", *tests],
                            env=env, capture_output=True, text=True, cwd=tmp_path)
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and "emulated build's own" in skipped[0], report  # this test, and nothing else
    assert " passed" in result.stdout, report


@pytest.fixture(autouse=True)
def unmeasured(monkeypatch):
    """The kernels wherever they apply, as with ATENCION_MATVEC=1: these tests check the kernels and where
    they apply; the measured choice between them and F.linear is test_kernels.py's."""
    matvec.kernel()
    monkeypatch.setattr(matvec.KERNELS, "policy", "always")


@pytest.fixture(scope="module")
def kernel():
    compiled = matvec.kernel()
    if compiled is None:
        pytest.skip("the kernel does not compile here (no C++ compiler or ninja, or ATENCION_MATVEC=0)")
    return compiled


@pytest.mark.parametrize("rows", range(1, matvec.MAX_ROWS + 1))
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_multiplies_as_f_linear_does(kernel, rows, bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 577, generator=generator)  # 577: no multiple of any vector width
    weight = torch.randn(1001, 577, generator=generator)
    b = torch.randn(1001, generator=generator) if bias else None
    torch.testing.assert_close(kernel(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    rows_of = weight[300:700]  # the cross-attention slices: contiguous rows of a larger matrix
    torch.testing.assert_close(kernel(x, rows_of, None), F.linear(x, rows_of), rtol=1e-5, atol=1e-4)


def test_the_kernel_is_used_for_a_few_rows_in_inference_only(kernel, monkeypatch):
    calls = []

    def spy(x, weight, bias):
        calls.append(tuple(x.shape))
        return kernel(x, weight, bias)

    monkeypatch.setattr(matvec.KERNELS, "matvec", spy)
    weight = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(2, 1, 32)
    with torch.no_grad():
        out = matvec.linear(x, weight)
    assert calls == [(2, 1, 32)] and out.shape == (2, 1, 64)  # the layer's tensor as it is: no reshaping
    torch.testing.assert_close(out, F.linear(x, weight.detach()), rtol=1e-5, atol=1e-5)

    calls.clear()
    trained = matvec.linear(x, weight)  # a gradient to compute: F.linear
    trained.sum().backward()
    assert weight.grad is not None
    bias = torch.zeros(64, requires_grad=True)  # a frozen weight, a trained bias (BitFit): F.linear
    matvec.linear(x, weight.detach(), bias).sum().backward()
    assert torch.equal(bias.grad, torch.full((64,), 2.0))
    with torch.no_grad():
        matvec.linear(torch.randn(matvec.MAX_ROWS + 1, 32), weight)  # more rows: the panels' kernel, not this
        matvec.linear(x.double(), weight.double())                  # not float32
        matvec.linear(x, weight.t().contiguous().t())               # a transposed view
    assert calls == []


def test_switched_off_by_the_environment_f_linear_alone(monkeypatch, tmp_path):
    monkeypatch.setenv("ATENCION_MATVEC", "0")
    monkeypatch.setattr(matvec, "KERNELS", matvec.Kernels(root=tmp_path))
    assert matvec.kernel() is None and matvec.KERNELS.reason == "switched off (ATENCION_MATVEC=0)"
    assert list(tmp_path.iterdir()) == []  # nothing built
    x, weight = torch.randn(1, 8), torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(matvec.linear(x, weight), F.linear(x, weight))


def test_a_decoder_generates_the_same_with_and_without_it(kernel, monkeypatch):
    monkeypatch.setenv("ATENCION_FUSED", "0")  # layer by layer (test_fused.py: all the layers in one call)
    torch.manual_seed(0)
    cfg = small_config(arch="decoder", dropout=0.0, norm="rmsnorm", norm_first=True, positional="rope",
                       activation="swiglu", d_model=64, d_ff=128, n_heads=4, n_kv_heads=2, bias=False)
    model = Transformer(cfg).eval()  # d_k 16: attend_one applies
    prompt = torch.randint(4, cfg.vocab_size, (3, 6))

    def greedy(steps: int = 12):
        ids, state, logits = prompt, model.init_state(), []
        with torch.no_grad():
            step = model.decode_step(ids, state, last=1)
            for _ in range(steps):
                logits.append(step[:, -1])
                ids = torch.cat([ids, step[:, -1].argmax(-1, keepdim=True)], 1)
                step = model.decode_step(ids[:, -1:], state)
        return ids, torch.stack(logits, 1)

    calls = []
    names = ("matvec", "rms_norm", "rotate") + (("attend_one",) if matvec.KERNELS.attend_one is not None else ())
    for name in names:
        compiled = getattr(matvec.KERNELS, name)
        monkeypatch.setattr(matvec.KERNELS, name, lambda *a, name=name, compiled=compiled: calls.append(name)
                            or compiled(*a))
    with_kernel = greedy()
    assert set(calls) == set(names)  # the three rows of each step went through them
    for name in names:
        monkeypatch.setattr(matvec.KERNELS, name, None)
    without = greedy()
    assert torch.equal(with_kernel[0], without[0])
    torch.testing.assert_close(with_kernel[1], without[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 1), (1, 3), (2, 2, 1), (3,)])
def test_the_kernels_take_any_leading_shape_and_give_it_back(kernel, shape):
    """(..., k) in, (..., n) out, equal to the same rows given as a matrix, for every kernel a layer
    calls; a non-contiguous x too (made contiguous inside)."""
    generator = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, 577, generator=generator)
    rows = x.reshape(-1, 577)
    weight = torch.randn(1001, 577, generator=generator)
    bias = torch.randn(1001, generator=generator)
    layer = int8_layer(1001, 577, True, 3)
    products = [lambda x: kernel(x, weight, bias),
                lambda x: matvec.KERNELS.matvec_int8(x, layer._int8, layer._scales, layer._sums, layer.bias)]
    if matvec.KERNELS.matmul_panels is not None:
        products.append(lambda x: matvec.KERNELS.matmul_panels(x, matvec.panels(weight), 1001, bias))
    if matvec.KERNELS.matmul_int8_panels is not None:
        products.append(lambda x: matvec.KERNELS.matmul_int8_panels(x, matvec.int8_panels(layer._int8), 1001,
                                                             layer._scales, layer._sums, layer.bias))
    for product in products:
        got = product(x)
        assert got.shape == (*shape, 1001)
        assert torch.equal(got.reshape(-1, 1001), product(rows))
    strided = torch.randn(577, rows.size(0), generator=generator).t()  # (rows, 577), not contiguous
    assert torch.equal(kernel(strided, weight, bias), kernel(strided.contiguous(), weight, bias))
    gain = torch.randn(577, generator=generator)
    rms_norm = matvec.KERNELS.rms_norm
    assert torch.equal(rms_norm(x, gain, 1e-5).reshape(-1, 577), rms_norm(rows, gain, 1e-5))


@pytest.fixture(scope="module")
def kernel_int8(kernel):
    return matvec.KERNELS.matvec_int8


def int8_layer(n: int, k: int, bias: bool, seed: int):
    from atencion.nn.quantize import Int8Linear

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.05
    weight[7] *= 30  # a row of its own range: the per-row scales
    return Int8Linear(weight, torch.randn(n, generator=generator) if bias else None)


@pytest.mark.parametrize("rows", range(1, matvec.MAX_ROWS + 1))
@pytest.mark.parametrize("bias", [False, True])
def test_the_int8_kernel_computes_what_pytorchs_dynamic_int8_linear_does(kernel_int8, rows, bias):
    layer = int8_layer(1001, 577, bias, rows)
    generator = torch.Generator().manual_seed(10 + rows)
    for x in (torch.randn(rows, 577, generator=generator),        # a zero point inside the range
              torch.rand(rows, 577, generator=generator) + 0.5,   # all positive: zero point 0
              -torch.rand(rows, 577, generator=generator),        # all negative: zero point 127
              torch.zeros(rows, 577)):                            # no range at all
        want = torch.ops.quantized.linear_dynamic(x, layer._packed, True)
        got = kernel_int8(x, layer._int8, layer._scales, layer._sums, layer.bias)
        # the same int32 sums, rescaled the same way: equal but for the float rounding of the bias' sum
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_int8_layers_use_the_kernels_for_up_to_16_rows_and_fbgemm_for_more(kernel_int8, monkeypatch):
    calls = []
    monkeypatch.setattr(matvec.KERNELS, "matvec_int8",
                        lambda *a: calls.append(("dots", a[0].size(0))) or kernel_int8(*a))
    panels = matvec.KERNELS.matmul_int8_panels
    if panels is not None:
        monkeypatch.setattr(matvec.KERNELS, "matmul_int8_panels", lambda *a: calls.append(("panels", a[0].size(0)))
                            or panels(*a))
    layer = int8_layer(64, 32, True, 0)
    with torch.no_grad():
        few = layer(torch.ones(2, 1, 32))
        more = layer(torch.ones(matvec.PANEL_ROWS, 32))
        many = layer(torch.ones(matvec.PANEL_ROWS + 1, 32))
    # the panels take from 1 row (AVX-512 VNNI) or 3 (AVX2) up to 16, where they are faster; the dot products fewer
    two = ("panels" if panels is not None and matvec.KERNELS.int8_panels_from <= 2 else "dots", 2)
    assert calls == ([two, ("panels", matvec.PANEL_ROWS)] if panels is not None else [two])
    assert few.shape == (2, 1, 64)
    torch.testing.assert_close(few[:, 0], many[:2], rtol=1e-6, atol=1e-6)  # fbgemm's rows: the same values
    torch.testing.assert_close(more, many[:-1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 3, matvec.MAX_ROWS + 1, 7, 11, matvec.PANEL_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_the_int8_panels_kernel_computes_what_pytorchs_dynamic_int8_linear_does(kernel_int8, rows, bias):
    if matvec.KERNELS.matmul_int8_panels is None:
        pytest.skip("the kernel was compiled without AVX-512 VNNI: the dot products or fbgemm")
    layer = int8_layer(1001, 577, bias, rows)  # 1001 rows, 577 columns: padding in both
    generator = torch.Generator().manual_seed(20 + rows)
    for x in (torch.randn(rows, 577, generator=generator), torch.rand(rows, 577, generator=generator) + 0.5,
              -torch.rand(rows, 577, generator=generator), torch.zeros(rows, 577)):
        want = torch.ops.quantized.linear_dynamic(x, layer._packed, True)
        got = matvec.KERNELS.matmul_int8_panels(x, matvec.int8_panels(layer._int8), 1001, layer._scales, layer._sums,
                                         layer.bias)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_an_int8_decoder_generates_the_same_with_and_without_it(kernel_int8, monkeypatch):
    from atencion.nn.quantize import quantize_int8

    torch.manual_seed(1)
    cfg = small_config(arch="decoder", dropout=0.0, norm="rmsnorm", norm_first=True, positional="rope",
                       activation="swiglu", n_heads=4, n_kv_heads=2, bias=False)
    model = quantize_int8(Transformer(cfg))
    prompt = torch.randint(4, cfg.vocab_size, (2, 5))

    def greedy(steps: int = 10):
        ids, state = prompt, model.init_state()
        with torch.no_grad():
            step = model.decode_step(ids, state, last=1)
            for _ in range(steps):
                ids = torch.cat([ids, step[:, -1].argmax(-1, keepdim=True)], 1)
                step = model.decode_step(ids[:, -1:], state)
        return ids, step

    calls = []
    kernels = [name for name in ("matvec_int8", "matmul_int8_panels") if getattr(matvec.KERNELS, name) is not None]
    for name in kernels:
        compiled = getattr(matvec.KERNELS, name)
        monkeypatch.setattr(matvec.KERNELS, name, lambda *a, compiled=compiled: calls.append(1) or compiled(*a))
    with_kernel = greedy()
    assert calls
    for name in kernels:
        monkeypatch.setattr(matvec.KERNELS, name, None)
    without = greedy()  # fbgemm's
    assert torch.equal(with_kernel[0], without[0])
    torch.testing.assert_close(with_kernel[1], without[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, matvec.SMALL_ROWS])
def test_the_rms_norm_kernel_normalises_as_torch_does(kernel, rows):
    norm = matvec.RMSNorm(577, eps=1e-5)
    reference = torch.nn.RMSNorm(577, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
        reference.weight.copy_(norm.weight)
    x = torch.randn(rows, 1, 577) * 3
    calls = []
    compiled = matvec.KERNELS.rms_norm
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(matvec.KERNELS, "rms_norm", lambda *a: calls.append(1) or compiled(*a))
        got = norm(x)
        many = norm(torch.randn(matvec.SMALL_ROWS + 1, 577))  # more rows: PyTorch's
    assert calls == [1] and many.shape == (matvec.SMALL_ROWS + 1, 577)
    torch.testing.assert_close(got, reference(x), rtol=1e-5, atol=1e-5)
    assert norm(x).grad_fn is not None  # with gradients to compute: nn.RMSNorm's own


@pytest.mark.parametrize("length", [1, 4])
def test_the_rope_kernel_turns_queries_and_keys_as_rotate_does(kernel, length):
    from atencion.nn.attention import RelativeTerms
    from atencion.nn.positional import RotaryPositions

    heads, kv_heads, d_k = 4, 2, 10
    projected = torch.randn(3, length, (heads + 2 * kv_heads) * d_k)
    terms = RelativeTerms(rotary=RotaryPositions(d_k).angles(torch.arange(5, 5 + length)))
    split = projected.view(3, length, -1, d_k).transpose(1, 2)
    want_q, want_k = terms.rotate(split[:, :heads]), terms.rotate(split[:, heads:heads + kv_heads])
    values = split[:, heads + kv_heads:].clone()
    with torch.no_grad():
        assert matvec.rotate_(projected, heads + kv_heads, d_k, *terms.rotary)
    turned = projected.view(3, length, -1, d_k).transpose(1, 2)
    torch.testing.assert_close(turned[:, :heads], want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(turned[:, heads:heads + kv_heads], want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(turned[:, heads + kv_heads:], values)  # the values are not turned
    assert not matvec.rotate_(projected.requires_grad_(), heads + kv_heads, d_k, *terms.rotary)  # autograd: no


@pytest.fixture(scope="module")
def panels_kernel(kernel):
    if matvec.KERNELS.matmul_panels is None:
        pytest.skip("the kernel was compiled without AVX-512: 6-16 rows go to F.linear")
    return matvec.KERNELS.matmul_panels


@pytest.mark.parametrize("rows", [matvec.MAX_ROWS + 1, 7, 11, matvec.PANEL_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_the_panels_kernel_multiplies_as_f_linear_does(panels_kernel, rows, bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 577, generator=generator)
    weight = torch.randn(1001, 577, generator=generator)  # 1001: the last panel is partly padding
    b = torch.randn(1001, generator=generator) if bias else None
    got = panels_kernel(x, matvec.panels(weight), 1001, b)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_6_to_16_rows_use_the_panels_made_once_and_again_when_the_weight_changes(panels_kernel, monkeypatch):
    calls = []
    monkeypatch.setattr(matvec.KERNELS, "matmul_panels", lambda x, p, n, b: calls.append((x.size(0), p.data_ptr()))
                        or panels_kernel(x, p, n, b))
    layer = matvec.Linear(32, 40)
    with torch.no_grad():
        for rows in (matvec.MAX_ROWS + 1, matvec.PANEL_ROWS, matvec.PANEL_ROWS + 1):
            out = layer(torch.ones(rows, 1, 32))
            torch.testing.assert_close(out, F.linear(torch.ones(rows, 1, 32), layer.weight, layer.bias))
        assert [r for r, _ in calls] == [matvec.MAX_ROWS + 1, matvec.PANEL_ROWS]  # 17 rows: F.linear's
        assert calls[0][1] == calls[1][1]  # the same panels: made once
        layer.weight.mul_(2)  # a changed weight (an optimiser's step, a loaded state dict): new panels
        torch.testing.assert_close(layer(torch.ones(8, 32)), F.linear(torch.ones(8, 32), layer.weight, layer.bias))
    assert calls[2][0] == 8 and calls[2][1] != calls[0][1]


def test_rows_of_a_larger_matrix_use_its_panels_where_they_start_a_panel(panels_kernel, monkeypatch):
    made = []
    real = matvec.panels
    monkeypatch.setattr(matvec, "panels", lambda w: made.append(tuple(w.shape)) or real(w))
    weight, x = torch.randn(96, 24), torch.randn(7, 24)
    with torch.no_grad():
        for start, stop in ((32, 64), (16, 90), (0, 96), (8, 40)):  # the last starts inside a panel: F.linear
            torch.testing.assert_close(matvec.linear(x, weight[start:stop]), F.linear(x, weight[start:stop]),
                                       rtol=1e-5, atol=1e-5)
    assert made == [(96, 24)] * 3  # the whole matrix's panels each time, never a slice's


@pytest.mark.parametrize("fused", [False, True])
def test_panels_are_made_again_after_an_optimizer_step(panels_kernel, fused):
    """Fused Adam writes the weights without bumping their version: the panels follow every step."""
    layer = matvec.Linear(32, 40)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1, fused=fused)
    x = torch.randn(8, 32)
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def attend_kernel(kernel):
    if matvec.KERNELS.attend_one is None:
        pytest.skip("the kernel was compiled without AVX-512 or AVX2: attention goes to PyTorch's")
    return matvec.KERNELS.attend_one


@pytest.mark.parametrize("shape", [(16, 9, 3, 120, 64), (1, 4, 4, 1, 32), (3, 8, 1, 17, 16), (2, 6, 2, 33, 48),
                                   (2, 2, 2, 300, 256)])
def test_one_query_attends_as_torchs_attention_does(attend_kernel, shape):
    b, h, g, length, d = shape  # GQA (g < h), multi-query (g = 1), one key, 17 keys (a partial block of 16)
    generator = torch.Generator().manual_seed(length)
    q = torch.randn(b, h, 1, d, generator=generator)
    k = torch.randn(b, g, length, d, generator=generator) * 3  # peaked weights
    v = torch.randn(b, g, length, d, generator=generator)
    got = matvec.attend_one(q, k, v, None)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, enable_gqa=g != h), rtol=1e-5, atol=1e-5)
    assert got.transpose(1, 2).is_contiguous()  # the heads side by side: the output projection's input as a view
    torch.testing.assert_close(matvec.attend_one(q, k, v, 0.5),
                               F.scaled_dot_product_attention(q, k, v, scale=0.5, enable_gqa=g != h),
                               rtol=1e-5, atol=1e-5)


def test_weights_far_below_the_largest_underflow_to_zero_and_not_to_garbage(attend_kernel):
    """Scores exact by construction (one feature), 0 to 300 below the largest: the weights of those
    more than 87 below are under float32's least normal number (AVX2's exponential gives 0, AVX-512's
    subnormals), nothing beside the largest's 1; the output is the float64 softmax's to rounding."""
    scores = torch.tensor([-1.0, 0.0, -3.5, -50.0, -86.0, -87.5, -88.0, -100.0, -103.0, -104.0, -105.0, -126.0,
                           -150.0, -200.0, -300.0, -2.0, -0.5, -90.0, -1000.0])  # 19 keys: a partial block
    q = torch.zeros(1, 2, 1, 32)
    q[0, :, 0, 0] = 1.0
    k = torch.zeros(1, 1, scores.numel(), 32)
    k[0, 0, :, 0] = scores
    v = torch.randn(1, 1, scores.numel(), 32, generator=torch.Generator().manual_seed(0))
    expected = (scores.double().softmax(0) @ v[0, 0].double()).float().expand(1, 2, 1, 32)
    torch.testing.assert_close(matvec.attend_one(q, k, v, 1.0), expected, rtol=1e-6, atol=1e-6)


def test_one_query_attends_over_strided_views_of_a_cache(attend_kernel):
    generator = torch.Generator().manual_seed(0)
    projected = torch.randn(4, 1, (6 + 2 * 2) * 32, generator=generator)  # in_proj's output: q, k, v side by side
    q = projected[..., :192].view(4, 1, 6, 32).transpose(1, 2)
    buffers = torch.randn(2, 4, 2, 50, 32, generator=generator)  # room for 50 keys, 37 written
    k, v = buffers[0, :, :, :37], buffers[1, :, :, :37]
    torch.testing.assert_close(matvec.attend_one(q, k, v, None),
                               F.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), enable_gqa=True),
                               rtol=1e-5, atol=1e-5)


def test_attention_uses_the_kernel_for_one_query_without_a_mask_only(attend_kernel, monkeypatch):
    from atencion.nn.attention import scaled_dot_product_attention

    calls = []
    monkeypatch.setattr(matvec.KERNELS, "attend_one", lambda *a: calls.append(a[0].shape) or attend_kernel(*a))
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 5, 16)
    scaled_dot_product_attention(q, k, k)
    assert len(calls) == 1
    scaled_dot_product_attention(q, k, k, mask=torch.ones(2, 1, 1, 5, dtype=torch.bool))  # a mask: torch's
    scaled_dot_product_attention(torch.randn(2, 4, 3, 16), k, k)  # three queries: torch's
    scaled_dot_product_attention(q, k, k, need_weights=True)  # the weights asked for: the explicit path
    scaled_dot_product_attention(q.requires_grad_(), k, k)  # a gradient to follow: torch's
    assert len(calls) == 1
