"""The decoding kernels' build and choice (atencion/nn/matvec.py ``Kernels``): a build folder per CPU, one
warning line and F.linear where nothing can be built, the kernel used only where it was measured faster,
the record later processes read, the server's warm-up and ``atencion kernels``."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from atencion.nn import fused, matvec
from atencion.nn.transformer import Transformer
from conftest import small_config

AVX2 = matvec.Cpu("Some CPU", ("avx", "avx2", "fma", "sse2"))
AVX512 = matvec.Cpu("Some CPU", ("avx", "avx2", "avx512f", "fma", "sse2"))


def test_cpuinfo_is_read_for_its_model_name_and_flags():
    text = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Gold\nflags\t\t: fpu avx2 sse2 avx2\n\n"
            "processor\t: 1\nmodel name\t: another\nflags\t\t: fpu\n")
    assert matvec.Cpu.parse(text) == matvec.Cpu("Intel(R) Xeon(R) Gold", ("avx2", "fpu", "sse2"))
    assert matvec.Cpu.parse("processor : 0\nFeatures : fp asimd\nCPU part : 0xd0c\n").flags == ("asimd", "fp")


def test_the_build_name_differs_for_other_flags_a_model_or_compiler_flags():
    names = {matvec.build_name(AVX2), matvec.build_name(AVX512), matvec.build_name(matvec.Cpu("Other CPU", AVX2.flags)),
             matvec.build_name(AVX2, ["-include", "x.h"])}
    assert len(names) == 4 and all(name.startswith("atencion_matvec_") and name.isidentifier() for name in names)
    assert matvec.build_name(AVX2) == matvec.build_name(matvec.Cpu("Some CPU", AVX2.flags))  # the same CPU: the same


def fake_build(kernels: matvec.Kernels) -> None:
    """What a build leaves: the library and its record (a stand-in library: never imported here)."""
    kernels.directory.mkdir(parents=True)
    (kernels.directory / f"{kernels.name}.so").write_bytes(b"not a library")
    kernels._write({"cpu": {"model": kernels.for_cpu.model}, "build": kernels.stamp(), "choices": {}})


def test_a_build_for_one_cpu_is_never_loaded_on_another(tmp_path, monkeypatch):
    fake_build(matvec.Kernels(root=tmp_path, cpu=AVX512))
    assert matvec.Kernels(root=tmp_path, cpu=AVX512).built()
    other = matvec.Kernels(root=tmp_path, cpu=AVX2)  # a home shared with an AVX2 machine
    assert not other.built() and other.directory != matvec.Kernels(root=tmp_path, cpu=AVX512).directory
    imported = []
    monkeypatch.setattr(matvec.Kernels, "_import", lambda self: imported.append(self.name))
    assert other.load(build=False) is None and other.reason == "not built for this CPU" and imported == []
    changed = matvec.Kernels(root=tmp_path, cpu=AVX512)
    monkeypatch.setattr(matvec, "_source_digest", lambda: "another source")  # matvec.cpp edited: built again
    assert not changed.built()


def test_without_a_compiler_one_warning_line_and_f_linear(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no c++, no ninja on PATH
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("ATENCION_MATVEC", raising=False)
    kernels = matvec.Kernels(root=tmp_path / "builds", cpu=AVX2)
    monkeypatch.setattr(matvec, "KERNELS", kernels)
    with caplog.at_level(logging.WARNING, logger="atencion.nn.matvec"):
        assert matvec.kernel() is None and matvec.kernel() is None  # tried once
        x, weight = torch.randn(1, 8), torch.randn(4, 8)
        with torch.no_grad():
            assert torch.equal(matvec.linear(x, weight), F.linear(x, weight))
    (record,) = caplog.records
    assert "no C++ compiler (c++ is not on PATH" in record.getMessage() and "uses F.linear" in record.getMessage()
    assert "\n" not in record.getMessage() and not (tmp_path / "builds").exists()


@pytest.fixture
def loaded(tmp_path):
    """This process's kernels with a record of their own (under tmp_path), the choices measured."""
    if matvec.kernel() is None:
        pytest.skip("the kernels are not built here")
    real = matvec.KERNELS
    kernels = matvec.Kernels(root=tmp_path, cpu=real.for_cpu, policy="measured", tried=True)
    for name in ("module", "matvec", "matvec_int8", "rms_norm", "rotate", "matmul_panels", "matmul_int8_panels",
                 "int8_panels_from", "attend_one", "decoder_step"):
        setattr(kernels, name, getattr(real, name))
    kernels.directory.mkdir(parents=True)
    kernels._write({"cpu": {"model": kernels.for_cpu.model}, "build": kernels.stamp(), "choices": {}})
    return kernels


def test_a_measured_choice_is_recorded_and_read_by_a_later_process(loaded):
    import time

    start = time.perf_counter()
    won = loaded.measure(1536, 576, 1)
    assert time.perf_counter() - start < 5  # a fraction of a second alone on a machine
    threads = torch.get_num_threads()
    ours, theirs = loaded.timings[1536, 576, 1, threads]
    assert won == (ours < theirs) and ours > 0 and theirs > 0
    later = matvec.Kernels(root=loaded.root, cpu=loaded.cpu)
    later._read_choices()
    assert later.choices == {(1536, 576, 1, threads): won}
    assert later.record()["choices"][f"1536,576,1,{threads}"]["use"] == ("kernel" if won else "linear")


def test_the_kernel_is_used_only_where_it_won(loaded, monkeypatch):
    threads = torch.get_num_threads()
    loaded.choices.update({(64, 32, 1, threads): True, (48, 32, 1, threads): False, (64, 32, 8, threads): False})
    calls = []
    for name in ("matvec", "matmul_panels"):
        real = getattr(loaded, name)
        monkeypatch.setattr(loaded, name, lambda *a, name=name, real=real: calls.append(name) or real(*a))
    monkeypatch.setattr(loaded, "measure", lambda *a, **k: pytest.fail("measured again"))
    monkeypatch.setattr(matvec, "KERNELS", loaded)
    with torch.no_grad():
        for rows, n in ((1, 64), (1, 48), (8, 64)):  # the kernel's, F.linear's, F.linear's
            x, weight = torch.randn(rows, 32), torch.randn(n, 32)
            torch.testing.assert_close(matvec.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert calls == ["matvec"]


def _llama(d_model: int = 64) -> Transformer:
    torch.manual_seed(0)
    return Transformer(small_config(arch="decoder", norm="rmsnorm", norm_first=True, positional="rope",
                                    activation="swiglu", bias=False, dropout=0.0, d_model=d_model, d_ff=96,
                                    n_heads=4)).eval()


def _decodes_whole(model: Transformer) -> bool:
    """Whether two greedy steps of ``model`` went through the whole-step kernel (``DecoderState.fused``)."""
    state = model.init_state()
    with torch.no_grad():
        model.decode_step(torch.tensor([[5]]), state)
        model.decode_step(torch.tensor([[6]]), state)
    return bool(state.fused)


@pytest.mark.parametrize("fused_faster", [True, False])
def test_the_whole_step_runs_where_it_was_measured_faster_than_the_layers_and_the_choice_is_kept(
        loaded, monkeypatch, fused_faster):
    if loaded.decoder_step is None:
        pytest.skip("no whole-step kernel here")
    monkeypatch.setattr(matvec, "KERNELS", loaded)
    timed = []
    monkeypatch.setattr(fused, "_time_whole_step", lambda *a: timed.append(a) or ((1e-3, 2e-3) if fused_faster
                                                                                  else (2e-3, 1e-3)))
    model = _llama()
    assert _decodes_whole(model) is fused_faster
    assert _decodes_whole(model) is fused_faster and len(timed) == 1  # measured once, then recorded
    (key, entry), = loaded.record()["whole_steps"].items()
    assert entry["use"] == ("fused" if fused_faster else "layers") and "rows 1" in key
    later = matvec.Kernels(root=loaded.root, cpu=loaded.cpu, policy="measured", tried=True)
    later._read_choices()  # another process reads the record: no measurement
    assert later.whole[key][0] is fused_faster
    other = _llama(d_model=128)  # another shape: measured on its own
    _decodes_whole(other)
    assert len(timed) == 2 and len(loaded.record()["whole_steps"]) == 2


def test_the_whole_step_is_timed_against_the_layers_on_the_model_itself(loaded, monkeypatch):
    if loaded.decoder_step is None:
        pytest.skip("no whole-step kernel here")
    monkeypatch.setattr(matvec, "KERNELS", loaded)
    model = _llama()
    with torch.no_grad():
        planned = fused.plan(model.decoder, 1)
    whole, layers = fused._time_whole_step(model.decoder, 1, (fused.layout(1), fused.for_kernel(planned)), steps=2,
                                          rounds=1)
    assert 0 < whole < 1 and 0 < layers < 1


def test_warm_measures_a_models_shapes_before_any_request(loaded, monkeypatch):
    monkeypatch.setattr(matvec, "KERNELS", loaded)
    model = Transformer(small_config(arch="decoder", d_model=32, d_ff=64, vocab_size=40))
    made = matvec.warm(model)
    assert {(n, k) for n, k, rows, _ in made} == {(96, 32), (32, 32), (64, 32), (32, 64), (40, 32)}
    assert all(rows == 1 for _, _, rows, _ in made)
    assert {key[:3] for key in loaded.choices} == {(n, k, 1) for n, k, _, _ in made}


def test_no_optimizer_hook_and_no_private_onnx_import_at_import():
    code = ("import torch.optim.optimizer as o; n = len(o._global_optimizer_post_hooks); "
            "import atencion.nn.matvec; print(len(o._global_optimizer_post_hooks) - n)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"
    assert "torch.onnx._internal" not in open(matvec.__file__).read()


def test_the_command_says_what_is_built_and_used(capsys):
    from atencion.cli import main

    assert main(["kernels", "status"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu: ") and "build: " in out and "used: " in out


def test_warm_makes_a_decoders_whole_step_choice_before_any_request(loaded, monkeypatch):
    if loaded.decoder_step is None:
        pytest.skip("no whole-step kernel here")
    monkeypatch.setattr(matvec, "KERNELS", loaded)
    timed = []
    monkeypatch.setattr(fused, "_time_whole_step", lambda *a: timed.append(a) or (1e-3, 2e-3))
    model = _llama()
    assert fused.warm(model) == [(1, True)] and len(timed) == 1
    assert _decodes_whole(model) and len(timed) == 1  # the first decoding measures nothing
    assert fused.warm(Transformer(small_config(arch="encoder-decoder"))) == []  # a translator: no whole step
