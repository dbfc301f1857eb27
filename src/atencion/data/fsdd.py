"""The Free Spoken Digit Dataset (FSDD; Jackson et al., github Jakobovski/free-spoken-digit-
dataset, Zenodo DOI 10.5281/zenodo.1342401): the digits 0-9 spoken in English, 8 kHz mono WAV
files named ``{digit}_{speaker}_{index}.wav``, 50 of each digit by each speaker.

    python -m atencion.data.fsdd runs/fsdd/data      # from ../shared/data/fsdd/recordings.tar.gz

reads the archive with ``tarfile`` (each recording checked as a PCM WAV, nothing extracted by
the archive's own paths) and writes, under OUT:

- ``wav/{digit}_{speaker}_{index}.wav``: the recordings, as they are (``task: classify`` and
  ``atencion transcribe`` resample them to 16 kHz when they read them);
- ``train.tsv``, ``valid.tsv``, ``test.tsv``: ``label<TAB>path`` rows (the digit, and the path
  relative to the TSV's folder) for the dataset's own split: indices 0-4 of each digit and
  speaker are the test set (FSDD's README); of the rest, indices 5-9 are held out for validation
  (choosing checkpoints and settings) and indices 10-49 train;
- ``train_text.tsv``, ``valid_text.tsv``, ``test_text.tsv``: the same split as ``text<TAB>path``
  rows, the digit's English word ("seven"), for speech to text;
- ``speaker_{name}/train.tsv``, ``valid.tsv``, ``test.tsv`` for each speaker: leave one speaker
  out. The test set is every recording of that speaker; the other four give the rest, indices
  5-9 of each digit and speaker held out for validation, the others (0-4 and 10-49) training.

Every row lists its recordings in one order (digit, speaker, index); existing files are
refused unless ``--force``; each file is written under a temporary name, then renamed.
"""

from __future__ import annotations

import logging
import re
import sys
import tarfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from ..errors import AtencionError, MissingFileError
from ..fileio import atomic_write_bytes, atomic_write_text
from .audio import decode_wav
from .script import ScriptParser, run_writer

log = logging.getLogger(__name__)

ARCHIVE = "../shared/data/fsdd/recordings.tar.gz"
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SPLITS = ("train", "valid", "test")
TEST_INDICES = range(0, 5)    # FSDD's own test split
VALID_INDICES = range(5, 10)  # held out of the rest for validation
_NAME = re.compile(r"(?:.*/)?(?P<digit>\d)_(?P<speaker>[A-Za-z]+)_(?P<index>\d+)\.wav")


def recording_key(name: str) -> tuple[int, str, int]:
    """(digit, speaker, index) of a file name ``{digit}_{speaker}_{index}.wav``."""
    match = _NAME.fullmatch(name)
    return int(match["digit"]), match["speaker"], int(match["index"])


def read_archive(archive: str | Path) -> dict[str, bytes]:
    """The recordings of an FSDD ``.tar.gz``: file name (``0_george_3.wav``) → WAV bytes, each
    checked as a PCM WAV. Members that are not ``{digit}_{speaker}_{index}.wav`` files are left
    out; an archive without any, or one that is not a readable tar file, is refused in one
    line naming it (and the member, for a corrupt recording)."""
    archive = Path(archive)
    if archive.is_dir():
        raise AtencionError(f"--archive {archive}: is a directory; expected FSDD's recordings.tar.gz")
    if not archive.exists():
        raise MissingFileError(f"--archive {archive}: file not found")
    recordings: dict[str, bytes] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                name = member.name.rsplit("/", 1)[-1]
                if not member.isfile() or not _NAME.fullmatch(name):
                    continue
                if name in recordings:
                    raise AtencionError(f"--archive {archive}: {member.name}: a second recording named {name}")
                data = tar.extractfile(member).read()
                decode_wav(data, f"--archive {archive}: {member.name}")
                recordings[name] = data
    except (tarfile.TarError, EOFError, zlib.error, OSError) as err:
        raise AtencionError(f"--archive {archive}: not a readable tar archive ({err})") from None
    if not recordings:
        raise AtencionError(f"--archive {archive}: no recordings named {{digit}}_{{speaker}}_{{index}}.wav")
    return recordings


def standard_split(key: tuple[int, str, int]) -> str:
    """FSDD's split of a recording: test (indices 0-4), valid (5-9) or train (10 and above)."""
    index = key[2]
    return "test" if index in TEST_INDICES else "valid" if index in VALID_INDICES else "train"


def speaker_split(key: tuple[int, str, int], held_out: str) -> str:
    """The split of a recording when ``held_out`` is left out: all of that speaker's are test;
    of the others', indices 5-9 are valid and the rest train."""
    if key[1] == held_out:
        return "test"
    return "valid" if key[2] in VALID_INDICES else "train"


def _rows(keys: list[tuple[int, str, int]], split: Callable[[tuple], str], column: Callable[[int], str],
          wav: str) -> dict[str, str]:
    """Each split's TSV text: ``column(digit)<TAB>wav/name`` rows of its recordings."""
    out = {name: "" for name in SPLITS}
    for key in keys:
        digit, speaker, index = key
        out[split(key)] += f"{column(digit)}\t{wav}/{digit}_{speaker}_{index}.wav\n"
    return out


def write_fsdd(out: str | Path, archive: str | Path = ARCHIVE, force: bool = False) -> dict:
    """Write the recordings and every split's TSV files under ``out`` (see the module's
    docstring); refused before anything is written when a TSV is there and not ``force``.
    Returns the counts of each split, the speakers and the seconds taken."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AtencionError(f"{out}: is a file; expected a directory")
    if (out / "train.tsv").exists() and not force:
        raise AtencionError(f"{out / 'train.tsv'}: exists; nothing was overwritten (--force replaces it)")
    start = time.perf_counter()
    recordings = read_archive(archive)
    keys = sorted(recording_key(name) for name in recordings)
    speakers = sorted({speaker for _, speaker, _ in keys})
    files: dict[str, str] = {}
    for suffix, column in (("", str), ("_text", WORDS.__getitem__)):
        for split, text in _rows(keys, standard_split, column, "wav").items():
            files[f"{split}{suffix}.tsv"] = text
    for held_out in speakers:
        for split, text in _rows(keys, lambda key, s=held_out: speaker_split(key, s), str, "../wav").items():
            files[f"speaker_{held_out}/{split}.tsv"] = text
    (out / "wav").mkdir(parents=True, exist_ok=True)
    for name, data in recordings.items():
        atomic_write_bytes(out / "wav" / name, data)
    for name, text in files.items():
        (out / name).parent.mkdir(exist_ok=True)
        atomic_write_text(out / name, text)
    log.info("fsdd: wrote %d recordings and %d TSV files under %s", len(recordings), len(files), out)
    counts = {name: text.count("\n") for name, text in files.items() if "_text" not in name}
    return {"out": str(out), "archive": str(archive), "recordings": len(recordings), "speakers": speakers,
            "rows": counts, "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    """``python -m atencion.data.fsdd OUT_DIR [--archive F] [--force]``: write, print one JSON line."""
    p = ScriptParser("python -m atencion.data.fsdd", __doc__)
    p.add_argument("out", metavar="OUT_DIR", help="where wav/ and the TSV files are written")
    p.add_argument("--archive", default=ARCHIVE, help=f"FSDD's recordings.tar.gz (default: {ARCHIVE})")
    p.add_argument("--force", action="store_true", help="replace existing files")
    args = p.parse_args(argv)
    return run_writer(p.prog, lambda: write_fsdd(args.out, args.archive, args.force))


if __name__ == "__main__":
    sys.exit(main())
