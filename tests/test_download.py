"""The Multi30k download command, tested on a local copy of the repository layout (file:// URL)."""

import gzip
import json

from atencion.cli import main
from atencion.data.corpus import read_parallel
from atencion.data.download import LANGUAGES, SPLITS


def fake_repository(root):
    """data/task1 as the multi30k/dataset repository lays it out: raw/*.gz, tok/* plain text."""
    for split in SPLITS:
        for lang in LANGUAGES:
            (root / "raw").mkdir(parents=True, exist_ok=True)
            (root / "tok").mkdir(parents=True, exist_ok=True)
            text = f"{split} sentence in {lang} .\nanother {lang} line .\n"
            (root / "raw" / f"{split}.{lang}.gz").write_bytes(gzip.compress(text.encode()))
            (root / "tok" / f"{split}.lc.norm.tok.{lang}").write_text(text.lower())


def test_download_writes_the_layout_the_recipes_read(tmp_path, capsys):
    fake_repository(tmp_path / "repo")
    out = tmp_path / "multi30k"
    assert main(["download", "multi30k", "--out", str(out), "--base-url", (tmp_path / "repo").as_uri()]) == 0
    assert json.loads(capsys.readouterr().out)["files_written"] == 2 * len(SPLITS) * len(LANGUAGES)
    pairs, _ = read_parallel(out / "tok" / "train.lc.norm.tok.en.gz", out / "tok" / "train.lc.norm.tok.de.gz")
    assert pairs[0] == ("train sentence in en .", "train sentence in de .")
    assert read_parallel(out / "raw" / "val.en.gz", out / "raw" / "val.fr.gz")[0][1] == (
        "another en line .", "another fr line .")
    # a second run keeps what is there
    assert main(["download", "multi30k", "--out", str(out), "--base-url", (tmp_path / "repo").as_uri()]) == 0
    assert json.loads(capsys.readouterr().out)["files_written"] == 0


def test_unreachable_source_is_one_clear_error(tmp_path, capsys):
    assert main(["download", "multi30k", "--out", str(tmp_path / "m"),
                 "--base-url", (tmp_path / "missing").as_uri()]) == 2
    err = capsys.readouterr().err
    assert "download failed" in err and "raw/train.en.gz" in err
