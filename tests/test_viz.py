"""Attention inspection: every map captured and labelled, words, alignments, AER, the files written."""

import json
import re

import numpy as np
import pytest
import torch

from atencion.cli import main
from atencion.data.tokenizer import Tokenizer
from atencion.demo import grammar
from atencion.nn.model_dir import load_model_dir
from atencion.train.trainer import train
from atencion.viz.attention import (
    AttentionMap,
    aggregate_words,
    alignment_error_rate,
    capture_attention,
    corpus_alignment_error_rate,
    parse_pharaoh,
    word_alignment,
    word_labels,
)
from atencion.viz.plots import grid_figure, mean_figure
from conftest import small_model
from test_training import tiny_config

SRC, TGT = "el gato negro come el ratón", "the black cat eats the mouse"


@pytest.fixture(scope="module")
def subwords():
    """A 60-piece BPE vocabulary: most words of the grammar split into several pieces."""
    pairs = [(p.src, p.tgt) for p in grammar.generate(300, seed=3)]
    return Tokenizer.train(pairs, vocab_size=60, model_type="bpe")


@pytest.fixture(scope="module")
def random_model(subwords):
    return small_model(vocab_size=subwords.src_vocab_size, n_decoder_layers=3)


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """A 2-layer model trained for 150 updates on the grammar's short sentences (~5 s on a CPU)."""
    tmp = tmp_path_factory.mktemp("viz")
    pairs = [p for p in grammar.generate(1000, seed=1) if len(p.src.split()) <= 8]
    files = grammar.write_corpus(pairs, tmp / "data", "train")
    cfg = tiny_config({"data.train_src": files["es"], "data.train_tgt": files["en"]},
                      **{"data.vocab_size": 300, "data.max_len": 64, "model.n_layers": 2,
                         "model.d_model": 64, "model.d_ff": 128, "model.n_heads": 4,
                         "train.max_steps": 150, "train.max_epochs": 1000, "train.max_tokens": 1024,
                         "train.warmup": 100, "train.lr_peak": 0.005, "train.valid_bleu": False,
                         "train.keep_last": 1, "train.log_every": 1000, "train.seed": 0})
    train(cfg, tmp / "run")
    return tmp / "run" / "checkpoints" / "step_00000150"


def test_every_map_has_one_matrix_per_layer_and_head_labelled_with_the_pieces(subwords, random_model):
    src_pieces, tgt_pieces = subwords.src_pieces(SRC), subwords.tgt_pieces(TGT)
    assert len(src_pieces) > len(SRC.split()) and len(tgt_pieces) > len(TGT.split())   # real subwords
    s, t = len(src_pieces) + 1, len(tgt_pieces) + 1
    attention = capture_attention(random_model, subwords, SRC, TGT)
    assert attention.encoder.weights.shape == (2, 4, s, s)
    assert attention.decoder.weights.shape == (3, 4, t, t)
    assert attention.cross.weights.shape == (3, 4, t, s)
    assert attention.encoder.rows == attention.encoder.cols == src_pieces + ["</s>"]
    assert attention.decoder.rows == attention.decoder.cols == ["<s>"] + tgt_pieces
    assert attention.cross.rows == tgt_pieces + ["</s>"] and attention.cross.cols == src_pieces + ["</s>"]
    shifted = capture_attention(random_model, subwords, SRC, TGT, shift="input")
    assert shifted.cross.rows == ["<s>"] + tgt_pieces
    np.testing.assert_array_equal(shifted.cross.weights, attention.cross.weights)


def test_heatmaps_label_both_axes_with_the_tokens(subwords, random_model):
    cross = capture_attention(random_model, subwords, SRC, TGT).cross
    grid = grid_figure(cross)
    assert len(grid.axes) == 3 * 4 + 1                    # layers × heads, and the colour bar
    bottom_left = grid.axes[2 * 4]
    assert [t.get_text() for t in bottom_left.get_xticklabels()] == cross.cols
    assert [t.get_text() for t in bottom_left.get_yticklabels()] == cross.rows
    ax = mean_figure(cross.to_words()).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["el", "gato", "negro", "come", "el", "ratón", "</s>"]
    assert [t.get_text() for t in ax.get_yticklabels()] == TGT.split() + ["</s>"]


def test_attention_rows_sum_to_one_and_the_decoder_never_sees_the_future(subwords, random_model):
    attention = capture_attention(random_model, subwords, SRC, TGT)
    for amap in attention.maps().values():
        np.testing.assert_allclose(amap.weights.sum(-1), 1.0, atol=1e-5)
        np.testing.assert_allclose(amap.to_words().weights.sum(-1), 1.0, atol=1e-5)
    t = attention.decoder.weights.shape[-1]
    assert np.all(attention.decoder.weights[..., np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]] == 0)


@pytest.mark.parametrize("shift, extra", [("predict", 0), ("input", 1)])
def test_the_cross_row_labelled_with_a_piece_is_the_one_the_shift_names(subwords, random_model, shift, extra):
    """"predict": the row labelled p_j is the last row of a pass fed <s> p_0 … p_{j-1}, whose
    output predicts p_j; "input": the last row of a pass fed <s> p_0 … p_j."""
    attention = capture_attention(random_model, subwords, SRC, TGT, shift)
    ids = subwords.encode_tgt(TGT)
    src = torch.tensor([subwords.encode_src(SRC) + [3]])
    for j in range(len(ids)):
        with torch.no_grad():
            _, attn = random_model(src, torch.tensor([[2] + ids[:j + extra]]), return_attention=True)
        row = attention.cross.rows.index(subwords.tgt.id_to_piece(ids[j]), j)
        assert row == j + extra
        np.testing.assert_allclose(attention.cross.weights[:, :, row],
                                   torch.stack(attn["cross"])[:, 0, :, -1].numpy(), atol=1e-5)


ROWS, COLS = ["▁a", "▁bc", "d", "</s>"], ["▁x", "y", "▁z", "</s>"]
HAND = np.array([[0.1, 0.2, 0.3, 0.4],
                 [0.5, 0.5, 0.0, 0.0],
                 [0.0, 0.2, 0.2, 0.6],
                 [0.25, 0.25, 0.25, 0.25]])


def test_words_average_their_query_rows_and_sum_their_key_columns_so_rows_stay_distributions():
    assert word_labels(ROWS) == ["a", "bcd", "</s>"] and word_labels(COLS) == ["xy", "z", "</s>"]
    amap = AttentionMap("cross", HAND[None, None], ROWS, COLS).to_words()
    np.testing.assert_allclose(amap.weights[0, 0], [[0.3, 0.3, 0.4], [0.6, 0.1, 0.3], [0.5, 0.25, 0.25]])
    np.testing.assert_allclose(amap.weights.sum(-1), 1.0)
    assert amap.rows == ["a", "bcd", "</s>"] and amap.cols == ["xy", "z", "</s>"]


def test_the_issue_wording_sums_query_rows_and_averages_key_columns():
    spans_rows, spans_cols = [[0], [1, 2], [3]], [[0, 1], [2], [3]]
    literal = aggregate_words(HAND, spans_rows, spans_cols, rows="sum", cols="mean")
    np.testing.assert_allclose(literal, [[0.15, 0.3, 0.4], [0.6, 0.2, 0.6], [0.25, 0.25, 0.25]])
    np.testing.assert_allclose(literal.sum(-1), [0.85, 1.4, 0.75])   # no longer distributions


def test_word_alignment_takes_each_target_word_to_the_source_word_it_attends_most():
    rows, cols = ["▁the", "▁bl", "ack", "</s>"], ["▁el", "▁ne", "gro", "</s>"]
    layer0 = [[0.05, 0.45, 0.45, 0.05],   # the → negro: its pieces together outweigh "el"
              [0.10, 0.10, 0.10, 0.70],   # bl → </s> most, which takes no part
              [0.10, 0.30, 0.30, 0.30],
              [0.90, 0.00, 0.00, 0.10]]   # the </s> row links nothing
    layer1 = [[0.60, 0.20, 0.20, 0.00],
              [0.80, 0.10, 0.00, 0.10],
              [0.80, 0.10, 0.10, 0.00],
              [0.00, 0.00, 0.00, 1.00]]
    cross = AttentionMap("cross", np.array([[layer0], [layer1]]), rows, cols)
    assert word_alignment(cross, layer=0) == {(1, 0), (1, 1)}
    assert word_alignment(cross, layer=1) == {(0, 0), (0, 1)}
    assert word_alignment(cross) == {(1, 0), (0, 1)}          # layers averaged: each row follows the surer layer


def test_alignment_error_rate_matches_hand_computed_values():
    sure = {(0, 0), (1, 1)}
    assert alignment_error_rate(sure, sure) == 0.0
    assert alignment_error_rate({(0, 1), (1, 0)}, sure) == 1.0
    predicted, possible = {(0, 0), (2, 1), (3, 3)}, sure | {(2, 1), (1, 2)}
    # |A∩S| = 1, |A∩P| = 2, |A| = 3, |S| = 2: AER = 1 − 3/5
    assert alignment_error_rate(predicted, sure, possible) == pytest.approx(0.4)
    assert alignment_error_rate(predicted, sure, {(2, 1), (1, 2)}) == pytest.approx(0.4)   # P taken as P ∪ S
    assert alignment_error_rate(predicted, sure) == pytest.approx(1 - 2 / 5)                 # P = S
    # a corpus sums the counts: 1 − (3 + 2) / (5 + 2), not the mean of 0.4 and 0
    assert corpus_alignment_error_rate([predicted, {(0, 0)}], [sure, {(0, 0)}],
                                       [possible, set()]) == pytest.approx(2 / 7)
    assert parse_pharaoh("0-0 2?1 1-1") == ({(0, 0), (1, 1)}, {(0, 0), (1, 1), (2, 1)})


def test_a_trained_model_attends_from_black_to_negro_and_from_cat_to_gato(trained_dir):
    model_dir = trained_dir
    model, tokenizer = load_model_dir(model_dir)
    gold = grammar.translate_known(SRC)
    assert gold.tgt == TGT and {(2, 1), (1, 2)} <= set(gold.alignment)
    links = word_alignment(capture_attention(model, tokenizer, SRC, TGT).cross)
    assert {(2, 1), (1, 2)} <= links


def test_attention_command_writes_every_file_it_promises(trained_dir, tmp_path, capsys):
    model_dir = trained_dir
    out = tmp_path / "maps"
    assert main(["attention", "--model", str(model_dir), "--src", SRC, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert "not a causal explanation" in captured.err and summary["decoded"]
    for name in ("encoder.png", "decoder.png", "cross.png", "cross_mean.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    d = json.loads((out / "bertviz.json").read_text(encoding="utf-8"))
    s, t = len(d["encoder_tokens"]), len(d["decoder_tokens"])
    assert d["encoder_tokens"] == Tokenizer.load(model_dir).src_pieces(SRC) + ["</s>"]
    assert d["decoder_tokens"][0] == "<s>"
    for key, shape in (("encoder_attention", (1, 4, s, s)), ("decoder_attention", (1, 4, t, t)),
                       ("cross_attention", (1, 4, t, s))):
        assert len(d[key]) == 2 and all(np.array(layer).shape == shape for layer in d[key])
    page = (out / "attention.html").read_text(encoding="utf-8")
    inlined = json.loads(re.search(r"const DATA = (.*);\n", page).group(1))
    assert inlined["maps"]["cross"]["cols"] == d["encoder_tokens"]
    assert inlined["maps"]["cross"]["rows"] == d["decoder_tokens"][1:] + ["</s>"]
    assert all(token in page for token in d["encoder_tokens"][:-1] + d["decoder_tokens"][1:])
    assert not re.search(r"https?://", page) and "not a causal explanation" in page


def test_aer_command_prints_a_table_per_layer_and_a_json_line(trained_dir, tmp_path, capsys):
    model_dir = trained_dir
    files = grammar.write_corpus(grammar.generate(40, seed=9), tmp_path, "test")
    assert main(["aer", "--model", str(model_dir), "--src", str(files["es"]), "--tgt", str(files["en"]),
                 "--align", str(files["align"]), "--max-sentences", "30"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["sentences"] == 30 and len(result["layers"]) == 2 and result["shift"] == "predict"
    assert sum(line.startswith("| ") and line[2].isdigit() for line in lines) == 2
    assert min(result["layers"]) <= 0.3                     # the issue's target, on the grammar


def test_line_figure_draws_one_labelled_line_per_series_and_saves_a_png(tmp_path):
    from atencion.viz.plots import line_figure, save

    fig = line_figure({"a": ([1, 2, 4], [1.0, 0.1, 0.01]), "b": ([1, 2, 4], [2.0, 2.0, 2.0])}, "x", "y", "t",
                      log_x=True, log_y=True, styles={"b": "--"})
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["a", "b"]
    assert list(ax.get_lines()[0].get_ydata()) == [1.0, 0.1, 0.01] and ax.get_lines()[1].get_linestyle() == "--"
    assert (ax.get_xscale(), ax.get_yscale(), ax.get_title()) == ("log", "log", "t")
    assert save(fig, tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
