"""The command line: one line out per line in, JSON from evaluate, --help everywhere, clear errors."""

import io
import json
import subprocess
import sys

import pytest

from atencion.cli import build_parser, main
from atencion.train.trainer import train
from test_training import tiny_config, write_corpus


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    data = write_corpus(tmp / "data", n=300)
    train(tiny_config(data, **{"train.max_steps": 30, "train.max_epochs": 100}), tmp / "run")
    return tmp / "run" / "checkpoints" / "step_00000030"


def test_translate_writes_one_line_per_input_line_in_order(model_dir, tmp_path, monkeypatch, capsys):
    lines = ["uno dos tres", "", "cuatro cinco", "   ", "seis"]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    assert main(["translate", "--model", str(model_dir), "--input", str(tmp_path / "in.txt"),
                 "--output", str(tmp_path / "out.txt"), "--beam", "3"]) == 0
    out = (tmp_path / "out.txt").read_text().split("\n")[:-1]
    assert len(out) == len(lines)
    assert out[1] == "" and out[3] == ""
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["translate", "--model", str(model_dir), "--beam", "3"]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == out


def test_translate_nbest_prints_n_lines_per_input(model_dir, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("uno dos\ntres\n")
    assert main(["translate", "--model", str(model_dir), "--input", str(tmp_path / "in.txt"),
                 "--beam", "4", "--nbest", "3"]) == 0
    rows = [line.split(" ||| ") for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == ["0"] * 3 + ["1"] * 3
    scores = [float(r[2]) for r in rows[:3]]
    assert scores == sorted(scores, reverse=True)


def test_evaluate_prints_one_json_object_with_the_scores(model_dir, tmp_path, capsys):
    (tmp_path / "src.txt").write_text("uno dos\ntres cuatro\n")
    (tmp_path / "ref.txt").write_text("two one\nfour three\n")
    assert main(["evaluate", "--model", str(model_dir), "--src", str(tmp_path / "src.txt"),
                 "--ref", str(tmp_path / "ref.txt"), "--beam", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"bleu", "bleu_tok", "chrf", "beam", "alpha", "sentences"} <= set(result)
    assert result["beam"] == 2 and result["sentences"] == 2


def test_evaluate_refuses_misaligned_files(model_dir, tmp_path, capsys):
    (tmp_path / "src.txt").write_text("uno\ndos\n")
    (tmp_path / "ref.txt").write_text("one\n")
    assert main(["evaluate", "--model", str(model_dir), "--src", str(tmp_path / "src.txt"),
                 "--ref", str(tmp_path / "ref.txt")]) == 2
    assert "src.txt has 2 lines but" in capsys.readouterr().err


def test_missing_model_directory_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("uno\n")
    assert main(["translate", "--model", str(tmp_path / "none"), "--input", str(tmp_path / "in.txt")]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "directory not found" in err and "Traceback" not in err


def test_average_refuses_to_overwrite_a_non_empty_directory(model_dir, tmp_path, capsys):
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "mine.txt").write_text("precious")
    assert main(["average", "--out", str(tmp_path / "keep"), str(model_dir)]) == 2
    assert (tmp_path / "keep" / "mine.txt").read_text() == "precious"


def test_every_command_has_help(capsys):
    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"train", "translate", "evaluate", "average"} <= set(commands)
    for name in commands:
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0
        assert f"usage: atencion {name}" in capsys.readouterr().out, name
    result = subprocess.run([sys.executable, "-m", "atencion", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "usage: atencion" in result.stdout
