"""The training tasks beside translation: lm (GPT), mlm (BERT's masking), classify; the character
tokenizer; train.init_from; exact resume for each task; the bad inputs each one refuses."""

from __future__ import annotations

import gzip
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atencion.config import ModelConfig
from atencion.data.text import epoch_offset, lm_blocks, mask_tokens, read_labelled, split_tail
from atencion.data.tokenizer import MASK, Tokenizer
from atencion.errors import AtencionError
from atencion.nn.model_dir import load_model_dir
from atencion.nn.transformer import Transformer
from atencion.tasks.mlm import Masker
from atencion.train.config import load_config
from atencion.train.schedule import learning_rate
from atencion.train.trainer import train

WORDS = ("the cat sat on the mat while a dog ran to the park and the bird sang over a tree near "
         "an old house by the river where children play").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (int(torch.randint(3, 12, (1,),
                                                                                       generator=rng)),),
                                                           generator=rng)) for _ in range(n)]


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("".join(s + "\n" for s in sentences(300)), encoding="utf-8")
    return path


@pytest.fixture
def tsv_files(tmp_path) -> tuple[Path, Path]:
    """Sentences labelled by whether they mention the cat, with a header line."""
    def rows(n, seed):
        return "".join(f"{'pos' if 'cat' in s else 'neg'}\t{s}\n" for s in sentences(n, seed))
    train_tsv, valid_tsv = tmp_path / "train.tsv", tmp_path / "valid.tsv"
    train_tsv.write_text("label\tsentence\n" + rows(200, 1), encoding="utf-8")
    valid_tsv.write_text("label\tsentence\n" + rows(40, 2), encoding="utf-8")
    return train_tsv, valid_tsv


TINY = ["model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "train.warmup=5",
        "train.lr_peak=0.003", "train.progress=false", "train.tensorboard=false", "train.log_every=1"]


def config(tmp_path, task: str, *sets: str, tiny: bool = True):
    path = tmp_path / f"{task}.yaml"
    path.write_text(f"task: {task}\n", encoding="utf-8")
    return load_config(path, [*(TINY if tiny else [s for s in TINY if not s.startswith("model.")]), *sets])


def lm_sets(text_file) -> list[str]:
    return [f"data.train_text={text_file}", "data.tokenizer=char", "data.block_size=32", "train.max_tokens=256",
            "model.max_positions=32", "model.dropout=0.0"]


# the character tokenizer --------------------------------------------------------------------------


def test_a_character_vocabulary_round_trips_text_and_is_saved_as_json(tmp_path):
    tok = Tokenizer.train_text(["héllo wörld\nsecond line"], "char")
    ids = tok.encode("wörld\nhe")
    assert len(ids) == 8 and tok.decode(ids) == "wörld\nhe"
    assert tok.encode("z") == [1]  # never seen: <unk>
    tok.save(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["kind"] == "char"
    again = Tokenizer.load(tmp_path)
    assert again.kind == "char" and again.encode("wörld\nhe") == ids and again.vocab_size == tok.vocab_size


def test_a_masked_vocabulary_holds_mask_as_one_token():
    tok = Tokenizer.train_text(sentences(200), vocab_size=60, symbols=(MASK,))
    ids = tok.encode(f"the cat {MASK} on")
    assert tok.mask_id is not None and ids.count(tok.mask_id) == 1
    assert Tokenizer.train_text(sentences(50), "char").mask_id is None


# lm ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 7])
def test_lm_blocks_cover_the_text_without_overlap(offset):
    n, block = 1000, 64
    blocks = lm_blocks(n, block, offset)
    inputs = [i for start, length in blocks for i in range(start, start + length)]
    assert len(inputs) == len(set(inputs))  # no token is an input twice
    assert inputs == list(range(offset, offset + len(inputs)))  # contiguous
    assert n - (offset + len(inputs)) <= block  # what is left is less than a block (+ its last target)
    tail = lm_blocks(n, block, 0, partial=True)
    targets = [i + 1 for start, length in tail for i in range(start, start + length)]
    assert targets == list(range(1, n))  # validation predicts every token but the first, once


def test_epochs_shift_their_blocks_reproducibly():
    """An epoch's shift is a function of (seed, epoch, block size) alone: not of the global random state (which it
    leaves alone), of the calls made before it, or of the process (a run resumed elsewhere cuts the same blocks)."""
    assert epoch_offset(1, 0, 64) == 0
    random.seed(0)
    state = random.getstate()
    shifts = [epoch_offset(1, e, 64) for e in range(1, 20)]
    assert random.getstate() == state  # it draws from a generator of its own
    assert len(set(shifts)) > 1 and all(0 <= s < 64 for s in shifts)
    assert shifts[:8] == [63, 35, 43, 34, 37, 24, 31, 40]  # written down: the same in any process (no hash())
    random.seed(1)
    assert [epoch_offset(1, e, 64) for e in reversed(range(1, 20))] == shifts[::-1]  # other state, other order
    assert [epoch_offset(2, e, 64) for e in range(1, 20)] != shifts  # the seed matters


def test_the_held_out_tail_is_the_last_share_of_the_characters():
    lines = ["abcdefghij"] * 10  # 110 characters with newlines
    head, tail = split_tail(lines, 0.1)
    text = "".join(x + "\n" for x in lines)
    assert "\n".join(head) + "\n" + "\n".join(tail) + "\n" == text or \
        "\n".join(head) + "\n".join(tail) + "\n" == text
    assert abs(len("\n".join(tail)) + 1 - 11) <= 1


def test_an_lm_trains_validates_and_its_loss_falls(tmp_path, text_file):
    cfg = config(tmp_path, "lm", *lm_sets(text_file), "train.max_steps=40", "train.valid_every=20")
    summary = train(cfg, tmp_path / "run")
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    valid = [r for r in log if "valid_loss" in r]
    assert len(valid) == 2 and valid[1]["valid_loss"] < valid[0]["valid_loss"]
    assert valid[0]["valid_bpc"] == pytest.approx(valid[0]["valid_loss"] / math.log(2))  # characters = tokens
    model, tok = load_model_dir(summary["best_model"])
    assert model.cfg.arch == "decoder" and tok.kind == "char"
    assert 1 not in tok.encode("the cat\nsat") and tok.decode(tok.encode("the cat\nsat")) == "the cat\nsat"


def test_a_text_shorter_than_one_block_is_refused(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("to be or not\n", encoding="utf-8")
    cfg = config(tmp_path, "lm", f"data.train_text={short}", "data.tokenizer=char", "data.block_size=32",
                 "data.valid_text=" + str(short))
    with pytest.raises(AtencionError, match=r"data.train_text: .* fewer than one block of data.block_size=32"):
        train(cfg, tmp_path / "run")


def test_learned_positions_shorter_than_the_block_are_refused_before_anything_is_written(tmp_path, text_file):
    with pytest.raises(AtencionError, match=r"data.block_size .*max_positions=16"):
        config(tmp_path, "lm", *lm_sets(text_file), "model.max_positions=16")


# mlm --------------------------------------------------------------------------------------------


def test_masking_follows_berts_rates_and_never_touches_special_tokens():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (400, 100))
    ids[:, 0], ids[:, -1] = 2, 3  # <s> … </s>
    ids[:50, 60:] = 0  # padding
    maskable = ids >= 5
    inputs, targets = mask_tokens(ids, maskable, 4, 5, 1000, 0.15, generator)
    chosen = targets != 0
    assert not chosen[~maskable].any()  # special tokens and padding are never chosen
    assert (inputs[~maskable] == ids[~maskable]).all()
    rate = chosen.sum() / maskable.sum()
    n = int(chosen.sum())
    assert abs(float(rate) - 0.15) < 4 * math.sqrt(0.15 * 0.85 / int(maskable.sum()))
    masked = float((inputs[chosen] == 4).sum()) / n
    kept = float((inputs[chosen] == ids[chosen]).sum()) / n
    assert abs(masked - 0.8) < 4 * math.sqrt(0.8 * 0.2 / n)
    assert abs(kept - 0.1) < 4 * math.sqrt(0.1 * 0.9 / n) + 1 / 995  # a random token can be the same
    assert (targets[chosen] == ids[chosen]).all()
    assert ((inputs[chosen] >= 5) | (inputs[chosen] == 4)).all()  # random replacements are regular tokens


def test_the_mlm_loss_counts_the_chosen_positions_only():
    tok = Tokenizer.train_text(sentences(200), vocab_size=60, symbols=(MASK,))
    masker = Masker(tok, 0.3)
    rows = [[2, *tok.encode(s), 3] for s in sentences(8, 5)]
    inputs, targets = masker(rows, torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("bert-tiny", vocab_size=tok.vocab_size, dropout=0.0)).eval()
    from atencion.tasks.loss import sequence_loss

    with torch.no_grad():
        loss, nll = sequence_loss(model, model, inputs, targets)
    chosen = targets != 0
    with torch.no_grad():
        logits = model(inputs)
    expected = torch.nn.functional.cross_entropy(logits[chosen], targets[chosen], reduction="sum")
    assert float(nll) == pytest.approx(float(expected), rel=1e-5)
    changed = targets.clone()
    changed[~chosen] = 0
    with torch.no_grad():
        assert float(sequence_loss(model, model, inputs, changed)[1]) == pytest.approx(float(nll), rel=1e-6)


def test_an_mlm_run_reports_masked_accuracy(tmp_path, text_file):
    cfg = config(tmp_path, "mlm", f"data.train_text={text_file}", "data.vocab_size=60", "train.max_tokens=512",
                 "train.max_steps=10", "train.valid_every=10")
    summary = train(cfg, tmp_path / "run")
    record = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()
              if "valid_accuracy" in line][-1]
    assert 0.0 <= record["valid_accuracy"] <= 1.0
    model, tok = load_model_dir(summary["best_model"])
    assert model.cfg.arch == "encoder" and tok.mask_id is not None


# classify ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["bert-tiny", "gpt-tiny"])
def test_the_classification_head_sees_only_real_tokens(arch):
    torch.manual_seed(0)
    cfg = ModelConfig.preset(arch, vocab_size=50, num_labels=3, dropout=0.0,
                             pooling="first" if arch == "bert-tiny" else "last")
    model = Transformer(cfg).eval()
    ids = torch.tensor([[2, 7, 8, 9, 3]])
    padded = torch.tensor([[2, 7, 8, 9, 3, 0, 0, 0]])
    torch.testing.assert_close(model.classify(ids), model.classify(padded), rtol=1e-5, atol=1e-6)
    if arch == "gpt-tiny":  # the last real token, not the last position
        other = torch.tensor([[2, 7, 8, 9, 3, 5, 5, 5]])
        assert not torch.allclose(model.classify(other), model.classify(ids))


def test_labelled_rows_take_a_header_and_refuse_unknown_labels(tmp_path):
    path = tmp_path / "a.tsv"
    path.write_text("label\tsentence\n1\tgood\n0\tbad\n10\tfine\n", encoding="utf-8")
    rows, labels, _ = read_labelled(str(path))
    assert labels == ["0", "1", "10"] and rows == [(1, "good"), (0, "bad"), (2, "fine")]
    bad = tmp_path / "b.tsv"
    bad.write_text("1\tgood\n7\tnew\n", encoding="utf-8")
    with pytest.raises(AtencionError, match=r"b.tsv line 2: label '7' was not seen in training"):
        read_labelled(str(bad), labels)
    no_tab = tmp_path / "c.tsv"
    no_tab.write_text("1\tgood\n0 bad\n", encoding="utf-8")
    with pytest.raises(AtencionError, match=r"c.tsv line 2: expected label<TAB>text, found no tab"):
        read_labelled(str(no_tab))


def test_pretraining_then_classifying_starts_from_the_pretrained_weights(tmp_path, text_file, tsv_files):
    pre = train(config(tmp_path, "mlm", f"data.train_text={text_file}", "data.vocab_size=60",
                       "train.max_steps=5", "train.valid_every=5"), tmp_path / "pre")
    train_tsv, valid_tsv = tsv_files
    cfg = config(tmp_path, "classify", f"data.train_tsv={train_tsv}", f"data.valid_tsv={valid_tsv}",
                 f"train.init_from={pre['best_model']}", "train.max_steps=1", "train.valid_every=1",
                 "train.lr_peak=1e-9", "model.dropout=0.3")  # the same shape; dropout may change
    summary = train(cfg, tmp_path / "cls")
    base, _ = load_model_dir(pre["best_model"])
    tuned, tok = load_model_dir(summary["last_checkpoint"])
    assert tuned.cfg.labels == ["neg", "pos"] and tuned.cfg.num_labels == 2 and tuned.cfg.dropout == 0.3
    tokenizer_file = (Path(pre["best_model"]) / "tokenizer.json").read_bytes()
    assert (tmp_path / "cls" / "tokenizer.json").read_bytes() == tokenizer_file
    w0 = base.state_dict()["encoder.layers.0.ffn.linear1.weight"]
    w1 = tuned.state_dict()["encoder.layers.0.ffn.linear1.weight"]
    torch.testing.assert_close(w0, w1, atol=1e-6, rtol=0)  # lr 1e-9: the encoder is the pretrained one
    cfg.train.max_steps = 2  # a fine-tuning run resumes with the shape it started from
    assert train(cfg, tmp_path / "cls", resume=True)["steps"] == 2


def test_init_from_refuses_a_changed_shape(tmp_path, text_file, tsv_files):
    pre = train(config(tmp_path, "mlm", f"data.train_text={text_file}", "data.vocab_size=60",
                       "train.max_steps=1", "train.valid_every=1"), tmp_path / "pre")
    cfg = config(tmp_path, "classify", f"data.train_tsv={tsv_files[0]}", f"train.init_from={pre['best_model']}",
                 "model.d_model=64", "train.max_steps=1")
    with pytest.raises(AtencionError, match=r"model.d_model is 64 in the config but 32 in train.init_from"):
        train(cfg, tmp_path / "cls")
    assert not (tmp_path / "cls" / "checkpoints").exists()


# every task: exact resume -------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["lm", "mlm", "classify"])
def test_resume_in_the_middle_of_an_epoch_is_exact(tmp_path, text_file, tsv_files, task):
    sets = {"lm": lm_sets(text_file),
            "mlm": [f"data.train_text={text_file}", "data.vocab_size=60", "train.max_tokens=512"],
            "classify": [f"data.train_tsv={tsv_files[0]}", f"data.valid_tsv={tsv_files[1]}", "data.vocab_size=60",
                         "train.max_tokens=512"]}[task]
    whole = train(config(tmp_path, task, *sets, "train.max_steps=6", "train.valid_every=3"), tmp_path / "whole")
    assert whole["epochs"] == 0  # the stop falls inside the first epoch
    train(config(tmp_path, task, *sets, "train.max_steps=3", "train.valid_every=3"), tmp_path / "parts")
    resumed = train(config(tmp_path, task, *sets, "train.max_steps=6", "train.valid_every=3"), tmp_path / "parts",
                    resume=True)
    a, _ = load_model_dir(whole["last_checkpoint"])
    b, _ = load_model_dir(resumed["last_checkpoint"])
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)


# configuration ----------------------------------------------------------------------------------


def test_the_task_decides_the_default_model_and_refuses_the_wrong_arch(tmp_path, text_file):
    assert config(tmp_path, "lm", f"data.train_text={text_file}").model_config(70, None).arch == "decoder"
    assert config(tmp_path, "mlm").model_config(70, None).arch == "encoder"
    with pytest.raises(AtencionError, match=r"model.arch 'encoder-decoder' cannot be trained by task 'lm'"):
        config(tmp_path, "lm", "model.preset=tiny")
    with pytest.raises(AtencionError, match=r"task must be one of"):
        config(tmp_path, "poetry")
    with pytest.raises(AtencionError, match=r"early_stop_metric 'bleu' is not measured by task 'lm'"):
        config(tmp_path, "lm", "train.early_stop_metric=bleu")


def test_the_cosine_schedule_warms_up_then_decays_to_its_floor(tmp_path):
    t = config(tmp_path, "lm", "train.schedule=cosine", "train.max_steps=100", "train.warmup=10",
               "train.lr_peak=1e-3", "train.lr_min=1e-4").train
    assert learning_rate(5, 128, t) == pytest.approx(5e-4)
    assert learning_rate(10, 128, t) == pytest.approx(1e-3)
    assert learning_rate(55, 128, t) == pytest.approx(5.5e-4)
    assert learning_rate(100, 128, t) == pytest.approx(1e-4)
    with pytest.raises(AtencionError, match=r"cosine .* set train.max_steps"):
        config(tmp_path, "lm", "train.schedule=cosine")


def test_a_bad_lm_config_gets_one_line_and_writes_nothing(tmp_path):
    gz = tmp_path / "t.txt.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write("short\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"task: lm\ndata:\n  train_text: {gz}\n  tokenizer: char\n  block_size: 64\n", encoding="utf-8")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "atencion", "train", str(cfg), "--out", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr and "data.block_size=64" in lines[0]
    assert not (out / "checkpoints").exists()
