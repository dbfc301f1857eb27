"""Download Multi30k (task 1) from its public repository, laid out as this project reads it."""

from __future__ import annotations

import gzip
import logging
import urllib.request
from pathlib import Path

from ..errors import AtencionError

log = logging.getLogger(__name__)

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1"
SPLITS = ("train", "val", "test_2016_flickr")
LANGUAGES = ("en", "de", "fr")


def download_multi30k(out: str | Path, base_url: str = MULTI30K_URL) -> list[Path]:
    """Fetch raw/{split}.{lang}.gz and tok/{split}.lc.norm.tok.{lang} (stored gzipped) into ``out``.

    Files already there are kept; each new file is written under a temporary name, then renamed.
    """
    from ..fileio import atomic_write_bytes, need_output_dir

    out = need_output_dir(out, "--out", empty=False)
    written = []
    for split in SPLITS:
        for lang in LANGUAGES:
            for remote, local in ((f"raw/{split}.{lang}.gz", f"raw/{split}.{lang}.gz"),
                                  (f"tok/{split}.lc.norm.tok.{lang}", f"tok/{split}.lc.norm.tok.{lang}.gz")):
                target = out / local
                if target.exists():
                    continue
                url = f"{base_url.rstrip('/')}/{remote}"
                try:
                    with urllib.request.urlopen(url, timeout=60) as response:
                        data = response.read()
                except OSError as err:
                    raise AtencionError(f"{url}: download failed ({err})") from None
                if not local.endswith(".gz") or not remote.endswith(".gz"):
                    data = gzip.compress(data, mtime=0)
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(target, data)
                log.info("wrote %s", target)
                written.append(target)
    return written
