"""Language models at work (atencion/tasks/, `atencion generate | fill-mask | classify | evaluate`,
the server's /generate, /fill-mask, /classify), on tiny random models saved as model directories:
each answer equals what the model computes, seeds reproduce, one line comes out per line in, and
every bad input is one line on stderr with exit status 2."""

import asyncio
import io
import json
import subprocess
import sys
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient

from atencion import ModelConfig, Transformer
from atencion.data.batching import token_batches
from atencion.data.text import read_labelled
from atencion.data.tokenizer import BOS_ID, EOS_ID, MASK, PAD_ID, Tokenizer
from atencion.decode.sample import check_sampling, choose_next, generate_ids
from atencion.decode.settings import SamplingConfig
from atencion.errors import AtencionError
from atencion.nn.model_dir import load_model_dir
from atencion.serve.app import LoadedModel, ServeSettings, create_app
from atencion.serve.batching import QueueFull, Worker
from atencion.tasks import model_task
from atencion.tasks.classify import (
    classify_file,
    classify_lines,
    classify_probabilities,
    classify_scores,
    evaluate_classifier,
)
from atencion.tasks.lm import evaluate_lm, generate_text, generate_to, lm_scores, prompt_ids, render, text_stream
from atencion.tasks.mlm import Masker, evaluate_mlm, fill_mask, mlm_scores
from atencion.train.checkpoint import save_checkpoint
from conftest import run_cli as run

LINES = ["the cat sat on the mat", "the dog ate the bone", "a bird sang in the tree", "my cat likes fish",
         "the sun is warm today", "we walk to the park"] * 3
SMALL = dict(n_layers=1, d_model=32, d_ff=64, n_heads=2, max_positions=64)


def save(path, preset, tokenizer, **overrides):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset(preset, vocab_size=tokenizer.vocab_size, **{**SMALL, **overrides}))
    save_checkpoint(path, model, tokenizer)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Model directories: GPTs on characters and on SentencePiece, BERTs (SentencePiece and
    characters, with <mask>), classifiers (an encoder and a decoder) with labels neg and pos, and a
    translator."""
    root = tmp_path_factory.mktemp("lm-models")
    char = Tokenizer.train_text([line + "\n" for line in LINES], "char")
    pieces = Tokenizer.train_text(LINES, "sentencepiece", vocab_size=60)
    masked = Tokenizer.train_text(LINES, "sentencepiece", vocab_size=60, symbols=(MASK,))
    masked_char = Tokenizer.train_text(LINES, "char", symbols=(MASK,))
    labels = dict(num_labels=2, labels=["neg", "pos"])
    return {"gpt": save(root / "gpt", "gpt-tiny", char), "gpt-sp": save(root / "gpt-sp", "gpt-tiny", pieces),
            "bert": save(root / "bert", "bert-tiny", masked), "bert-char": save(root / "bert-char", "bert-tiny",
                                                                                  masked_char),
            "classifier": save(root / "classifier", "bert-tiny", masked, **labels),
            "gpt-classifier": save(root / "gpt-classifier", "gpt-tiny", char, **labels),
            "translator": save(root / "translator", "tiny", pieces)}


@pytest.fixture(scope="module")
def loaded(models):
    return {name: load_model_dir(path) for name, path in models.items()}




# generate ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt", "gpt-sp"])
def test_a_seed_reproduces_the_samples_and_top_k_1_is_temperature_0(loaded, name):
    model, tokenizer = loaded[name]
    first = generate_text(model, tokenizer, "the cat", max_new_tokens=20, seed=5, num_samples=3)
    assert first == generate_text(model, tokenizer, "the cat", max_new_tokens=20, seed=5, num_samples=3)
    assert len(first) == 3 and len(set(first)) > 1
    assert generate_text(model, tokenizer, "the cat", max_new_tokens=20, top_k=1) == \
        generate_text(model, tokenizer, "the cat", max_new_tokens=20, temperature=0)


@pytest.mark.parametrize("name", ["gpt", "gpt-sp"])
def test_the_text_is_what_the_sampler_draws_and_streams_as_it_is_returned(loaded, name):
    model, tokenizer = loaded[name]
    ids = prompt_ids(tokenizer, "the dog")
    expected = generate_ids(model, torch.tensor([ids] * 2), 25, 0.8, 10, 0.9, torch.Generator().manual_seed(3))
    pieces = {0: [], 1: []}
    texts = generate_text(model, tokenizer, "the dog", SamplingConfig(25, 0.8, 10, 0.9, seed=3, num_samples=2),
                          on_text=lambda k, text: pieces[k].append(text))
    for k in range(2):
        whole = render(tokenizer, ids + expected[k].tolist())
        assert render(tokenizer, ids) + texts[k] == whole
        assert "".join(pieces[k]) == texts[k] and len(pieces[k]) > 1


def test_a_prompt_reads_like_the_training_stream_with_sentencepiece_line_breaks_as_eos(loaded):
    _, pieces = loaded["gpt-sp"]
    _, chars = loaded["gpt"]
    assert prompt_ids(pieces, "") == [EOS_ID] and prompt_ids(chars, "") == chars.encode("\n")
    assert prompt_ids(pieces, "the cat\nthe dog") == pieces.encode("the cat") + [EOS_ID] + pieces.encode("the dog")
    assert prompt_ids(pieces, "the cat\nthe dog") == text_stream(["the cat", "the dog"], pieces)[:-1]
    assert render(pieces, prompt_ids(pieces, "the cat\nthe dog\n")) == "the cat\nthe dog\n"


def test_generate_prints_the_prompt_and_its_continuation_as_the_library_samples_it(models, loaded, capsys):
    model, tokenizer = loaded["gpt"]
    status, out, err = run(["generate", "--model", models["gpt"], "--prompt", "the cat", "--seed", "7",
                            "--max-new-tokens", "30", "--top-p", "0.9"], capsys)
    assert status == 0 and err == ""
    assert out == "the cat" + generate_text(model, tokenizer, "the cat", max_new_tokens=30, top_p=0.9, seed=7)[0] + "\n"
    assert run(["generate", "--model", models["gpt"], "--prompt", "the cat", "--seed", "7", "--max-new-tokens",
                "30", "--top-p", "0.9"], capsys)[1] == out


def test_generate_with_input_gives_one_generation_per_line_under_headers(models, loaded, tmp_path, capsys):
    model, tokenizer = loaded["gpt-sp"]
    (tmp_path / "prompts.txt").write_text("the cat\n\nmy dog\n")
    status, out, _ = run(["generate", "--model", models["gpt-sp"], "--input", str(tmp_path / "prompts.txt"),
                          "--seed", "1", "--max-new-tokens", "8"], capsys)
    assert status == 0
    expected = "".join(f"--- line {n} ---\n{p}{generate_text(model, tokenizer, p, max_new_tokens=8, seed=1)[0]}\n"
                       for n, p in enumerate(["the cat", "", "my dog"], start=1))
    assert out == expected
    status, out, _ = run(["generate", "--model", models["gpt-sp"], "--prompt", "the", "--seed", "1",
                          "--max-new-tokens", "8", "--num-samples", "2"], capsys)
    texts = generate_text(model, tokenizer, "the", max_new_tokens=8, seed=1, num_samples=2)
    assert out == f"--- sample 1 ---\nthe{texts[0]}\n--- sample 2 ---\nthe{texts[1]}\n"


def test_generate_in_a_real_process_streams_to_a_pipe_and_ends_cleanly(models):
    done = subprocess.run([sys.executable, "-m", "atencion", "generate", "--model", models["gpt"], "--prompt", "a",
                           "--seed", "0", "--max-new-tokens", "12"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "" and done.stdout.startswith("a") and done.stdout.endswith("\n")


# fill-mask --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bert", "bert-char"])
def test_fill_mask_ranks_the_model_s_own_probabilities_at_each_mask(loaded, name):
    model, tokenizer = loaded[name]
    masks = fill_mask(model, tokenizer, f"the {MASK} sat on the {MASK}", top_k=4)
    parts = "the <mask> sat on the <mask>".split(MASK)
    ids = [BOS_ID, *tokenizer.encode(parts[0]), tokenizer.mask_id, *tokenizer.encode(parts[1]),
           tokenizer.mask_id, EOS_ID]
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    at = [i for i, t in enumerate(ids) if t == tokenizer.mask_id]
    assert len(masks) == 2
    for position, mask in zip(at, masks):
        probabilities = [p for _, p in mask]
        assert len(mask) == 4 and probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1
        best = int(logits[position].argmax())
        shown = tokenizer.piece(best).replace("▁", " ") if tokenizer.kind == "sentencepiece" else tokenizer.piece(best)
        assert mask[0][0] == shown
        assert mask[0][1] == pytest.approx(float(logits[position].softmax(-1).max()), abs=1e-6)


def test_fill_mask_prints_a_table_or_the_library_s_json(models, loaded, capsys):
    model, tokenizer = loaded["bert"]
    text = f"my {MASK} likes fish"
    status, out, _ = run(["fill-mask", "--model", models["bert"], "--text", text, "--json", "--top-k", "3"], capsys)
    assert status == 0
    expected = [[{"token": t, "probability": p} for t, p in mask] for mask in fill_mask(model, tokenizer, text, 3)]
    assert json.loads(out) == {"text": text, "masks": expected}
    status, out, _ = run(["fill-mask", "--model", models["bert"], "--text", text], capsys)
    lines = out.splitlines()
    assert status == 0 and lines[0] == "<mask> 1:" and len(lines) == 6
    assert lines[1].split(maxsplit=1)[1] == json.dumps(fill_mask(model, tokenizer, text)[0][0][0])


# classify ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["classifier", "gpt-classifier"])
def test_classify_gives_one_line_per_line_with_the_model_s_softmax(models, loaded, tmp_path, capsys, name):
    model, tokenizer = loaded[name]
    lines = ["the cat sat on the mat", "", "a bird sang in the tree and the dog ate the bone"]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    status, out, _ = run(["classify", "--model", models[name], "--input", str(tmp_path / "in.txt")], capsys)
    assert status == 0 and len(out.splitlines()) == 3
    for line, row in zip(lines, out.splitlines()):
        with torch.no_grad():
            probabilities = model.classify(torch.tensor([[BOS_ID, *tokenizer.encode(line), EOS_ID]]))[0].softmax(-1)
        label, p = row.split("\t")
        assert label == ["neg", "pos"][int(probabilities.argmax())] and float(p) == pytest.approx(
            float(probabilities.max()), abs=1e-4)
    status, out, _ = run(["classify", "--model", models[name], "--input", str(tmp_path / "in.txt"), "--json"],
                         capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    together = classify_probabilities(model, tokenizer, lines)
    assert [[r["probabilities"]["neg"], r["probabilities"]["pos"]] for r in rows] == together.tolist()
    assert [(r["label"], r["probability"]) for r in rows] == classify_lines(model, tokenizer, lines)


def test_classify_reads_stdin_and_replaces_bytes_that_are_not_utf8(models, loaded):
    done = subprocess.run([sys.executable, "-m", "atencion", "classify", "--model", models["classifier"]],
                          input=b"the cat\n\xe9 bad\n", capture_output=True, timeout=120)
    assert done.returncode == 0 and len(done.stdout.decode().splitlines()) == 2
    assert done.stderr.decode().count("\n") == 1 and "stdin line 2: not valid UTF-8" in done.stderr.decode()


def test_the_library_without_a_warn_callback_logs_replaced_bytes_instead_of_failing(models, tmp_path, caplog):
    (tmp_path / "in.txt").write_bytes(b"the cat\n\xe9 bad\n")
    out = io.StringIO()
    with caplog.at_level("WARNING"):
        generate_to(out, models["gpt-sp"], input=str(tmp_path / "in.txt"),
                    sampling=SamplingConfig(max_new_tokens=2, seed=0))
        labels = classify_file(models["classifier"], str(tmp_path / "in.txt"))
    assert out.getvalue().count("--- line ") == 2 and len(labels.splitlines()) == 2
    assert [r.getMessage() for r in caplog.records] == [f"{tmp_path / 'in.txt'} line 2: not valid UTF-8 (byte 0xe9 "
                                                        f"at column 1); each bad byte was replaced with U+FFFD"] * 2


# evaluate ---------------------------------------------------------------------------------------


def test_evaluate_an_lm_reports_what_lm_scores_computes(models, loaded, tmp_path, capsys):
    model, tokenizer = loaded["gpt"]
    (tmp_path / "test.txt").write_text("\n".join(LINES[:5]) + "\n")
    status, out, _ = run(["evaluate", "--model", models["gpt"], "--text", str(tmp_path / "test.txt"),
                          "--block-size", "16"], capsys)
    result = json.loads(out)
    stream = torch.tensor(text_stream(LINES[:5], tokenizer))
    with torch.no_grad():
        expected = lm_scores(model, stream, 16, 4096 // 16, "cpu")
    assert status == 0 and result["task"] == "lm"
    for key in ("loss", "ppl", "bpc", "tokens", "block_size"):
        assert result[key] == pytest.approx(expected[key], rel=1e-6), key
    assert evaluate_lm(model, tokenizer, LINES[:5])["block_size"] == 64  # max_positions by default


def test_evaluate_an_mlm_reports_mlm_scores_and_the_most_frequent_token_baseline(models, loaded, tmp_path, capsys):
    model, tokenizer = loaded["bert"]
    (tmp_path / "test.txt").write_text("\n".join(LINES) + "\n\n")
    status, out, _ = run(["evaluate", "--model", models["bert"], "--text", str(tmp_path / "test.txt")], capsys)
    result = json.loads(out)
    examples = [[BOS_ID, *tokenizer.encode(line), EOS_ID] for line in LINES]
    masker = Masker(tokenizer)
    with torch.no_grad():
        expected = mlm_scores(model, masker, examples, 4096, "cpu", seed=0)
    assert status == 0 and result["task"] == "mlm" and result["sentences"] == len(LINES)
    for key in ("loss", "ppl", "accuracy", "masked"):
        assert result[key] == pytest.approx(expected[key], rel=1e-6), key
    generator, gold = torch.Generator().manual_seed(0), []
    for group in token_batches([(len(e), 0) for e in examples], 4096, seed=None):
        _, targets = masker([examples[i] for i in group], generator)
        gold += targets[targets != PAD_ID].tolist()
    counts = torch.bincount(torch.tensor([i for e in examples for i in e[1:-1]]))
    assert len(gold) == result["masked"]
    assert result["most_frequent_token_accuracy"] == sum(g == int(counts.argmax()) for g in gold) / len(gold)
    assert evaluate_mlm(model, tokenizer, LINES + [""]) == {k: v for k, v in result.items()
                                                           if k not in ("task", "model", "int8", "batch_tokens",
                                                                        "text")}


def test_evaluate_a_classifier_reports_accuracy_loss_and_the_confusion_matrix(models, loaded, tmp_path, capsys):
    model, tokenizer = loaded["classifier"]
    (tmp_path / "dev.tsv").write_text("label\tsentence\npos\tthe cat sat\nneg\tthe dog ate\npos\tmy cat likes fish\n")
    status, out, _ = run(["evaluate", "--model", models["classifier"], "--tsv", str(tmp_path / "dev.tsv")], capsys)
    result = json.loads(out)
    rows, _, _ = read_labelled(str(tmp_path / "dev.tsv"), ["neg", "pos"])
    with torch.no_grad():
        expected = classify_scores(model, [[BOS_ID, *tokenizer.encode(t), EOS_ID] for _, t in rows],
                                   [label for label, _ in rows], 4096, "cpu")
    assert status == 0 and result["task"] == "classify" and result["labels"] == ["neg", "pos"]
    assert result["confusion"] == expected["confusion"] and sum(map(sum, result["confusion"])) == 3
    assert result["accuracy"] == expected["accuracy"] and result["loss"] == pytest.approx(expected["loss"])
    assert evaluate_classifier(model, tokenizer, rows)["confusion"] == expected["confusion"]


def test_each_model_dir_says_its_task(loaded):
    tasks = {name: model_task(model.cfg) for name, (model, _) in loaded.items()}
    assert tasks == {"gpt": "lm", "gpt-sp": "lm", "bert": "mlm", "bert-char": "mlm", "classifier": "classify",
                     "gpt-classifier": "classify", "translator": "translate"}


# bad input: one line, exit 2 --------------------------------------------------------------------


def bad_cases():
    """(command line with placeholders for model dirs and files, what the one stderr line must say)."""
    return [
        ("generate --model BERT --prompt the", "generate needs a decoder-only model"),
        ("generate --model GPT --top-p 0", "argument --top-p"),
        ("generate --model GPT --top-p 1.5", "argument --top-p"),
        ("generate --model GPT --temperature -1", "argument --temperature"),
        ("generate --model GPT --top-k -2", "argument --top-k"),
        ("generate --model GPT --prompt the --input PROMPTS", "not allowed with argument"),
        ("generate --model GPT --prompt LONG --max-new-tokens 10", "--prompt: 80 tokens, but this model's learned "
                                                                   "positions stop at max_positions=64"),
        ("fill-mask --model GPT --text the_<mask>", "fill-mask needs an encoder"),
        ("fill-mask --model BERT --text no_mask_here", "--text: no <mask> in the text"),
        ("fill-mask --model BERT --top-k 0 --text <mask>", "argument --top-k"),
        ("classify --model BERT --input PROMPTS", "classify needs a model with a classification head"),
        ("classify --model CLASSIFIER --input PROMPTS --max-input-tokens 3", "prompts.txt line 2: 4 tokens, more "
                                                                             "than the limit of 3"),
        ("evaluate --model CLASSIFIER --tsv NO_TAB", "line 2: expected label<TAB>text, found no tab"),
        ("evaluate --model CLASSIFIER --tsv UNSEEN", "line 3: label 'maybe' was not seen in training"),
        ("evaluate --model CLASSIFIER --tsv HEADED --max-input-tokens 3", "headed.tsv line 3: 9 tokens, more than"),
        ("evaluate --model GPT --text PROMPTS --src PROMPTS", "--src is for a translator"),
        ("evaluate --model GPT --tsv PROMPTS", "--tsv is for a classifier"),
        ("evaluate --model BERT --text PROMPTS --block-size 8", "--block-size is for a language model"),
        ("evaluate --model GPT", "is a language model (arch decoder): give --text F"),
        ("evaluate --model GPT --text PROMPTS --block-size 65", "--block-size 65: more than this model's learned"),
        ("evaluate --model TRANSLATOR --text PROMPTS", "--text is for a language model"),
        ("evaluate --model TRANSLATOR --src PROMPTS", "is a translator (arch encoder-decoder): give --src F --ref F"),
        ("generate --model TRANSLATOR", "this model is a translator (arch encoder-decoder): use translate"),
    ]


@pytest.mark.parametrize("command, message", bad_cases(), ids=[c[0] for c in bad_cases()])
def test_bad_input_is_one_line_naming_it_and_exit_2(models, tmp_path, capsys, command, message):
    (tmp_path / "prompts.txt").write_text("a cat\nthe dog\n")
    (tmp_path / "no-tab.tsv").write_text("pos\tthe cat\nneg the dog\n")
    (tmp_path / "unseen.tsv").write_text("pos\tthe cat\nneg\tthe dog\nmaybe\tthe bird\n")
    (tmp_path / "headed.tsv").write_text("label\tsentence\npos\tthe cat\nneg\tthe cat sat on the mat\n")
    places = {"GPT": models["gpt"], "BERT": models["bert"], "CLASSIFIER": models["classifier"],
              "TRANSLATOR": models["translator"], "PROMPTS": str(tmp_path / "prompts.txt"),
              "NO_TAB": str(tmp_path / "no-tab.tsv"), "UNSEEN": str(tmp_path / "unseen.tsv"),
              "HEADED": str(tmp_path / "headed.tsv"), "LONG": "ab" * 40}
    argv = [places.get(word, word.replace("_", " ")) for word in command.split()]
    status, out, err = run(argv, capsys)
    assert status == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and "Traceback" not in err and message in err, err


# text the model cannot read: not UTF-8, no token, characters a character vocabulary lacks --------


NOT_UTF8 = b"\xff ok".decode("utf-8", "surrogateescape")  # what sys.argv holds for $'\xff ok'


@pytest.mark.parametrize("command, option", [
    ("generate --model GPT --prompt TEXT", "--prompt"),
    ("generate --model GPT_SP --prompt TEXT", "--prompt"),
    ("fill-mask --model BERT --text TEXT", "--text"),
    ("fill-mask --model BERT_CHAR --text TEXT", "--text"),
    ("attention --model GPT --text TEXT --out OUT", "--text"),
    ("attention --model GPT_SP --text TEXT --out OUT", "--text"),
    ("attention --model BERT_CHAR --text TEXT --out OUT", "--text"),
    ("attention --model TRANSLATOR --src TEXT --out OUT", "--src"),
    ("attention --model TRANSLATOR --src the_cat --tgt TEXT --out OUT", "--tgt"),
])
def test_a_text_argument_that_is_not_utf8_is_one_line_naming_it_and_nothing_is_written(models, tmp_path, capsys,
                                                                                        command, option):
    places = {"GPT": models["gpt"], "GPT_SP": models["gpt-sp"], "BERT": models["bert"],
              "BERT_CHAR": models["bert-char"], "TRANSLATOR": models["translator"],
              "TEXT": f"{NOT_UTF8} {MASK}", "OUT": str(tmp_path / "maps")}
    status, out, err = run([places.get(word, word.replace("_", " ")) for word in command.split()], capsys)
    assert status == 2 and out == "", (out, err)
    assert err == (f"atencion {command.split()[0]}: error: {option}: not valid UTF-8 (byte 0xff at character 1); "
                   f"give the text in UTF-8\n")
    assert not (tmp_path / "maps").exists()


def test_the_library_refuses_text_that_is_not_unicode_naming_where_it_came_from(loaded):
    with pytest.raises(AtencionError, match=r"^--prompt: not valid UTF-8 \(byte 0xff at character 1\)"):
        generate_text(*loaded["gpt"], NOT_UTF8, max_new_tokens=3)
    with pytest.raises(AtencionError, match=r"^--text: not valid Unicode \(a lone surrogate U\+D800 at character 5\)"):
        fill_mask(*loaded["bert"], f"the \ud800 {MASK}")
    with pytest.raises(AtencionError, match=r"^--input line 2: not valid UTF-8 \(byte 0xff at character 1\)"):
        classify_probabilities(*loaded["classifier"], ["the cat", NOT_UTF8])


def test_a_temperature_that_is_0_in_float32_is_greedy_and_such_a_top_p_is_refused_naming_it(models, loaded, capsys):
    model, tokenizer = loaded["gpt"]
    base = ["generate", "--model", models["gpt"], "--prompt", "the", "--max-new-tokens", "12", "--seed", "3"]
    greedy = run(base + ["--temperature", "0"], capsys)
    assert greedy[0] == 0
    for temperature in ("1e-300", "1e-46"):
        assert run(base + ["--temperature", temperature], capsys) == greedy
        assert generate_text(model, tokenizer, "the", max_new_tokens=12, temperature=float(temperature)) == \
            generate_text(model, tokenizer, "the", max_new_tokens=12, temperature=0.0)
    for top_p in ("1e-50", "1e-300"):
        status, out, err = run(base + ["--top-p", top_p], capsys)
        assert status == 2 and out == "", (out, err)
        assert err == (f"atencion generate: error: --top-p must be in (0, 1], got {float(top_p)!r}, which is 0 in "
                       f"float32 (the precision the sampler computes in)\n")
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(choose_next(logits, 1e-300), logits.argmax(-1))
    with pytest.raises(AtencionError, match=r"^--top-p must be in \(0, 1\], got 1e-50"):
        check_sampling(1.0, 0, 1e-50)
    check_sampling(1e-300, 0, 1.0)


def test_a_prompt_that_encodes_to_no_token_says_so_before_anything_is_written(models, loaded, tmp_path, capsys):
    status, out, err = run(["generate", "--model", models["gpt-sp"], "--prompt", "\u200b "], capsys)
    assert status == 2 and out == "", (out, err)
    assert err == ("atencion generate: error: --prompt: encodes to no token: this tokenizer drops each of its "
                   "characters ('\\u200b', ' '); give text it reads (an empty prompt starts a new line)\n")
    (tmp_path / "prompts.txt").write_text("the cat\n\ufeff\n", encoding="utf-8")
    status, out, err = run(["generate", "--model", models["gpt-sp"], "--input", str(tmp_path / "prompts.txt")],
                           capsys)
    assert status == 2 and out == "" and err.startswith("atencion generate: error: --input line 2: encodes to no "
                                                        "token: "), (out, err)
    with pytest.raises(AtencionError, match="^--prompt: encodes to no token"):
        generate_text(*loaded["gpt-sp"], "\ufeff", max_new_tokens=3)


def test_evaluate_tsv_names_the_file_line_of_a_row_past_the_header_and_the_rows_left_out(models, tmp_path, capsys):
    path = tmp_path / "dev.tsv"
    path.write_text("label\tsentence\npos\tthe cat\nneg\t\npos\tthe cat sat on the mat\n")
    status, out, err = run(["evaluate", "--model", models["classifier"], "--tsv", str(path), "--max-input-tokens",
                            "3"], capsys)
    assert status == 2 and out == "", (out, err)
    assert err.splitlines()[0] == f"atencion evaluate: warning: {path}: left out 1 rows with an empty text"
    assert err.splitlines()[1].startswith(f"atencion evaluate: error: --tsv {path} line 4: ")
    assert len(err.splitlines()) == 2 and "more than the limit of 3" in err


def test_evaluate_an_mlm_leaves_out_and_counts_lines_that_encode_to_no_token(models, loaded, tmp_path, capsys):
    model, tokenizer = loaded["bert"]
    path = tmp_path / "test.txt"
    path.write_text("\n".join(LINES[:4] + ["\ufeff", LINES[4], "\u200b", ""]) + "\n", encoding="utf-8")
    status, out, err = run(["evaluate", "--model", models["bert"], "--text", str(path)], capsys)
    assert status == 0, err
    assert err == f"atencion evaluate: warning: {path}: left out 2 lines with no token to mask: lines 5, 7\n"
    result = json.loads(out)
    expected = evaluate_mlm(model, tokenizer, LINES[:5])
    assert result["no_token_lines"] == 2 and expected["no_token_lines"] == 0
    assert {k: result[k] for k in expected if k != "no_token_lines"} == \
        {k: v for k, v in expected.items() if k != "no_token_lines"}
    (tmp_path / "none.txt").write_text("\ufeff\n\n\u200b\n", encoding="utf-8")
    status, out, err = run(["evaluate", "--model", models["bert"], "--text", str(tmp_path / "none.txt")], capsys)
    assert status == 2 and out == "", (out, err)
    assert err == (f"atencion evaluate: error: {tmp_path / 'none.txt'}: no sentence; every line is empty or "
                   f"has no token to mask\n")


UNSEEN = "'ß', '€'"


@pytest.mark.parametrize("command, warning", [
    ("generate --model GPT --prompt the_ß€_cat --max-new-tokens 2", f"--prompt: 2 characters not in the "
                                                                    f"vocabulary, read as <unk>: {UNSEEN}"),
    ("generate --model GPT --input TEXT --max-new-tokens 2 --num-samples 2",
     f"TEXT: 2 characters not in the vocabulary, read as <unk>: {UNSEEN} (first on line 2)"),
    ("fill-mask --model BERT_CHAR --text ß_<mask>_€", f"--text: 2 characters not in the vocabulary, read as <unk>: "
                                                      f"{UNSEEN}"),
    ("classify --model GPT_CLASSIFIER --input TEXT", f"TEXT: 2 characters not in the vocabulary, read as <unk>: "
                                                     f"{UNSEEN} (first on line 2)"),
    ("evaluate --model GPT --text TEXT", f"TEXT: 2 characters not in the vocabulary, read as <unk>: {UNSEEN} "
                                         f"(first on line 2)"),
    ("evaluate --model BERT_CHAR --text TEXT", f"TEXT: 2 characters not in the vocabulary, read as <unk>: {UNSEEN} "
                                               f"(first on line 2)"),
    ("evaluate --model GPT_CLASSIFIER --tsv TSV", f"--tsv TSV: 2 characters not in the vocabulary, read as <unk>: "
                                                  f"{UNSEEN} (first on line 3)"),
])
def test_a_character_model_warns_once_of_characters_not_in_its_vocabulary(models, tmp_path, capsys, command,
                                                                           warning):
    (tmp_path / "text.txt").write_text("the cat sat\nthe ß sat\nmy € and ß\n", encoding="utf-8")
    (tmp_path / "dev.tsv").write_text("label\ttext\npos\tthe cat\nneg\tthe ß\npos\tmy € and ß\n", encoding="utf-8")
    places = {"GPT": models["gpt"], "BERT_CHAR": models["bert-char"], "GPT_CLASSIFIER": models["gpt-classifier"],
              "TEXT": str(tmp_path / "text.txt"), "TSV": str(tmp_path / "dev.tsv")}
    status, out, err = run([places.get(word, word.replace("_", " ")) for word in command.split()], capsys)
    assert status == 0 and out, err
    warning = warning.replace("TEXT", places["TEXT"]).replace("TSV", places["TSV"])
    assert err == f"atencion {command.split()[0]}: warning: {warning}\n"


def test_the_library_logs_characters_a_character_vocabulary_lacks_once(loaded, caplog):
    with caplog.at_level("WARNING"):
        generate_text(*loaded["gpt"], "ß ok €", max_new_tokens=3, num_samples=2)
        fill_mask(*loaded["bert-char"], f"ß {MASK}")
        classify_lines(*loaded["gpt-classifier"], ["ok", "€ ß", "ß"])
    assert [r.getMessage() for r in caplog.records] == [
        f"--prompt: 2 characters not in the vocabulary, read as <unk>: {UNSEEN}",
        "--text: 1 character not in the vocabulary, read as <unk>: 'ß'",
        "--input: 2 characters not in the vocabulary, read as <unk>: '€', 'ß' (first on line 2)"]
    caplog.clear()
    with caplog.at_level("WARNING"):
        generate_text(*loaded["gpt-sp"], "ß ok €", max_new_tokens=3)  # SentencePiece: not a character vocabulary
    assert caplog.records == []


# the server -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(loaded, models):
    served = [LoadedModel(name, models[name], *loaded[name]) for name in ("gpt-sp", "bert", "classifier")]
    with TestClient(create_app(served, ServeSettings(max_new_tokens=40, max_samples=4, max_tokens=30))) as c:
        yield c


def test_the_server_answers_what_the_library_computes(client, loaded):
    r = client.post("/generate", json={"model": "gpt-sp", "prompt": "the cat", "max_new_tokens": 12, "seed": 4,
                                       "num_samples": 2, "temperature": 0.7, "top_p": 0.95})
    assert r.status_code == 200, r.text
    assert r.json()["texts"] == generate_text(*loaded["gpt-sp"], "the cat", SamplingConfig(12, 0.7, 0, 0.95, 4, 2))
    r = client.post("/fill-mask", json={"model": "bert", "text": f"the {MASK} sat", "top_k": 3})
    assert r.status_code == 200, r.text
    assert r.json()["masks"] == [[{"token": t, "probability": p} for t, p in mask]
                                 for mask in fill_mask(*loaded["bert"], f"the {MASK} sat", 3)]
    texts = ["the cat sat", "", "my dog"]
    r = client.post("/classify", json={"model": "classifier", "texts": texts})
    assert r.status_code == 200, r.text
    expected = classify_probabilities(*loaded["classifier"], texts).tolist()
    assert [[p["probabilities"]["neg"], p["probabilities"]["pos"]] for p in r.json()["predictions"]] == expected
    assert [(p["label"], p["probability"]) for p in r.json()["predictions"]] == \
        classify_lines(*loaded["classifier"], texts)


def test_info_tells_each_model_s_task_and_endpoints(client):
    models = {m["name"]: m for m in client.get("/info").json()["models"]}
    assert [(m["arch"], m["task"], m["endpoints"]) for m in models.values()] == [
        ("decoder", "lm", ["/generate", "/attention"]), ("encoder", "mlm", ["/fill-mask", "/attention"]),
        ("encoder", "classify", ["/classify", "/fill-mask", "/attention"])]
    assert models["classifier"]["labels"] == ["neg", "pos"] and models["gpt-sp"]["decoding"]["max_new_tokens"] == 40
    assert 'atencion_queue_depth{model="gpt-sp"} 0.0' in client.get("/metrics").text


def test_a_worker_runs_one_request_at_a_time_refuses_past_its_queue_and_times_out():
    async def scenario():
        worker, started, gate = Worker(max_queue=1), threading.Event(), threading.Event()

        def slow():
            started.set()
            return gate.wait(10) and "done"

        first = asyncio.create_task(worker.run(slow, 10))
        assert await asyncio.to_thread(started.wait, 10)  # it runs on the worker's thread
        assert len(worker) == 1
        with pytest.raises(QueueFull):
            await worker.run(lambda: "second", 10)
        gate.set()
        assert await first == "done" and len(worker) == 0
        with pytest.raises(asyncio.TimeoutError):
            await worker.run(lambda: time.sleep(0.5), 0.05)
        worker.stop()

    asyncio.run(scenario())


BAD_REQUESTS = [
    ("generate", {"model": "bert", "prompt": "the"}, 400, "/generate needs a decoder-only model"),
    ("fill-mask", {"model": "gpt-sp", "text": "the <mask>"}, 400, "/fill-mask needs an encoder"),
    ("classify", {"model": "bert", "texts": ["the"]}, 400, "/classify needs a model with a classification head"),
    ("translate", {"model": "bert", "sentences": []}, 400, "/translate needs a translator"),  # the model first
    ("translate", {"model": "nope", "sentences": []}, 404, "no model named 'nope'"),
    ("generate", {"model": "gpt-sp", "max_new_tokens": 41}, 422, "max_new_tokens: 41 is more than the limit of 40"),
    ("generate", {"model": "gpt-sp", "num_samples": 5}, 422, "num_samples: 5 is more than the limit of 4"),
    ("generate", {"model": "gpt-sp", "top_p": 0}, 422, "top_p"),
    ("generate", {"model": "gpt-sp", "temperature": -1}, 422, "temperature"),
    ("generate", {"model": "gpt-sp", "prompt": "the cat " * 30}, 422, "prompt: 60 subword pieces, more than"),
    ("generate", {"model": "gpt-sp", "seed": "1"}, 422, "seed"),
    ("fill-mask", {"model": "bert", "text": "no mask"}, 422, "text: no <mask> in the text"),
    ("fill-mask", {"model": "bert"}, 422, "text: required field missing"),
    ("classify", {"model": "classifier", "texts": []}, 422, "texts"),
    ("classify", {"model": "classifier", "texts": ["the cat " * 30]}, 422, "texts.0: "),
    ("classify", {"model": "classifier", "texts": ["a"] * 65}, 422, "more than the limit of 64"),
]


@pytest.mark.parametrize("endpoint, body, status, message", BAD_REQUESTS,
                         ids=[f"{e} {json.dumps(b)[:40]}" for e, b, _, _ in BAD_REQUESTS])
def test_a_bad_request_is_a_4xx_naming_the_field(client, endpoint, body, status, message):
    r = client.post(f"/{endpoint}", json=body)
    assert r.status_code == status and message in r.json()["error"], r.text


@pytest.fixture(scope="module")
def every_kind(loaded, models):
    """A server with a model of every kind: GPTs on characters and SentencePiece, a BERT, a
    classifier and a translator."""
    served = [LoadedModel(name, models[name], *loaded[name])
              for name in ("gpt", "gpt-sp", "bert", "classifier", "translator")]
    with TestClient(create_app(served, ServeSettings(max_new_tokens=40, max_samples=4, max_tokens=30))) as c:
        yield c


GOOD = {"translate": {"model": "translator", "sentences": ["the cat"], "beam": 1, "max_len_b": 5},
        "generate": {"model": "gpt", "prompt": "the", "max_new_tokens": 3},
        "fill-mask": {"model": "bert", "text": "the <mask>"},
        "classify": {"model": "classifier", "texts": ["the cat"]}}

NOT_UNICODE = [  # bodies as JSON text: "\\ud83d" is valid JSON for a lone surrogate, which no UTF-8 can carry
    ("translate", r'{"model": "translator", "sentences": ["the cat", "the \ud83d cat"]}',
     "sentences.1: not valid Unicode (a lone surrogate at character 5)"),
    ("generate", r'{"model": "gpt", "prompt": "the \ud83d", "max_new_tokens": 3}',
     "prompt: not valid Unicode (a lone surrogate at character 5)"),
    ("generate", r'{"model": "gpt-sp", "prompt": "\ude00the"}', "prompt: not valid Unicode (a lone surrogate at "
                                                                "character 1)"),
    ("fill-mask", r'{"model": "bert", "text": "the <mask> \udfff"}',
     "text: not valid Unicode (a lone surrogate at character 12)"),
    ("classify", r'{"model": "classifier", "texts": ["fine", "x\ud800"]}',
     "texts.1: not valid Unicode (a lone surrogate at character 2)"),
    ("classify", r'{"model": "classifier\ud800", "texts": ["fine"]}',
     "model: not valid Unicode (a lone surrogate at character 11)"),
    ("translate", r'{"model": "translator", "sentences": ["the cat"], "\ud83d": 1}',
     r"body: the field name '\ud83d' is not valid Unicode (a lone surrogate at character 1)"),
]


@pytest.mark.parametrize("endpoint, body, message", NOT_UNICODE, ids=[f"{e} {b[:40]}" for e, b, _ in NOT_UNICODE])
def test_text_that_is_not_valid_unicode_is_422_naming_the_field_before_any_work(every_kind, monkeypatch, endpoint,
                                                                                body, message):
    from atencion.serve import app as served
    from atencion.tasks import classify, lm, mlm

    calls = []

    def spy(name, original):
        def called(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        return called

    for module, name in ((lm, "generate_text"), (mlm, "fill_mask"), (classify, "classify_probabilities")):
        monkeypatch.setattr(module, name, spy(name, getattr(module, name)))  # the endpoints' work, in their tasks
    monkeypatch.setattr(served.Batcher, "submit", spy("submit", served.Batcher.submit))
    r = every_kind.post(f"/{endpoint}", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json() == {"error": message}, r.text
    assert calls == []  # refused before any work
    good = every_kind.post(f"/{endpoint}", json=GOOD[endpoint])
    assert good.status_code == 200 and calls, good.text  # and the next request is answered


@pytest.mark.parametrize("value", [1e-300, 1e-50])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_temperature_or_top_p_that_float32_reads_as_0_is_422_naming_it_never_500(every_kind, field, value):
    r = every_kind.post("/generate", json={"model": "gpt", "max_new_tokens": 3, "seed": 1, field: value})
    assert r.status_code == 422 and r.json()["error"] == (
        f"{field}: {value!r} is too small for float32, where sampling runs; give "
        + ("0 for greedy decoding or " if field == "temperature" else "") + "at least 1e-30"), r.text


@pytest.mark.parametrize("name", ["gpt", "gpt-sp"])
def test_the_smallest_temperature_and_top_p_the_server_takes_sample_the_greedy_text(every_kind, name):
    def texts(**sampling):
        r = every_kind.post("/generate", json={"model": name, "prompt": "the", "max_new_tokens": 8, "seed": 3,
                                               "num_samples": 2, **sampling})
        assert r.status_code == 200, r.text
        return r.json()["texts"]

    greedy = texts(temperature=0)
    assert texts(temperature=1e-30) == greedy and texts(top_p=1e-30) == greedy


UNPROCESSABLE = [  # (endpoint, body): each a 422 whose message starts with the field it names
    ("generate", {"model": "gpt-sp", "prompt": " "}),  # no tokens at all: SentencePiece drops the space
    ("generate", {"model": "gpt-sp", "prompt": "   \t "}),
    ("generate", {"model": "gpt", "prompt": "ab" * 40, "max_new_tokens": 10}),  # past the learned positions
    ("generate", {"model": "gpt-sp", "prompt": "the cat " * 30}),
    ("generate", {"model": "gpt", "prompt": "a" * 5000}),
    ("generate", {"model": "gpt", "max_new_tokens": 0}), ("generate", {"model": "gpt", "max_new_tokens": 41}),
    ("generate", {"model": "gpt", "num_samples": 0}), ("generate", {"model": "gpt", "num_samples": 5}),
    ("generate", {"model": "gpt", "top_k": -1}), ("generate", {"model": "gpt", "top_p": 0}),
    ("generate", {"model": "gpt", "top_p": 1.5}), ("generate", {"model": "gpt", "top_p": 1e-50}),
    ("generate", {"model": "gpt", "temperature": -1}), ("generate", {"model": "gpt", "temperature": 101}),
    ("generate", {"model": "gpt", "temperature": 1e-300}), ("generate", {"model": "gpt", "temperature": "1"}),
    ("generate", {"model": "gpt", "seed": -1}), ("generate", {"model": "gpt", "prompt": None}),
    ("fill-mask", {"model": "bert", "text": "no mask"}), ("fill-mask", {"model": "bert", "text": "a <mask>",
                                                                         "top_k": 0}),
    ("fill-mask", {"model": "bert", "text": "a " * 40 + MASK}), ("fill-mask", {"model": "bert", "text": MASK * 40}),
    ("fill-mask", {"model": "bert", "text": "a" * 5000 + MASK}), ("fill-mask", {"model": "bert"}),
    ("classify", {"model": "classifier", "texts": []}), ("classify", {"model": "classifier", "texts": [1]}),
    ("classify", {"model": "classifier", "texts": ["a " * 40]}),
    ("classify", {"model": "classifier", "texts": ["a"] * 65}),
    ("classify", {"model": "classifier", "texts": ["fine", "b" * 5000]}),
    ("translate", {"model": "translator", "sentences": [" "]}),
    ("translate", {"model": "translator", "sentences": ["a " * 40]}),
    ("translate", {"model": "translator", "sentences": ["the"], "beam": 0}),
    ("translate", {"model": "translator", "sentences": ["the"], "beam": 2, "nbest": 3}),
    ("translate", {"model": "translator", "sentences": ["the"], "max_len_b": 5000}),
]


@pytest.mark.parametrize("endpoint, body", UNPROCESSABLE, ids=[f"{e} {json.dumps(b)[:50]}" for e, b in UNPROCESSABLE])
def test_the_server_s_422_names_its_own_field_never_a_command_line_option(every_kind, endpoint, body):
    from atencion.serve.app import model_endpoints

    schema = next(e.schema for e in model_endpoints() if e.name == endpoint)
    r = every_kind.post(f"/{endpoint}", json=body)
    error = r.json()["error"]
    assert r.status_code == 422 and "--" not in error, r.text
    assert error.split(":")[0].split(".")[0] in schema.model_fields, r.text


@pytest.mark.parametrize("endpoint, field", [("generate", "temperature"), ("generate", "top_p"),
                                             ("translate", "alpha"), ("translate", "max_len_a"),
                                             ("translate", "beam")])
def test_nan_is_422_saying_it_is_not_a_number(every_kind, endpoint, field):
    body = {"model": "translator", "sentences": ["the"]} if endpoint == "translate" else {"model": "gpt"}
    r = every_kind.post(f"/{endpoint}", content=json.dumps({**body, field: float("nan")}),
                        headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json() == {"error": f"{field}: NaN is not a number"}, r.text
