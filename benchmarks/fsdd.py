"""Spoken digits (the Free Spoken Digit Dataset, five speakers): a speech Transformer's accuracy on
the dataset's own test split and on each speaker left out of training, and the speech-to-text
model's exact match, beside a logistic regression on the same log-mel frames, measured in the
same run.

    python -m benchmarks.fsdd                               # everything (about 40 minutes on one thread)
    python -m benchmarks.fsdd --parts classify,baseline     # the standard split only
    python -m benchmarks.fsdd --loso-steps 300              # shorter leave-one-speaker-out runs

Steps (a finished run is reused when the command is run again):
1. OUT/data: python -m atencion.data.fsdd from --archive: train on indices 10-49 of each digit and
   speaker, choose checkpoints and settings on 5-9, test on 0-4 (the dataset's test split); for
   each speaker left out, train and validate on the other four (0-4 and 10-49 / 5-9), test on all
   500 of that speaker's recordings.
2. classify: configs/fsdd_speech.yaml on the standard split; its best model (by validation
   accuracy) scored on test.tsv as `atencion evaluate --tsv` scores it.
3. loso: the same config, one run per speaker left out (--loso-steps updates each, the config's
   by default), each scored on that speaker: every accuracy, their median and range.
4. transcribe: configs/fsdd_transcribe.yaml (the word, "seven", spelled by the decoder) on the
   standard split, scored on test_text.tsv: exact match and chrF with greedy and beam search (4);
   BLEU counts up to 4-grams, so on one-word transcripts it is 0 and is not shown.
5. baseline: scikit-learn's LogisticRegression on each recording's mean and standard deviation
   over time of the same log-mel frames (160 numbers), on the standard split and on each speaker
   left out.
Prints a table and writes OUT/fsdd.json. Every run uses train.threads --threads (default 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, SMOKE_HELP, TINY_MODEL, finished, read_log, smoke_dir, spread

KIND = "experiment"  # trains and reports quality (benchmarks/__init__.py lists the two groups)
PARTS = ("classify", "loso", "transcribe", "baseline")


def tiny_archive(path: Path, speakers: tuple[str, ...] = ("alice", "bob"), indices: tuple[int, ...] = (0, 5, 10)):
    """An FSDD-shaped recordings.tar.gz of made-up tones (0.2 s at 8 kHz, a pitch per digit and speaker):
    ``{digit}_{speaker}_{index}.wav`` with an index of each split (test 0-4, valid 5-9, train 10-)."""
    import io
    import math
    import struct
    import tarfile
    import wave

    with tarfile.open(path, "w:gz") as tar:
        for digit in range(10):
            for k, speaker in enumerate(speakers):
                for index in indices:
                    pitch, buffer = 200 + 60 * digit + 15 * k + index, io.BytesIO()
                    with wave.open(buffer, "wb") as w:
                        w.setnchannels(1)
                        w.setsampwidth(2)
                        w.setframerate(8000)
                        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * pitch * t / 8000)))
                                               for t in range(1600)))
                    info = tarfile.TarInfo(f"recordings/{digit}_{speaker}_{index}.wav")
                    info.size = len(buffer.getvalue())
                    tar.addfile(info, io.BytesIO(buffer.getvalue()))
    return path


def prepare(data: Path, archive: str) -> tuple[Path, list[str]]:
    """The data folder (written unless it is there) and the speakers."""
    from atencion.data.fsdd import write_fsdd

    if not (data / "test_text.tsv").is_file():
        write_fsdd(data, archive, force=True)
    return data, sorted(p.name.removeprefix("speaker_") for p in data.glob("speaker_*"))


def train_run(name: str, config: Path, folder: Path, args, suffix: str = "", *sets: str) -> dict:
    """The run OUT/NAME of ``config`` on the TSVs of ``folder`` (train/valid, with ``suffix``),
    trained now unless it is there already: its updates, minutes and best model."""
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    run = Path(args.out) / name
    wall = None
    if not finished(run):
        overrides = [f"data.train_tsv={folder / f'train{suffix}.tsv'}",
                     f"data.valid_tsv={folder / f'valid{suffix}.tsv'}", f"train.threads={args.threads}",
                     "train.progress=false", *sets, *args.set]
        start = time.perf_counter()
        train(load_config(config, overrides), run, resume=(run / "checkpoints").is_dir())
        wall = round((time.perf_counter() - start) / 60, 2)  # reading the recordings included
    summary = [r["summary"] for r in read_log(run) if "summary" in r][-1]
    return {"updates": summary["steps"], "best_step": summary["best_step"],
            "minutes": round(summary["seconds"] / 60, 2), "wall_minutes": wall, "model": summary["best_model"]}


def accuracy(model: str, tsv: Path) -> float:
    """The model's accuracy on ``tsv``, as `atencion evaluate --tsv` computes it."""
    from atencion.tasks.classify import evaluate_classifier_dir

    return evaluate_classifier_dir(model, {"tsv": str(tsv)})["accuracy"]


def transcripts(model: str, tsv: Path) -> dict:
    """Exact match and chrF of the speech-to-text model on ``tsv``, greedy and with a beam of 4."""
    from atencion.decode.settings import DecodeConfig
    from atencion.tasks.transcribe import evaluate_transcriber

    out = {}
    for beam in (1, 4):
        decode = DecodeConfig(beam=beam, max_len_a=0.0, max_len_b=10)
        scores = evaluate_transcriber(model, {"tsv": str(tsv), "decode": decode})
        out[f"beam {beam}"] = {"exact_match": scores["exact_match"], "chrf": scores["chrf"],
                               "recordings": scores["sentences"]}
    return out


def baseline(data: Path, speakers: list[str]) -> dict:
    """LogisticRegression on the mean and standard deviation over time of each recording's
    log-mel frames: the standard split, and each speaker left out."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from atencion.data.audio import load_features

    cache: dict[Path, np.ndarray] = {}

    def table(tsv: Path) -> tuple[np.ndarray, np.ndarray]:
        rows = [line.split("\t") for line in tsv.read_text(encoding="utf-8").splitlines()]
        for _, name in rows:
            path = (tsv.parent / name).resolve()
            if path not in cache:
                frames = load_features(path).numpy()
                cache[path] = np.concatenate([frames.mean(axis=1), frames.std(axis=1)])
        return (np.stack([cache[(tsv.parent / name).resolve()] for _, name in rows]),
                np.array([int(label) for label, _ in rows]))

    def score(folder: Path) -> float:
        x, y = table(folder / "train.tsv")
        model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000)).fit(x, y)
        x_test, y_test = table(folder / "test.tsv")
        return float((model.predict(x_test) == y_test).mean())

    loso = {speaker: score(data / f"speaker_{speaker}") for speaker in speakers}
    return {"standard": score(data), "loso": loso, "loso_accuracy": spread(list(loso.values()))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/fsdd", help="data and runs go here (default: runs/fsdd)")
    parser.add_argument("--archive", default="../shared/data/fsdd/recordings.tar.gz",
                        help="FSDD's recordings.tar.gz (default: ../shared/data/fsdd/recordings.tar.gz)")
    parser.add_argument("--config", default=str(ROOT / "configs" / "fsdd_speech.yaml"), help="the classifier's")
    parser.add_argument("--transcribe-config", default=str(ROOT / "configs" / "fsdd_transcribe.yaml"))
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--loso-steps", type=int, default=0,
                        help="updates of each leave-one-speaker-out run (default: 0, the config's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here two speakers of made-up tones")
    args = parser.parse_args(argv)
    if args.smoke:
        sets = [*TINY_MODEL, "train.max_steps=2", "train.valid_every=2"]
        with smoke_dir("fsdd") as tmp:
            return main(["--out", str(tmp), "--archive", str(tiny_archive(tmp / "recordings.tar.gz")), "--loso-steps",
                         "2", "--threads", "1", *[a for s in sets for a in ("--set", s)]])
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import torch

    torch.set_num_threads(args.threads)
    data, speakers = prepare(Path(args.out) / "data", args.archive)
    report: dict = {"threads": args.threads}
    if "classify" in parts:
        run = train_run("classify", Path(args.config), data, args)
        report["classify"] = {**run, "test_accuracy": accuracy(run["model"], data / "test.tsv")}
    if "loso" in parts:
        steps = [f"train.max_steps={args.loso_steps}"] if args.loso_steps else []
        loso = {}
        for speaker in speakers:
            folder = data / f"speaker_{speaker}"
            run = train_run(f"speaker_{speaker}", Path(args.config), folder, args, "", *steps)
            loso[speaker] = {**run, "test_accuracy": accuracy(run["model"], folder / "test.tsv")}
        report["loso"] = loso
        report["loso_accuracy"] = spread([r["test_accuracy"] for r in loso.values()])
    if "transcribe" in parts:
        run = train_run("transcribe", Path(args.transcribe_config), data, args, "_text")
        report["transcribe"] = {**run, "test": transcripts(run["model"], data / "test_text.tsv")}
    if "baseline" in parts:
        report["baseline"] = baseline(data, speakers)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fsdd.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print_table(report)
    return report


def print_table(report: dict) -> None:
    def row(name: str, value: float, run: dict | None = None) -> None:
        detail = f" ({run['updates']} updates, {run['minutes']} min)" if run else ""  # training; wall in the JSON
        print(f"{name + detail:<64}{100 * value:>8.2f}%")

    print(f"{'FSDD (' + str(report['threads']) + ' thread(s))':<64}{'accuracy':>9}")
    if "classify" in report:
        row("speech Transformer, standard test split (indices 0-4)", report["classify"]["test_accuracy"],
            report["classify"])
    for speaker, run in report.get("loso", {}).items():
        row(f"speech Transformer, {speaker} left out", run["test_accuracy"], run)
    if "loso_accuracy" in report:
        a = report["loso_accuracy"]
        print(f"{'speech Transformer, speaker left out: median of ' + str(a['runs']):<64}{100 * a['median']:>8.2f}%"
              f"  (range {100 * a['min']:.2f}-{100 * a['max']:.2f})")
    if "baseline" in report:
        b = report["baseline"]
        row("logistic regression on mean/std log-mel, standard test split", b["standard"])
        a = b["loso_accuracy"]
        print(f"{'logistic regression, speaker left out: median of ' + str(a['runs']):<64}{100 * a['median']:>8.2f}%"
              f"  (range {100 * a['min']:.2f}-{100 * a['max']:.2f})")
    if "transcribe" in report:
        t = report["transcribe"]
        for search, scores in t["test"].items():
            name = f"speech to text, test split, {search} ({t['updates']} updates, {t['minutes']} min)"
            print(f"{name:<64}{100 * scores['exact_match']:>8.2f}% exact match, chrF {scores['chrf']}")


if __name__ == "__main__":
    main()
