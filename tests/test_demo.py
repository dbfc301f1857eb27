"""`atencion demo` end to end, shrunk to seconds (the full demo is the README's main command)."""

import json

from atencion.cli import main
from atencion.nn.model_dir import load_model_dir


def test_demo_prints_examples_and_ends_with_a_json_summary(tmp_path, capsys):
    # Small but trained enough to translate: 300 updates of a one-layer d_model=32 model at a high rate, without
    # dropout or label smoothing. It costs the CPU time of the untrained 6-update run it replaced (a trained model
    # stops at its end of sentence; an untrained one decodes to the length limit). Over corpus and training seeds
    # 0-11 it reached exact match 0.35-0.8 and BLEU 65-86 on its 20 test sentences (0.7 and 86 with the seeds used
    # here); an untrained model, or one whose decoder sees the future in training, gets 0.0 and BLEU near 0.
    fast = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "model.n_heads=2", "model.dropout=0",
            "train.max_steps=300", "train.warmup=10", "train.lr_peak=0.01", "train.max_tokens=512",
            "train.label_smoothing=0", "train.valid_every=150", "train.valid_bleu_sentences=50",
            "train.progress=false", "train.tensorboard=false", "decode.beam=2"]
    args = ["demo", "--out", str(tmp_path / "demo"), "--train-size", "1000", "--test-size", "20"]
    assert main(args + [a for s in fast for a in ("--set", s)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert {"exact_match", "bleu", "seconds", "model_dir"} <= set(summary)
    assert summary["train_steps"] == 300
    assert summary["exact_match"] >= 0.15, summary  # it learned to translate, not just to run
    assert summary["bleu"] >= 40.0, summary
    assert any("el gato negro come el ratón" in line for line in lines[:-1])
    load_model_dir(summary["model_dir"])  # a usable model directory
    for name in ("train", "valid", "test"):
        es = (tmp_path / "demo" / "data" / f"{name}.es").read_text().splitlines()
        align = (tmp_path / "demo" / "data" / f"{name}.align").read_text().splitlines()
        assert len(es) == len(align) > 0


def test_demo_refuses_a_directory_that_holds_something(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    assert main(["demo", "--out", str(tmp_path / "d")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "d" / "notes.txt").read_text() == "mine"


def test_a_machine_too_slow_for_the_demos_updates_is_told_so(tmp_path, capsys):
    """The demo is counted in updates; its clock is a cap only, and hitting the cap is said."""
    fast = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "model.n_heads=2", "train.max_steps=500",
            "train.time_limit_minutes=0.0001", "train.valid_every=3", "train.progress=false",
            "train.tensorboard=false", "decode.beam=1"]
    args = ["demo", "--out", str(tmp_path / "demo"), "--train-size", "300", "--test-size", "20"]
    assert main(args + [a for s in fast for a in ("--set", s)]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["stopped_by"] == "time_limit" and summary["train_steps"] < 500
    assert f"after {summary['train_steps']} of 500 updates" in captured.err and "too slow" in captured.err
