"""scikit-learn's bundled handwritten digits (``sklearn.datasets.load_digits``: 1,797 images of
8 × 8 pixels, values 0-16, 10 classes, from the UCI optical recognition set; the package ships
them, nothing is downloaded) as files a ViT trains on:

    python -m atencion.data.digits runs/digits/data    # images/*.npy, train.tsv, valid.tsv, test.tsv

The split is the fixed one of scikit-learn's own example ("Recognizing hand-written digits":
``train_test_split(..., test_size=0.5, shuffle=False)``): the first half (898 images) to learn
from, the second (899) to test. Checkpoints are chosen on the last ``--valid`` images of the
first half (default 90, its last 10%: images 808-897), so valid.tsv holds those and train.tsv
the first 808; the test half is never looked at before the end.

Each image is written as ``images/NNNN.npy`` (its index in load_digits' order), float32 (8, 8),
the pixel values divided by 16 so that they lie in [0, 1] as a PNG's do once read; the TSVs are
``label<TAB>images/NNNN.npy``, the path relative to the TSV's folder (``task: classify`` with
``model.inputs: {kind: patches, size: [8, 8], channels: 1, ...}`` reads them).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from ..errors import AtencionError
from ..fileio import atomic_write
from .script import ScriptParser, run_writer

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")


def digits_split(valid: int = 90) -> dict[str, range]:
    """The indices of each split in load_digits' order: the first half (its last ``valid``
    images validate, the rest train), then the test half."""
    half = 1797 // 2  # scikit-learn's test_size=0.5 puts the odd image in the test half: 898 / 899
    if isinstance(valid, bool) or not isinstance(valid, int) or not 1 <= valid < half:
        raise AtencionError(f"--valid must be an integer from 1 to {half - 1} (the images of the first half "
                            f"that validate), got {valid!r}")
    return {"train": range(0, half - valid), "valid": range(half - valid, half), "test": range(half, 1797)}


def write_digits(out: str | Path, valid: int = 90, force: bool = False) -> dict:
    """Write ``out``/images/NNNN.npy and train.tsv, valid.tsv, test.tsv (``digits_split``).
    Existing TSVs are refused unless ``force``; each file is written under a temporary name,
    then renamed. Returns each split's size and label counts, and the seconds taken."""
    from sklearn.datasets import load_digits

    split = digits_split(valid)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AtencionError(f"{out}: is a file; expected a directory")
    there = [str(out / f"{name}.tsv") for name in SPLITS if (out / f"{name}.tsv").exists()]
    if there and not force:
        raise AtencionError(f"{there[0]}: exists; nothing was overwritten (--force replaces it)")
    start = time.perf_counter()
    digits = load_digits()
    images, labels = (digits.images / 16.0).astype(np.float32), digits.target.tolist()
    (out / "images").mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        atomic_write(out / "images" / f"{i:04d}.npy", lambda tmp, image=image: _save(tmp, image))
    report: dict = {"out": str(out)}
    for name in SPLITS:
        rows = [f"{labels[i]}\timages/{i:04d}.npy\n" for i in split[name]]
        atomic_write(out / f"{name}.tsv", lambda tmp, rows=rows: tmp.write_text("".join(rows), encoding="utf-8"))
        counts = Counter(labels[i] for i in split[name])
        report[name] = {"images": len(rows), "first": split[name].start, "last": split[name].stop - 1,
                        "labels": [counts[d] for d in range(10)]}
        log.info("digits: wrote %s (%d images)", out / f"{name}.tsv", len(rows))
    report["seconds"] = round(time.perf_counter() - start, 1)
    return report


def _save(path: Path, image: np.ndarray) -> None:
    with path.open("wb") as f:  # a file object: np.save would add .npy to the temporary name
        np.save(f, image, allow_pickle=False)


def main(argv: list[str] | None = None) -> int:
    """``python -m atencion.data.digits OUT_DIR [--valid N] [--force]``: write the files, print one JSON line."""
    p = ScriptParser("python -m atencion.data.digits", __doc__)
    p.add_argument("out", metavar="OUT_DIR", help="where images/, train.tsv, valid.tsv and test.tsv are written")
    p.add_argument("--valid", type=int, default=90,
                   help="the last this many images of the first half validate (default: 90, its last 10%%)")
    p.add_argument("--force", action="store_true", help="replace existing files")
    args = p.parse_args(argv)
    return run_writer(p.prog, lambda: write_digits(args.out, args.valid, args.force))


if __name__ == "__main__":
    sys.exit(main())
