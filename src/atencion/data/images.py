"""Images from files, as a ViT reads them (model.inputs kind patches): a PNG (or any image Pillow
reads), its pixels scaled to [0, 1], or a NumPy array (.npy, read without pickle) taken as it is,
(height, width) or (channels, height, width). An image must have the size the model was built
for: one of another size is refused, naming the file and the size expected (no resizing, which
would change what the model sees without saying so). A missing, empty, unreadable or non-finite
file is refused in one line naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import AtencionError, MissingFileError

MODES = {1: "L", 3: "RGB", 4: "RGBA"}  # channels → the Pillow mode an image is converted to


def read_image(path: str | Path, channels: int, size: tuple[int, int] | list[int]) -> Tensor:
    """The image at ``path`` as a float32 tensor (channels, height, width), checked against the
    ``channels`` and ``size`` [height, width] of the model (its ``model.inputs``)."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: image not found")
    if path.stat().st_size == 0:
        raise AtencionError(f"{path}: empty file; expected a PNG or NPY image")
    array = _read_npy(path, channels) if path.suffix.lower() == ".npy" else _read_picture(path, channels)
    height, width = size
    if tuple(array.shape[1:]) != (height, width):
        raise AtencionError(f"{path}: an image of {array.shape[1]} × {array.shape[2]} pixels (height × width); this "
                            f"model reads {height} × {width} (model.inputs.size): resize it first")
    if not np.isfinite(array).all():
        raise AtencionError(f"{path}: holds non-finite values (NaN or inf)")
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def _read_npy(path: Path, channels: int) -> np.ndarray:
    """A .npy array (no pickle): (height, width) for one channel, or (channels, height, width)."""
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise AtencionError(f"{path}: not a readable NPY array ({str(err).splitlines()[0]})") from None
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "biuf":
        raise AtencionError(f"{path}: holds {getattr(array, 'dtype', type(array).__name__)}; expected an array of "
                            f"numbers (the pixels)")
    if array.ndim == 2 and channels == 1:
        array = array[None]
    if array.ndim != 3 or array.shape[0] != channels:
        expected = "(height, width) or (1, height, width)" if channels == 1 else f"({channels}, height, width)"
        raise AtencionError(f"{path}: an array of shape {array.shape}; this model reads {expected} "
                            f"(model.inputs.channels {channels})")
    return array


def _read_picture(path: Path, channels: int) -> np.ndarray:
    """A picture Pillow reads (PNG, ...), converted to the model's channels, scaled to [0, 1]."""
    from PIL import Image, UnidentifiedImageError

    if channels not in MODES:
        raise AtencionError(f"{path}: a picture has 1 (grey), 3 (RGB) or 4 (RGBA) channels, but this model reads "
                            f"{channels} (model.inputs.channels); give it NPY arrays")
    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert(MODES[channels]), dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise AtencionError(f"{path}: not a PNG or NPY image ({str(err).splitlines()[0] or type(err).__name__})") \
            from None
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def shift_images(images: Tensor, shift: int, generator: torch.Generator) -> Tensor:
    """Each image of ``images`` (batch, channels, height, width) moved by its own random whole
    number of pixels in [-shift, shift] down and right (negative: up and left), drawn from
    ``generator``; what leaves the frame is lost and what enters is zero (data augmentation)."""
    if shift == 0:
        return images
    batch, _, height, width = images.shape
    padded = torch.nn.functional.pad(images, (shift, shift, shift, shift))
    offsets = torch.randint(0, 2 * shift + 1, (batch, 2), generator=generator).tolist()
    return torch.stack([padded[i, :, dy:dy + height, dx:dx + width] for i, (dy, dx) in enumerate(offsets)])


def shifted_views(images: Tensor, shift: int) -> list[Tensor]:
    """``images`` (batch, channels, height, width) moved by every whole offset (dy, dx) in
    [-shift, shift]², each a batch like ``images``, zero where the frame is left empty: the (2 ·
    shift + 1)² views that test-time augmentation averages over (the unmoved one among them)."""
    _, _, height, width = images.shape
    padded = torch.nn.functional.pad(images, (shift, shift, shift, shift))
    return [padded[:, :, dy:dy + height, dx:dx + width] for dy in range(2 * shift + 1) for dx in range(2 * shift + 1)]


def rotate(images: Tensor, degrees: Tensor) -> Tensor:
    """Each image of ``images`` (batch, channels, height, width) turned about its centre by its own
    angle ``degrees[i]`` (counter-clockwise as displayed, rows running down), sampled bilinearly;
    what enters the frame is zero. The grid is in pixels, so non-square images turn without shear."""
    batch, _, height, width = images.shape
    angle = torch.deg2rad(degrees.to(images.dtype))
    cos, sin, zero = angle.cos(), angle.sin(), torch.zeros_like(angle)
    # output pixel -> input pixel, in affine_grid's coordinates (-1 … 1 along each side)
    theta = torch.stack([torch.stack([cos, -sin * height / width, zero], 1),
                         torch.stack([sin * width / height, cos, zero], 1)], 1)
    grid = torch.nn.functional.affine_grid(theta, list(images.shape), align_corners=False)
    return torch.nn.functional.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def rotate_images(images: Tensor, degrees: float, generator: torch.Generator) -> Tensor:
    """Each image turned by its own angle drawn uniformly from [-degrees, degrees] with
    ``generator`` (data augmentation; :func:`rotate`)."""
    if degrees == 0:
        return images
    angles = (torch.rand(images.size(0), generator=generator) * 2 - 1) * degrees
    return rotate(images, angles)
