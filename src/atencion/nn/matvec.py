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
(``python -m benchmarks.matvec --rows 16``).

The kernels are compiled by ``torch.utils.cpp_extension`` on first use (about a minute, once per CPU;
under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR, in a folder named after a hash of this CPU's
model name and flags, ``build_name``: a home shared by machines of different CPUs never loads one's build
on the other), or by ``atencion kernels build``. A build made before is imported without ninja or a
compiler. Where none is built and ninja or a compiler is missing, one warning line says which and that
``F.linear`` is used. They are used only where they apply (float32 on the CPU, at most ``PANEL_ROWS``
rows, nothing to differentiate, not while tracing, compiling or exporting) and where they are faster:
the first time a weight's shape meets a number of rows (and of threads) the kernel and ``F.linear`` are
timed on it (``measure``: medians of a few passes over copies of the weight larger than the caches, a
fraction of a second), and the faster is used from then on, by this process and the later ones (the
record, kernels.json, lies beside the build; ``atencion kernels status`` shows it). ``ATENCION_MATVEC=1``
uses the kernels wherever they apply, unmeasured; ``ATENCION_MATVEC=0`` never. Both sum the same
products in different orders: outputs agree to float32 rounding. The loaded functions, the record and
the lock are held by one ``Kernels`` object, ``KERNELS``.

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

import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shlex
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

MAX_ROWS = 5  # a beam of 5: still 1.4× F.linear (benchmarks/matvec.py --rows 5); at 8 rows no faster than it
PANEL_ROWS = 16  # 6-16 rows: matmul_panels on a copy of the weight in panels (benchmarks/matvec.py --rows 16)
SMALL_ROWS = 64  # rms_norm's and rotate_'s kernels (one thread): a decoding step's rows; more go to PyTorch
SOURCE = Path(__file__).with_suffix(".cpp")  # the kernels' C++, compiled on first use
NAME = "atencion_matvec"
RECORD = "kernels.json"  # beside the build: what it was built from, for which CPU, and the measured choices
COLD_BYTES = 64 << 20  # measure's copies of a weight add up to this (more than a CPU's caches), 32 copies at most


@dataclass(frozen=True)
class Cpu:
    """What a build is for: the CPU's model name and its instruction-set flags (/proc/cpuinfo)."""

    model: str
    flags: tuple[str, ...]  # sorted

    @classmethod
    def parse(cls, cpuinfo: str) -> Cpu:
        """The first processor's "model name" and "flags" ("Features" on ARM) of a /proc/cpuinfo text."""
        fields: dict[str, str] = {}
        for line in cpuinfo.splitlines():
            if not line.strip():
                if fields:
                    break
                continue
            key, _, value = line.partition(":")
            fields.setdefault(key.strip().lower(), value.strip())
        flags = fields.get("flags") or fields.get("features") or ""
        return cls(fields.get("model name") or fields.get("cpu model") or platform.processor() or platform.machine(),
                   tuple(sorted(set(flags.split()))))

    @classmethod
    def here(cls) -> Cpu:
        try:
            return cls.parse(Path("/proc/cpuinfo").read_text(errors="replace"))
        except OSError:  # not Linux: the processor's name, which on most systems names its family
            return cls(platform.processor() or platform.machine(), ())

    @property
    def vector_width(self) -> str:
        """The widest float vectors the kernels use here: AVX-512, AVX2 (with FMA), or neither."""
        if "avx512f" in self.flags:
            return "AVX-512"
        return "AVX2" if "avx2" in self.flags else "no AVX2" if self.flags else "unknown"

    @property
    def vectors(self) -> str:
        """The instruction sets the kernels choose among, as this CPU has them."""
        have = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni") if f in self.flags]
        return " ".join(have) or "none of avx2, avx512f"


def build_name(cpu: Cpu, cflags: tuple[str, ...] | list[str] = ()) -> str:
    """The extension's name and build folder for ``cpu`` (and extra compiler flags): a short hash of its
    model name, flags and architecture, so that a build for one CPU is never loaded on another."""
    key = "\n".join([platform.machine(), cpu.model, " ".join(cpu.flags), " ".join(cflags)])
    return f"{NAME}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def missing_tools() -> list[str]:
    """What compiling the kernels needs and this machine lacks (a C++ compiler, ninja), in words."""
    missing = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing.append(f"no C++ compiler ({compiler} is not on PATH; set CXX)")
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the pip package puts its binary beside the interpreter)
            found = shutil.which("ninja", path=str(Path(sys.executable).parent))
        except ImportError:
            found = None
        if found is None:
            missing.append("no ninja (pip install ninja)")
    return missing


@functools.cache
def _source_digest() -> str:
    """The kernels' source, hashed (once a process: each measurement's record checks it)."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


@dataclass
class Kernels:
    """The compiled kernels of this CPU, loaded once (``load``), and the record of where each is faster
    than ``F.linear``. ``root``: where builds go (default $TORCH_EXTENSIONS_DIR or torch's); ``cpu``:
    the CPU they are for (default this one's). The functions are None until loaded, and where they do not
    apply (``matmul_panels``, ``attend_one``, ``decoder_step`` need AVX-512 or AVX2; the int8 panels VNNI
    or AVX2)."""

    root: Path | None = None
    cpu: Cpu | None = None
    policy: str | None = None  # "measured", "always" (ATENCION_MATVEC=1) or "off" (0); read at load
    tried: bool = False
    reason: str = ""  # why nothing was loaded, in words
    module: object = None
    matvec: object = None
    matvec_int8: object = None
    rms_norm: object = None
    rotate: object = None
    matmul_panels: object = None  # where compiled with AVX-512 or AVX2
    matmul_int8_panels: object = None  # with AVX-512 VNNI or AVX2
    int8_panels_from: int = 1  # the fewest rows the int8 panels take: where they beat the dot products (VNNI 1, AVX2 3)
    attend_one: object = None
    decoder_step: object = None
    choices: dict = field(default_factory=dict)  # (n, k, rows, threads) → True where the kernel won
    timings: dict = field(default_factory=dict)  # (n, k, rows, threads) → (kernel's s, F.linear's s)
    whole: dict = field(default_factory=dict)  # a decoder's shape, rows, threads (nn/fused.py) → (won, fused s,
                                               # layer by layer s): the whole-step kernel's record
    steps: int = 0  # optimizer steps since panels were first made (fused Adam does not bump _version)
    counting: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def for_cpu(self) -> Cpu:
        if self.cpu is None:  # read when first asked, not at import
            self.cpu = Cpu.here()
        return self.cpu

    @property
    def build_root(self) -> Path:
        if self.root is None:
            from torch.utils.cpp_extension import get_default_build_root

            self.root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
        return Path(self.root)

    @property
    def cflags(self) -> list[str]:
        # ATENCION_MATVEC_CFLAGS: more compiler flags (tests/test_matvec.py builds the AVX-512 branches so)
        return ["-O3", "-march=native", "-fopenmp", *shlex.split(os.environ.get("ATENCION_MATVEC_CFLAGS", ""))]

    @property
    def name(self) -> str:
        return build_name(self.for_cpu, self.cflags[3:])

    @property
    def directory(self) -> Path:
        return self.build_root / self.name

    def stamp(self) -> dict:
        """What a build is made from: the same stamp, the same library."""
        return {"source": _source_digest(), "cflags": self.cflags, "torch": torch.__version__,
                "python": sys.implementation.cache_tag}

    def record(self) -> dict:
        """kernels.json of this CPU's build, or {}."""
        try:
            return json.loads((self.directory / RECORD).read_text())
        except (OSError, ValueError):
            return {}

    def built(self) -> bool:
        """A library for this CPU, from this source and flags, is there to import."""
        return (self.directory / f"{self.name}.so").is_file() and self.record().get("build") == self.stamp()

    def load(self, build: bool = True) -> object:
        """Load (once; compiling where ``build`` and nothing is built) and return ``matvec``, or None."""
        if self.tried:
            return self.matvec
        with self.lock:
            if not self.tried:
                self._load(build)
                self.tried = build or self.matvec is not None
        return self.matvec

    def _load(self, build: bool) -> None:
        setting = os.environ.get("ATENCION_MATVEC", "auto")
        self.policy = self.policy or {"0": "off", "1": "always"}.get(setting, "measured")
        if self.policy == "off":
            self.reason = "switched off (ATENCION_MATVEC=0)"
            return
        try:
            if self.built():
                module = self._import()
            elif not build:
                self.reason = "not built for this CPU"
                return
            elif missing := missing_tools():
                self.reason = " and ".join(missing)
                log.warning("atencion's decoding kernels are not built for this CPU and cannot be: %s; decoding "
                            "on the CPU uses F.linear", self.reason)
                return
            else:
                module = self._compile()
        except Exception as err:  # a compiler error, another platform: F.linear, said once
            self.reason = (str(err).strip().splitlines() or [repr(err)])[0]
            log.warning("atencion's decoding kernels did not compile (%s); decoding on the CPU uses F.linear. "
                        "ATENCION_MATVEC=0 skips the attempt.", self.reason)
            return
        self.module = module
        self.matvec, self.matvec_int8, self.rms_norm, self.rotate = (module.matvec, module.matvec_int8,
                                                                     module.rms_norm, module.rotate_)
        self.matmul_panels = module.matmul_panels if module.simd else None
        self.attend_one = module.attend_one if module.simd else None
        self.decoder_step = module.decoder_step if module.simd else None
        self.matmul_int8_panels = module.matmul_int8_panels if module.int8_panels_from else None
        self.int8_panels_from = module.int8_panels_from
        self._read_choices()

    def _import(self):
        spec = importlib.util.spec_from_file_location(self.name, self.directory / f"{self.name}.so")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def _compile(self):
        from torch.utils.cpp_extension import load

        log.warning("compiling atencion's decoding kernels for this CPU (once, about a minute; "
                    "ATENCION_MATVEC=0 skips it)")
        self.directory.mkdir(parents=True, exist_ok=True)
        module = load(self.name, [str(SOURCE)], extra_cflags=self.cflags, extra_ldflags=["-fopenmp"],
                      build_directory=str(self.directory))
        self._write({"cpu": {"model": self.for_cpu.model, "flags": " ".join(self.for_cpu.flags)}, "build": self.stamp(),
                     "choices": {}})
        return module

    def _write(self, record: dict) -> None:
        """kernels.json written whole (another name, then renamed): a reader never sees half of it."""
        path = self.directory / RECORD
        try:
            temporary = path.with_name(f".{RECORD}.{os.getpid()}.{threading.get_ident()}")
            temporary.write_text(json.dumps(record, indent=1))
            os.replace(temporary, path)
        except OSError as err:  # a read-only cache: the choices last this process
            log.info("could not write %s (%s)", path, err)

    def _read_choices(self) -> None:
        record = self.record()
        for key, entry in record.get("choices", {}).items():
            try:
                n, k, rows, threads = (int(v) for v in key.split(","))
                self.choices[n, k, rows, threads] = entry["use"] == "kernel"
                self.timings[n, k, rows, threads] = (entry["kernel_s"], entry["linear_s"])
            except (ValueError, KeyError, TypeError):
                continue
        for key, entry in record.get("whole_steps", {}).items():
            try:
                self.whole[key] = (entry["use"] == "fused", float(entry["fused_s"]), float(entry["layers_s"]))
            except (KeyError, TypeError, ValueError):
                continue

    def whole_step_wins(self, key: str, time_both: Callable[[], tuple[float, float]]) -> bool:
        """Whether nn/fused.py's whole-step kernel decodes a step of the decoder ``key`` names (its shape,
        rows and threads) faster than its layers one by one, each product by whichever is faster for its
        shape: measured the first time (``time_both``: the seconds of each) and recorded. A whole step
        saves dozens of PyTorch calls per layer besides its products, so its products' choices alone do
        not decide it."""
        if self.policy != "measured":
            return True
        with self.lock:  # (reentrant: the layer by layer step asks ``wins`` of its products)
            if key not in self.whole:
                fused, layers = time_both()
                self.whole[key] = (fused < layers, fused, layers)
                log.info("whole decoding step %s: %.2f ms, layer by layer %.2f ms: %s", key, fused * 1e3,
                         layers * 1e3, "the whole-step kernel" if fused < layers else "layer by layer")
                record = self.record()
                if record.get("build") == self.stamp():
                    record.setdefault("whole_steps", {})[key] = {
                        "use": "fused" if fused < layers else "layers", "fused_s": fused, "layers_s": layers}
                    self._write(record)
            return self.whole[key][0]

    def wins(self, n: int, k: int, rows: int) -> bool:
        """Whether the kernel multiplies ``rows`` rows by an (n, k) weight faster than ``F.linear`` here,
        at torch's number of threads: measured the first time (``measure``) and recorded."""
        if self.policy != "measured":
            return True
        won = self.choices.get((n, k, rows, torch.get_num_threads()))
        return self.measure(n, k, rows) if won is None else won

    def measure(self, n: int, k: int, rows: int, again: bool = False) -> bool:
        """Time the kernel and ``F.linear`` (``time_products``), record which is faster, and return
        whether the kernel is. ``again``: measure even where a choice is recorded."""
        threads = torch.get_num_threads()
        with self.lock:
            if not again and (n, k, rows, threads) in self.choices:
                return self.choices[n, k, rows, threads]
            ours, theirs = time_products(self, n, k, rows)
            won = ours < theirs
            self.choices[n, k, rows, threads], self.timings[n, k, rows, threads] = won, (ours, theirs)
            log.info("decoding kernel for %d rows × (%d, %d), %d threads: %.1f µs, F.linear %.1f µs: %s", rows, n, k,
                     threads, ours * 1e6, theirs * 1e6, "the kernel" if won else "F.linear")
            record = self.record()
            if record.get("build") == self.stamp():
                record.setdefault("choices", {})[f"{n},{k},{rows},{threads}"] = {
                    "use": "kernel" if won else "linear", "kernel_s": ours, "linear_s": theirs}
                self._write(record)
            return won

    def count_steps(self) -> None:
        """Count optimizer steps from now on (``panels``' copies follow them): registered when the first
        panels are made, not at import, since only a weight with panels needs it."""
        with self.lock:
            if not self.counting:
                from torch.optim.optimizer import register_optimizer_step_post_hook

                register_optimizer_step_post_hook(self._count_step)
                self.counting = True

    def _count_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1


def time_products(kernels: Kernels, n: int, k: int, rows: int, repeats: int = 5) -> tuple[float, float]:
    """The median seconds of ``rows`` rows times an (n, k) weight by the kernel (dot products up to
    ``MAX_ROWS`` rows, panels past) and by ``F.linear``: each of ``repeats`` rounds runs both over copies of
    the weight adding up to ``COLD_BYTES`` (as decoding reads its weights: from memory, not from a cache),
    at least a millisecond's worth of products."""
    generator = torch.Generator().manual_seed(n * 31 + k)
    with torch.inference_mode():
        weight = torch.randn(n, k, generator=generator)
        copies = [weight] + [weight.clone() for _ in range(min(31, COLD_BYTES // (4 * n * k) - 1))]
        x = torch.randn(rows, k, generator=generator)
        if rows <= MAX_ROWS:
            ours, items = (lambda w: kernels.matvec(x, w, None)), copies
        else:
            ours, items = (lambda p: kernels.matmul_panels(x, p, n, None)), [panels(w) for w in copies]

        def seconds(product, over, times=1) -> float:
            start = time.perf_counter()
            for _ in range(times):
                for item in over:
                    product(item)
            return (time.perf_counter() - start) / (times * len(over))

        def theirs(w: Tensor) -> Tensor:
            return F.linear(x, w)

        once = max(seconds(ours, items), seconds(theirs, copies), 1e-7)  # (the first calls: warming up)
        times = max(1, int(1e-3 / (once * len(items))))
        mine, yours = [], []
        for _ in range(repeats):  # interleaved: a slower moment of the machine slows both
            mine.append(seconds(ours, items, times))
            yours.append(seconds(theirs, copies, times))
    return statistics.median(mine), statistics.median(yours)


KERNELS = Kernels()  # this process's kernels (its CPU and build folder read when first loaded)


def kernel():
    """The compiled ``matvec`` function (loading, or compiling, the kernels the first time), or None
    where they are switched off or cannot be built."""
    return KERNELS.load()


_tracing = torch.jit.is_tracing
_compiling = getattr(torch.compiler, "is_compiling", lambda: False)  # torch >= 2.3: torch.compile and torch.export
_exporting = getattr(torch.compiler, "is_exporting", lambda: False)  # torch.export (ONNX's exporter runs it)


def eager() -> bool:
    """Not tracing, compiling or exporting: the kernels (and nn/cache.py's buffers) stay out of graphs.
    (ONNX export goes through torch.export, or, in its TorchScript form, through torch.jit's tracer.)"""
    return not (_tracing() or _compiling() or _exporting())


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


def panels(weight: Tensor) -> Tensor:
    """``weight`` (n, k) in panels of 16 rows stored column by column, (ceil(n / 16), k, 16), zero
    rows padding the last: the layout of ``matmul_panels``. Made on first use and kept on the
    weight (a second copy of it: memory for speed, and only where 6-16 rows are multiplied); made
    again when the weight changes: its version, or any optimizer's step since (fused Adam writes
    weights without bumping their version; the step counter, ``Kernels.count_steps``, starts with the
    first panels made: a step before them changes nothing they copied)."""
    kernels = KERNELS
    if not kernels.counting:
        kernels.count_steps()
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor keeps no version: the one made first stays
        version = None
    kept = getattr(weight, "_atencion_panels", None)
    if kept is not None and kept[0] == (version, kernels.steps) and kept[1] == weight.data_ptr():
        return kept[2]
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // 16) * 16, k)
    padded[:n] = weight
    made = padded.view(-1, 16, k).transpose(1, 2).contiguous()
    weight._atencion_panels = ((version, kernels.steps), weight.data_ptr(), made)
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
    """``F.linear(x, weight, bias)``; a few float32 rows on the CPU go through the kernel where it
    is faster for the weight's shape (``Kernels.wins``)."""
    if _applies(x, weight, bias) and kernel() is not None:  # (the kernels take x (..., k) and give (..., n))
        kernels, rows = KERNELS, x.numel() // x.size(-1)
        if rows <= MAX_ROWS:
            if kernels.wins(weight.size(0), weight.size(1), rows):
                return kernels.matvec(x, weight, bias)
        elif (kernels.matmul_panels is not None and kernels.wins(weight.size(0), weight.size(1), rows)
              and (laid_out := _panels_of(weight)) is not None):
            return kernels.matmul_panels(x, laid_out, weight.size(0), bias)
    return F.linear(x, weight, bias)


def int8_linear(x: Tensor, weight: Tensor, scales: Tensor, sums: Tensor, bias: Tensor | None) -> Tensor | None:
    """The int8 kernels' ``x Wᵀ + b`` for float32 ``x`` (..., k), ``W = weight * scales[:, None]``
    (``weight`` int8, ``sums`` its rows' int32 sums): up to ``MAX_ROWS`` rows by dot products, up to
    ``PANEL_ROWS`` on ``int8_panels(weight)`` (AVX-512 VNNI from one row on, AVX2 from 3: where they beat
    the dot products). None where neither applies (more rows, another device, tracing, switched off):
    the caller then runs PyTorch's ``linear_dynamic``."""
    if not (_few_rows(x, PANEL_ROWS) and kernel() is not None):
        return None
    kernels, rows = KERNELS, x.numel() // x.size(-1)
    if kernels.matmul_int8_panels is not None and rows >= kernels.int8_panels_from:  # no sums across a vector
        return kernels.matmul_int8_panels(x, int8_panels(weight), weight.size(0), scales, sums, bias)
    if rows <= MAX_ROWS and kernels.matvec_int8 is not None:
        return kernels.matvec_int8(x, weight, scales, sums, bias)
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
                and kernel() is not None and KERNELS.rms_norm is not None):
            eps = torch.finfo(torch.float32).eps if self.eps is None else self.eps
            return KERNELS.rms_norm(x, self.weight, eps)
        return super().forward(x)


def rotate_(projected: Tensor, heads: int, d_k: int, cos: Tensor, sin: Tensor) -> bool:
    """Turn the first ``heads`` heads of each position of ``projected`` (batch, length, n) by RoPE
    in place (the queries' and keys' heads, which the attention layer's projection puts first), with
    ``cos``, ``sin`` (length, d_k); True if done, False where the kernel does not apply (the caller
    then turns its queries and keys with PyTorch)."""
    if (projected.dim() == 3 and _few_rows(projected, SMALL_ROWS) and projected.is_contiguous()
            and _inference(projected, cos, sin) and cos.shape == sin.shape == (projected.size(1), d_k)
            and cos.is_contiguous() and sin.is_contiguous() and kernel() is not None and KERNELS.rotate is not None):
        KERNELS.rotate(projected, heads, d_k, cos, sin)
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
            and KERNELS.attend_one is not None and q.stride(3) == k.stride(3) == v.stride(3) == 1
            and q.size(3) % 16 == 0 and q.size(3) <= 256):
        return KERNELS.attend_one(q, k, v, q.size(3) ** -0.5 if scale is None else scale)
    return None


def shapes_of(model: nn.Module) -> list[tuple[int, int]]:
    """The (n, k) shapes of ``model``'s float32 CPU products that ``linear`` may take: its linear layers'
    weights, and its embeddings' (a tied output layer multiplies by them)."""
    shapes = set()
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if ((isinstance(m, (nn.Linear, nn.Embedding)) or type(m).__name__.endswith("Embedding"))
                and isinstance(weight, Tensor) and weight.dim() == 2
                and weight.dtype is torch.float32 and weight.device.type == "cpu"):
            shapes.add(tuple(weight.shape))
    return sorted(shapes)


def warm(model: nn.Module, rows: tuple[int, ...] = (1,)) -> list[tuple[int, int, int, bool]]:
    """Load the kernels (compiling them, once per CPU) and make the choice between them and ``F.linear``
    for every shape of ``model`` (``shapes_of``) at each number of ``rows``, as its first decoding step
    would (measured where not recorded): (n, k, rows, the kernel's?) for each. The server calls it before it
    listens, so that no request pays for either."""
    if kernel() is None:
        return []
    kernels = KERNELS
    return [(n, k, r, kernels.wins(n, k, r)) for r in rows for n, k in shapes_of(model)
            if r <= MAX_ROWS or kernels.matmul_panels is not None]
