"""The course's figures and tables, computed here: sinusoidal positions (§3.5), Table 1 (§4),
and why attention divides by √d_k (§3.2.1).

Each figure has a function that computes its numbers (tested) and one that draws them
(matplotlib's Agg canvas: no display, no global backend). ``write_figures`` writes them all.
"""

from __future__ import annotations

import json
import logging
import math
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from ..fileio import atomic_write, need_output_dir
from ..nn.positional import sinusoidal_table
from . import table1

log = logging.getLogger(__name__)

DPI = 80


@dataclass
class FigureSettings:
    """What ``write_figures`` computes; ``full()`` for the documentation, ``quick()`` for a look."""

    table1_ns: tuple[int, ...] = tuple(2**i for i in range(6, 13))  # 64 … 4096
    repeats: int = 3
    d_model: int = 512
    n_heads: int = 8
    k: int = 3  # convolution kernel width
    r: int = 32  # neighbourhood of restricted self-attention
    d_ks: tuple[int, ...] = tuple(2**i for i in range(0, 11))  # 1 … 1024
    n_samples: int = 20000  # q·k pairs per d_k for the variance
    n_keys: int = 64  # keys per softmax row
    n_queries: int = 500  # softmax rows per d_k
    pe_positions: int = 100
    pe_d_model: int = 128
    seed: int = 0
    layers: list[str] = field(default_factory=lambda: list(table1.PAPER))

    @classmethod
    def full(cls) -> "FigureSettings":
        return cls()

    @classmethod
    def quick(cls) -> "FigureSettings":
        return cls(table1_ns=(64, 128, 256, 512), repeats=2, n_samples=5000, n_queries=200)

    @property
    def fit_from(self) -> int:
        """Exponents are fitted over the three largest n (n ≥ 1024 in the full run)."""
        return self.table1_ns[-3] if len(self.table1_ns) >= 3 else self.table1_ns[0]


def _plain_log_ticks(ax) -> None:
    """Label log axes 0.01, 64, 1000 rather than 10⁻², 2⁶, 10³ (the plots span several powers)."""
    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log":
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.set_minor_formatter(NullFormatter())


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=DPI, format="png"))
    return path


def _write_json(path: Path, data) -> Path:
    text = json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path


# --------------------------------------------------------------------------- §3.5 positions

def pe_dot_by_offset(d_model: int, starts: list[int], max_offset: int) -> torch.Tensor:
    """PE(p)·PE(p+k) for each start p (rows) and offset k = 0 … max_offset (columns).

    Σ_i sin(ω_i p) sin(ω_i (p+k)) + cos(ω_i p) cos(ω_i (p+k)) = Σ_i cos(ω_i k): it depends on k only.
    """
    table = sinusoidal_table(max(starts) + max_offset + 1, d_model).double()
    return torch.stack([table[p: p + max_offset + 1] @ table[p] for p in starts])


def positional_figures(out: Path, s: FigureSettings) -> list[Path]:
    table = sinusoidal_table(s.pe_positions, s.pe_d_model).numpy()
    fig = Figure(figsize=(7, 3.6))
    ax = fig.add_subplot()
    image = ax.imshow(table, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    fig.colorbar(image, ax=ax)
    ax.set(xlabel="dimension (even: sin, odd: cos)", ylabel="position",
           title=f"Sinusoidal positional encoding, {s.pe_positions} positions × d_model {s.pe_d_model}")
    files = [_save(fig, out / "pe_heatmap.png")]

    fig = Figure(figsize=(7, 3.6))
    ax = fig.add_subplot()
    d = s.pe_d_model
    for dim in sorted({0, 2 * (d // 16), 2 * (d // 8), 2 * (d // 4)}):  # even dimensions: sines
        wavelength = 2 * math.pi * 10000 ** (dim / d)
        ax.plot(table[:, dim], label=f"dim {dim} (wavelength {wavelength:.0f})")
    ax.set(xlabel="position", ylabel="PE", title="A few dimensions: high to low frequency")
    ax.legend(fontsize=7, loc="lower left")
    files.append(_save(fig, out / "pe_curves.png"))

    starts, max_offset = [0, 20, 50], 2 * s.pe_positions
    dots = pe_dot_by_offset(s.pe_d_model, starts, max_offset)
    fig = Figure(figsize=(7, 3.6))
    ax = fig.add_subplot()
    for p, row, style in zip(starts, dots.numpy(), ("-", "--", ":")):
        ax.plot(row, style, lw=2, label=f"p = {p}")
    ax.set(xlabel="offset k", ylabel="PE(p) · PE(p + k)",
           title=f"Dot product of positions k apart: the same curve for every p (d_model {s.pe_d_model})")
    ax.legend()
    files.append(_save(fig, out / "pe_dot_offset.png"))
    spread = (dots - dots[0]).abs().max().item()
    files.append(_write_json(out / "positional.json", {
        "d_model": s.pe_d_model, "starts": starts, "dot_at_offset": {
            str(k): round(dots[0, k].item(), 4) for k in (0, 1, 2, 5, 10, 20, 50, 100, 200) if k <= max_offset},
        "max_difference_between_starts": spread}))
    return files


# --------------------------------------------------------------------------- Table 1: path length

PATH_NOTE = ("Longest path, in layers (or recurrent steps), from an input position to an output "
             "position, computed from each layer's definition: recurrent n; self-attention 1; "
             "stacked contiguous convolutions ⌈(n−1)/(k−1)⌉; dilated convolutions ⌈log_k n⌉; "
             "restricted self-attention over a neighbourhood r (r/2 each side) ⌈(n−1)/(r/2)⌉.")


def path_lengths(ns: list[int], k: int, r: int) -> dict[str, list[int]]:
    return {
        "recurrent: O(n)": [table1.rnn_path_length(n) for n in ns],
        f"convolutional, contiguous (k={k}): O(n/k)": [table1.contiguous_conv_path_length(n, k) for n in ns],
        f"convolutional, dilated (k={k}): O(log_k n)": [table1.dilated_conv_path_length(n, k) for n in ns],
        f"restricted self-attention (r={r}): O(n/r)": [table1.restricted_attention_path_length(n, r) for n in ns],
        "self-attention: O(1)": [table1.self_attention_path_length(n) for n in ns],
    }


def path_length_figure(out: Path, s: FigureSettings) -> list[Path]:
    ns = sorted({round(2 ** (e / 8)) for e in range(8, 8 * 12 + 1)})  # 2 … 4096
    lengths = path_lengths(ns, s.k, s.r)
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for label, ys in lengths.items():
        ax.plot(ns, ys, lw=2, label=label)
    ax.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="maximum path length",
           title="Maximum path length between positions (Table 1, last column)")
    _plain_log_ticks(ax)
    ax.grid(True, which="major", ls="--", alpha=0.5)
    ax.legend(fontsize=8)
    powers = [2**i for i in range(1, 13)]
    return [_save(fig, out / "path_length.png"),
            _write_json(out / "path_length.json", {"note": PATH_NOTE, "k": s.k, "r": s.r, "n": powers,
                                                    "path_length": path_lengths(powers, s.k, s.r)})]


# --------------------------------------------------------------------------- Table 1: measured

def _fit(ns: list[int], ys: list[float]) -> float | None:
    """The fitted exponent, or None where a value is missing or 0 (memory below the page resolution)."""
    if len(ns) < 2 or any(y is None or y <= 0 for y in ys):
        return None
    return table1.fit_exponent(ns, ys)


def _exponent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def table1_results(points: list[table1.Point], s: FigureSettings) -> dict:
    """Measurements per layer with exponents fitted over n ≥ fit_from and over all n."""
    layers = {}
    for kind in s.layers:
        rows = [p for p in points if p.layer == kind]
        ns = [p.n for p in rows]
        big = [i for i, n in enumerate(ns) if n >= s.fit_from]
        seconds = [p.seconds for p in rows]
        mib = [None if p.peak_bytes is None else p.peak_bytes / 2**20 for p in rows]
        complexity, exponent, sequential, path = table1.PAPER[kind]
        layers[kind] = {
            "complexity": complexity, "expected_exponent": exponent, "sequential_operations": sequential,
            "maximum_path_length": path, "n": ns, "seconds": seconds, "peak_mib": mib,
            "time_exponent": _fit([ns[i] for i in big], [seconds[i] for i in big]),
            "memory_exponent": _fit([ns[i] for i in big], [mib[i] for i in big]),
            "time_exponent_all_n": _fit(ns, seconds),
            "memory_exponent_all_n": _fit(ns, mib),
        }
    settings = {"d_model": s.d_model, "batch": 1, "h": s.n_heads, "k": s.k, "r": s.r, "repeats": s.repeats,
                "n": list(s.table1_ns), "fit_from_n": s.fit_from, "torch": torch.__version__,
                "threads": torch.get_num_threads(), "machine": platform.machine(),
                "time": "median wall-clock of forward + backward after a warm-up",
                "memory": "growth of the resident set (VmHWM after reset) during one forward + backward"}
    return {"settings": settings, "layers": layers}


def table1_markdown(results: dict) -> str:
    st, layers = results["settings"], results["layers"]
    lines = [f"# Table 1, measured: one layer, forward + backward, d = {st['d_model']}, batch 1",
             "",
             f"torch {st['torch']}, {st['threads']} threads; time = {st['time']} (median of {st['repeats']}); "
             f"memory = {st['memory']}. Exponents are least-squares slopes of log y on log n over "
             f"n ≥ {st['fit_from_n']} (and over all n). h = {st['h']}, k = {st['k']}, r = {st['r']}.",
             "",
             "| layer | complexity per layer (paper) | sequential ops | max path length | paper's exponent in n "
             f"| time exponent, n ≥ {st['fit_from_n']} (all n) | memory exponent, n ≥ {st['fit_from_n']} (all n) |",
             "|---|---|---|---|---|---|---|"]
    for kind, row in layers.items():
        lines.append(f"| {kind} | {row['complexity']} | {row['sequential_operations']} | {row['maximum_path_length']} "
                     f"| {row['expected_exponent']} | {_exponent(row['time_exponent'])} "
                     f"({_exponent(row['time_exponent_all_n'])}) | {_exponent(row['memory_exponent'])} "
                     f"({_exponent(row['memory_exponent_all_n'])}) |")
    for title, key, scale, fmt in (("Time (ms)", "seconds", 1000, "{:.1f}"),
                                   ("Peak memory (MiB)", "peak_mib", 1, "{:.1f}")):
        lines += ["", f"## {title}", "", "| n | " + " | ".join(layers) + " |", "|---" * (len(layers) + 1) + "|"]
        for i, n in enumerate(st["n"]):
            cells = ("n/a" if row[key][i] is None else fmt.format(row[key][i] * scale) for row in layers.values())
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _loglog_figure(results: dict, key: str, ylabel: str, title: str) -> Figure:
    fig = Figure(figsize=(7, 4.4))
    ax = fig.add_subplot()
    fit_from = results["settings"]["fit_from_n"]
    exponent_key = "time_exponent" if key == "seconds" else "memory_exponent"
    for kind, row in results["layers"].items():
        measured = [(n, y) for n, y in zip(row["n"], row[key]) if y is not None]
        if not measured:  # memory where /proc is missing
            continue
        ns, ys = zip(*measured)
        slope = row[exponent_key]
        (line,) = ax.plot(ns, ys, "o-", ms=4, label=f"{kind} {row['complexity']}: slope {_exponent(slope)}")
        big = [(n, y) for n, y in zip(ns, ys) if n >= fit_from]
        if slope is not None:  # the fitted line through the largest n, extended over all n
            n0, y0 = big[-1]
            ax.plot([ns[0], n0], [y0 * (ns[0] / n0) ** slope, y0], ":", color=line.get_color(), lw=1)
    ax.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel=ylabel, title=title)
    ax.set_xscale("log", base=2)
    _plain_log_ticks(ax)
    ax.grid(True, which="major", ls="--", alpha=0.5)
    if ax.lines:
        ax.legend(fontsize=7, title=f"slope fitted over n ≥ {fit_from} (dotted)", title_fontsize=7)
    return fig


def table1_figures(out: Path, s: FigureSettings) -> tuple[list[Path], dict]:
    points = table1.measure_table1(list(s.table1_ns), s.d_model, s.repeats, s.layers, s.n_heads, s.k, s.r)
    results = table1_results(points, s)
    d = s.d_model
    files = [
        _save(_loglog_figure(results, "seconds", "seconds (forward + backward)",
                             f"Table 1 measured: time per layer, d = {d}"), out / "table1_time.png"),
        _save(_loglog_figure(results, "peak_mib", "peak memory (MiB)",
                             f"Table 1 measured: peak memory per layer, d = {d}"), out / "table1_memory.png"),
        _write_json(out / "table1.json", results),
    ]
    md = table1_markdown(results)
    atomic_write(out / "table1.md", lambda tmp: tmp.write_text(md, encoding="utf-8"))
    files.append(out / "table1.md")
    return files, results


# --------------------------------------------------------------------------- §3.2.1 why √d_k

def dot_product_variance(d_ks: list[int], n_samples: int, seed: int = 0) -> dict[str, list[float]]:
    """Variance of q·k and of q·k/√d_k for q, k with independent N(0, 1) components.

    q·k is a sum of d_k products of variance 1, so its variance is d_k; scaled, it is 1.
    """
    g = torch.Generator().manual_seed(seed)
    unscaled, scaled = [], []
    for d_k in d_ks:
        q, k = torch.randn(n_samples, d_k, generator=g), torch.randn(n_samples, d_k, generator=g)
        dots = (q * k).sum(-1).double()
        unscaled.append(dots.var().item())
        scaled.append((dots / math.sqrt(d_k)).var().item())
    return {"d_k": list(d_ks), "unscaled": unscaled, "scaled": scaled}


def softmax_saturation(d_ks: list[int], n_keys: int, n_queries: int, seed: int = 0) -> dict[str, list[float]]:
    """For softmax rows over n_keys random keys, with and without 1/√d_k: the mean entropy (nats;
    uniform = log n_keys, one-hot = 0), the mean largest weight, and the mean Frobenius norm of
    the softmax Jacobian diag(p) − p pᵀ, which scales the gradient that reaches the scores."""
    g = torch.Generator().manual_seed(seed)
    result = {"d_k": list(d_ks), "n_keys": n_keys, "max_entropy": math.log(n_keys)}
    for name in ("entropy", "max_weight", "jacobian_norm"):
        result[f"{name}_unscaled"], result[f"{name}_scaled"] = [], []
    for d_k in d_ks:
        q = torch.randn(n_queries, 1, d_k, generator=g, dtype=torch.float64)
        k = torch.randn(n_queries, n_keys, d_k, generator=g, dtype=torch.float64)
        scores = (q * k).sum(-1)
        for tag, s in (("unscaled", scores), ("scaled", scores / math.sqrt(d_k))):
            p = torch.softmax(s, dim=-1)
            entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
            jacobian = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
            result[f"entropy_{tag}"].append(entropy.mean().item())
            result[f"max_weight_{tag}"].append(p.max(-1).values.mean().item())
            result[f"jacobian_norm_{tag}"].append(jacobian.flatten(1).norm(dim=-1).mean().item())
    return result


def scaling_figures(out: Path, s: FigureSettings) -> tuple[list[Path], dict]:
    variance = dot_product_variance(list(s.d_ks), s.n_samples, s.seed)
    saturation = softmax_saturation(list(s.d_ks), s.n_keys, s.n_queries, s.seed)
    d_ks = variance["d_k"]

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot(d_ks, variance["unscaled"], "o-", label="q·k (unscaled)")
    ax.plot(d_ks, variance["scaled"], "s-", label="q·k / √d_k (scaled)")
    ax.plot(d_ks, d_ks, ":", color="grey", label="d_k")
    ax.set(xscale="log", yscale="log", xlabel="d_k", ylabel="variance",
           title=f"Variance of q·k, N(0,1) components ({s.n_samples} pairs per d_k)")
    ax.set_xscale("log", base=2)
    _plain_log_ticks(ax)
    ax.grid(True, ls="--", alpha=0.5)
    ax.legend()
    files = [_save(fig, out / "variance_scaling.png")]

    fig = Figure(figsize=(12, 3.6))
    panels = [("entropy", "entropy of a softmax row (nats)", f"Softmax over {s.n_keys} keys: entropy", "linear"),
              ("max_weight", "largest weight of a row", "Concentration", "linear"),
              ("jacobian_norm", "‖diag(p) − p pᵀ‖_F", "Size of the softmax's Jacobian", "linear")]
    for i, (key, ylabel, title, yscale) in enumerate(panels):
        ax = fig.add_subplot(1, 3, i + 1)
        for tag, marker in (("unscaled", "o-"), ("scaled", "s-")):
            ax.plot(d_ks, saturation[f"{key}_{tag}"], marker, label=f"{tag}" + (" (÷√d_k)" if tag == "scaled" else ""))
        if key == "entropy":
            ax.axhline(saturation["max_entropy"], ls=":", color="grey", label=f"uniform: log {s.n_keys}")
        ax.set(xlabel="d_k", ylabel=ylabel, title=title, yscale=yscale)
        ax.set_xscale("log", base=2)
        _plain_log_ticks(ax)
        ax.grid(True, ls="--", alpha=0.5)
        ax.legend(fontsize=8)
    files.append(_save(fig, out / "entropy_scaling.png"))
    data = {"variance": variance, "softmax": saturation}
    files.append(_write_json(out / "scaling.json", data))
    return files, data


# --------------------------------------------------------------------------- all of them

def write_figures(out: str | Path, settings: FigureSettings | None = None) -> dict:
    """Write every figure and table into ``out``; returns {"files": [...], "table1": …, "scaling": …}."""
    s = settings or FigureSettings.full()
    out = need_output_dir(out, "--out", empty=False)
    out.mkdir(parents=True, exist_ok=True)
    log.info("figures: settings %s", asdict(s))
    files = positional_figures(out, s) + path_length_figure(out, s)
    scaling_files, scaling = scaling_figures(out, s)
    table_files, results = table1_figures(out, s)
    return {"files": [str(f) for f in files + scaling_files + table_files], "table1": results, "scaling": scaling}


def summary(result: dict) -> str:
    """A few lines for the terminal: Table 1's fitted exponents and the variance of q·k at d_k = 64."""
    fit_from = result["table1"]["settings"]["fit_from_n"]
    lines = [f"Table 1, exponent of n fitted over n ≥ {fit_from}:",
             f"{'layer':<28}{'paper':>12}{'time':>7}{'memory':>8}"]
    for kind, row in result["table1"]["layers"].items():
        lines.append(f"{kind:<28}{row['complexity']:>12}{_exponent(row['time_exponent']):>7}"
                     f"{_exponent(row['memory_exponent']):>8}")
    variance = result["scaling"]["variance"]
    i = variance["d_k"].index(64) if 64 in variance["d_k"] else -1
    lines.append(f"var(q·k) at d_k = {variance['d_k'][i]}: {variance['unscaled'][i]:.1f} unscaled, "
                 f"{variance['scaled'][i]:.2f} scaled by 1/√d_k")
    lines += ["wrote:", *(f"  {path}" for path in result["files"])]
    return "\n".join(lines)
