"""`atencion demo`: write the grammar's corpus, train a tiny model on it, translate, score."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import MissingFileError
from . import grammar

log = logging.getLogger(__name__)

EXAMPLES = [
    "el gato negro come el ratón",
    "las casas blancas eran viejas",
    "el libro que los estudiantes leían era difícil",
    "el banco aprobó el crédito",
    "el hombre se sentó en el banco",
]
DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "toy_es_en.yaml"


def run_demo(out: str | Path, config: str | Path | None = None, overrides: list[str] = (),
             n_train: int = 30000, n_valid: int = 300, n_test: int = 500, seed: int = 0,
             warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train the embedded Spanish→English model under ``out`` and return the demo's summary,
    with, under "examples", each example sentence, the model's translation and the grammar's.

    Training runs for the config's train.max_steps updates (or stops earlier when validation
    BLEU stops improving): the result does not depend on the machine's speed. Its
    time_limit_minutes is a safety cap only; when the cap stops training first, ``warn(message)``
    (default: a logging warning) says so, and the summary's "stopped_by" is "time_limit"."""
    from ..decode.settings import DecodeConfig
    from ..decode.translate import translate_lines
    from ..evaluate import score
    from ..fileio import need_file, need_output_dir
    from ..nn.model_dir import load_model_dir
    from ..train.config import load_config
    from ..train.trainer import train

    start = time.time()
    out = need_output_dir(out, "--out")
    if config is not None:
        need_file(config, "--config")
    data = out / "data"
    train_pairs, held_out = grammar.split(n_train, n_valid + n_test, seed=seed)
    valid_pairs, test_pairs = held_out[:n_valid], held_out[n_valid:]
    files = {name: grammar.write_corpus(pairs, data, name)
             for name, pairs in (("train", train_pairs), ("valid", valid_pairs), ("test", test_pairs))}
    paths = [f"data.train_src={files['train']['es']}", f"data.train_tgt={files['train']['en']}",
             f"data.valid_src={files['valid']['es']}", f"data.valid_tgt={files['valid']['en']}"]
    cfg = load_config(config or _config_path(), [*paths, *overrides])
    summary = train(cfg, out / "run")
    if summary["stopped_by"] == "time_limit":
        message = (f"this machine was too slow for the demo: the {cfg.train.time_limit_minutes:g}-minute cap "
                   f"stopped training after {summary['steps']} of {cfg.train.max_steps} updates, so the "
                   f"result is that of fewer updates than the recipe's")
        (warn or log.warning)(message)
    model_dir = Path(summary["best_model"] or summary["last_checkpoint"])

    model, tokenizer = load_model_dir(model_dir)
    d = cfg.decode
    hyps = [t[0].text for t in translate_lines(model, tokenizer, [p.src for p in test_pairs], d)]
    refs = [p.tgt for p in test_pairs]
    examples_decode = DecodeConfig(beam=d.beam, alpha=d.alpha)  # the default length limits and batches
    exact = sum(h == r for h, r in zip(hyps, refs)) / len(refs)
    scores = score(hyps, refs)
    examples = [{"src": src, "translation": hyp[0].text, "expected": grammar.translate_known(src).tgt}
                for src, hyp in zip(EXAMPLES, translate_lines(model, tokenizer, EXAMPLES, examples_decode))]
    return {"examples": examples, "exact_match": round(exact, 4), "bleu": scores["bleu"], "chrf": scores["chrf"],
            "test_sentences": len(refs), "train_steps": summary["steps"], "stopped_by": summary["stopped_by"],
            "train_seconds": summary["seconds"],
            "seconds": round(time.time() - start, 1), "model_dir": str(model_dir)}


def _config_path() -> Path:
    """configs/toy_es_en.yaml of the source tree this package runs from."""
    if not DEFAULT_CONFIG.is_file():
        raise MissingFileError(f"{DEFAULT_CONFIG}: the demo config is not there (an installed copy "
                                f"without the source tree?); pass --config configs/toy_es_en.yaml")
    return DEFAULT_CONFIG


def format_examples(examples: list[dict[str, str]]) -> str:
    """One line per example: ✓ or ✗, the sentence, the model's translation, and the grammar's when they differ."""
    lines = []
    for example in examples:
        right = example["translation"] == example["expected"]
        lines.append(f"{'✓' if right else '✗'} {example['src']}  →  {example['translation']}"
                     + ("" if right else f"   (expected: {example['expected']})"))
    return "".join(line + "\n" for line in lines)
