"""data.tokenizer subword-nmt: the joint BPE of the published translation setups. Its merges and
segmentations equal those of the subword-nmt command line (learn-bpe, apply-bpe), the tool those
setups ran; it round-trips text, is saved with the model, and a translator trains and decodes with it."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from atencion.cli import main
from atencion.data.tokenizer import SPECIALS, UNK_ID, Tokenizer
from atencion.errors import AtencionError
from atencion.train.config import load_config
from atencion.train.trainer import train
from test_training import NUMBERS, WORDS, tiny_config

SOURCE = ["ein mann hält eine gitarre , während der andere mann ein hemd ansieht .",
          "zwei männer halten gitarren und hemden .", "eine frau sieht die gitarre an ."] * 3
TARGET = ["a man holds a guitar while the other man looks at a shirt .",
          "two men are holding guitars and shirts .", "a woman looks at the guitar ."] * 3
HELD_OUT = "ein anderer mann hält zwei hemden , während eine frau gitarren ansieht ."


def subword_nmt(args: list[str], stdin: str) -> str:
    """subword-nmt's own command line, as the published setups ran it."""
    command = "from subword_nmt.subword_nmt import main; main()"  # the subword-nmt command's entry point
    run = subprocess.run([sys.executable, "-c", command, *args], input=stdin,
                         capture_output=True, text=True, check=True)
    return run.stdout


@pytest.mark.parametrize("merges", [5, 40, 200])
def test_merges_and_pieces_equal_the_subword_nmt_command_line(merges, tmp_path):
    tok = Tokenizer.train(list(zip(SOURCE, TARGET)), merges, kind="subword-nmt")
    codes = subword_nmt(["learn-bpe", "-s", str(merges)], "".join(f"{s}\n{t}\n" for s, t in zip(SOURCE, TARGET)))
    assert ["#version: 0.2", *tok.src.merges] == codes.splitlines()
    (tmp_path / "codes").write_text(codes)
    texts = [*SOURCE[:3], *TARGET[:3], HELD_OUT]
    applied = subword_nmt(["apply-bpe", "-c", str(tmp_path / "codes")], "".join(f"{t}\n" for t in texts))
    assert [tok.src_pieces(text) for text in texts] == [line.split() for line in applied.splitlines()]
    assert tok.joint and tok.src_pieces(HELD_OUT) == tok.tgt_pieces(HELD_OUT)


def test_pieces_round_trip_to_the_text_and_the_vocabulary_is_saved_with_its_merges(tmp_path):
    tok = Tokenizer.train(list(zip(SOURCE, TARGET)), 40, kind="subword-nmt")
    assert tok.kind == "subword-nmt" and tok.src.pieces[:4] == list(SPECIALS)
    pieces = tok.src_pieces(HELD_OUT)
    assert any(p.endswith("@@") for p in pieces) and len(pieces) > len(HELD_OUT.split())  # words were split
    for text in [*SOURCE[:3], *TARGET[:3], HELD_OUT, "  zwei   männer\thalten  "]:
        ids = tok.encode_tgt(text)
        assert UNK_ID not in ids and tok.decode_tgt(ids) == " ".join(text.split())
    assert tok.encode_src("xyz")[0] == UNK_ID  # characters never seen in training
    cut = tok.encode_tgt("gitarren")
    assert tok.decode_tgt(cut[:-1]) == "".join(p.removesuffix("@@") for p in tok.tgt_pieces("gitarren")[:-1])
    tok.save(tmp_path)
    info = json.loads((tmp_path / "tokenizer.json").read_text())
    assert info["kind"] == "subword-nmt" and info["merges"] == tok.src.merges
    again = Tokenizer.load(tmp_path)
    assert again.kind == "subword-nmt" and again.encode_src(HELD_OUT) == tok.encode_src(HELD_OUT)
    info["merges"][3] = "a b c"
    (tmp_path / "tokenizer.json").write_text(json.dumps(info, indent=1))
    with pytest.raises(AtencionError, match=r"tokenizer.json line \d+: 'merges' must list subword-nmt's merges"):
        Tokenizer.load(tmp_path)


def test_subword_nmt_is_accepted_as_a_joint_vocabulary_only(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  tokenizer: subword-nmt\n  vocab_size: 10000\n", encoding="utf-8")
    assert load_config(path).data.tokenizer == "subword-nmt"
    path.write_text("data:\n  tokenizer: subword-nmt\n  joint: false\n", encoding="utf-8")
    with pytest.raises(AtencionError, match="subword-nmt learns one joint vocabulary; set data.joint: true"):
        load_config(path)


def test_a_translator_trains_and_translates_through_subword_nmt_pieces(tmp_path, capsys):
    rng = random.Random(0)
    rows = [[rng.randrange(10) for _ in range(rng.randint(2, 6))] for _ in range(400)]
    for name, words in (("train.es", WORDS), ("train.en", NUMBERS)):  # number words, word for word
        (tmp_path / name).write_text("".join(" ".join(words[i] for i in row) + "\n" for row in rows))
    cfg = tiny_config({"data.train_src": tmp_path / "train.es", "data.train_tgt": tmp_path / "train.en"},
                      **{"data.tokenizer": "subword-nmt", "data.vocab_size": 12, "train.max_steps": 150,
                         "train.max_epochs": 100, "model.dropout": 0.0})
    train(cfg, tmp_path / "run")
    model = tmp_path / "run" / "checkpoints" / "step_00000150"
    tok = Tokenizer.load(model)
    assert tok.kind == "subword-nmt" and sum(len(tok.tgt_pieces(word)) > 1 for word in NUMBERS) >= 5
    (tmp_path / "in.txt").write_text("uno dos tres\ncuatro cinco\nseis siete ocho nueve\n")
    assert main(["translate", "--model", str(model), "--input", str(tmp_path / "in.txt"), "--beam", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and all(line and set(line.split()) <= set(NUMBERS) for line in out), out  # whole words
