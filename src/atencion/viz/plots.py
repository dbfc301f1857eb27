"""Heatmaps of attention weights with matplotlib (the Agg canvas: no display, no global backend).

Queries are rows (y, top to bottom) and keys are columns (x): for cross-attention the source
runs along x and the target down y, as in the usual figure of a translation's alignment.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..fileio import atomic_write
from .attention import AttentionMap

CMAP = "viridis"
TITLES = {"encoder": "encoder self-attention", "decoder": "decoder masked self-attention",
          "cross": "encoder-decoder (cross) attention"}


def _cell_inches(n_tokens: int) -> float:
    return min(6.0, max(2.2, 0.22 * n_tokens))


def _label(ax, amap: AttentionMap, x: bool = True, y: bool = True) -> None:
    size = 8 if max(len(amap.rows), len(amap.cols)) <= 20 else 6
    ax.set_xticks(range(len(amap.cols)))
    ax.set_yticks(range(len(amap.rows)))
    ax.set_xticklabels(amap.cols if x else [], rotation=90, fontsize=size)
    ax.set_yticklabels(amap.rows if y else [], fontsize=size)


def _vmax(weights: np.ndarray) -> float:
    """Probabilities on a fixed 0–1 scale (a word-level "sum" reduction may exceed 1)."""
    return max(1.0, float(weights.max()) if weights.size else 1.0)


def grid_figure(amap: AttentionMap) -> Figure:
    """A layers × heads grid of heatmaps, token labels on the first column and the last row."""
    n_layers, n_heads = amap.weights.shape[:2]
    side = _cell_inches(max(len(amap.rows), len(amap.cols)))
    fig = Figure(figsize=(side * n_heads + 1.5, side * n_layers + 1.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    vmax = _vmax(amap.weights)
    for layer in range(n_layers):
        for head in range(n_heads):
            ax = axes[layer][head]
            image = ax.imshow(amap.weights[layer, head], cmap=CMAP, vmin=0.0, vmax=vmax, aspect="auto")
            _label(ax, amap, x=layer == n_layers - 1, y=head == 0)
            ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.6)
    unit = "words" if amap.words else "pieces"
    fig.suptitle(f"{TITLES[amap.kind]} ({unit}; rows: queries, columns: keys)")
    return fig


def mean_figure(amap: AttentionMap, layer: int | None = None) -> Figure:
    """One heatmap: the head average of ``layer`` (0-based), or of every layer when None."""
    side = max(3.0, 0.35 * max(len(amap.rows), len(amap.cols)))
    fig = Figure(figsize=(side + 1.5, side + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    matrix = amap.mean(layer)
    image = ax.imshow(matrix, cmap=CMAP, vmin=0.0, vmax=_vmax(matrix), aspect="auto")
    _label(ax, amap)
    fig.colorbar(image, ax=ax, shrink=0.8)
    which = "every layer and head" if layer is None else f"every head of layer {layer + 1}"
    ax.set_title(f"{TITLES[amap.kind]}\nmean of {which}", fontsize=9)
    if amap.kind == "cross":
        ax.set_xlabel("source")
        ax.set_ylabel("target")
    return fig


def line_figure(series: dict[str, tuple[list, list]], xlabel: str, ylabel: str, title: str, marker: str = "o",
                log_x: bool = False, log_y: bool = False, styles: dict[str, str] | None = None) -> Figure:
    """One line per entry of ``series`` (label → (xs, ys)), as the benchmarks draw their results;
    ``styles`` gives a label its line style ("--", ...)."""
    fig = Figure(figsize=(6.5, 3.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker=marker, label=label, linestyle=(styles or {}).get(label, "-"))
    if log_x:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both" if log_x or log_y else "major")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def save(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` (format from its suffix), atomically."""
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png"))
    return path


def _upsample(values: np.ndarray, grid: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """A patch grid's values (grid[0] * grid[1],) as an image of ``shape`` (each patch's pixels one value)."""
    cells = values.reshape(grid)
    return np.kron(cells, np.ones((shape[0] // grid[0], shape[1] // grid[1])))


def image_attention_figure(image: np.ndarray, maps: dict[str, np.ndarray], grid: tuple[int, int]) -> Figure:
    """The image (channels, height, width) and, beside it, each of ``maps`` (title → weights over
    the patches, row-major over ``grid``) as a heatmap overlaid on it, each on its own min–max scale."""
    pixels = image[0] if image.shape[0] == 1 else np.clip(image[:3].transpose(1, 2, 0), 0, 1)
    shape = image.shape[1:]
    fig = Figure(figsize=(2.2 * (len(maps) + 1), 2.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(maps) + 1, squeeze=False)[0]
    axes[0].imshow(pixels, cmap="gray")
    axes[0].set_title("image", fontsize=8)
    for ax, (title, values) in zip(axes[1:], maps.items()):
        ax.imshow(pixels, cmap="gray")
        ax.imshow(_upsample(values, grid, shape), cmap="inferno", alpha=0.6, vmin=float(values.min()),
                  vmax=max(float(values.max()), float(values.min()) + 1e-12))
        ax.set_title(title, fontsize=8)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    return fig


def spectrogram_attention_figure(frames: np.ndarray, rows: list[tuple[str, np.ndarray]], title: str,
                                 ylabel: str = "") -> Figure:
    """The log-mel spectrogram (n_mels, frames) on top and, under it on the same time axis, one
    heatmap whose rows are ``rows`` ((label, weights over the encoder positions, each two frames
    after the stride-2 convolution), in order; a label may repeat, as a word's letters do), each
    row on its own 0–max scale."""
    n_frames = frames.shape[1]
    labels = [label for label, _ in rows]
    matrix = np.stack([values / max(float(values.max()), 1e-12) for _, values in rows])
    positions = matrix.shape[1]
    fig = Figure(figsize=(7.0, 2.6 + 0.28 * len(labels)), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2.2, max(0.6, 0.28 * len(labels))]})
    top.imshow(frames, origin="lower", aspect="auto", cmap="magma", extent=(0, n_frames, 0, frames.shape[0]))
    top.set_ylabel("mel channel", fontsize=8)
    top.set_title(title, fontsize=9)
    bottom.imshow(matrix, aspect="auto", cmap=CMAP, vmin=0.0, vmax=1.0, interpolation="nearest",
                  extent=(0, 2 * positions, len(labels), 0))
    bottom.set_yticks(np.arange(len(labels)) + 0.5)
    bottom.set_yticklabels(labels, fontsize=8)
    bottom.set_xlim(0, n_frames)
    bottom.set_xlabel("log-mel frame (10 ms)", fontsize=8)
    if ylabel:
        bottom.set_ylabel(ylabel, fontsize=8)
    return fig
