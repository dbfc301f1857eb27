"""Bad corpora get one clear line naming the file and line; nothing is silently dropped."""

import gzip

import pytest

from atencion.data.corpus import CorpusError, read_parallel
from atencion.train.config import load_config


def write(path, text: bytes | str):
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_two_files_plain_and_gzip_and_tsv_give_the_same_pairs(tmp_path):
    src = write(tmp_path / "a.es", "hola\nadiós\n")
    with gzip.open(tmp_path / "a.en.gz", "wb") as f:
        f.write(b"hello\ngoodbye\n")
    tsv = write(tmp_path / "a.tsv", "hola\thello\nadiós\tgoodbye\n")
    pairs, report = read_parallel(src, tmp_path / "a.en.gz")
    assert pairs == [("hola", "hello"), ("adiós", "goodbye")] == read_parallel(tsv)[0]
    assert report.pairs == 2 and report.empty_skipped == 0


def test_different_line_counts_name_both_files(tmp_path):
    src = write(tmp_path / "a.es", "uno\ndos\ntres\n")
    tgt = write(tmp_path / "a.en", "one\ntwo\n")
    with pytest.raises(CorpusError, match=r"a.es has 3 lines but .*a.en has 2"):
        read_parallel(src, tgt)


def test_empty_file_is_named(tmp_path):
    with pytest.raises(CorpusError, match=r"a.en: the file is empty"):
        read_parallel(write(tmp_path / "a.es", "uno\n"), write(tmp_path / "a.en", ""))


def test_bytes_that_are_not_utf8_name_file_line_and_column(tmp_path):
    src = write(tmp_path / "a.es", b"uno\ndos \xff tres\n")
    tgt = write(tmp_path / "a.en", "one\ntwo\n")
    with pytest.raises(CorpusError, match=r"a.es line 2: not valid UTF-8 \(byte 0xff at column 5\)"):
        read_parallel(src, tgt)


def test_empty_lines_are_skipped_and_counted_or_refused(tmp_path):
    src = write(tmp_path / "a.es", "uno\n\ntres\ncuatro\n")
    tgt = write(tmp_path / "a.en", "one\ntwo\nthree\n  \n")
    pairs, report = read_parallel(src, tgt, empty_lines="skip")
    assert pairs == [("uno", "one"), ("tres", "three")]
    assert report.empty_skipped == 2 and "a.es line 2" in report.first_empty
    assert "2 skipped with an empty side" in report.summary("train")
    with pytest.raises(CorpusError, match=r"a.es line 2: empty source sentence"):
        read_parallel(src, tgt, empty_lines="error")


def test_tsv_line_without_a_tab_is_named(tmp_path):
    tsv = write(tmp_path / "c.tsv", "hola\thello\nsin tabulador\n")
    with pytest.raises(CorpusError, match=r"c.tsv line 2: expected 2 tab-separated fields"):
        read_parallel(tsv)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.es: file not found"):
        read_parallel(tmp_path / "nope.es", tmp_path / "nope.en")


@pytest.mark.parametrize("override, message", [
    ("train.max_stpes=3", "unknown key train.max_stpes"),
    ("train.max_steps=many", "train.max_steps: expected an integer"),
    ("model.d_mdoel=3", r"unknown key\(s\) model.d_mdoel"),
    ("data.model_type=words", "data.model_type must be one of"),
    ("nosection=1", "expected SECTION.KEY=VALUE"),
])
def test_bad_config_keys_and_values_are_named(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_reference_config_documents_every_key():
    import dataclasses

    import yaml

    from atencion.train.config import SECTIONS

    reference = yaml.safe_load(open("configs/reference.yaml"))
    for name, cls in SECTIONS.items():
        assert set(reference[name]) == {f.name for f in dataclasses.fields(cls)}, name
    text = open("configs/reference.yaml").read()
    from atencion.config import MODEL_KEYS
    for key in MODEL_KEYS - {"preset"}:
        assert f"# {key}:" in text, key
