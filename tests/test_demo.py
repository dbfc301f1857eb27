"""`atencion demo` end to end, shrunk to seconds (the full demo is the README's main command)."""

import json

from atencion.cli import main
from atencion.nn.model_dir import load_model_dir


def test_demo_prints_examples_and_ends_with_a_json_summary(tmp_path, capsys):
    fast = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "model.n_heads=2",
            "train.max_steps=6", "train.valid_every=3", "train.progress=false", "train.tensorboard=false",
            "decode.beam=2"]
    args = ["demo", "--out", str(tmp_path / "demo"), "--train-size", "300", "--test-size", "20"]
    assert main(args + [a for s in fast for a in ("--set", s)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert {"exact_match", "bleu", "seconds", "model_dir"} <= set(summary)
    assert 0.0 <= summary["exact_match"] <= 1.0
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
