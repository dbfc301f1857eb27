"""Every benchmark runs: ``python -m benchmarks.NAME --smoke`` (its whole path in seconds, on tiny
data made on the fly, in a temporary directory) exits 0 and prints its figures, for every script
found in benchmarks/ (a new script without --smoke, or without a check here, fails)."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "common"))

# What each script's smoke run must print (a regular expression on stdout + stderr): its table or JSON.
PRINTS = {
    "ab_versions": r"same beams: True.*time new/old median.*generation, gpt-tiny",
    "compile_step": r"batch 1: fused step [\d.]+ ms, layer by layer [\d.]+ ms",
    "bandwidth": r"(AVX-512|AVX2|no AVX2): read bandwidth [\d.]+ GB/s \(.* GiB.*threads, median of 2\): hand loop",
    "adapt_lm": r'"base": [\d.]+, "full": [\d.]+, "lora": [\d.]+, "prefix": [\d.]+, "prompt": [\d.]+, "scratch"',
    "bottleneck": r"\| source words \| sentences \|.*\| model \| parameters \| updates \| tokens/s \|",
    "digits_vit": r"ViT, seed 1 .*%.*SVC\(gamma=0\.001\).*training images/s",
    "dropout": r"forward\+backward .* 2 ",
    "fsdd": r"speech Transformer, standard test split.*speaker left out: median of 2.*speech to text, test split",
    "gpt2_recipe": r'"tok_s_median": [\d.]+, .*"mfu": ',
    "gradient_distance": r'"norms": \{"LSTM, initialised".*"self-attention, trained"',
    "head_seeds": r"\| layer\.head \| AER seed 1 \| AER seed 2 \|.*Spearman correlation",
    "induction_heads": r'"first_step_with_induction_heads": .*"last": ',
    "kv_cache": r"n_kv_heads 1: .* MiB after 8 tokens \(9\.0x smaller",
    "listops": r"\| full \| [\d.]+ \|.*most frequent label",
    "lm_curve": r"lm_curve: drew 23 records, \d+ bytes of PNG",
    "long_attention": r"\| eq\. \(1\) explicit \|.*\| torch fused \(full\) \|.*threads: ",
    "long_context": r"final valid.*\n\s*full\s+3 .*generation, full: resident MiB",
    "lora_transfer": r'"scratch": \{"test2016_best".*"lora_embeddings": \{',
    "matvec": r"F\.linear\(x, W\)\s+[\d.]+.*fbgemm linear_dynamic\s+[\d.]+",
    "moe": r'\{"dense": \{"best_valid_loss".*"moe_noaux": \{',
    "multi30k": r'"pair": "en-de".*"test2016_averaged": \{"bleu_tok"',
    "positions": r'"loss": \{"learned": \{"1": [\d.]+, "2": null\}, "alibi": \{"1": [\d.]+, "2": [\d.]+\}',
    "rnn_ladder": r"\| gru_bahdanau \|.*\| transformer \|.*\| source words \| sentences \|",
    "scale_out": r"ddp \+ checkpointing .*tok/s fsdp/ddp: [\d.]+",
    "scaling": r'"fit": "with_floor", "alpha": .*"fit": "frontier"',
    "sequential": r"\| 8 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|",
    "serve_llm": r"vector width .*\n1 stream\n.*atencion-seq1 .*generate .*2 streams\n.*atencion / atencion-seq1: "
                 r"[\d.]+x.*greedy agreement",
    "serve_load": r"sequential .*concurrent .*overload: 8 clients.*checks: ",
    "speculative": r"speed-up\s+acceptance.*\n\s*3 .*\(median \[min, max\] over the prompts\)",
    "speed": r"read bandwidth [\d.]+ GB/s.*train_tok_s.*lm \(tokens/s\).*llama_b16_greedy.*at the memory wall.*"
             r"llama_b1_greedy\s+atencion f32\s+\d+\s+[\d.]+\s+[\d.]+.*llama1b_b1_greedy\s+atencion f32",
    "sst2": r'"pretraining": \{"masked_accuracy".*"lora_trainable_share"',
    "table3": r"\| base_seed1 \| train\.seed=1 \|.*\| A_heads_1 \| model\.n_heads=1 \|",
}


def test_every_script_has_a_smoke_check_and_says_its_group():
    """A check per script, ``KIND`` (experiment or speed) in each, each listed in the package's docstring,
    and none of them edits sys.path (they run as ``python -m benchmarks.NAME``)."""
    assert sorted(PRINTS) == SCRIPTS, "a script in benchmarks/ without a smoke check here, or a check of none"
    listed = ast.get_docstring(ast.parse((ROOT / "benchmarks" / "__init__.py").read_text(encoding="utf-8")))
    for name in SCRIPTS:
        source = (ROOT / "benchmarks" / f"{name}.py").read_text(encoding="utf-8")
        assert re.search(r'^KIND = "(experiment|speed)"', source, re.M), f"{name}: no KIND constant"
        assert re.search(rf"^- {name}: ", listed, re.M), f"{name}: not listed in benchmarks/__init__.py"
        assert "sys.path.insert" not in source and "--smoke" in source, name


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_smoke_run_runs_and_prints_its_figures(name):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"python -m benchmarks.{name} --smoke exited {done.returncode}:\n{output[-4000:]}"
    assert re.search(PRINTS[name], output, re.S), f"{name} --smoke did not print its figures:\n{output[-4000:]}"
