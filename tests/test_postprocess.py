"""Back from tokenized lower-cased output to raw text: recasing, detokenization, raw scores."""

import json

from sacrebleu.metrics import BLEU

from atencion.cli import main
from atencion.data.postprocess import Detokenizer, Recaser, language_of
from atencion.evaluate import raw_score
from test_cli import model_dir  # noqa: F401  (the module's trained toy model)

RAW = ["Ein Mann mit einem roten Hut.", "Der Hund läuft über die Wiese.",
       "Ein Hund und ein Mann sitzen im Park.", "Zwei Kinder spielen, der Mann schaut zu."]


def test_recaser_takes_the_most_frequent_casing_outside_sentence_starts():
    recaser = Recaser.fit(RAW, "de")
    # "ein" starts two sentences as "Ein" but is "ein" inside one: the inside casing wins
    assert recaser(["der", "mann", "und", "ein", "hund", "."]) == ["Der", "Mann", "und", "ein", "Hund", "."]
    assert recaser([",", "ein", "unbekannt"]) == [",", "Ein", "unbekannt"]  # first word capitalised
    assert recaser.casing["zwei"] == "Zwei"  # seen only at a start: that casing is all there is


def test_detokenizer_undoes_moses_tokenization_and_escapes():
    detokenize = Detokenizer("de")
    assert detokenize("ein mann , der &quot; hallo &quot; sagt .") == 'ein mann, der "hallo" sagt.'
    assert Detokenizer("fr")("l&apos; homme est là .") == "l'homme est là."
    assert Detokenizer("de", Recaser.fit(RAW, "de"))("ein mann mit einem roten hut .") == RAW[0]


def test_raw_score_of_the_lowercased_tokenized_references_recovers_them():
    tokenized = ["ein mann mit einem roten hut .", "der hund läuft über die wiese ."]
    scores, lines = raw_score(tokenized, RAW[:2], "de", RAW)
    assert lines == RAW[:2]
    assert scores["raw_bleu"] == 100.0 and scores["raw_bleu_lc"] == 100.0
    without_recaser, lines = raw_score(tokenized, RAW[:2], "de")
    assert set(without_recaser) == {"raw_bleu_lc"} and without_recaser["raw_bleu_lc"] == 100.0
    assert without_recaser["raw_bleu_lc"] > BLEU().corpus_score(lines, [RAW[:2]]).score  # casing counts


def test_the_language_is_read_from_a_two_letter_file_suffix():
    assert language_of("data/test_2016_flickr.de.gz") == "de"
    assert language_of("train.lc.norm.tok.fr") == "fr"
    assert language_of("references.txt") is None


def test_evaluate_with_raw_references_adds_sacrebleu_on_the_detokenized_output(model_dir, tmp_path, capsys):  # noqa: F811
    (tmp_path / "src.txt").write_text("uno dos\ntres cuatro\n")
    (tmp_path / "ref.txt").write_text("two one\nfour three\n")
    (tmp_path / "raw.txt").write_text("Two one\nFour three\n")
    args = ["evaluate", "--model", str(model_dir), "--src", str(tmp_path / "src.txt"), "--ref",
            str(tmp_path / "ref.txt"), "--raw-ref", str(tmp_path / "raw.txt"), "--output", str(tmp_path / "out")]
    assert main(args) == 2
    assert "cannot tell the language of" in capsys.readouterr().err
    assert main(args + ["--lang", "en", "--recase-from", str(tmp_path / "raw.txt")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"raw_bleu", "raw_bleu_lc", "raw_chrf"} <= set(result)
    detok = (tmp_path / "out.detok").read_text().splitlines()
    assert len(detok) == 2 and all(line[:1].isupper() for line in detok if line)
