"""The fault catalogue: every fault a user or an adversary met ends in one line on stderr (no
traceback), a documented exit status, and every file that was there before byte-identical after.

Disk-full cases run on a small tmpfs, so they need root (mount); elsewhere they skip.
"""

import gc
import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from atencion.cli import main
from atencion.train.trainer import train
from test_training import tiny_config, write_corpus

ROOT = Path(__file__).resolve().parents[1]


# helpers -----------------------------------------------------------------------------------------

def snapshot(*directories: Path) -> dict[Path, bytes]:
    """Every file under ``directories`` with its bytes."""
    return {p: p.read_bytes() for d in directories if d.exists() for p in sorted(d.rglob("*")) if p.is_file()}


def unchanged(before: dict[Path, bytes], appended: tuple[str, ...] = ()) -> bool:
    """Every file as it was; files named in ``appended`` (a run's log) may only have grown at the end."""
    changed = [p for p, data in before.items() if not (p.is_file() and p.read_bytes() == data)]
    grown = [p for p in changed if p.name in appended and p.read_bytes().startswith(before[p])]
    assert changed == grown, changed
    return True


def fault(argv: list[str], capsys, status: int = 2) -> str:
    """Run the CLI; assert the exit status and one line on stderr without a traceback; return it."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == status, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def copy_dir(source: Path, target: Path) -> Path:
    target.mkdir()
    for f in source.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


def write_config(path: Path, data: dict[str, str], **train) -> Path:
    """A YAML config of a 1-layer model on the toy corpus (the tests' tiny_config, as a file)."""
    settings = {"max_tokens": 256, "warmup": 20, "lr_peak": 0.01, "progress": False, "tensorboard": False,
                "log_every": 1, "threads": 1, "max_steps": 6, "valid_every": 3, **train}
    path.write_text(
        "model: {preset: tiny, d_model: 32, d_ff: 64, n_layers: 1, n_heads: 2}\n"
        f"data: {{train_src: {data['data.train_src']}, train_tgt: {data['data.train_tgt']}, "
        f"valid_src: {data['data.train_src']}, valid_tgt: {data['data.train_tgt']}, vocab_size: 40}}\n"
        "train: {" + ", ".join(f"{k}: {v}" for k, v in settings.items()) + "}\n"
        "decode: {beam: 2, max_len_b: 10}\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("faults") / "data", n=200)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("faults-run") / "run"
    train(tiny_config(corpus, **{"train.max_steps": 10, "train.max_epochs": 100}), out)
    return out / "checkpoints" / "step_00000010"


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("disk-full cases mount a tmpfs, which needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield disk
    gc.collect()  # weights loaded from the disk are memory-mapped until collected
    if subprocess.run(["umount", str(disk)]).returncode != 0:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk: Path, leave: int = 0) -> None:
    """Fill ``disk`` until at most ``leave`` bytes are free."""
    with open(disk / "filler", "ab", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1 << 9):
            try:
                while os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize > leave:
                    f.write(b"\0" * size)
            except OSError:
                pass


# 1. divergence -----------------------------------------------------------------------------------

@pytest.mark.parametrize("valid_bleu", [False, True])
def test_a_diverged_run_stops_with_one_line_and_saves_nothing_non_finite(tmp_path, corpus, capsys, valid_bleu):
    config = write_config(tmp_path / "c.yaml", corpus, max_steps=40, valid_bleu=str(valid_bleu).lower())
    line = fault(["train", str(config), "--out", str(tmp_path / "run"), "--set", "train.lr_peak=10000"], capsys)
    assert "diverged" in line and "at step" in line and line.endswith("--set=train.lr_peak=5000 --resume")
    saved = list((tmp_path / "run").rglob("model.safetensors"))
    for path in saved:
        assert all(torch.isfinite(t).all() for t in load_file(str(path)).values()), path
    for path in (tmp_path / "run").rglob("trainer_state.json"):
        best = json.loads(path.read_text())["best"]
        assert best is None or math.isfinite(best)


def test_a_run_that_diverges_before_its_first_checkpoint_can_be_rerun(tmp_path, corpus, capsys):
    config = write_config(tmp_path / "c.yaml", corpus, valid_every=100)
    out = tmp_path / "run"
    line = fault(["train", str(config), "--out", str(out), "--set", "train.lr_peak=10000"], capsys)
    assert "no checkpoint was written" in line and f"--out {out}" in line and "lr_peak=10000" not in line
    assert main(["train", str(config), "--out", str(out)]) == 0  # the same command, a sane rate
    assert (out / "checkpoints" / "step_00000006").is_dir()


def test_a_model_with_non_finite_weights_is_refused_on_load(model_dir, tmp_path, capsys):
    broken = copy_dir(model_dir, tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    tensors = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, str(broken / "model.safetensors"))
    (tmp_path / "in.txt").write_text("uno dos\ntres\n")
    before = snapshot(tmp_path)
    line = fault(["translate", "--model", str(broken), "--input", str(tmp_path / "in.txt"), "--nbest", "2",
                  "--output", str(tmp_path / "out.txt")], capsys)
    assert "non-finite" in line and "model.safetensors" in line
    assert unchanged(before) and not (tmp_path / "out.txt").exists()


@pytest.mark.parametrize("changes", [{"n_layers": 10**6}, {"n_layers": 10**9}, {"vocab_size": 10**12},
                                     {"d_ff": 10**11}, {"moe": {"experts": 10**7}}])
def test_a_config_far_larger_than_its_weights_is_refused_on_load_before_anything_is_built(model_dir, tmp_path, capsys,
                                                                                          changes):
    edited = copy_dir(model_dir, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, **changes}))
    (tmp_path / "in.txt").write_text("uno dos\n")
    started = time.monotonic()
    line = fault(["translate", "--model", str(edited), "--input", str(tmp_path / "in.txt")], capsys)
    assert str(edited / "config.json") in line and "different models" in line, line
    assert time.monotonic() - started < 30  # refused from the numbers, not after building the model


def test_decoding_a_model_that_gives_nan_scores_is_an_error_not_missing_lines(model_dir):
    from atencion.decode.translate import translate_lines
    from atencion.errors import AtencionError
    from atencion.nn.model_dir import load_model_dir

    model, tokenizer = load_model_dir(model_dir)
    with torch.no_grad():
        model.generator.weight.fill_(float("nan"))
    for beam, nbest in ((1, 1), (4, 2)):
        with pytest.raises(AtencionError, match="not finite"):
            translate_lines(model, tokenizer, ["uno dos", "tres"], beam=beam, nbest=nbest)


# 2-3. the user's files and failed starts -----------------------------------------------------------

def test_train_refuses_a_directory_that_is_not_a_run(tmp_path, corpus, capsys):
    config = write_config(tmp_path / "c.yaml", corpus)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("my own notes\n")
    before = snapshot(tmp_path)
    line = fault(["train", str(config), "--out", str(out)], capsys)
    assert "not a training run" in line and unchanged(before) and sorted(os.listdir(out)) == ["config.yaml"]


def test_model_section_errors_name_the_file_and_key_and_write_nothing(tmp_path, corpus, capsys):
    config = write_config(tmp_path / "c.yaml", corpus)
    line = fault(["train", str(config), "--out", str(tmp_path / "run"), "--set", "model.n_heads=3"], capsys)
    assert str(config) in line and "model.n_heads" in line
    assert not (tmp_path / "run").exists()


def test_a_run_killed_before_its_first_checkpoint_starts_over_and_temporaries_are_cleaned(tmp_path, corpus):
    config = write_config(tmp_path / "c.yaml", corpus)
    out = tmp_path / "run"
    dead = 2 ** 22 + 12345  # above the usual pid_max: no such process
    (out / "checkpoints" / f".step_00000003.tmp-{dead}").mkdir(parents=True)  # what a kill leaves
    (out / "run.json").write_text("{}\n")
    (out / "config.yaml").write_text("an older dump\n")
    (out / f".config.yaml.tmp-{dead}").write_text("half")
    assert main(["train", str(config), "--out", str(out)]) == 0
    assert not list(out.rglob(f"*-{dead}"))
    assert "an older dump" not in (out / "config.yaml").read_text()


def test_resume_of_a_run_without_a_checkpoint_says_to_start_over(tmp_path, corpus, capsys):
    config = write_config(tmp_path / "c.yaml", corpus)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}\n")
    line = fault(["train", str(config), "--out", str(tmp_path / "run"), "--resume"], capsys)
    assert "without --resume" in line


def test_a_best_model_caught_between_its_two_renames_is_put_back(tmp_path):
    from atencion.fileio import clean_stale_temporaries

    dead = 2 ** 22 + 12345
    (tmp_path / f".best.old-{dead}").mkdir()
    (tmp_path / f".best.old-{dead}" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / f".best.tmp-{dead}").mkdir()
    clean_stale_temporaries(tmp_path)
    assert (tmp_path / "best" / "model.safetensors").read_bytes() == b"weights"
    assert sorted(os.listdir(tmp_path)) == ["best"]


def test_resume_refuses_a_changed_model_section_naming_the_key(tmp_path, corpus, capsys):
    config = write_config(tmp_path / "c.yaml", corpus, max_steps=3)
    assert main(["train", str(config), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    before = snapshot(tmp_path)
    line = fault(["train", str(config), "--out", str(tmp_path / "run"), "--resume", "--set", "model.d_ff=128",
                  "--set", "train.max_steps=6"], capsys)
    assert "config.json: d_ff is 64" in line and unchanged(before)


# 4-5. atomic writes, full disks, bytes that are not UTF-8, paths of the wrong kind, Ctrl-C -----------

def test_evaluate_on_a_full_disk_keeps_the_previous_output(model_dir, tmp_path, small_disk, capsys):
    (tmp_path / "src.txt").write_text("uno dos tres\n" * 300)
    (tmp_path / "ref.txt").write_text("three two one\n" * 300)
    output = small_disk / "hyp.txt"
    output.write_text("my previous translations\n")
    fill(small_disk)
    before = snapshot(tmp_path)
    line = fault(["evaluate", "--model", str(model_dir), "--src", str(tmp_path / "src.txt"), "--ref",
                  str(tmp_path / "ref.txt"), "--output", str(output), "--beam", "1"], capsys)
    assert f"{output}: cannot write (No space left on device)" in line and ".tmp-" not in line
    assert unchanged(before)
    assert sorted(os.listdir(small_disk)) == ["filler", "hyp.txt"]


@pytest.mark.parametrize("command", ["translate", "train", "resume", "average", "export", "attention"])
def test_a_full_disk_is_one_line_for_every_command(model_dir, tmp_path, small_disk, corpus, capsys, command):
    (tmp_path / "in.txt").write_text("uno dos\n" * 400)
    config = write_config(tmp_path / "c.yaml", corpus, max_steps=3)
    if command == "resume":
        assert main(["train", str(config), "--out", str(small_disk / "run")]) == 0
        capsys.readouterr()
    fill(small_disk, leave=4096 if command in ("train", "resume") else 0)
    argv = {"translate": ["translate", "--model", str(model_dir), "--input", str(tmp_path / "in.txt"),
                          "--output", str(small_disk / "out.txt"), "--beam", "1"],
            "train": ["train", str(config), "--out", str(small_disk / "run")],
            "resume": ["train", str(config), "--out", str(small_disk / "run"), "--resume",
                       "--set", "train.max_steps=6"],
            "average": ["average", "--out", str(small_disk / "avg"), str(model_dir)],
            "export": ["export", "--model", str(model_dir), "--format", "ctranslate2", "--out",
                       str(small_disk / "ct2")],
            "attention": ["attention", "--model", str(model_dir), "--src", "uno dos", "--out",
                          str(small_disk / "maps")]}[command]
    before = snapshot(tmp_path, small_disk)
    line = fault(argv, capsys)
    assert "No space left on device" in line, line
    if command in ("train", "resume"):
        assert "--resume" in line or "start over" in line
    assert unchanged(before, appended=("log.jsonl",))  # a resumed run's log grows
    assert not [p for p in small_disk.rglob("*") if ".tmp-" in p.name]


def test_bytes_that_are_not_utf8_on_stdin_become_replacement_characters_one_line_out_per_line_in(
        model_dir, capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"uno \xe9 dos\ntres\n\xff\n")))
    assert main(["translate", "--model", str(model_dir), "--beam", "1"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 3
    assert "stdin line 1: not valid UTF-8 (byte 0xe9 at column 5)" in captured.err
    assert "and 1 more line" in captured.err


def test_bytes_that_are_not_utf8_in_a_training_corpus_name_the_file_and_line(tmp_path, corpus, capsys):
    bad = tmp_path / "bad.es"
    bad.write_bytes(Path(corpus["data.train_src"]).read_bytes().replace(b"\n", b" \xe9\n", 1))
    config = write_config(tmp_path / "c.yaml", corpus)
    line = fault(["train", str(config), "--out", str(tmp_path / "run"), "--set", f"data.train_src={bad}"], capsys)
    assert f"{bad} line 1: not valid UTF-8" in line and not (tmp_path / "run").exists()


def path_cases():
    """(command line with FILE/DIR/MODEL placeholders, the option whose kind is wrong)."""
    return [
        ("train DIR --out NEW", "CONFIG"), ("train CONFIG --out FILE", "--out"),
        ("train CONFIG --out FILE --resume", "--out"),
        ("translate --model FILE", "--model"), ("translate --model MODEL --input DIR", "--input"),
        ("translate --model MODEL --input FILE --output DIR", "--output"),
        ("evaluate --model MODEL --src DIR --ref FILE", "--src"),
        ("evaluate --model MODEL --src FILE --ref DIR", "--ref"),
        ("evaluate --model FILE --src FILE --ref FILE", "--model"),
        ("evaluate --model MODEL --src FILE --ref FILE --output DIR", "--output"),
        ("evaluate --model MODEL --src FILE --ref FILE --raw-ref DIR", "--raw-ref"),
        ("evaluate --model MODEL --src FILE --ref FILE --raw-ref FILE --recase-from DIR", "--recase-from"),
        ("average --out NEW FILE", "CKPT"), ("average --out FILE MODEL", "--out"),
        ("attention --model FILE --src uno --out NEW", "--model"),
        ("attention --model MODEL --src uno --out FILE", "--out"),
        ("aer --model MODEL --src DIR --tgt FILE --align FILE", "--src"),
        ("aer --model MODEL --src FILE --tgt DIR --align FILE", "--tgt"),
        ("aer --model MODEL --src FILE --tgt FILE --align DIR", "--align"),
        ("aer --model FILE --src FILE --tgt FILE --align FILE", "--model"),
        ("figures --out FILE --quick", "--out"),
        ("export --model FILE --format onnx --out NEW", "--model"),
        ("export --model MODEL --format onnx --out FILE", "--out"),
        ("demo --out FILE", "--out"), ("demo --out NEW --config DIR", "--config"),
        ("download multi30k --out FILE", "--out"),
    ]


@pytest.mark.parametrize("command, option", path_cases())
def test_a_path_of_the_wrong_kind_is_named_by_its_option(model_dir, tmp_path, corpus, capsys, command, option):
    (tmp_path / "a-file").write_text("uno dos\n")
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-dir" / "inside").write_text("x\n")
    places = {"FILE": str(tmp_path / "a-file"), "DIR": str(tmp_path / "a-dir"), "MODEL": str(model_dir),
              "NEW": str(tmp_path / "new"), "CONFIG": str(write_config(tmp_path / "c.yaml", corpus))}
    argv = [places.get(word, word) for word in command.split()]
    before = snapshot(tmp_path)
    line = fault(argv, capsys)
    assert option in line and ("is a directory" in line or "is a file" in line), line
    assert unchanged(before) and not (tmp_path / "new").exists()


# `atencion train` in a process of its own, held once at a chosen moment: it writes the file MARKER
# there and waits (Ctrl-C ends the wait), so the test's SIGINT lands at that moment and no other.
CTRL_C_RUN = r"""
import os, signal, sys, time
from pathlib import Path

signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, even if started where SIGINT is ignored
moment, marker, *argv = sys.argv[1:]
held = []


def hold(swallow=False):
    if held:
        return
    held.append(moment)
    Path(marker).write_text(moment)
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        if not swallow:
            raise  # swallow: as code that a C library calls and whose error it clears


if moment == "startup":  # SentencePiece training a large corpus: C++ that returns to Python only when done
    import sentencepiece as spm

    real_train = spm.SentencePieceTrainer.train

    def train(*args, **kwargs):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # a signal waits until the C++ returns
        hold()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        return real_train(*args, **kwargs)

    spm.SentencePieceTrainer.train = train
elif moment == "checkpoint":  # the second checkpoint's files written, not yet in place
    import atencion.train.checkpoint as checkpoint

    real_directory = checkpoint.atomic_directory

    def atomic_directory(path, fill):
        def held_fill(tmp):
            fill(tmp)
            if path.name.startswith("step_") and any(path.parent.glob("step_*")):
                hold()
        real_directory(path, held_fill)

    checkpoint.atomic_directory = atomic_directory
elif moment == "best":  # a better model replacing best/: between its two renames
    real_replace = os.replace

    def replace(source, target):
        real_replace(source, target)
        if Path(source).name == "best" and ".old-" in Path(target).name:
            hold()

    os.replace = replace
else:  # validation, between two updates, or a KeyboardInterrupt that something swallows
    from atencion.train.trainer import Trainer

    name = "validate" if moment == "validation" else "_step"
    real_method = getattr(Trainer, name)

    def method(self, *args):
        if any(self.ckpt_dir.glob("step_*")):
            hold(swallow=moment == "swallowed")
        return real_method(self, *args)

    setattr(Trainer, name, method)

from atencion.cli import main

sys.exit(main(argv))
"""


def wait_until(condition, process: subprocess.Popen, seconds: float = 120) -> None:
    """Poll ``condition`` until it holds; fail with the process' stderr if it ends or time runs out."""
    deadline = time.monotonic() + seconds
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"not reached (exit status {process.poll()}): {process.communicate()[1]}")
        time.sleep(0.02)


@pytest.mark.parametrize("moment", ["startup", "checkpoint", "best", "validation", "update", "swallowed"])
def test_ctrl_c_during_training_says_where_and_how_to_resume_and_exits_130(tmp_path, corpus, capsys, moment):
    """Ctrl-C at each moment of a run: while SentencePiece trains (C++ that would hold the signal),
    while a checkpoint is written, between the two renames that replace best/, during validation,
    between updates, and when a library swallows the KeyboardInterrupt: exit status 130 within
    seconds, one line that says where and how to go on, every checkpoint whole, and that line's
    command works."""
    from atencion.nn.model_dir import load_model_dir
    from atencion.train.checkpoint import list_checkpoints

    config = write_config(tmp_path / "c.yaml", corpus, max_steps=0, max_epochs=10000, valid_every=5,
                          valid_bleu="false")
    out, marker = tmp_path / "run", tmp_path / "held"
    process = subprocess.Popen([sys.executable, "-c", CTRL_C_RUN, moment, str(marker), "train", str(config),
                                "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(marker.exists, process)
    process.send_signal(signal.SIGINT)
    try:
        _, err = process.communicate(timeout=30)  # generous: the exit itself takes seconds on a busy machine
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"still running 30 s after Ctrl-C: {process.communicate()[1]}") from None
    line = err.strip().splitlines()[-1]
    assert process.returncode == 130 and "Traceback" not in err and "Exception ignored" not in err, err
    checkpoints = list_checkpoints(out / "checkpoints")
    assert not [p for p in out.rglob(".*") if "-" in p.name], list(out.rglob(".*"))  # no temporaries left
    if moment == "startup":
        assert not checkpoints and "interrupted while the run was starting" in line
        assert line.endswith(f"start over in the same directory: atencion train {config} --out {out}"), line
        assert main(["train", str(config), "--out", str(out), "--set", "train.max_steps=2"]) == 0
        return
    assert "interrupted at step" in line and line.endswith(f"--out {out} --resume"), line
    assert f"the last checkpoint is {checkpoints[-1]};" in line
    if moment == "checkpoint":  # the one being written was dropped whole
        assert [p.name for p in checkpoints] == ["step_00000005"]
    for directory in [*checkpoints, out / "best"]:
        load_model_dir(directory, what="checkpoint", merge=False)
    step = int(checkpoints[-1].name.removeprefix("step_"))
    assert main(["train", str(config), "--out", str(out), "--resume", "--set", f"train.max_steps={step + 1}"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == step + 1


def test_a_ctrl_c_that_something_swallows_is_raised_again_by_the_end_of_the_block():
    """interrupt.py: Python code that a C library calls may lose a KeyboardInterrupt (the library
    clears the error); the press is remembered and raised by check_ctrl_c or the block's end. A
    deferring block only remembers it, and raises it at its end."""
    from atencion.interrupt import check_ctrl_c, remembering_ctrl_c

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # even where SIGINT is ignored
    try:
        with pytest.raises(KeyboardInterrupt):
            with remembering_ctrl_c():
                with remembering_ctrl_c():  # blocks nest: the inner one neither resets nor raises
                    try:
                        signal.raise_signal(signal.SIGINT)
                    except KeyboardInterrupt:
                        pass  # swallowed
                with pytest.raises(KeyboardInterrupt):
                    check_ctrl_c()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
        with remembering_ctrl_c():  # a new block starts with no press
            check_ctrl_c()
        done = []
        with pytest.raises(KeyboardInterrupt):
            with remembering_ctrl_c(defer=True):  # the package's imports: not cut in the middle
                signal.raise_signal(signal.SIGINT)
                done.append(True)
        assert done
    finally:
        signal.signal(signal.SIGINT, before)


# 5. files checked against the files they are used with ------------------------------------------

def test_a_tokenizer_from_another_run_is_named_with_the_config_line(model_dir, tmp_path, capsys):
    mixed = copy_dir(model_dir, tmp_path / "mixed")
    config = json.loads((mixed / "config.json").read_text())
    config["vocab_size"] += 1
    (mixed / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    from atencion import ModelConfig, Transformer

    Transformer(ModelConfig.from_dict(config)).save(mixed)
    (tmp_path / "in.txt").write_text("uno\n")
    line = fault(["translate", "--model", str(mixed), "--input", str(tmp_path / "in.txt")], capsys)
    assert "tokenizer.json" in line and "config.json line 2" in line


def test_a_sentencepiece_model_that_disagrees_with_tokenizer_json_is_named(model_dir, tmp_path, capsys):
    mixed = copy_dir(model_dir, tmp_path / "mixed")
    info = json.loads((mixed / "tokenizer.json").read_text())
    info["src_vocab_size"] += 5
    (mixed / "tokenizer.json").write_text(json.dumps(info, indent=2))
    (tmp_path / "in.txt").write_text("uno\n")
    line = fault(["translate", "--model", str(mixed), "--input", str(tmp_path / "in.txt")], capsys)
    assert "spm.model" in line and "tokenizer.json line" in line


def test_an_alignment_past_the_sentence_is_named_by_file_and_line(model_dir, tmp_path, capsys):
    (tmp_path / "s").write_text("uno dos\ntres\n")
    (tmp_path / "t").write_text("two one\nthree\n")
    (tmp_path / "a").write_text("0-1 1-0\n0-3\n")
    line = fault(["aer", "--model", str(model_dir), "--src", str(tmp_path / "s"), "--tgt", str(tmp_path / "t"),
                  "--align", str(tmp_path / "a")], capsys)
    assert f"{tmp_path / 'a'} line 2: link 0-3 points past" in line


def test_averaging_checkpoints_of_different_tokenizers_is_refused(model_dir, tmp_path, capsys):
    other = copy_dir(model_dir, tmp_path / "other")
    (other / "spm.model").write_bytes((other / "spm.model").read_bytes() + b"\0")
    line = fault(["average", "--out", str(tmp_path / "avg"), str(model_dir), str(other)], capsys)
    assert "spm.model: differs from" in line and not (tmp_path / "avg").exists()


# 6. numbers ------------------------------------------------------------------------------------

def test_numbers_yaml_reads_as_strings_are_numbers(tmp_path, corpus):
    from atencion.train.config import load_config

    config = write_config(tmp_path / "c.yaml", corpus, lr_peak="3e-3")
    assert load_config(config).train.lr_peak == 3e-3
    assert load_config(config, ["train.lr_peak=3e-4"]).train.lr_peak == 3e-4
    assert load_config(config, ["model.dropout=1e-1"]).model_config(40, None).dropout == 0.1


@pytest.mark.parametrize("override, message", [
    ("train.lr_peak=-1", "train.lr_peak must be > 0.0"), ("train.lr_peak=0", "train.lr_peak must be > 0.0"),
    ("train.lr_factor=-0.5", "train.lr_factor must be > 0.0"), ("train.max_steps=-5", "train.max_steps must be >= 0"),
    ("train.lr_peak=.nan", "expected a finite number"), ("train.max_steps=2.5", "expected an integer"),
    ("train.adam_betas=[0.9, 1.5]", r"train.adam_betas\[1\] must be in \[0, 1.0\)"),
    ("decode.alpha=-1", "decode.alpha must be >= 0.0"), ("train.device=gpu", "train.device must be"),
    ("model.norm_first=maybe", "model.norm_first must be true or false"),
    ("model.arch=decoder", "model.arch 'decoder' cannot be trained by task 'translate'"),
    ("model.preset=bert-tiny", "model.arch 'encoder' cannot be trained by task 'translate'"),
    ("model.positional=relative", "model.positional must be one of"),
])
def test_impossible_numbers_are_refused_naming_the_key(tmp_path, corpus, capsys, override, message):
    import re

    config = write_config(tmp_path / "c.yaml", corpus)
    line = fault(["train", str(config), "--out", str(tmp_path / "run"), "--set", override], capsys)
    assert re.search(message, line), line
    assert not (tmp_path / "run").exists()


def test_tokens_per_second_of_a_two_step_run_is_a_real_rate(tmp_path, corpus, capsys):
    config = write_config(tmp_path / "c.yaml", corpus, max_steps=2, valid_every=1)
    assert main(["train", str(config), "--out", str(tmp_path / "run")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < summary["tok_s"] < 10_000_000, summary


# 7. unbounded work -------------------------------------------------------------------------------

def test_attention_on_a_huge_sentence_is_refused_before_any_work(model_dir, tmp_path, capsys):
    started = time.time()
    line = fault(["attention", "--model", str(model_dir), "--src", " ".join(["uno dos"] * 1000), "--out",
                  str(tmp_path / "maps")], capsys)
    assert "--src" in line and "--max-tokens" in line and time.time() - started < 30
    assert not (tmp_path / "maps").exists() or not any((tmp_path / "maps").iterdir())


def test_translate_refuses_a_line_over_the_input_limit_naming_it(model_dir, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("uno\n" + "dos " * 50 + "\n")
    line = fault(["translate", "--model", str(model_dir), "--input", str(tmp_path / "in.txt"),
                  "--max-input-tokens", "20"], capsys)
    assert f"{tmp_path / 'in.txt'} line 2:" in line and "--max-input-tokens" in line


# 8. messages that name the right thing --------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_says_so(model_dir, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("uno\n")
    line = fault(["translate", "--model", str(model_dir), "--input", str(tmp_path / "in.txt"), "--device",
                  "cuda"], capsys)
    assert "--device cuda: this machine has no CUDA device" in line


def test_a_directory_given_as_a_corpus_says_so(tmp_path, corpus, capsys):
    config = write_config(tmp_path / "c.yaml", corpus)
    line = fault(["train", str(config), "--out", str(tmp_path / "run"), "--set", f"data.train_src={tmp_path}"],
                 capsys)
    assert "is a directory" in line


@pytest.mark.parametrize("option, value", [("--batch-tokens", "0"), ("--beam", "0"), ("--nbest", "-1"),
                                           ("--alpha", "nan"), ("--max-len-b", "-2")])
def test_a_bad_number_is_named_by_its_option(model_dir, capsys, option, value):
    with pytest.raises(SystemExit) as done:
        main(["translate", "--model", str(model_dir), option, value])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"argument {option}" in err


def test_an_unwritable_output_names_the_output_not_a_temporary(model_dir, tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("mounts a read-only tmpfs, which needs root")
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(ro)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (tmp_path / "in.txt").write_text("uno\n")
        line = fault(["translate", "--model", str(model_dir), "--input", str(tmp_path / "in.txt"), "--output",
                      str(ro / "out.txt")], capsys)
        assert str(ro / "out.txt") in line and ".tmp-" not in line
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_a_corrupt_gzip_corpus_is_one_line(tmp_path, corpus, capsys):
    bad = tmp_path / "bad.es.gz"
    bad.write_bytes(gzip.compress(b"uno dos\n" * 50)[:-20])
    config = write_config(tmp_path / "c.yaml", corpus)
    line = fault(["train", str(config), "--out", str(tmp_path / "run"), "--set", f"data.train_src={bad}"], capsys)
    assert str(bad) in line


# 9. the training side of the tasks: their data, their epochs, train.lora, train.init_from ---------------

TINY_TASK = {"model.n_layers": 1, "model.d_model": 32, "model.d_ff": 64, "model.n_heads": 2, "train.warmup": 5,
             "train.lr_peak": 0.003, "train.progress": "false", "train.tensorboard": "false", "train.log_every": 1,
             "train.threads": 1, "train.max_steps": 2, "train.valid_every": 2}


def task_config(path: Path, task: str, **sets) -> Path:
    """A YAML config of ``task`` with a 1-layer model and a 2-step run; ``sets``: KEY=VALUE with
    the section's dot as a double underscore (data__train_text)."""
    values = {**TINY_TASK, **{key.replace("__", "."): value for key, value in sets.items()}}
    sections: dict[str, dict] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    path.write_text(f"task: {task}\n" + "".join(f"{section}: {{" + ", ".join(f"{k}: {v}" for k, v in keys.items())
                                                 + "}\n" for section, keys in sections.items()), encoding="utf-8")
    return path


def task_sentences(n: int, seed: int = 0) -> list[str]:
    from test_tasks import sentences

    return sentences(n, seed)


@pytest.mark.parametrize("where", [1, 3])
def test_a_labelled_row_with_no_label_is_refused_naming_the_file_and_line(tmp_path, capsys, where):
    rows = [f"{'pos' if 'cat' in s else 'neg'}\t{s}" for s in task_sentences(40)]
    rows.insert(where - 1, "\tno label here")
    tsv = tmp_path / "train.tsv"
    tsv.write_text("".join(row + "\n" for row in rows), encoding="utf-8")
    config = task_config(tmp_path / "c.yaml", "classify", data__train_tsv=tsv, data__vocab_size=60)
    before = snapshot(tmp_path)
    line = fault(["train", str(config), "--out", str(tmp_path / "run")], capsys)
    assert f"{tsv} line {where}: the label is empty" in line, line
    assert unchanged(before) and not (tmp_path / "run").exists()


def test_a_labelled_row_with_no_label_is_refused_in_validation_and_evaluation_too(tmp_path):
    from atencion.data.text import read_labelled
    from atencion.errors import AtencionError

    tsv = tmp_path / "valid.tsv"
    tsv.write_text("pos\tthe cat\n \tno label here\nneg\tthe dog\n", encoding="utf-8")
    with pytest.raises(AtencionError, match=rf"{tsv} line 2: the label is empty"):
        read_labelled(str(tsv), ["neg", "pos"])


def test_a_first_line_taken_as_a_header_is_named_with_the_reason(tmp_path, caplog):
    from atencion.tasks import make_task
    from atencion.train.config import load_config

    train_tsv, valid_tsv = tmp_path / "train.tsv", tmp_path / "valid.tsv"
    train_tsv.write_text("label\tsentence\npos\tthe cat\nneg\tthe dog\n", encoding="utf-8")
    valid_tsv.write_text("verdict\ttext\npos\tmy cat\n", encoding="utf-8")
    config = task_config(tmp_path / "c.yaml", "classify", data__train_tsv=train_tsv, data__valid_tsv=valid_tsv)
    with caplog.at_level("WARNING"):
        task = make_task(load_config(config))
    assert task.labels == ["neg", "pos"] and len(task.train_rows) == 2 and len(task.valid_rows) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"{train_tsv} line 1: taken as a header" in w and "its label 'label' appears on no other line" in w
               for w in warnings), warnings
    assert any(f"{valid_tsv} line 1: taken as a header" in w and "its label 'verdict' is not a label" in w
               for w in warnings), warnings
    caplog.clear()
    with caplog.at_level("WARNING"):
        make_task(load_config(config, ["data.header=yes"]))  # asked for: nothing to say
    assert not [r for r in caplog.records if "header" in r.getMessage()]


def test_data_header_yes_and_no_written_plain_in_yaml_are_the_choices_yes_and_no(tmp_path):
    from atencion.train.config import load_config

    config = tmp_path / "c.yaml"
    config.write_text("task: classify\ndata: {train_tsv: t.tsv, header: yes}\n", encoding="utf-8")
    assert load_config(config).data.header == "yes"  # YAML 1.1 reads the word as true
    assert load_config(config, ["data.header=no"]).data.header == "no"
    assert load_config(config, ["data.header=auto"]).data.header == "auto"


def test_every_lm_epoch_has_a_block_when_the_text_holds_one():
    from atencion.data.text import epoch_offset, lm_blocks

    block = 64
    for n in range(block + 1, 3 * block):
        for seed in range(3):
            for epoch in range(30):
                offset = epoch_offset(seed, epoch, block, n)
                assert lm_blocks(n, block, offset), (n, seed, epoch, offset)
                if n >= 2 * block:  # a text of two blocks or more: the offsets it always had (exact resume)
                    assert offset == epoch_offset(seed, epoch, block)


def test_an_lm_text_between_one_and_two_blocks_trains_every_epoch_and_resumes(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(("to be or not to be, that is the question\n" * 3)[:99] + "\n", encoding="utf-8")
    assert len(text.read_text(encoding="utf-8")) == 100
    sets = [f"--set=data.train_text={text}", "--set=train.progress=false", "--set=train.tensorboard=false",
            "--set=train.threads=1", "--set=train.valid_every=1", "--set=train.log_every=1"]
    argv = ["train", str(ROOT / "configs" / "shakespeare_char.yaml"), "--out", str(tmp_path / "run")]
    assert main([*argv, *sets, "--set=train.max_steps=4"]) == 0  # one block an epoch: four epochs
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 4
    parts = ["train", str(ROOT / "configs" / "shakespeare_char.yaml"), "--out", str(tmp_path / "parts")]
    assert main([*parts, *sets, "--set=train.max_steps=1"]) == 0
    assert main([*parts, *sets, "--set=train.max_steps=4", "--resume"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 4


def test_a_task_that_gives_no_batch_is_refused_in_one_line_keeping_its_checkpoints(tmp_path, capsys, monkeypatch):
    from atencion.tasks.lm import LMTask

    batches = LMTask.batches
    monkeypatch.setattr(LMTask, "batches", lambda self, epoch: batches(self, epoch)[:2] if epoch == 0 else [])
    text = tmp_path / "text.txt"
    text.write_text("".join(s + "\n" for s in task_sentences(100)), encoding="utf-8")
    config = task_config(tmp_path / "c.yaml", "lm", data__train_text=text, data__tokenizer="char",
                         data__block_size=32, model__max_positions=32, train__max_tokens=64, train__max_steps=0,
                         train__valid_every=0, train__max_epochs=3)
    line = fault(["train", str(config), "--out", str(tmp_path / "run")], capsys)
    assert "epoch 2: task 'lm' gave no batch" in line and "step_00000002" in line, line
    assert (tmp_path / "run" / "checkpoints" / "step_00000002").is_dir()


def test_a_step_with_nothing_to_predict_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    from atencion.tasks.lm import LMTask

    make_batch = LMTask.make_batch

    def nothing(self, indices, step, part):
        batch = make_batch(self, indices, step, part)
        batch.units = 0 if step == 2 else batch.units
        return batch

    monkeypatch.setattr(LMTask, "make_batch", nothing)
    text = tmp_path / "text.txt"
    text.write_text("".join(s + "\n" for s in task_sentences(100)), encoding="utf-8")
    config = task_config(tmp_path / "c.yaml", "lm", data__train_text=text, data__tokenizer="char",
                         data__block_size=32, model__max_positions=32, train__valid_every=1)
    line = fault(["train", str(config), "--out", str(tmp_path / "run")], capsys)
    assert "step 2: its batches hold nothing to predict" in line and "step_00000001" in line, line


def test_mlm_lines_that_encode_to_no_piece_are_dropped_and_counted(tmp_path, capsys, caplog):
    lines = task_sentences(300)
    nothing = ["\ufeff", "\u200b", "\ufeff\u200b", " \u200b "] * 10  # 40 lines: SentencePiece drops these marks
    text = tmp_path / "text.txt"
    text.write_text("".join(s + "\n" for s in lines[:150] + nothing + lines[150:] + nothing), encoding="utf-8")
    config = task_config(tmp_path / "c.yaml", "mlm", data__train_text=text, data__vocab_size=60,
                         train__max_tokens=64, train__max_steps=4, train__valid_every=2)
    with caplog.at_level("WARNING"):
        assert main(["train", str(config), "--out", str(tmp_path / "run")]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "train text: dropped 40 sentences with no token to mask" in " ".join(warnings), warnings
    assert "valid text: dropped 40 sentences with no token to mask" in " ".join(warnings), warnings


def test_a_validation_text_with_no_piece_is_refused_before_any_training(tmp_path, capsys):
    text, valid = tmp_path / "text.txt", tmp_path / "valid.txt"
    text.write_text("".join(s + "\n" for s in task_sentences(300)), encoding="utf-8")
    valid.write_text("\ufeff\n\u200b\n" * 5, encoding="utf-8")
    config = task_config(tmp_path / "c.yaml", "mlm", data__train_text=text, data__valid_text=valid,
                         data__vocab_size=60)
    line = fault(["train", str(config), "--out", str(tmp_path / "run")], capsys)
    assert "valid text: no sentence left: 10 with no token to mask (of 10 non-empty lines)" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_masking_a_batch_with_nothing_maskable_chooses_nothing():
    from atencion.data.text import mask_tokens

    ids = torch.tensor([[2, 3, 0], [2, 4, 3]])
    inputs, targets = mask_tokens(ids, torch.zeros_like(ids, dtype=torch.bool), 4, 5, 50, 0.15,
                                  torch.Generator().manual_seed(0))
    assert torch.equal(inputs, ids) and not targets.any()


@pytest.mark.parametrize("task", ["lm", "mlm"])
def test_an_empty_held_out_tail_is_named_with_what_to_do(tmp_path, capsys, task):
    text = tmp_path / "text.txt"
    text.write_text("".join(s + "\n" for s in task_sentences(300)), encoding="utf-8")
    extra = {"data__tokenizer": "char", "data__block_size": 32, "model__max_positions": 32} if task == "lm" else {}
    config = task_config(tmp_path / "c.yaml", task, data__train_text=text, data__vocab_size=60,
                         data__valid_fraction=0.00001, **extra)
    line = fault(["train", str(config), "--out", str(tmp_path / "run")], capsys)
    assert "data.valid_fraction: the held-out tail (1e-05 of 300 lines of data.train_text) is empty" in line, line
    assert "data.valid_text" in line and not (tmp_path / "run" / "checkpoints").exists()


def test_train_lora_takes_the_numbers_the_other_sections_take(tmp_path):
    from atencion.errors import AtencionError
    from atencion.nn.lora import LoraSpec
    from atencion.train.config import load_config

    assert LoraSpec.from_config({"rank": "4", "alpha": "1e1", "dropout": "1e-1"}) == \
        LoraSpec(4, 10.0, 0.1, ["attention"])
    assert LoraSpec.from_config({"rank": 4.0}).rank == 4
    config = tmp_path / "c.yaml"
    config.write_text("task: classify\ntrain:\n  init_from: somewhere\n  lora: {rank: 2, alpha: 1e1}\n",
                      encoding="utf-8")
    assert LoraSpec.from_config(load_config(config).train.lora).alpha == 10.0
    for key, value, message in [("alpha", "ten", "expected a number > 0, got 'ten'"),
                                ("alpha", ".nan", "expected a number > 0"), ("alpha", "0", "expected a number > 0"),
                                ("rank", "2.5", "expected an integer >= 1, got '2.5'"),
                                ("rank", True, "expected an integer >= 1, got True"),
                                ("dropout", "1e0", r"expected a number in \[0, 1\), got '1e0'")]:
        with pytest.raises(AtencionError, match=rf"train.lora.{key}: {message}"):
            LoraSpec.from_config({key: value})


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny GPT (character vocabulary, 32 positions), a tiny BERT (SentencePiece with <mask>) and
    a tiny BERT classifier (SentencePiece without <mask>)."""
    from test_tasks import config as task_cfg
    from test_tasks import lm_sets

    tmp = tmp_path_factory.mktemp("pretrained")
    text = tmp / "text.txt"
    text.write_text("".join(s + "\n" for s in task_sentences(300)), encoding="utf-8")
    gpt = train(task_cfg(tmp, "lm", *lm_sets(text), "train.max_steps=1", "train.valid_every=1",
                         "train.threads=1"), tmp / "gpt")
    bert = train(task_cfg(tmp, "mlm", f"data.train_text={text}", "data.vocab_size=60", "train.max_steps=1",
                          "train.valid_every=1", "train.threads=1"), tmp / "bert")
    tsv = tmp / "train.tsv"
    tsv.write_text("".join(f"{'pos' if 'cat' in s else 'neg'}\t{s}\n" for s in task_sentences(100)), encoding="utf-8")
    classifier = train(task_cfg(tmp, "classify", f"data.train_tsv={tsv}", "data.vocab_size=60", "train.max_steps=1",
                                "train.threads=1"), tmp / "classifier")
    return {"gpt": gpt["best_model"], "bert": bert["best_model"], "classifier": classifier["last_checkpoint"],
            "text": text}


@pytest.mark.parametrize("task, start, sets, message", [
    ("mlm", "gpt", {}, "model.arch 'decoder' cannot be trained by task 'mlm'"),
    ("lm", "bert", {}, "model.arch 'encoder' cannot be trained by task 'lm'"),
    ("lm", "gpt", {"data__tokenizer": "char", "data__block_size": 64}, "data.block_size gives sequences of up to 64"),
    ("classify", "bert", {"model__d_model": 64}, "model.d_model is 64 in the config but 32 in"),
    ("mlm", "classifier", {}, "its tokenizer has no <mask>, which task 'mlm' needs"),
])
def test_every_init_from_refusal_names_it_and_comes_before_anything_is_written(tmp_path, capsys, pretrained,
                                                                               task, start, sets, message):
    data = {"classify": {"data__train_tsv": tmp_path / "train.tsv"}}.get(task, {"data__train_text": pretrained["text"]})
    (tmp_path / "train.tsv").write_text("".join(f"{'pos' if 'cat' in s else 'neg'}\t{s}\n"
                                                for s in task_sentences(40)), encoding="utf-8")
    config = task_config(tmp_path / "c.yaml", task, train__init_from=pretrained[start], **data, **sets)
    before = snapshot(tmp_path, Path(pretrained[start]))
    line = fault(["train", str(config), "--out", str(tmp_path / "run")], capsys)
    assert f"train.init_from {pretrained[start]}" in line and message in line, line
    assert unchanged(before) and not (tmp_path / "run").exists()


# 10. text arguments that are not UTF-8 ---------------------------------------------------------------

NOT_UTF8 = b"\xff uno".decode("utf-8", "surrogateescape")  # what sys.argv holds for $'\xff uno'


@pytest.mark.parametrize("given, named", [(["--src", NOT_UTF8], "--src"), (["--text", NOT_UTF8], "--src"),
                                          (["--src", "uno dos", "--tgt", NOT_UTF8], "--tgt")])
def test_a_text_argument_that_is_not_utf8_is_refused_naming_it_before_any_file_is_written(model_dir, tmp_path, capsys,
                                                                                          given, named):
    out = tmp_path / "maps"
    line = fault(["attention", "--model", str(model_dir), *given, "--out", str(out)], capsys)
    assert line == (f"atencion attention: error: {named}: not valid UTF-8 (byte 0xff at character 1); "
                    f"give the text in UTF-8")
    assert not out.exists()


CTRL_C_AT_IMPORT = """
import signal, sys

signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal
import atencion.cli
assert "torch" not in sys.modules, "import atencion.cli loaded torch"


class PressCtrlCBeforeTorch:  # the key pressed at the moment torch starts loading
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            signal.raise_signal(signal.SIGINT)
        return None


sys.meta_path.insert(0, PressCtrlCBeforeTorch())
sys.exit(atencion.cli.main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_command_loads_torch_says_interrupted_not_a_traceback(tmp_path):
    """The first seconds of every command load torch: a Ctrl-C then ends it with one line and
    exit status 130, as at any later moment, and `import atencion.cli` itself costs no torch."""
    process = subprocess.run([sys.executable, "-c", CTRL_C_AT_IMPORT, "presets"], capture_output=True, text=True,
                             timeout=120)
    assert process.returncode == 130, process.stderr
    assert process.stderr.strip() == "atencion presets: interrupted", process.stderr


# 11. sizes and counts before allocation (issue #52, class 7) -----------------------------------------

GB = 10 ** 9


@pytest.mark.parametrize("sets", [
    ["model.d_model=1000000", "model.n_heads=2"],               # 1.2e13 parameters
    ["model.n_layers=1000000"],                                  # 2,000,000 blocks
    ["model.d_model=2", "model.n_heads=1", "model.d_ff=2", "model.n_layers=300000"],  # narrow: their objects
    ["model.d_ff=1000000000"],
    ["model.moe={experts: 10000000}"],
    ["model.moe={experts: 10000000}", "model.d_model=2", "model.n_heads=1", "model.d_ff=1"],
    ["model.positional=learned", "model.max_positions=1000000000"],
    ["model.max_positions=1000000000"],                          # the sinusoid tables
    ["model.n_heads=1000000", "model.d_model=1000000"],
])
def test_a_model_larger_than_the_machine_is_refused_with_its_size_before_anything_is_built(
        tmp_path, corpus, capsys, monkeypatch, sets):
    import atencion.train.config

    monkeypatch.setattr(atencion.train.config, "machine_memory", lambda: 24 * GB, raising=False)
    config = write_config(tmp_path / "c.yaml", corpus)
    started = time.perf_counter()
    line = fault(["train", str(config), "--out", str(tmp_path / "run"), *(f"--set={s}" for s in sets)], capsys)
    assert time.perf_counter() - started < 30
    assert f"{config}: model: about " in line and " parameters in " in line and "this machine has 24 GB" in line
    assert "to train" in line and not (tmp_path / "run").exists()


def test_a_model_no_machine_holds_is_refused_by_the_real_memory_too(tmp_path, corpus, capsys):
    config = write_config(tmp_path / "c.yaml", corpus)
    line = fault(["train", str(config), "--out", str(tmp_path / "run"), "--set=model.d_model=1000000"], capsys)
    assert "about 1.2e13 parameters" in line and "192 TB to train" in line and "this machine has" in line


def test_the_size_estimate_is_the_parameter_count_of_the_built_model():
    """One place counts the parameters from the config (ModelConfig.parameter_estimate): it is the
    count of the model built on the meta device, for every preset and the variants of the fields."""
    from atencion.config import PRESETS, PUBLISHED, ModelConfig
    from atencion.nn.model_dir import build_model

    cases = [(name, {"vocab_size": PUBLISHED.get(name, (1000,))[0]}) for name in PRESETS
             if name not in ("vit-base", "vit-tiny", "whisper-tiny")]
    cases += [("vit-base", {}), ("whisper-tiny", {"tgt_vocab_size": 51865}),
              ("vit-tiny", {"inputs": {"kind": "patches", "patch": 4, "size": [32, 32], "shifted": True},
                            "max_positions": 65}),
              ("tiny", {"vocab_size": 100, "moe": {"experts": 4}}),
              ("tiny", {"vocab_size": 100, "moe": {"experts": 3, "layers": "every_other"}, "n_layers": 3}),
              ("tiny", {"vocab_size": 100, "share_embeddings": False, "tie_output": False, "tgt_vocab_size": 200}),
              ("gpt-tiny", {"vocab_size": 100, "d_ff": 0, "embedding_norm": True, "positional": "alibi"}),
              ("bert-tiny", {"vocab_size": 100, "num_labels": 3, "pooler": True}),
              ("bert-tiny", {"vocab_size": 100, "attention": {"kind": "linformer", "proj_len": 16, "sharing": "none"}}),
              ("llama-tiny", {"vocab_size": 100, "qkv_bias": True, "output_bias": True}),
              ("tiny", {"vocab_size": 100, "arch": "rnn"}),
              ("tiny", {"vocab_size": 100, "arch": "rnn", "n_layers": 2,
                        "rnn": {"cell": "lstm", "attention": "luong"}})]
    for name, values in cases:
        cfg = ModelConfig.preset(name, **values)
        with torch.device("meta"):
            built = sum(p.numel() for p in build_model(cfg).parameters())
        assert cfg.parameter_estimate() == built, (name, values)


def test_the_memory_check_leaves_the_presets_and_small_runs_alone(tmp_path, corpus):
    """A 7B model still builds on the meta device and lists in `atencion presets` whatever the
    machine; only training and building for real are checked."""
    from atencion.config import LOAD_BYTES, TRAIN_BYTES, ModelConfig, check_memory
    from atencion.errors import AtencionError
    from atencion.nn.model_dir import build_model

    mistral = ModelConfig.preset("mistral-7b", vocab_size=32000)
    with torch.device("meta"):
        assert build_model(mistral).num_parameters() == mistral.parameter_estimate()
    check_memory(mistral, LOAD_BYTES, 40 * GB, "to load")
    with pytest.raises(AtencionError, match=r"about 7.2e9 parameters in 32 layers \(116 GB to train"):
        check_memory(mistral, TRAIN_BYTES, 40 * GB, "to train")
    check_memory(mistral, TRAIN_BYTES, None, "to train")  # memory unknown: nothing refused
    config = write_config(tmp_path / "c.yaml", corpus, max_steps=1)  # data.vocab_size bounds the tokenizer's:
    assert main(["train", str(config), "--out", str(tmp_path / "run"), "--set=data.vocab_size=1000000000"]) == 0
    assert json.loads((tmp_path / "run" / "best" / "config.json").read_text())["vocab_size"] < 1000  # the corpus's


LISTOPS_TOO_MANY = [
    (["--train", "100000", "--min-length", "1", "--max-length", "6"], "104,000 distinct examples asked, but only "
                                                                       "4,400 trees"),
    (["--train", "11", "--valid", "1", "--test", "1", "--min-length", "0", "--max-length", "2"], "only 10 trees"),
    (["--train", "5", "--valid", "1", "--test", "1", "--min-length", "1", "--max-length", "4"], "only 0 trees"),
    (["--train", "4400", "--valid", "1", "--test", "1", "--min-length", "3", "--max-length", "9", "--max-depth", "2",
      "--max-args", "3"], "4,402 distinct examples asked, but only 4,400 trees"),
    (["--train", "20", "--valid", "1", "--test", "1", "--min-length", "0", "--max-length", "2000", "--max-depth",
      "1"], "only 10 trees"),
]


@pytest.mark.parametrize("args, message", LISTOPS_TOO_MANY)
def test_listops_refuses_more_examples_than_distinct_trees_at_once(tmp_path, capsys, args, message):
    from atencion.data.listops import main as listops_main

    started = time.perf_counter()
    assert listops_main([str(tmp_path / "data"), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err and "--min-length/--max-length" in err, err
    assert time.perf_counter() - started < 10 and not (tmp_path / "data").exists()


def test_the_distinct_trees_are_counted_exactly_and_all_of_them_can_be_drawn():
    import random

    from atencion.data.listops import ListOpsRecipe, draw_examples

    def enumerated(recipe: ListOpsRecipe) -> int:  # every tree spelt out, for recipes small enough
        def trees(level: int) -> list[list[str]]:
            found = [[str(v)] for v in range(10)]
            if level < recipe.max_depth:
                below = [t for t in trees(level + 1) if len(t) < recipe.max_length]
                lists = [[]]
                for k in range(1, recipe.max_args + 1):
                    lists = [a + b for a in lists for b in below if len(a) + len(b) + 2 < recipe.max_length]
                    found += [[op, *args, "]"] for op in ("[MIN", "[MAX", "[MED", "[SM") for args in lists] \
                        if k >= 2 else []
            return found
        return len({" ".join(t) for t in trees(1) if recipe.min_length < len(t) < recipe.max_length})

    for recipe in [ListOpsRecipe(1, 6), ListOpsRecipe(3, 9, max_depth=2, max_args=3),
                   ListOpsRecipe(0, 8, max_depth=3, max_args=2), ListOpsRecipe(0, 2), ListOpsRecipe(1, 4)]:
        assert recipe.distinct_trees() == enumerated(recipe), recipe
    small = ListOpsRecipe(0, 5, max_depth=2, max_args=2)  # 10 digits and 400 two-digit operators
    assert small.distinct_trees() == 410 == len(list(draw_examples(410, random.Random(0), small, set())))
    assert ListOpsRecipe().distinct_trees() == 10 ** 15  # LRA's recipe: past any count asked


# 12. friction (issue #52, class 10) ------------------------------------------------------------------

def decoder_dir(path: Path, vocabulary: int, max_positions: int, **model) -> Path:
    """A random 2-layer GPT with learned positions and a character vocabulary of ``vocabulary``
    regular tokens, saved as a model directory."""
    from atencion import ModelConfig, Transformer
    from atencion.data.tokenizer import Tokenizer
    from atencion.nn.model_dir import save_model_dir

    tokenizer = Tokenizer.train_text(["".join(chr(0x4E00 + i) for i in range(vocabulary)) + "\n"], kind="char")
    cfg = ModelConfig(**{"vocab_size": tokenizer.vocab_size, "arch": "decoder", "n_layers": 2, "d_model": 16,
                         "n_heads": 2, "d_ff": 32, "dropout": 0.0, "positional": "learned",
                         "max_positions": max_positions, "norm_first": True, **model})
    torch.manual_seed(0)
    save_model_dir(path, Transformer(cfg).eval(), tokenizer)
    return path


def test_induction_fits_its_length_to_the_model_and_names_length_and_context_when_they_do_not_fit(
        tmp_path, capsys):
    model = str(decoder_dir(tmp_path / "gpt128", vocabulary=120, max_positions=128))
    assert main(["induction", "--model", model, "--rows", "2"]) == 0  # its defaults on a 128-position model
    assert json.loads(capsys.readouterr().out)["length"] == 64
    line = fault(["induction", "--model", model, "--length", "100"], capsys)
    assert "--length 100" in line and "max_positions=128" in line and "--length 64 or less" in line
    line = fault(["induction", "--model", model, "--length", "65", "--rows", "1"], capsys)
    assert "--length 65" in line and "2 × --length = 130 tokens" in line
    small = decoder_dir(tmp_path / "few-tokens", vocabulary=20, max_positions=128)
    regular = json.loads((small / "config.json").read_text())["vocab_size"] - 4  # the ids below 4 are special
    assert main(["induction", "--model", str(small), "--rows", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["length"] == regular
    line = fault(["induction", "--model", str(small), "--length", "30"], capsys)
    assert "--length 30" in line and f"{regular} regular ones" in line and f"--length {regular} or less" in line
    (tmp_path / "text.txt").write_text(chr(0x4E00) * 2000 + "\n", encoding="utf-8")
    for context, message in [("512", "--context 512: rows of --text of 512 tokens pass the model's learned positions, "
                                     "which stop at max_positions=128"),
                             ("100", "--context 100: the in-context learning score compares tokens 50 and 500")]:
        line = fault(["induction", "--model", model, "--text", str(tmp_path / "text.txt"), "--context", context],
                     capsys)
        assert message in line, line


@pytest.mark.parametrize("kind", ["prefix", "prompt"])
@pytest.mark.parametrize("positional", ["learned", "rope"])
def test_induction_scores_a_model_adapted_by_virtual_tokens(tmp_path, capsys, kind, positional):
    """Its scores are the tokens' (a prompt's places and a prefix's keys left out); was a RuntimeError."""
    import numpy as np

    from atencion import ModelConfig, Transformer
    from atencion.nn.model_dir import load_model_dir, save_model_dir, weights_checksum
    from atencion.nn.prefix import PrefixSpec, PromptSpec, apply_virtual

    base = decoder_dir(tmp_path / "base", vocabulary=40, max_positions=64)
    model, tokenizer = load_model_dir(base)
    if positional == "rope":
        model = Transformer(ModelConfig.from_dict({**model.cfg.to_dict(), "positional": "rope"})).eval()
        save_model_dir(tmp_path / "rope", model, tokenizer)
        base = tmp_path / "rope"
    spec = PrefixSpec(5, projection=True) if kind == "prefix" else PromptSpec(5)
    apply_virtual(model, spec, base, weights_checksum(base))
    save_model_dir(tmp_path / "adapted", model, tokenizer)
    assert main(["induction", "--model", str(tmp_path / "adapted"), "--rows", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    regular = model.cfg.vocab_size - 4  # the ids below 4 are special
    longest = 29 if positional == "learned" else regular  # 2 × 29 + 5 virtual places <= 64
    assert report["length"] == longest and np.isfinite(report["copying"]).all()
    assert np.array(report["prefix_matching"]).shape == (2, 2)
    line = fault(["induction", "--model", str(tmp_path / "adapted"), "--length", str(longest + 1)], capsys)
    assert f"--length {longest + 1}" in line and f"--length {longest} or less" in line


@pytest.mark.parametrize("extra", [["--draft-tokens", "4"], ["--draft-tokens", "8"], ["--draft-tokens=1"],
                                   ["--draft-tokens", "2", "--num-samples", "2"]])
def test_draft_tokens_without_draft_is_refused_naming_both_options(tmp_path, capsys, extra):
    model = str(decoder_dir(tmp_path / "gpt", vocabulary=20, max_positions=64))
    argv = ["generate", "--model", model, "--prompt", chr(0x4E00), "--max-new-tokens", "2", "--seed", "0"]
    line = fault([*argv, *extra], capsys)
    assert line.startswith("atencion generate: error: --draft-tokens ") and "--draft DIR" in line
    assert main([*argv, "--draft", model]) == 0  # --draft alone: its default, 4 tokens a round
    assert main([*argv, "--draft", model, *extra]) == 0
    serve_extra = extra[:2] if len(extra) > 2 else extra  # serve has no --num-samples
    line = fault(["serve", "--model", model, "--port", "0", *serve_extra], capsys)  # refused before anything is served
    assert line.startswith("atencion serve: error: --draft-tokens ") and "--draft DIR" in line


@pytest.mark.parametrize("model, message", [
    ({"n_kv_heads": 1}, "this model's 2 query heads share 1 (grouped-query attention, n_kv_heads 1)"),
    ({"n_heads": 4, "n_kv_heads": 2}, "this model's 4 query heads share 2 (grouped-query attention"),
    ({"attention": {"kind": "window", "window": 4}}, "this model's is attention.kind 'window'"),
    ({"attention": {"kind": "flash"}}, "this model's is attention.kind 'flash'"),
])
def test_prefix_tuning_a_model_it_cannot_adapt_says_what_it_does_adapt(tmp_path, capsys, pretrained, model, message):
    from atencion.errors import AtencionError
    from atencion.nn.model_dir import load_model_dir
    from atencion.nn.prefix import PrefixSpec, apply_virtual

    base = decoder_dir(tmp_path / "base", vocabulary=40, max_positions=64, **model)
    with pytest.raises(AtencionError) as refused:
        apply_virtual(load_model_dir(base)[0], PrefixSpec(2), base, "0" * 64)
    assert message in str(refused.value) and "None" not in str(refused.value)
    assert "train.prefix adapts models whose " in str(refused.value)
    assert str(refused.value).endswith(": use train.prompt or train.lora")
    text = tmp_path / "text.txt"
    text.write_text(chr(0x4E00 + 4) * 400 + "\n", encoding="utf-8")
    config = task_config(tmp_path / "c.yaml", "lm", data__train_text=text, data__tokenizer="char",
                         data__block_size=16, train__init_from=base, train__prefix="{length: 2}")
    line = fault(["train", str(config), "--out", str(tmp_path / "run")], capsys)
    assert f"train.init_from {base}: train.prefix adapts models" in line and message in line
    assert not (tmp_path / "run").exists()


def refused_run_cases(tmp_path: Path, pretrained) -> list[tuple[Path, list[str]]]:
    """Configs refused once their run has started (the data read, the model built), each with its sets."""
    text, valid = tmp_path / "text.txt", tmp_path / "valid.txt"
    text.write_text("".join(s + "\n" for s in task_sentences(300)), encoding="utf-8")
    valid.write_text("\ufeff\n\u200b\n" * 5, encoding="utf-8")
    return [
        (task_config(tmp_path / "tail.yaml", "lm", data__train_text=text, data__tokenizer="char",
                     data__block_size=32, model__max_positions=32, data__valid_fraction=0.00001), []),
        (task_config(tmp_path / "valid.yaml", "mlm", data__train_text=text, data__valid_text=valid,
                     data__vocab_size=60), []),
        (task_config(tmp_path / "big.yaml", "lm", data__train_text=pretrained["text"], data__tokenizer="char",
                     data__block_size=16, train__init_from=pretrained["gpt"]), ["memory"]),
    ]


@pytest.mark.parametrize("case", [0, 1, 2])
@pytest.mark.parametrize("out", ["new", "new/deeper/run", "empty"])
def test_a_run_refused_as_it_starts_takes_back_the_out_directory_it_made(tmp_path, capsys, monkeypatch, pretrained,
                                                                         case, out):
    import atencion.train.config

    config, sets = refused_run_cases(tmp_path, pretrained)[case]
    if "memory" in sets:  # the init_from model, too large for a machine of 100 kB: found when the run starts
        monkeypatch.setattr(atencion.train.config, "machine_memory", lambda: 100_000, raising=False)
    (tmp_path / "empty").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    line = fault(["train", str(config), "--out", str(tmp_path / out)], capsys)
    assert line.startswith("atencion train: error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not any((tmp_path / "empty").iterdir())


def test_a_refused_run_keeps_a_directory_that_held_a_run_before(tmp_path, capsys, pretrained):
    config, _ = refused_run_cases(tmp_path, pretrained)[0]
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{}\n")  # an earlier run, stopped before its first checkpoint
    fault(["train", str(config), "--out", str(out)], capsys)
    assert out.is_dir() and (out / "run.json").is_file()
