"""What the benchmarks share (one copy of each, as litgpt's utils.py): the repository's paths, a
run's log and whether it is done (a finished run is reused), the median and range of repeated
figures, a free port, timing, and the smoke mode's helpers (``--smoke``: every script's whole path
in seconds, on tiny data made on the fly, in a temporary directory).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import random
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"  # ../shared/data, beside the repository
# --smoke's model: one layer (or one of each side) of d_model 32, as config overrides
TINY_MODEL = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64"]
SMOKE_HELP = ("run the whole path in seconds: a tiny model, a few steps, tiny data made on the fly, in a temporary "
              "directory (a check that it runs, not a result)")


# runs ------------------------------------------------------------------------------------------

def read_log(run: Path) -> list[dict]:
    """The records of a training run's log.jsonl (none when there is no log)."""
    path = Path(run) / "log.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []


def finished(run: Path) -> bool:
    """Whether the run under ``run`` finished (its log holds a summary): then it is reused, not trained again."""
    return any("summary" in r for r in read_log(run))


def last_summary(run: Path) -> dict:
    """The summary a finished run's trainer logged last."""
    return [r["summary"] for r in read_log(run) if "summary" in r][-1]


# figures ---------------------------------------------------------------------------------------

def spread(values: list[float], digits: int | None = None) -> dict:
    """The median and range of repeated figures, and how many there are (rounded to ``digits``)."""
    keep = (lambda x: x) if digits is None else (lambda x: round(x, digits))
    return {"median": keep(statistics.median(values)), "min": keep(min(values)), "max": keep(max(values)),
            "runs": len(values)}


def timed(call: Callable[[], object]) -> float:
    """Seconds of one call."""
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# smoke mode ------------------------------------------------------------------------------------

def smoke_requested(argv: list[str] | None) -> bool:
    """Whether ``--smoke`` is among the arguments (before parsing: it makes the required ones optional)."""
    return "--smoke" in (sys.argv[1:] if argv is None else argv)


@contextlib.contextmanager
def smoke_dir(name: str) -> Iterator[Path]:
    """A temporary directory for one smoke run, removed after it."""
    with tempfile.TemporaryDirectory(prefix=f"atencion-smoke-{name}-") as tmp:
        yield Path(tmp)


def installed(module: str, what: str) -> bool:
    """Whether ``module`` can be imported; if not, a line on stderr says that ``what`` is skipped."""
    if importlib.util.find_spec(module) is not None:
        return True
    print(f"skipped: {what} ({module} is not installed)", file=sys.stderr, flush=True)
    return False


WORDS = ("the a one two red blue man woman dog cat runs walks sits near under over with and street water "
         "ball boy girl small big old young green house tree looks holds plays in on at of").split()


def tiny_lines(n: int, seed: int = 0, words: tuple[str, ...] | list[str] = WORDS) -> list[str]:
    """``n`` lines of 4 to 12 words drawn from a small vocabulary: tiny data for the smoke runs."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(n)]


def write_gz(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    return path


def tiny_text(path: Path, lines: int = 400, seed: int = 0) -> Path:
    """A gzipped text of ``lines`` lines, in place of Tiny Shakespeare."""
    return write_gz(Path(path), tiny_lines(lines, seed))


def tiny_multi30k(root: Path, sizes: dict[str, int] | None = None) -> Path:
    """A Multi30k-shaped directory (tok/ lower-cased and tokenized, raw/ cased) of made-up sentences:
    English, and German and French word by word from it, with train, val and test_2016_flickr."""
    sizes = sizes or {"train": 48, "val": 8, "test_2016_flickr": 8}
    suffix = {"en": "", "de": "en", "fr": "e"}
    for k, (split, n) in enumerate(sizes.items()):
        english = tiny_lines(n, seed=k)
        for lang, end in suffix.items():
            lines = [" ".join(w + end for w in line.split()) for line in english]
            write_gz(Path(root) / "tok" / f"{split}.lc.norm.tok.{lang}.gz", lines)
            raw = "train" if split == "train" else split
            write_gz(Path(root) / "raw" / f"{raw}.{lang}.gz", [line.capitalize() + "." for line in lines])
    return Path(root)
