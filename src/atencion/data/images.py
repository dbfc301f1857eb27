"""Images from files, as a ViT reads them (model.inputs kind patches): a PNG (or any image Pillow
reads), its pixels scaled to [0, 1], or a NumPy array (.npy, read without pickle) taken as it is,
(height, width) or (channels, height, width). An image must have the size the model was built
for: one of another size is refused, naming the file and the size expected (no resizing, which
would change what the model sees without saying so). A missing, empty, unreadable or non-finite
file is refused in one line naming it.

The size is judged from the header, before any pixel is decoded: Pillow's ``Image.open`` reads
only the header, and an NPY file's header (format 1.0 or 2.0) gives its shape and dtype, so a
20,000 × 20,000 PNG of 48 KB (a decompression bomb) or an NPY header claiming 10¹⁰ pixels is
refused at once, its data never read. A picture over Pillow's own limit against decompression
bombs (``Image.MAX_IMAGE_PIXELS``, 89 million pixels; its warning taken as a refusal, not printed)
is refused with the pixel count Pillow read, before its size could be asked.

Every depth and mode of picture comes to the same scale, 0 for black and 1 for full scale:

- 8-bit modes (L, RGB, RGBA, CMYK, YCbCr, HSV, LAB, …) through Pillow's conversion to the model's
  channels (L: ITU-R 601 luma of RGB), divided by 255; 16-bit colour is read by Pillow at 8 bits.
- 1-bit pictures (mode 1): 0 or 1.
- Palette pictures (P, PA): the palette's colours, not the indices.
- 16-bit grey (I;16, I;16B, …): divided by 65535. Mode I (32-bit integers) holds 16-bit grey only
  for PNG and PNM (Pillow scales a PGM's samples to 0 … 65535 for any maxval), so it is divided by
  65535 for those; from any other format (a TIFF of signed or 32-bit integers) its full scale is
  unknown, and it is refused rather than guessed.
- Floats (mode F, e.g. a float TIFF): taken as they are, as an NPY array is.
- Alpha: kept as the fourth channel for a model that reads 4 (RGBA; an opaque 1 where the picture
  has none); otherwise dropped, the colour as stored (compositing over a background would invent
  one). Premultiplied modes (La, RGBa) are unpremultiplied first.
- A grey picture read by a 3- or 4-channel model has its grey in each of R, G and B.
- A picture of several frames (GIF, TIFF pages): its first.
"""

from __future__ import annotations

import re
import struct
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import AtencionError, MissingFileError

MODES = {1: "L", 3: "RGB", 4: "RGBA"}  # channels → the Pillow mode an image is converted to
SIXTEEN_BITS = ("I;16", "I;16L", "I;16B", "I;16N")  # Pillow's modes of 16-bit unsigned grey
SIXTEEN_BIT_I = ("PNG", "PPM")  # the formats whose mode I pictures hold 16-bit grey (0 … 65535)
STEP = {"La": "LA", "RGBa": "RGBA", "LAB": "RGB"}  # modes Pillow converts to the others only through these
# What Pillow raises on malformed bytes, besides its own OSError (UnidentifiedImageError) and ValueError.
PILLOW_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, KeyError, TypeError, ZeroDivisionError,
                 OverflowError, MemoryError, struct.error)


def read_image(path: str | Path, channels: int, size: tuple[int, int] | list[int]) -> Tensor:
    """The image at ``path`` as a float32 tensor (channels, height, width), checked against the
    ``channels`` and ``size`` [height, width] of the model (its ``model.inputs``): the size from
    the file's header, before its pixels are read."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: image not found")
    if path.stat().st_size == 0:
        raise AtencionError(f"{path}: empty file; expected a PNG or NPY image")
    size = (int(size[0]), int(size[1]))
    if path.suffix.lower() == ".npy":
        array = _read_npy(path, channels, size)
    else:
        array = _read_picture(path, channels, size)
    if not np.isfinite(array).all():
        raise AtencionError(f"{path}: holds non-finite values (NaN or inf)")
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def _check_size(path: Path, height: int, width: int, size: tuple[int, int]) -> None:
    """Refuse an image of ``height`` × ``width`` pixels when the model reads another ``size``."""
    if (height, width) != size:
        raise AtencionError(f"{path}: an image of {height} × {width} pixels (height × width); this model reads "
                            f"{size[0]} × {size[1]} (model.inputs.size): resize it first")


# NPY arrays -------------------------------------------------------------------------------------


def _read_npy(path: Path, channels: int, size: tuple[int, int]) -> np.ndarray:
    """A .npy array (no pickle): (height, width) for one channel, or (channels, height, width).
    Its header is judged first (dtype, shape, and that the file holds the data it announces);
    only an array of the model's shape is read."""
    shape, dtype, start = _npy_header(path)
    if dtype.hasobject:
        raise AtencionError(f"{path}: not a readable NPY array (it holds Python objects, which only unpickling "
                            f"reads)")
    if dtype.kind not in "biuf":
        raise AtencionError(f"{path}: holds {dtype}; expected an array of numbers (the pixels)")
    if len(shape) == 2 and channels == 1:
        shape = (1, *shape)
    if len(shape) != 3 or shape[0] != channels:
        expected = "(height, width) or (1, height, width)" if channels == 1 else f"({channels}, height, width)"
        raise AtencionError(f"{path}: an array of shape {shape}; this model reads {expected} "
                            f"(model.inputs.channels {channels})")
    _check_size(path, shape[1], shape[2], size)
    needed, held = int(np.prod(shape)) * dtype.itemsize, path.stat().st_size - start
    if held < needed:
        raise AtencionError(f"{path}: not a readable NPY array (truncated: the header says {needed} bytes of "
                            f"pixels, the file holds {held})")
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise AtencionError(f"{path}: not a readable NPY array ({str(err).splitlines()[0]})") from None
    return array.reshape(shape)


def _npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    """An NPY file's shape, dtype and the offset of its data, from its header alone."""
    fmt = np.lib.format
    try:
        with path.open("rb") as f:
            version = fmt.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"format version {version[0]}.{version[1]}; expected 1.0 or 2.0")
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(f)
            return tuple(shape), dtype, f.tell()
    except (ValueError, OSError, EOFError, SyntaxError) as err:
        raise AtencionError(f"{path}: not a readable NPY array ({str(err).splitlines()[0]})") from None


# pictures ---------------------------------------------------------------------------------------


def _read_picture(path: Path, channels: int, size: tuple[int, int]) -> np.ndarray:
    """A picture Pillow reads (PNG, ...), its size checked from its header, then decoded and
    brought to the model's channels on the scale of [0, 1] (the module's rule)."""
    if channels not in MODES:
        raise AtencionError(f"{path}: a picture has 1 (grey), 3 (RGB) or 4 (RGBA) channels, but this model reads "
                            f"{channels} (model.inputs.channels); give it NPY arrays")
    with _open_picture(path, size) as image:
        _check_size(path, image.height, image.width, size)
        try:
            return _scaled(path, image, channels)
        except AtencionError:  # a ValueError too, but already the refusal
            raise
        except PILLOW_ERRORS as err:
            raise _unreadable(path, err) from None


def _open_picture(path: Path, size: tuple[int, int]):
    """The picture at ``path``, opened lazily (its header read, not its pixels). One over
    Pillow's limit against decompression bombs is refused here: Pillow refuses it before its
    size can be asked (above twice the limit) or warns (above the limit), taken as a refusal."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(path)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        found = re.search(r"\((\d+) pixels\)", str(err))
        pixels = f"{int(found.group(1)):,} pixels" if found else "more pixels than Pillow reads safely"
        raise AtencionError(f"{path}: an image of {pixels}, refused unread (Pillow's limit against decompression "
                            f"bombs is {Image.MAX_IMAGE_PIXELS:,}); this model reads {size[0]} × {size[1]} "
                            f"(model.inputs.size)") from None
    except PILLOW_ERRORS as err:
        raise _unreadable(path, err) from None


def _unreadable(path: Path, err: BaseException) -> AtencionError:
    """The one-line refusal of a picture Pillow could not read."""
    reason = str(err).splitlines()[0] if str(err).strip() else type(err).__name__
    return AtencionError(f"{path}: not a PNG or NPY image ({reason})")


def _scaled(path: Path, image, channels: int) -> np.ndarray:
    """``image`` decoded as (channels, height, width) float32 on [0, 1] (the module's rule)."""
    if image.mode in SIXTEEN_BITS or image.mode in ("I", "F"):
        grey = _deep_grey(path, image)
        planes = [grey] * min(channels, 3) + ([np.ones_like(grey)] if channels == 4 else [])
        return np.stack(planes)
    if image.mode in STEP:
        image = image.convert(STEP[image.mode])
    pixels = np.asarray(image.convert(MODES[channels]), dtype=np.float32) / 255.0
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def _deep_grey(path: Path, image) -> np.ndarray:
    """A grey picture of more than 8 bits (modes I;16…, I and F) as (height, width) float32:
    16-bit over 65535, floats as they are, mode I over 65535 where its format holds 16-bit grey
    in it (PNG, PNM) and refused elsewhere (its full scale unknown)."""
    if image.mode == "I" and image.format not in SIXTEEN_BIT_I:
        raise AtencionError(f"{path}: pixels in Pillow's mode I (32-bit integers) from a {image.format} file have no "
                            f"known full scale; expected 1-, 8- or 16-bit pixels, floats (mode F) or an NPY array")
    pixels = np.asarray(image)
    if image.mode == "F":
        return pixels.astype(np.float32)
    return (pixels.astype(np.float64) / 65535.0).astype(np.float32)


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
