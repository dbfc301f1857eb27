"""Images as data: scikit-learn's digits written as files with the fixed split, PNG and NPY files
read as the model's inputs say, a ViT trained with task classify on label<TAB>path rows (no
tokenizer), `atencion classify` and `atencion evaluate` on image paths, and bad input refused in
one line naming the file, with nothing written."""

import io
import json
import struct
import sys
import time
import warnings
import zlib
from functools import cache

import numpy as np
import pytest
import torch

from atencion.cli import main
from atencion.data.images import read_image, rotate, rotate_images, shift_images, shifted_views
from atencion.errors import AtencionError, MissingFileError


def _png(path, array, mode):
    from PIL import Image

    Image.fromarray(array, mode=mode).save(path)
    return path


# scikit-learn's digits -------------------------------------------------------------------------


def test_the_digits_are_written_with_scikit_learns_split_and_a_valid_part_of_the_first_half(tmp_path, capsys):
    from sklearn.datasets import load_digits

    assert main_digits([str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [report[s]["images"] for s in ("train", "valid", "test")] == [808, 90, 899]
    digits = load_digits()
    rows = {split: [line.split("\t") for line in (tmp_path / f"{split}.tsv").read_text().splitlines()]
            for split in ("train", "valid", "test")}
    order = [path for split in ("train", "valid", "test") for _, path in rows[split]]
    assert order == [f"images/{i:04d}.npy" for i in range(1797)]  # first half, its last 90, then the second half
    for split in rows:
        for label, path in rows[split][::97]:
            i = int(path[7:11])
            assert int(label) == digits.target[i]
            image = np.load(tmp_path / path, allow_pickle=False)
            assert image.dtype == np.float32 and image.shape == (8, 8)
            np.testing.assert_array_equal(image, digits.images[i] / 16.0)
    assert main_digits([str(tmp_path)]) == 2  # nothing overwritten without --force
    assert "train.tsv: exists; nothing was overwritten" in capsys.readouterr().err


def main_digits(argv):
    from atencion.data.digits import main as digits

    return digits(argv)


# reading an image ----------------------------------------------------------------------------------


def test_a_png_is_read_as_pixels_over_255_in_the_models_channels(tmp_path):
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    image = read_image(_png(tmp_path / "g.png", grey, "L"), 1, [3, 4])
    assert image.shape == (1, 3, 4) and image.dtype == torch.float32
    torch.testing.assert_close(image[0], torch.from_numpy(grey / 255.0).float())
    rgb = np.stack([grey, 255 - grey, grey // 2], axis=-1)
    image = read_image(_png(tmp_path / "c.png", rgb, "RGB"), 3, [3, 4])
    torch.testing.assert_close(image, torch.from_numpy(rgb.transpose(2, 0, 1) / 255.0).float())
    from PIL import Image

    expected = np.asarray(Image.fromarray(rgb, mode="RGB").convert("L"), dtype=np.float32) / 255.0
    torch.testing.assert_close(read_image(tmp_path / "c.png", 1, [3, 4])[0], torch.from_numpy(expected))


def test_an_npy_array_is_taken_as_it_is(tmp_path):
    array = np.random.default_rng(0).random((2, 3, 4)).astype(np.float64)
    np.save(tmp_path / "a.npy", array)
    torch.testing.assert_close(read_image(tmp_path / "a.npy", 2, [3, 4]), torch.from_numpy(array).float())
    np.save(tmp_path / "b.npy", array[0])
    assert read_image(tmp_path / "b.npy", 1, [3, 4]).shape == (1, 3, 4)


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_bytes(b""), "empty file; expected a PNG or NPY image"),
    (lambda p: p.write_text("not an image\n"), "not a PNG or NPY image"),
    (lambda p: _png(p, np.zeros((5, 4), np.uint8), "L"), r"an image of 5 × 4 pixels .height × width.; this model "
                                                           r"reads 3 × 4 \(model.inputs.size\)"),
])
def test_a_bad_picture_is_refused_naming_the_file(tmp_path, make, message):
    path = tmp_path / "x.png"
    make(path)
    with pytest.raises(AtencionError, match=f"{path}: {message}"):
        read_image(path, 1, [3, 4])
    with pytest.raises(MissingFileError, match=f"{tmp_path / 'none.png'}: image not found"):
        read_image(tmp_path / "none.png", 1, [3, 4])


def test_a_bad_array_is_refused_without_unpickling_it(tmp_path):
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(AtencionError, match="objects.npy: not a readable NPY array"):
        read_image(tmp_path / "objects.npy", 1, [3, 4])
    np.save(tmp_path / "nan.npy", np.full((3, 4), np.nan))
    with pytest.raises(AtencionError, match="nan.npy: holds non-finite values"):
        read_image(tmp_path / "nan.npy", 1, [3, 4])
    np.save(tmp_path / "rgb.npy", np.zeros((3, 3, 4)))
    with pytest.raises(AtencionError, match=r"rgb.npy: an array of shape \(3, 3, 4\); this model reads \(height, "
                                            r"width\) or \(1, height, width\)"):
        read_image(tmp_path / "rgb.npy", 1, [3, 4])



# hostile and unusual pictures (issue #52, class 3) -------------------------------------------------


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@cache
def blank_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of zeros, ``width`` × ``height``, a few KB even at 20,000 × 20,000 (a
    decompression bomb: 400 million pixels from 48 KB), its rows deflated one by one."""
    deflate = zlib.compressobj(9)
    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then the bits
    data = b"".join(deflate.compress(row) for _ in range(height)) + deflate.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


def _gif_claiming(width: int, height: int) -> bytes:
    """A GIF whose screen and first image say ``width`` × ``height``, with one byte of pixels."""
    size = struct.pack("<HH", width, height)
    return (b"GIF89a" + size + b"\x80\x00\x00" + b"\x00\x00\x00\xff\xff\xff" + b"," + b"\x00\x00\x00\x00" + size
            + b"\x00" + b"\x02\x02\x44\x01\x00" + b";")


def _bmp_claiming(width: int, height: int) -> bytes:
    """An 8-bit grey BMP header saying ``width`` × ``height``, followed by a few bytes of pixels."""
    palette = b"".join(bytes((i, i, i, 0)) for i in range(256))
    offset = 14 + 40 + len(palette)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 0, 0, 2835, 2835, 256, 0)
    return b"BM" + struct.pack("<IHHI", offset + 16, 0, 0, offset) + info + palette + bytes(16)


def _tiff_claiming(width: int, height: int) -> bytes:
    """An 8-bit grey TIFF whose tags say ``width`` × ``height``, with 16 bytes of pixels."""
    tags = [(256, 4, width), (257, 4, height), (258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, 8 + 2 + 10 * 12 + 4),
            (277, 3, 1), (278, 4, height), (279, 4, 16), (284, 3, 1)]
    ifd = struct.pack("<H", len(tags)) + b"".join(struct.pack("<HHII", tag, kind, 1, value) if kind == 4 else
                                                 struct.pack("<HHIHH", tag, kind, 1, value, 0)
                                                 for tag, kind, value in tags) + struct.pack("<I", 0)
    return b"II*\x00" + struct.pack("<I", 8) + ifd + bytes(16)


@pytest.fixture
def no_decoding(monkeypatch):
    """Pillow's decoding (``ImageFile.load``) and conversion made to fail the test: what is read
    under it is judged from its header alone."""
    from PIL import Image, ImageFile

    def decoded(*args, **kwargs):
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", decoded)
    monkeypatch.setattr(Image.Image, "convert", decoded)


@pytest.mark.parametrize("name, make, says", [
    ("bomb.png", lambda: blank_png(20_000, 20_000), "an image of 400,000,000 pixels"),
    ("between.png", lambda: blank_png(12_000, 12_000), "an image of 144,000,000 pixels"),  # Pillow only warns
    ("large.png", lambda: blank_png(9_000, 9_000), "an image of 9000 × 9000 pixels"),  # under Pillow's limit
    ("screen.gif", lambda: _gif_claiming(65_535, 65_535), "an image of 4,294,836,225 pixels"),
    ("wide.bmp", lambda: _bmp_claiming(30_000, 30_000), "an image of 900,000,000 pixels"),
    ("tall.tif", lambda: _tiff_claiming(5_000, 9_000), "an image of 9000 × 5000 pixels"),
])
def test_a_picture_of_huge_dimensions_is_refused_in_one_line_from_its_header(tmp_path, no_decoding, name, make, says):
    path = tmp_path / name
    path.write_bytes(make())
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, pytest.raises(AtencionError) as err:
        warnings.simplefilter("always")
        read_image(path, 1, [4, 4])
    message = str(err.value)
    assert message.startswith(f"{path}: {says}") and "this model reads 4 × 4 (model.inputs.size)" in message
    assert "\n" not in message and not caught  # no DecompressionBombWarning printed either
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("suffix", [".png", ".gif", ".bmp", ".tif", ".jpg", ".webp", ".ppm"])
def test_a_picture_of_the_wrong_size_is_refused_without_decoding_it(tmp_path, suffix):
    path = _png(tmp_path / f"x{suffix}", np.full((5, 4), 200, np.uint8), "L")
    from PIL import Image, ImageFile

    calls = []
    real_load = ImageFile.ImageFile.load
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ImageFile.ImageFile, "load", lambda self: calls.append(self) or real_load(self))
        patch.setattr(Image.Image, "convert", lambda self, *a, **k: calls.append(self))
        with pytest.raises(AtencionError, match=rf"x\{suffix}: an image of 5 × 4 pixels .height × width.; this model "
                                                r"reads 3 × 4"):
            read_image(path, 1, [3, 4])
    assert calls == []
    assert read_image(path, 1, [5, 4]).shape == (1, 5, 4)  # the same file, of the right size, is read


def _npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    """The header of an NPY file (format 1.0) for an array of ``shape``, without its data."""
    header = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode("latin1")
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header


@pytest.mark.parametrize("shape, says", [
    ((100_000, 100_000), "an image of 100000 × 100000 pixels"),
    ((1, 3, 100_000_000_000), "an image of 3 × 100000000000 pixels"),
    ((3, 3, 4), r"an array of shape \(3, 3, 4\); this model reads \(height, width\) or \(1, height, width\)"),
])
def test_an_npy_array_of_the_wrong_shape_is_refused_from_its_header_before_its_data_is_read(tmp_path, monkeypatch,
                                                                                             shape, says):
    path = tmp_path / "x.npy"
    path.write_bytes(_npy_header(shape) + bytes(800))  # the header claims far more than the file holds

    def loaded(*args, **kwargs):
        raise AssertionError("the array's data was read")

    monkeypatch.setattr(np, "load", loaded)
    monkeypatch.setattr(np, "fromfile", loaded)
    with pytest.raises(AtencionError, match=f"x.npy: {says}"):
        read_image(path, 1, [3, 4])


def test_an_npy_array_shorter_than_its_header_says_is_refused_naming_it(tmp_path):
    path = tmp_path / "short.npy"
    path.write_bytes(_npy_header((3, 4)) + bytes(8 * 11))  # eleven of twelve pixels
    with pytest.raises(AtencionError, match=r"short.npy: not a readable NPY array \(truncated: the header says "
                                            r"96 bytes of pixels, the file holds 88\)"):
        read_image(path, 1, [3, 4])


def _pgm(path, array: np.ndarray, maxval: int):
    """A binary PGM (P5) of 16-bit ``array`` with ``maxval``: Pillow opens it in mode I."""
    path.write_bytes(f"P5\n{array.shape[1]} {array.shape[0]}\n{maxval}\n".encode() + array.astype(">u2").tobytes())
    return path


def _saved(path, array: np.ndarray, mode: str):
    """``array`` saved as the picture at ``path``, Pillow choosing the mode from its dtype (asserted
    ``mode``: uint16 is I;16, big-endian uint16 I;16B, bool 1, int32 I, float32 F)."""
    from PIL import Image

    picture = Image.fromarray(array)
    assert picture.mode == mode
    picture.save(path)
    return path


GREY16 = (np.arange(12, dtype=np.uint16).reshape(3, 4) * 5957 + 1)  # 1 … 65528: every byte in play


@pytest.mark.parametrize("write, expected", [
    (lambda p: _saved(p / "g16.png", GREY16, "I;16"), GREY16 / 65535),
    (lambda p: _saved(p / "g16b.tif", GREY16.astype(">u2"), "I;16B"), GREY16 / 65535),
    (lambda p: _pgm(p / "g16.pgm", GREY16, 65535), GREY16 / 65535),  # mode I
    (lambda p: _pgm(p / "g1000.pgm", GREY16 % 1001, 1000), (GREY16 % 1001) / 1000),  # mode I, 0 … maxval
    (lambda p: _saved(p / "f.tif", (GREY16 / 65535).astype(np.float32), "F"), GREY16 / 65535),  # floats as they are
    (lambda p: _png(p / "g8.png", (GREY16 >> 8).astype(np.uint8), "L"), (GREY16 >> 8) / 255),
    (lambda p: _saved(p / "bits.png", GREY16 % 3 == 0, "1"), (GREY16 % 3 == 0) * 1.0),
])
def test_every_bit_depth_reads_on_the_same_0_to_1_scale(tmp_path, write, expected):
    path = write(tmp_path)
    grey = read_image(path, 1, [3, 4])
    np.testing.assert_allclose(grey[0].numpy(), expected, atol=1e-5 if "1000" in path.name else 1e-6, rtol=0)
    colour = read_image(path, 3, [3, 4])  # one grey value in each of R, G and B, as Pillow turns L into RGB
    np.testing.assert_allclose(colour.numpy(), np.stack([grey[0].numpy()] * 3), atol=1e-6, rtol=0)
    rgba = read_image(path, 4, [3, 4])  # and opaque
    np.testing.assert_allclose(rgba.numpy(), np.stack([grey[0].numpy()] * 3 + [np.ones((3, 4))]), atol=1e-6, rtol=0)


def test_a_palette_picture_is_read_through_its_palette(tmp_path):
    from PIL import Image

    rgb = np.random.default_rng(0).integers(0, 256, (3, 4, 3), dtype=np.uint8)
    picture = Image.fromarray(rgb, mode="RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=5)
    picture.save(tmp_path / "p.png")
    colours = np.asarray(picture.convert("RGB"), dtype=np.float64).transpose(2, 0, 1) / 255
    assert len(np.unique(np.asarray(picture))) > 1 and np.asarray(picture).max() < 5  # indices, not colours
    np.testing.assert_allclose(read_image(tmp_path / "p.png", 3, [3, 4]).numpy(), colours, atol=1e-6, rtol=0)
    luma = np.asarray(picture.convert("RGB").convert("L"), dtype=np.float64) / 255
    np.testing.assert_allclose(read_image(tmp_path / "p.png", 1, [3, 4])[0].numpy(), luma, atol=1e-6, rtol=0)


def test_grey_with_alpha_keeps_its_grey_and_gives_its_alpha_to_a_model_that_reads_rgba(tmp_path):
    grey, alpha = (GREY16 >> 8).astype(np.uint8), (255 - (GREY16 >> 8)).astype(np.uint8)
    path = _png(tmp_path / "la.png", np.stack([grey, alpha], -1), "LA")
    np.testing.assert_allclose(read_image(path, 1, [3, 4])[0].numpy(), grey / 255, atol=1e-6, rtol=0)
    np.testing.assert_allclose(read_image(path, 3, [3, 4]).numpy(), np.stack([grey / 255] * 3), atol=1e-6, rtol=0)
    np.testing.assert_allclose(read_image(path, 4, [3, 4]).numpy(), np.stack([grey / 255] * 3 + [alpha / 255]),
                               atol=1e-6, rtol=0)


def test_integer_pixels_of_no_known_full_scale_are_refused_not_clipped(tmp_path):
    path = _saved(tmp_path / "i32.tif", GREY16.astype(np.int32) * 1000, "I")
    with pytest.raises(AtencionError) as err:
        read_image(path, 1, [3, 4])
    assert str(err.value).startswith(f"{path}: pixels in Pillow's mode I (32-bit integers) from a TIFF file have no "
                                     f"known full scale; expected 1-, 8- or 16-bit pixels")


def test_classify_refuses_a_decompression_bomb_in_one_line(vit_dir, tmp_path, capsys):
    tmp, _ = vit_dir
    (tmp_path / "bomb.png").write_bytes(blank_png(20_000, 20_000))
    (tmp_path / "list.txt").write_text("bomb.png\n")
    assert main(["classify", "--model", str(tmp / "run" / "best"), "--input", str(tmp_path / "list.txt")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err
    assert f"list.txt line 1: {tmp_path / 'bomb.png'}: an image of 400,000,000 pixels" in captured.err


def test_a_shift_moves_each_image_by_whole_pixels_and_fills_zeros():
    images = torch.arange(2 * 1 * 5 * 6, dtype=torch.float32).reshape(2, 1, 5, 6) + 1
    assert torch.equal(shift_images(images, 0, torch.Generator()), images)
    moved = shift_images(images, 2, torch.Generator().manual_seed(3))
    assert torch.equal(moved, shift_images(images, 2, torch.Generator().manual_seed(3)))  # the seed decides
    for original, out in zip(images, moved):
        found = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
                 if torch.equal(out, _moved(original, dy, dx))]
        assert len(found) == 1


def test_the_shifted_views_are_every_offset_once_the_unmoved_image_among_them():
    images = torch.rand(2, 1, 5, 6) + 1
    assert [torch.equal(v, images) for v in shifted_views(images, 0)] == [True]
    views = shifted_views(images, 2)
    assert len(views) == 25
    for (dy, dx), view in zip([(a, b) for a in range(2, -3, -1) for b in range(2, -3, -1)], views):
        assert torch.equal(view, torch.stack([_moved(image, dy, dx) for image in images]))


def test_a_rotation_equals_scipys_bilinear_rotation_and_a_quarter_turn_is_rot90():
    ndimage = pytest.importorskip("scipy.ndimage")
    images = torch.randn(3, 2, 9, 7, dtype=torch.float64)          # not square: no shear allowed
    angles = torch.tensor([30.0, -17.0, 180.0])
    turned = rotate(images, angles)
    for image, angle, out in zip(images, angles.tolist(), turned):
        for channel, result in zip(image, out):
            expected = ndimage.rotate(channel.numpy(), angle, reshape=False, order=1, mode="grid-constant", cval=0.0)
            assert np.abs(result.numpy() - expected).max() < 1e-12
    square = torch.randn(2, 1, 6, 6)
    quarter = rotate(square, torch.tensor([90.0, -90.0]))
    assert torch.allclose(quarter[0], torch.rot90(square[0], 1, (1, 2)), atol=1e-5)    # counter-clockwise as shown
    assert torch.allclose(quarter[1], torch.rot90(square[1], -1, (1, 2)), atol=1e-5)


def test_random_rotations_are_drawn_from_the_generator_within_the_range():
    images = torch.rand(16, 1, 8, 8)
    assert torch.equal(rotate_images(images, 0, torch.Generator()), images)
    first = rotate_images(images, 15, torch.Generator().manual_seed(5))
    assert torch.equal(first, rotate_images(images, 15, torch.Generator().manual_seed(5)))   # the seed decides
    assert not torch.equal(first, rotate_images(images, 15, torch.Generator().manual_seed(6)))
    angles = (torch.rand(16, generator=torch.Generator().manual_seed(5)) * 2 - 1) * 15
    assert torch.equal(first, rotate(images, angles)) and angles.abs().max() <= 15 and angles.std() > 3


def _moved(image, dy, dx):
    out = torch.zeros_like(image)
    h, w = image.shape[-2:]
    out[..., max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        image[..., max(-dy, 0):h - max(dy, 0), max(-dx, 0):w - max(dx, 0)]
    return out


# a ViT trained on image files ----------------------------------------------------------------------


def _stripes(folder, n):
    """label<TAB>path rows of 4 × 4 NPY images: horizontal stripes (label h) or vertical (label v)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    rng = np.random.default_rng(len(str(folder)))
    for i in range(n):
        label = "hv"[i % 2]
        image = np.zeros((4, 4), np.float32)
        line = rng.integers(4)
        (image.__setitem__((line, slice(None)), 1.0) if label == "h" else image.__setitem__((slice(None), line), 1.0))
        np.save(folder / f"{i}.npy", image + 0.05 * rng.standard_normal((4, 4)).astype(np.float32))
        rows.append(f"{label}\t{folder.name}/{i}.npy\n")
    return rows


VIT = ["model.preset=vit-tiny", "model.inputs.kind=patches", "model.inputs.patch=2", "model.inputs.size=[4, 4]",
       "model.inputs.channels=1", "model.max_positions=5", "model.n_layers=1", "model.d_model=16", "model.d_ff=32",
       "model.n_heads=2", "train.max_tokens=80", "train.lr_peak=3e-3", "train.warmup=10", "train.optimizer=adamw",
       "train.progress=false", "train.tensorboard=false", "train.keep_last=1", "data.header=no"]


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    tmp = tmp_path_factory.mktemp("vit")
    (tmp / "train.tsv").write_text("".join(_stripes(tmp / "train", 64)))
    (tmp / "valid.tsv").write_text("".join(_stripes(tmp / "valid", 16)))
    (tmp / "c.yaml").write_text("task: classify\n")
    cfg = load_config(tmp / "c.yaml", [*VIT, f"data.train_tsv={tmp / 'train.tsv'}",
                                       f"data.valid_tsv={tmp / 'valid.tsv'}", "data.shift=1", "data.rotate=10",
                                       "train.max_steps=60", "train.max_epochs=100",
                                       "train.valid_every=30"])
    summary = train(cfg, tmp / "run")
    return tmp, summary


def test_a_vit_trains_on_image_files_and_its_directory_holds_no_tokenizer(vit_dir):
    from atencion.nn.model_dir import load_model_dir

    tmp, summary = vit_dir
    best = tmp / "run" / "best"
    assert sorted(p.name for p in best.iterdir()) == ["config.json", "model.safetensors"]
    from atencion.data.tokenizer import INFO_FILE

    assert not (tmp / "run" / INFO_FILE).exists() and not list((tmp / "run").glob("*.model"))
    model, tokenizer = load_model_dir(best)
    assert tokenizer is None and model.cfg.task == "classify" and model.cfg.labels == ["h", "v"]
    assert model.cfg.vocab_size == 0 and model.cfg.inputs["size"] == [4, 4]
    assert json.loads((tmp / "run" / "log.jsonl").read_text().splitlines()[-2])["valid_accuracy"] >= 0.9


def test_classify_labels_image_paths_and_evaluate_scores_a_tsv_of_them(vit_dir, tmp_path, monkeypatch, capsys):
    tmp, _ = vit_dir
    best = str(tmp / "run" / "best")
    listing = tmp / "list.txt"
    listing.write_text("valid/0.npy\nvalid/1.npy\n")  # relative to the list's folder
    assert main(["classify", "--model", best, "--input", str(listing)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in out] == ["h", "v"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{tmp / 'valid' / '0.npy'}\n"))  # stdin: the current directory
    assert main(["classify", "--model", best, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["label"] == "h" and set(answer["probabilities"]) == {"h", "v"}
    assert main(["evaluate", "--model", best, "--tsv", str(tmp / "valid.tsv")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["task"] == "classify" and result["examples"] == 16 and result["accuracy"] >= 0.9


def test_test_time_shifts_average_the_probabilities_over_the_moved_images(vit_dir, capsys):
    from atencion.nn.model_dir import load_model_dir

    tmp, _ = vit_dir
    best = str(tmp / "run" / "best")
    model, _ = load_model_dir(best)
    model.eval()
    rows = [line.split("\t") for line in (tmp / "valid.tsv").read_text().splitlines()]
    images = torch.stack([torch.from_numpy(np.load(tmp / path))[None] for _, path in rows])
    gold = torch.tensor(["hv".index(label) for label, _ in rows])
    with torch.no_grad():
        mean = torch.stack([model.classify(_moved_batch(images, dy, dx)).softmax(-1)
                            for dy in (-1, 0, 1) for dx in (-1, 0, 1)]).mean(0)
    assert main(["evaluate", "--model", best, "--tsv", str(tmp / "valid.tsv"), "--tta-shift", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tta_shift"] == 1
    assert result["accuracy"] == pytest.approx(float((mean.argmax(-1) == gold).float().mean()))
    assert result["loss"] == pytest.approx(float(-mean[torch.arange(len(gold)), gold].log().mean()), rel=1e-5)
    assert main(["evaluate", "--model", best, "--tsv", str(tmp / "valid.tsv")]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] != pytest.approx(result["loss"], rel=1e-3)  # they differ
    (tmp / "two.txt").write_text("valid/0.npy\nvalid/1.npy\n")
    assert main(["classify", "--model", best, "--input", str(tmp / "two.txt"), "--json", "--tta-shift", "1"]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for answer, row in zip(answers, mean[:2]):
        assert [answer["probabilities"][name] for name in "hv"] == pytest.approx(row.tolist(), rel=1e-5)


def _moved_batch(images, dy, dx):
    return torch.stack([_moved(image, dy, dx) for image in images])


def test_test_time_shifts_are_refused_for_a_model_that_reads_no_images(tmp_path, capsys):
    from atencion.train.trainer import train
    from test_tasks import config, sentences

    tsv = tmp_path / "train.tsv"
    tsv.write_text("".join(f"{'pos' if 'cat' in s else 'neg'}\t{s}\n" for s in sentences(60, 0)), encoding="utf-8")
    model = train(config(tmp_path, "classify", f"data.train_tsv={tsv}", "data.vocab_size=60", "train.max_steps=1",
                         "train.threads=1"), tmp_path / "run")["last_checkpoint"]
    for command in (["evaluate", "--model", model, "--tsv", str(tsv)],
                    ["classify", "--model", model, "--input", str(tsv)]):
        assert main([*command, "--tta-shift", "1"]) == 2
        captured = capsys.readouterr()
        assert "--tta-shift 1: test-time shifts are for image classifiers" in captured.err
        assert "reads tokens" in captured.err
        assert len(captured.err.strip().splitlines()) == 1 and captured.out == ""


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "x.npy").write_bytes(b""), "x.npy: empty file"),
    (lambda d: (d / "x.npy").write_text("hello"), "x.npy: not a readable NPY array"),
    (lambda d: np.save(d / "x.npy", np.zeros((5, 5))), r"x.npy: an image of 5 × 5 pixels"),
    (lambda d: None, "x.npy: image not found"),
])
def test_a_bad_image_is_one_line_naming_the_file_and_line_with_nothing_written(vit_dir, tmp_path, capsys, make,
                                                                              message):
    tmp, _ = vit_dir
    best = str(tmp / "run" / "best")
    make(tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text(f"{tmp / 'valid' / '0.npy'}\nx.npy\n")
    assert main(["classify", "--model", best, "--input", str(listing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"{listing} line 2: {tmp_path / 'x.npy'}" in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err
    assert pytest.importorskip("re").search(message, captured.err)
    (tmp_path / "test.tsv").write_text(f"h\t{tmp / 'valid' / '0.npy'}\nv\tx.npy\n")
    assert main(["evaluate", "--model", best, "--tsv", str(tmp_path / "test.tsv")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"--tsv {tmp_path / 'test.tsv'} line 2: {tmp_path / 'x.npy'}" in captured.err


def test_an_empty_line_of_paths_is_refused(vit_dir, tmp_path, capsys):
    tmp, _ = vit_dir
    (tmp_path / "list.txt").write_text(f"{tmp / 'valid' / '0.npy'}\n\n")
    assert main(["classify", "--model", str(tmp / "run" / "best"), "--input", str(tmp_path / "list.txt")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "list.txt line 2: empty; expected the path of a file to classify" in captured.err


def test_training_refuses_a_bad_image_before_writing_anything(vit_dir, tmp_path):
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    tmp, _ = vit_dir
    (tmp_path / "train.tsv").write_text(f"h\t{tmp / 'valid' / '0.npy'}\nv\tmissing.npy\n")
    (tmp_path / "c.yaml").write_text("task: classify\n")
    cfg = load_config(tmp_path / "c.yaml", [*VIT, f"data.train_tsv={tmp_path / 'train.tsv'}"])
    with pytest.raises(MissingFileError, match=f"{tmp_path / 'train.tsv'} line 2: {tmp_path / 'missing.npy'}: "
                                               f"image not found"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    text = load_config(tmp_path / "c.yaml", [f"data.train_tsv={tmp_path / 'train.tsv'}", "data.shift=1"])
    with pytest.raises(AtencionError, match="data.shift moves images; this model reads tokens"):
        train(text, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    turned = load_config(tmp_path / "c.yaml", [f"data.train_tsv={tmp_path / 'train.tsv'}", "data.rotate=5"])
    with pytest.raises(AtencionError, match="data.rotate turns images; this model reads tokens"):
        train(turned, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, does", [("data.shift=1", "data.shift moves"),
                                           ("data.rotate=10", "data.rotate turns")])
def test_image_augmentation_is_refused_for_a_task_without_images(tmp_path, setting, does):
    from atencion.train.config import load_config

    (tmp_path / "c.yaml").write_text("task: lm\n")
    with pytest.raises(AtencionError, match=f"{does} the images a classifier trains on; task 'lm' reads none"):
        load_config(tmp_path / "c.yaml", [f"data.train_text={tmp_path / 'text.txt'}", setting])
