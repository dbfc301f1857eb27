"""What an encoder reads (``ModelConfig.inputs``): the paper's tokens (§3.4), or another kind of
input turned into a sequence of d_model-wide vectors, as the Transformer left text behind —
image patches (ViT, Dosovitskiy et al. 2021, §3.1, eq. 1) and log-mel frames of a recording
(Whisper, Radford et al. 2022, §2.2; an encoder-only classifier or the encoder of a speech-to-text
encoder-decoder).

``INPUTS`` names every kind once, with what the rest of atencion asks about it: the raw input it
takes, the archs whose encoder can read it, its settings (required ones, defaults and their
check), the module it builds, how one example is read from a file and how examples make a
batch. ``ModelConfig.inputs`` takes ``{kind: NAME, ...settings}`` (a bare name is ``{kind:
NAME}``; None is ``tokens``, today's behaviour, and a config.json without it loads as tokens);
config.py's ``inputs_settings`` checks it against this table.

A kind's module maps the raw batch to the encoder's input:
``forward(inputs, lengths=None) -> (embeddings (batch, length, d_model), mask or None)``, the
mask a key-padding mask (batch, 1, 1, length), True at real positions, as
``Model.padding_mask`` gives for tokens (None: every position is real). The encoder then adds
its positions (``model.positional``), drops out and runs its layers (nn/transformer.py:
``Encoder``, ``Transformer._encode``), and the classification head pools the result.

Adding an input kind touches: one module class and one ``InputKind`` entry here (its settings,
``build``, ``read`` and ``collate``: ``spectrogram`` reads a WAV file into log-mel frames (n_mels,
frames) and pads a batch to (batch, n_mels, frames) with the lengths); the tasks that train on
files read them through ``read``/``collate`` (tasks/classify.py, tasks/transcribe.py), so nothing
else names a kind.
A position kind that needs the input's geometry (``sinusoidal-2d``) reads it from the settings
(nn/positional.py's ``patch_grid``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ARCHS, INPUTS, inputs_settings
from ..data.images import read_image, shifted_views
from ..errors import AtencionError
from .positional import TokenEmbedding, position_limit


class PatchEmbedding(nn.Module):
    """ViT (Dosovitskiy et al. 2021), §3.1, eq. (1): the image x ∈ R^{H×W×C} is cut into N =
    HW/P² patches x_p ∈ R^{N×(P²·C)}, each flattened and linearly projected by E ∈
    R^{(P²·C)×D}, and a learned [CLS] embedding x_class is prepended: z_0 = [x_class; x_p^1 E;
    …; x_p^N E] (the positions E_pos are the encoder's, added next). The projection is a
    convolution with kernel = stride = P (tested against ``torch.nn.Conv2d``): ``weight`` holds
    E row by row in the order (channel, row, column) of a patch, Conv2d's weight flattened.

    ``shifted`` (inputs.shifted): Shifted Patch Tokenization, for ViTs trained on small datasets
    (Lee et al. 2021, "Vision Transformer for Small-Size Datasets", §3.2, eq. 2-3): the image
    and its four copies moved diagonally by half a patch (⌈P/2⌉ pixels; zero-filled) are stacked
    along the channels, 5C in all, each patch of that flattened, layer-normalised (``norm``) and
    projected: a token also sees the pixels around its patch."""

    def __init__(self, d_model: int, patch: int, size: tuple[int, int], channels: int, shifted: bool = False):
        super().__init__()
        self.patch, self.size, self.channels, self.shifted = patch, tuple(size), channels, shifted
        self.grid = (size[0] // patch, size[1] // patch)
        width = (5 if shifted else 1) * channels * patch * patch
        self.norm = nn.LayerNorm(width) if shifted else None
        self.proj = nn.Linear(width, d_model)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        nn.init.normal_(self.cls, std=0.02)

    def patches(self, images: Tensor) -> Tensor:
        """(batch, C, H, W) → (batch, N, C·P·P): the patches in row-major order of the grid (with
        ``shifted``, of the 5C-channel stack: (batch, N, 5·C·P·P))."""
        if self.shifted:  # the four corners of the (2s + 1)² moves, s = ⌈P/2⌉
            s = (self.patch + 1) // 2
            views, n = shifted_views(images, s), 2 * s + 1
            images = torch.cat([images, views[0], views[n - 1], views[-n], views[-1]], dim=1)
        p = self.patch
        x = images.unfold(2, p, p).unfold(3, p, p)                 # (batch, C, rows, cols, P, P)
        return x.permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)

    def forward(self, images: Tensor, lengths: Tensor | None = None) -> tuple[Tensor, None]:
        """z_0 without positions, (batch, 1 + N, d_model); no position is padding."""
        self.check(images, lengths)
        x = self.patches(images.to(self.proj.weight.dtype))
        x = self.proj(x if self.norm is None else self.norm(x))
        return torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1), None

    def check(self, images: Tensor, lengths: Tensor | None) -> None:
        expected = (self.channels, *self.size)
        if not isinstance(images, Tensor) or not images.is_floating_point() or images.dim() != 4 \
                or tuple(images.shape[1:]) != expected or images.size(0) == 0:
            shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
            dtype = f" {images.dtype}" if isinstance(images, Tensor) else ""
            raise AtencionError(f"images must be a float tensor (batch, channels, height, width) = (batch, "
                                f"{', '.join(map(str, expected))}) as model.inputs says, got{dtype} {shape}")
        if lengths is not None:
            raise AtencionError("images have no lengths: every image has the size model.inputs gives")


class SpectrogramFrontEnd(nn.Module):
    """Whisper (Radford et al. 2022), §2.2 and Figure 1: the log-mel frames x ∈ R^{n_mels×T}
    (data/audio.py) pass through "a small stem comprised of two convolution layers with a filter
    width of 3 and the GELU activation function where the second convolution layer has a stride
    of two": z_0 = GELU(Conv_s2(GELU(Conv(x)))), T' = ceil(T / 2) positions of d_model (the
    sinusoidal positions are the encoder's, added next). Recordings of different lengths are
    padded: each one's frames beyond its length, and the first convolution's outputs there, are
    zeroed, so that the second convolution sees what its own zero padding would give; each
    recording's outputs are those it gets alone (tested), and the key-padding mask hides the
    positions past ceil(length / 2)."""

    def __init__(self, d_model: int, n_mels: int, max_frames: int):
        super().__init__()
        self.n_mels, self.max_frames = n_mels, max_frames
        self.conv1 = nn.Conv1d(n_mels, d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)

    def forward(self, frames: Tensor, lengths: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(batch, n_mels, T) frames (and each recording's T, when they differ) → the embeddings
        (batch, ceil(T / 2), d_model) and the key-padding mask (batch, 1, 1, ceil(T / 2)), None
        without ``lengths``."""
        self.check(frames, lengths)
        x = frames.to(self.conv1.weight.dtype)
        real = None if lengths is None else torch.arange(x.size(-1), device=x.device) < lengths.to(x.device)[:, None]
        if real is not None:
            x = x * real[:, None, :]
        x = F.gelu(self.conv1(x))
        if real is not None:
            x = x * real[:, None, :]
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        if lengths is None:
            return x, None
        kept = torch.arange(x.size(1), device=x.device) < frame_positions(lengths.to(x.device))[:, None]
        return x, kept[:, None, None, :]

    def check(self, frames: Tensor, lengths: Tensor | None) -> None:
        if not isinstance(frames, Tensor) or not frames.is_floating_point() or frames.dim() != 3 \
                or frames.size(1) != self.n_mels or 0 in frames.shape:
            shape = tuple(frames.shape) if isinstance(frames, Tensor) else type(frames).__name__
            dtype = f" {frames.dtype}" if isinstance(frames, Tensor) else ""
            raise AtencionError(f"log-mel frames must be a float tensor (batch, n_mels, frames) = (batch, "
                                f"{self.n_mels}, frames) as model.inputs says, got{dtype} {shape}")
        if frames.size(2) > self.max_frames:
            raise AtencionError(f"{frames.size(2)} frames, more than inputs.max_frames={self.max_frames}")
        if lengths is not None and (not isinstance(lengths, Tensor) or lengths.shape != frames.shape[:1]
                                    or lengths.is_floating_point() or bool((lengths < 1).any())
                                    or bool((lengths > frames.size(2)).any())):
            raise AtencionError(f"lengths must be an integer tensor (batch,) = ({frames.size(0)},) of frame counts "
                                f"in [1, {frames.size(2)}], got {lengths!r}")


def frame_positions(frames):
    """The encoder positions of ``frames`` log-mel frames (an int or a tensor): ceil(frames / 2),
    after the stride-2 convolution of ``SpectrogramFrontEnd``."""
    return (frames + 1) // 2


# the registry: every kind, named once ------------------------------------------------------------


def _no_check(cfg, settings: dict) -> str | None:
    return None


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _patches_check(cfg, settings: dict) -> str | None:
    """patch, size [height, width] and channels positive integers, the patch dividing the size,
    shifted true or false, and learned positions for every patch and the [CLS] token."""
    for key in ("patch", "channels"):
        if not _positive(settings[key]):
            return f"inputs.{key} must be a positive integer, got {settings[key]!r}"
    if not isinstance(settings["shifted"], bool):
        return f"inputs.shifted must be true or false, got {settings['shifted']!r}"
    size = settings["size"]
    if not (isinstance(size, list) and len(size) == 2 and all(_positive(s) for s in size)):
        return f"inputs.size must be [height, width], two positive integers, got {size!r}"
    if size[0] % settings["patch"] or size[1] % settings["patch"]:
        return (f"inputs.patch ({settings['patch']}) must divide both sides of inputs.size {size}: the image "
                f"is cut into patch × patch squares")
    length = 1 + (size[0] // settings["patch"]) * (size[1] // settings["patch"])
    limit = position_limit(cfg)
    if limit is not None and limit < length:
        return (f"max_positions ({limit}) must be at least {length}: inputs gives {length - 1} "
                f"patches and the [CLS] token, each with a learned position")
    return None


def _spectrogram_check(cfg, settings: dict) -> str | None:
    """n_mels and max_frames positive integers, and learned positions for the longest recording."""
    for key in ("n_mels", "max_frames"):
        if not _positive(settings[key]):
            return f"inputs.{key} must be a positive integer, got {settings[key]!r}"
    length = frame_positions(settings["max_frames"])
    limit = position_limit(cfg)
    if limit is not None and limit < length:
        return (f"max_positions ({limit}) must be at least {length}: inputs.max_frames "
                f"{settings['max_frames']} frames make {length} positions after the stride-2 convolution")
    return None


def read_spectrogram(path: Path, settings: dict) -> Tensor:
    """A WAV file's Whisper log-mel frames (n_mels, frames) (data/audio.py: mono, resampled to 16
    kHz); one longer than inputs.max_frames is refused, naming the file, from its header's length
    and rate before its samples are read (and once more after, from the frames themselves)."""
    from ..data.audio import HOP, SAMPLE_RATE, load_features

    frames = load_features(path, settings["n_mels"], max_frames=settings["max_frames"])
    if frames.size(1) > settings["max_frames"]:
        raise AtencionError(f"{path}: {frames.size(1)} frames ({frames.size(1) * HOP / SAMPLE_RATE:.2f} s), more "
                            f"than inputs.max_frames={settings['max_frames']}")
    return frames


def pad_frames(examples: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Recordings' frames, (n_mels, T_i) each, zero-padded to one batch (batch, n_mels, max T_i),
    and their lengths T_i."""
    lengths = torch.tensor([x.size(-1) for x in examples])
    batch = examples[0].new_zeros(len(examples), examples[0].size(0), int(lengths.max()))
    for row, x in enumerate(examples):
        batch[row, :, : x.size(-1)] = x
    return batch, lengths


@dataclass(frozen=True)
class InputKind:
    """One kind of encoder input (a value of ``ModelConfig.inputs.kind``) and what atencion asks of it.

    ``takes``: the raw input, in words. ``archs``: the archs whose encoder may read it.
    ``required`` and ``defaults``: its settings (config.json holds them all, completed);
    ``check(cfg, settings)``: why a value is wrong (one line naming ``inputs.<key>``), or None.
    ``build(cfg)``: the module of the encoder's input. ``preset``: the preset a training config
    of this kind starts from when it names none (tokens: the task's). ``read(path, settings)``:
    one example from a file, a float tensor (a bad file: an AtencionError naming it);
    ``collate(examples)``: the batch and its lengths (None when every example has the same
    size); ``positions(example, settings)``: how many positions the encoder gives it (what
    train.max_tokens and --batch-tokens count). tokens has none of the three: text goes through
    the tokenizer."""

    name: str
    takes: str
    archs: tuple[str, ...]
    build: Callable[[Any], nn.Module]
    required: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    check: Callable[[Any, dict], str | None] = _no_check
    preset: str | None = None
    read: Callable[[Path, dict], Tensor] | None = None
    collate: Callable[[list[Tensor]], tuple[Tensor, Tensor | None]] | None = None
    positions: Callable[[Tensor, dict], int] | None = None

    @property
    def tokens(self) -> bool:
        """Whether it reads token ids (through a tokenizer)."""
        return self.name == "tokens"


def stack_images(examples: list[Tensor]) -> tuple[Tensor, None]:
    """Images of one size, (C, H, W) each, as one batch (batch, C, H, W)."""
    return torch.stack(examples), None


def _patches(image: Tensor, settings: dict) -> int:
    """[CLS] and the patches of one image."""
    return 1 + (settings["size"][0] // settings["patch"]) * (settings["size"][1] // settings["patch"])


# config.INPUTS is the table ModelConfig checks ``inputs`` against; it is filled here, once.
INPUTS.update({kind.name: kind for kind in (
    # §3.4: token ids, each a learned d_model-wide vector × √d_model.
    InputKind("tokens", "token ids (batch, length), through a tokenizer", ARCHS,
              lambda cfg: TokenEmbedding(cfg.vocab_size, cfg.d_model, cfg.pad_id, cfg.scale_embedding)),
    # ViT (Dosovitskiy et al. 2021): P × P patches, each linearly embedded, and a [CLS] token.
    InputKind("patches", "images (batch, channels, height, width), floats", ("encoder",),
              lambda cfg: PatchEmbedding(cfg.d_model, cfg.inputs["patch"], cfg.inputs["size"],
                                         cfg.inputs["channels"], cfg.inputs["shifted"]),
              required=("patch", "size"), defaults={"channels": 3, "shifted": False}, check=_patches_check,
              preset="vit-tiny",
              read=lambda path, settings: read_image(path, settings["channels"], settings["size"]),
              collate=stack_images, positions=_patches),
    # Whisper (Radford et al. 2022): log-mel frames of a recording, two convolutions (the second of stride 2).
    InputKind("spectrogram", "log-mel frames (batch, n_mels, frames), floats, and their lengths",
              ("encoder", "encoder-decoder"),
              lambda cfg: SpectrogramFrontEnd(cfg.d_model, cfg.inputs["n_mels"], cfg.inputs["max_frames"]),
              defaults={"n_mels": 80, "max_frames": 3000}, check=_spectrogram_check, preset="whisper-tiny",
              read=read_spectrogram, collate=pad_frames, positions=lambda frames, settings: frame_positions(
                  frames.size(-1))),
)})


def input_kind_named(inputs: Any) -> InputKind | None:
    """The kind a model section's ``inputs`` (a mapping, a bare name, or None: tokens) names; None
    when it names none known (ModelConfig says why)."""
    name = inputs.get("kind", "tokens") if isinstance(inputs, dict) else inputs if inputs is not None else "tokens"
    return INPUTS.get(name) if isinstance(name, str) else None


def input_kind(cfg) -> InputKind:
    """The kind ``cfg.inputs`` names (None: tokens). A config made before this module was imported
    (config.py does not import torch) has its ``inputs`` checked and completed here."""
    if cfg.inputs is not None:
        cfg.inputs = inputs_settings(cfg)  # a complete setting is returned as it is
    return INPUTS["tokens" if cfg.inputs is None else cfg.inputs["kind"]]


def reads_tokens(cfg) -> bool:
    """Whether a model with ModelConfig ``cfg`` reads token ids (and so needs a tokenizer for its input)."""
    return input_kind(cfg).tokens


def read_inputs(settings: dict, paths: list[Path], where: Callable[[int], str]) -> list[Tensor]:
    """The examples at ``paths``, each read by the input kind of ``settings`` (a model's
    ``inputs``); a bad file is refused in one line that names it after ``where(i)`` (the list or
    TSV line that gives path i)."""
    kind = INPUTS[settings["kind"]]
    examples = []
    for i, path in enumerate(paths):
        try:
            examples.append(kind.read(path, settings))
        except AtencionError as err:
            raise type(err)(f"{where(i)}: {err}") from None
    return examples
