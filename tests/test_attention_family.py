"""`atencion attention` on single-stack models: a GPT's causal and a BERT's bidirectional
self-attention, shown and exported exactly as the model computes it, with readable labels;
alignment options refused; the length limit over the whole sequence."""

import json
import re

import numpy as np
import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.cli import main
from atencion.data.tokenizer import Tokenizer
from atencion.demo import grammar
from atencion.train.checkpoint import save_checkpoint
from atencion.viz.attention import AttentionMap, capture_self_attention, token_label
from atencion.viz.plots import grid_figure

SHAKESPEARE = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
PROMPT = "First Ci\nhe"                  # 11 characters, a space and a newline among them
PROMPT_LABELS = ["F", "i", "r", "s", "t", "␣", "C", "i", "⏎", "h", "e"]
NEW = 5
SENTENCE = "the black cat eats the mouse"


def tiny(preset: str, vocab_size: int) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig.preset(preset, vocab_size=vocab_size, n_layers=2, d_model=32, d_ff=64, n_heads=2,
                             max_positions=64)
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def gpt_dir(tmp_path_factory):
    """A random character-level GPT (nanoGPT's Shakespeare setting, shrunk)."""
    tokenizer = Tokenizer.train_text([SHAKESPEARE], "char")
    path = tmp_path_factory.mktemp("gpt") / "model"
    save_checkpoint(path, tiny("gpt-tiny", tokenizer.vocab_size), tokenizer)
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A random BERT with a 60-piece SentencePiece vocabulary (words split into several pieces)."""
    tokenizer = Tokenizer.train_text([p.tgt for p in grammar.generate(300, seed=3)], vocab_size=60,
                                     symbols=("<mask>",))
    path = tmp_path_factory.mktemp("bert") / "model"
    save_checkpoint(path, tiny("bert-tiny", tokenizer.vocab_size), tokenizer)
    return path


@pytest.fixture(scope="module")
def gpt_out(gpt_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt-maps")
    assert main(["attention", "--model", str(gpt_dir), "--text", PROMPT, "--max-new-tokens", str(NEW),
                 "--out", str(out)]) == 0
    return out


def load(path):
    model = Transformer.load(path).eval()
    return model, Tokenizer.load(path)


def greedy_ids(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by full forward passes (no cache): the argmax of the last position, n times."""
    with torch.no_grad():
        for _ in range(n):
            ids = ids + [int(model(torch.tensor([ids]))[0, -1].argmax())]
    return ids


def model_attention(model, ids: list[int], kind: str) -> np.ndarray:
    with torch.no_grad():
        _, attn = model(torch.tensor([ids]), return_attention=True)
    return torch.stack(attn[kind])[:, 0].numpy()


def bertviz(out):
    return json.loads((out / "bertviz.json").read_text(encoding="utf-8"))


def page_data(out):
    page = (out / "attention.html").read_text(encoding="utf-8")
    return page, json.loads(re.search(r"const DATA = (.*);\n", page).group(1))


def test_a_gpt_map_is_causal_and_its_rows_sum_to_one(gpt_dir):
    model, tokenizer = load(gpt_dir)
    amap = capture_self_attention(model, tokenizer, PROMPT, NEW).self_attention
    n = len(PROMPT) + NEW
    assert amap.kind == "decoder" and amap.weights.shape == (2, 2, n, n)
    above = np.triu_indices(n, 1)
    assert np.all(amap.weights[..., above[0], above[1]] == 0)
    np.testing.assert_allclose(amap.weights.sum(-1), 1.0, atol=1e-5)
    assert np.all(amap.weights[..., 1:, 0] < 1)       # not trivially attending to the first token only


def test_the_gpt_weights_exported_and_drawn_are_the_model_s_own(gpt_dir, gpt_out):
    model, tokenizer = load(gpt_dir)
    ids = greedy_ids(model, tokenizer.encode(PROMPT), NEW)
    expected = model_attention(model, ids, "decoder")
    exported = np.array(bertviz(gpt_out)["decoder_attention"])[:, 0]
    np.testing.assert_allclose(exported, expected, atol=1e-6)
    _, data = page_data(gpt_out)
    np.testing.assert_allclose(np.array(data["maps"]["decoder"]["weights"]), expected, atol=5e-5)
    amap = capture_self_attention(model, tokenizer, PROMPT, NEW).self_attention
    grid = grid_figure(amap)
    for k, ax in enumerate(grid.axes[:-1]):                  # layers × heads, then the colour bar
        np.testing.assert_allclose(ax.images[0].get_array(), expected[k // 2, k % 2], atol=1e-6)
    assert [t.get_text() for t in grid.axes[2].get_yticklabels()] == amap.rows


def test_the_bertviz_json_of_a_gpt_holds_the_text_and_the_generated_tokens_one_entry_per_layer(gpt_dir, gpt_out):
    model, tokenizer = load(gpt_dir)
    d = bertviz(gpt_out)
    assert set(d) == {"decoder_attention", "decoder_tokens"}
    ids = greedy_ids(model, tokenizer.encode(PROMPT), NEW)
    n = len(PROMPT) + NEW
    assert len(d["decoder_tokens"]) == n and d["decoder_tokens"][:len(PROMPT)] == PROMPT_LABELS
    assert d["decoder_tokens"][len(PROMPT):] == [token_label(tokenizer, i) for i in ids[len(PROMPT):]]
    assert len(d["decoder_attention"]) == 2
    assert all(np.array(layer).shape == (1, 2, n, n) for layer in d["decoder_attention"])
    assert sorted(p.name for p in gpt_out.iterdir()) == ["attention.html", "bertviz.json", "decoder.png",
                                                         "decoder_mean.png"]


def test_the_html_page_shows_the_text_the_generated_text_and_every_token(gpt_dir, gpt_out):
    model, tokenizer = load(gpt_dir)
    page, data = page_data(gpt_out)
    tokens = bertviz(gpt_out)["decoder_tokens"]
    assert list(data["maps"]) == ["decoder"]
    assert data["maps"]["decoder"]["rows"] == data["maps"]["decoder"]["cols"] == tokens
    generated = tokenizer.decode(greedy_ids(model, tokenizer.encode(PROMPT), NEW)[len(PROMPT):])
    assert "text: <b>First Ci\nhe</b>" in page and f"generated (greedy): <b>{generated}</b>" in page
    assert all(token in page for token in PROMPT_LABELS) and "⏎" in page and "␣" in page
    assert not re.search(r"https?://", page) and "not a causal explanation" in page


def test_bert_sees_both_ways_over_s_sentence_s_and_its_rows_sum_to_one(bert_dir, tmp_path, capsys):
    model, tokenizer = load(bert_dir)
    pieces = tokenizer.src_pieces(SENTENCE)
    assert len(pieces) > len(SENTENCE.split())                # real subwords
    assert main(["attention", "--model", str(bert_dir), "--text", SENTENCE, "--out", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["arch"] == "encoder" and summary["tokens"] == len(pieces) + 2 and summary["new_tokens"] == 0
    d = bertviz(tmp_path)
    assert set(d) == {"encoder_attention", "encoder_tokens"}
    assert d["encoder_tokens"] == ["<s>", *pieces, "</s>"]
    weights = np.array(d["encoder_attention"])[:, 0]
    expected = model_attention(model, [2, *tokenizer.encode(SENTENCE), 3], "encoder")
    np.testing.assert_allclose(weights, expected, atol=1e-6)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    above = np.triu_indices(len(pieces) + 2, 1)
    assert np.all(weights[..., above[0], above[1]] > 0)      # every query sees the keys after it
    assert (tmp_path / "encoder.png").is_file() and (tmp_path / "encoder_mean.png").is_file()
    assert all(piece in (tmp_path / "attention.html").read_text(encoding="utf-8") for piece in pieces)


def test_bert_words_sum_their_pieces_and_keep_rows_distributions(bert_dir, tmp_path):
    assert main(["attention", "--model", str(bert_dir), "--text", SENTENCE, "--words", "--out", str(tmp_path)]) == 0
    _, data = page_data(tmp_path)
    words = data["maps"]["encoder"]
    assert words["rows"] == ["<s>", *SENTENCE.split(), "</s>"]
    np.testing.assert_allclose(np.array(words["weights"]).sum(-1), 1.0, atol=1e-3)
    assert len(bertviz(tmp_path)["encoder_tokens"]) > len(SENTENCE.split()) + 2   # bertviz.json stays pieces


def test_a_character_model_s_words_start_at_whitespace():
    labels = PROMPT_LABELS
    weights = np.random.default_rng(0).dirichlet(np.ones(len(labels)), size=(1, 1, len(labels)))
    words = AttentionMap("decoder", weights, labels, labels).to_words()
    assert words.rows == ["First", "␣Ci", "⏎he"]
    np.testing.assert_allclose(words.weights.sum(-1), 1.0)


@pytest.mark.parametrize("model, options, named", [
    ("gpt", ["--tgt", "a target"], "--tgt"),
    ("gpt", ["--shift", "input"], "--shift"),
    ("gpt", ["--beam", "2"], "--beam"),
    ("bert", ["--tgt", "a target"], "--tgt"),
    ("bert", ["--max-new-tokens", "3"], "--max-new-tokens"),
])
def test_options_a_single_stack_model_has_no_use_for_are_refused_naming_them(gpt_dir, bert_dir, tmp_path, capsys,
                                                                            model, options, named):
    path = gpt_dir if model == "gpt" else bert_dir
    out = tmp_path / "maps"
    assert main(["attention", "--model", str(path), "--text", "he", *options, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith(f"atencion attention: error: {named} ")
    assert not out.exists() or not any(out.iterdir())


def test_aer_refuses_a_single_stack_model_in_one_line(gpt_dir, tmp_path, capsys):
    for name in ("src", "tgt", "align"):
        (tmp_path / name).write_text("0-0\n" if name == "align" else "he\n", encoding="utf-8")
    files = [str(tmp_path / name) for name in ("src", "tgt", "align")]
    assert main(["aer", "--model", str(gpt_dir), "--src", files[0], "--tgt", files[1], "--align", files[2]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("atencion aer: error: --model: AER needs the cross-attention") and "decoder-only" in err


def test_max_tokens_bounds_the_text_and_the_generated_tokens_together(gpt_dir, tmp_path, capsys):
    args = ["attention", "--model", str(gpt_dir), "--text", PROMPT, "--max-new-tokens", str(NEW)]
    too_few = tmp_path / "refused"
    assert main([*args, "--max-tokens", str(len(PROMPT) + NEW - 1), "--out", str(too_few)]) == 2
    err = capsys.readouterr().err
    assert f"{len(PROMPT)} tokens + {NEW} new (--max-new-tokens)" in err and "--max-tokens" in err
    assert not too_few.exists() or not any(too_few.iterdir())
    assert main([*args, "--max-tokens", str(len(PROMPT) + NEW), "--out", str(tmp_path / "kept")]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == len(PROMPT) + NEW
