"""The RNN encoder-decoder (arch rnn, nn/rnn.py): its attention by the papers' formulas, the
decoding protocol (step by step = teacher forcing, beam 1 = greedy), padding, the bottleneck of
attention "none", its settings, and the pipeline it shares with the Transformer (training,
resume, averaging, torchrun, translate, attention maps, AER, int8)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import atencion
from atencion import ModelConfig, Transformer
from atencion.cli import main
from atencion.decode.search import beam_search, greedy_search
from atencion.errors import AtencionError
from atencion.nn.model_dir import build_model, load_model, load_model_dir
from atencion.nn.quantize import quantize_int8
from atencion.nn.rnn import AdditiveAttention, MultiplicativeAttention, RNNSeq2Seq
from atencion.train.checkpoint import average_checkpoints, list_checkpoints
from atencion.train.config import load_config
from atencion.train.trainer import train
from atencion.viz.attention import capture_attention, evaluate_alignment
from test_training import one_and_two_processes, tiny_config, weights, write_corpus

VARIANTS = {
    "gru-none": dict(attention="none"),
    "gru-bahdanau": dict(attention="bahdanau"),
    "gru-luong-general": dict(attention="luong"),
    "gru-luong-dot-no-feeding": dict(attention="luong", score="dot", input_feeding=False, hidden=16),
    "lstm-bahdanau": dict(cell="lstm", attention="bahdanau"),
    "lstm-none-no-bridge": dict(cell="lstm", attention="none", bridge=False, hidden=16),
    "gru-luong-unidirectional": dict(attention="luong", bidirectional=False),
}


def rnn_model(seed: int = 0, layers: int = 2, **rnn) -> RNNSeq2Seq:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=40, arch="rnn", d_model=32, n_layers=layers, dropout=0.0, rnn=rnn)
    return build_model(cfg).eval()


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (3, 7), generator=g)
    src[1, 5:] = 0
    src[2, 3:] = 0
    tgt = torch.randint(4, 40, (3, 6), generator=g)
    tgt[:, 0] = 2
    return src, tgt


@pytest.mark.parametrize("name", VARIANTS)
def test_one_step_at_a_time_equals_the_teacher_forced_pass(name):
    model = rnn_model(**VARIANTS[name])
    src, tgt = batch()
    with torch.no_grad():
        full = model(src, tgt)
        memory, mask = model.encode(src)
        state = model.init_state(memory, mask)
        steps = torch.cat([model.decode_step(tgt[:, t:t + 1], state) for t in range(tgt.size(1))], dim=1)
        state = model.init_state(memory, mask)  # two tokens, then the rest, in one call each
        chunks = torch.cat([model.decode_step(tgt[:, :2], state), model.decode_step(tgt[:, 2:], state)], dim=1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunks, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gru-bahdanau", "lstm-none-no-bridge", "gru-luong-general"])
def test_beam_one_is_greedy_and_a_batched_beam_equals_one_sentence_at_a_time(name):
    model = rnn_model(**VARIANTS[name])
    src, _ = batch()
    greedy = greedy_search(model, src, max_len_b=12)
    assert [h[0].tokens for h in beam_search(model, src, beam_size=1, max_len_b=12)] == greedy
    together = beam_search(model, src, beam_size=4, max_len_b=12, nbest=2)
    for i in range(src.size(0)):
        row = src[i:i + 1, : int((src[i] != 0).sum())]
        alone = beam_search(model, row, beam_size=4, max_len_b=12, nbest=2)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in together[i]]
        for a, b in zip(alone, together[i]):
            assert a.score == pytest.approx(b.score, abs=1e-4)


def test_bahdanau_energies_follow_v_tanh_ws_plus_uh_on_a_hand_computed_case():
    attention = AdditiveAttention(query_size=2, memory_size=2, size=2)
    with torch.no_grad():
        attention.W.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        attention.U.weight.copy_(torch.tensor([[1.0, 1.0], [0.0, -1.0]]))
        attention.U.bias.copy_(torch.tensor([0.0, 0.5]))
        attention.v.weight.copy_(torch.tensor([[1.0, 2.0]]))
        s = torch.tensor([[[0.5, -1.0]]])                 # s_{t-1}: W s = (0.5, -1)
        h = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])      # U h_1 + b = (1, 0.5); U h_2 + b = (2, -1.5)
        e = attention.energies(s, attention.keys(h))
    expected = [math.tanh(0.5 + 1) + 2 * math.tanh(-1 + 0.5), math.tanh(0.5 + 2) + 2 * math.tanh(-1 - 1.5)]
    torch.testing.assert_close(e, torch.tensor([[expected]]))


def test_luong_scores_are_dot_products_with_the_state_or_with_W_a_h():
    h = torch.tensor([[[1.0, 2.0], [3.0, -1.0]]])
    s = torch.tensor([[[2.0, 0.5]]])
    dot = MultiplicativeAttention(2, 2, "dot")
    torch.testing.assert_close(dot.energies(s, dot.keys(h)), torch.tensor([[[3.0, 5.5]]]))
    general = MultiplicativeAttention(2, 2, "general")
    with torch.no_grad():
        general.W_a.weight.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))  # W_a h swaps h's two entries
    torch.testing.assert_close(general.energies(s, general.keys(h)), torch.tensor([[[4.5, -0.5]]]))


@pytest.mark.parametrize("kind", ["bahdanau", "luong"])
def test_each_step_reads_what_its_paper_feeds_it(kind):
    """Bahdanau: the recurrent input is [E y_{t-1}; c_t] with c_t = Σ α h; Luong with input
    feeding: [E y_{t-1}; h̃_{t-1}], h̃ being the output o of the step before (zeros first)."""
    model = rnn_model(attention=kind)
    src, tgt = batch()
    inputs = []
    handle = model.decoder.rnn.register_forward_hook(lambda module, args, out: inputs.append(args[0]))
    with torch.no_grad():
        _, attention = model(src, tgt, return_attention=True)
        outputs = model(src, tgt, project=False)
    handle.remove()
    inputs = torch.cat(inputs[: tgt.size(1)], dim=1)[..., model.cfg.d_model:]  # the first pass, past E y
    if kind == "bahdanau":
        memory, _ = model.encode(src)
        torch.testing.assert_close(inputs, attention["cross"][0][:, 0] @ memory)
    else:
        torch.testing.assert_close(inputs[:, 0], torch.zeros_like(inputs[:, 0]))
        torch.testing.assert_close(inputs[:, 1:], outputs[:, :-1])


def test_bahdanau_attends_from_the_previous_state():
    """α_1 comes from s_0, the state the bridge makes from the summary, before any word is read."""
    model = rnn_model(attention="bahdanau")
    src, tgt = batch()
    with torch.no_grad():
        _, attention = model(src, tgt, return_attention=True)
        memory, mask = model.encode(src)
        state = model.init_state(memory, mask)
        decoder = model.decoder
        e = decoder.attention.energies(state.hidden[-1][:, None, :], state.keys)
        e = e.masked_fill(~state.real[:, None, :], float("-inf"))
    torch.testing.assert_close(attention["cross"][0][:, 0, :1], torch.softmax(e, dim=-1))


@pytest.mark.parametrize("name", ["gru-bahdanau", "gru-luong-general", "gru-luong-dot-no-feeding"])
def test_attention_rows_sum_to_one_and_padding_changes_nothing(name):
    model = rnn_model(**VARIANTS[name])
    src, tgt = batch()
    with torch.no_grad():
        logits, attention = model(src, tgt, return_attention=True)
    alpha = attention["cross"][0]                       # (batch, 1 head, tgt_len, src_len)
    assert alpha.shape == (3, 1, tgt.size(1), src.size(1))
    torch.testing.assert_close(alpha.sum(-1), torch.ones(3, 1, tgt.size(1)))
    assert bool((alpha[1, ..., 5:] == 0).all()) and bool((alpha[2, ..., 3:] == 0).all())
    assert bool((alpha[2, ..., :3] > 0).all())
    for i, length in ((1, 5), (2, 3)):  # the sentence alone, without its padding
        with torch.no_grad():
            alone, alone_attention = model(src[i:i + 1, :length], tgt[i:i + 1], return_attention=True)
        torch.testing.assert_close(alone[0], logits[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(alone_attention["cross"][0][0, ..., :length], alpha[i, ..., :length])


def test_a_source_of_padding_alone_gives_finite_logits_and_no_attention_weight():
    model = rnn_model(attention="bahdanau")
    src, tgt = batch()
    src[0] = 0
    with torch.no_grad():
        logits, attention = model(src, tgt, return_attention=True)
    assert bool(torch.isfinite(logits).all()) and bool((attention["cross"][0][0] == 0).all())


@pytest.mark.parametrize("bidirectional", [True, False])
def test_without_attention_the_decoder_sees_only_the_final_encoder_state(bidirectional):
    model = rnn_model(attention="none", bidirectional=bidirectional)
    src, tgt = batch()
    src = src[:1, :5]  # one sentence of 5 real tokens
    tgt = tgt[:1]
    half = model.encoder.size // 2

    def decode(memory):
        with torch.no_grad():
            state = model.init_state(memory, model.padding_mask(src))
            return model.decode_step(tgt, state)

    with torch.no_grad():
        memory, _ = model.encode(src)
    reference = decode(memory)
    changed = memory.clone()
    changed[0, 1:4] = torch.randn(3, memory.size(-1))   # every state but the summary's
    if bidirectional:
        changed[0, 0, :half] += 1.0                     # the first token: its forward half
        changed[0, 4, half:] += 1.0                     # the last token: its backward half
    else:
        changed[0, 0] += 1.0                            # the first token too
    torch.testing.assert_close(decode(changed), reference, atol=0, rtol=0)
    summary = memory.clone()
    summary[0, 4, :half] += 1.0                         # the last token's forward state is the summary
    assert not torch.allclose(decode(summary), reference)


@pytest.mark.parametrize("settings, key", [
    ({"attention": "luong", "score": "cosine"}, "rnn.score"),
    ({"attention": "bahdanau", "score": "dot"}, "rnn.score"),
    ({"decoder_bidirectional": True}, "rnn.decoder_bidirectional"),
    ({"bridge": False, "hidden": 32, "decoder_hidden": 48}, "rnn.decoder_hidden"),
    ({"attention": "luong", "score": "dot", "decoder_hidden": 48}, "rnn.score"),
    ({"attention": "bahdanau", "input_feeding": True}, "rnn.input_feeding"),
    ({"cell": "lstn"}, "rnn.cell"),
    ({"attention": "additive"}, "rnn.attention"),
    ({"layers": 2}, "rnn.layers"),
    ({"bidirectional": "yes"}, "rnn.bidirectional"),
    ({"bridge": 1}, "rnn.bridge"),
    ({"attention": "luong", "input_feeding": "no"}, "rnn.input_feeding"),
    ({"hidden": 0}, "rnn.hidden"),
    ({"attention": "none", "score": "dot"}, "rnn.score"),
    ("gru", "rnn must be a mapping"),
])
def test_bad_rnn_settings_are_one_line_naming_the_key(settings, key):
    with pytest.raises(AtencionError) as err:
        ModelConfig(vocab_size=40, arch="rnn", d_model=32, rnn=settings)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_rnn_settings_need_arch_rnn_and_moe_needs_a_transformer():
    with pytest.raises(AtencionError, match="arch 'rnn'"):
        ModelConfig(vocab_size=40, rnn={"attention": "none"})
    with pytest.raises(AtencionError, match="arch 'rnn' has none"):
        ModelConfig(vocab_size=40, arch="rnn", moe={"experts": 2})
    # an RNN has no heads and no positions: their checks do not apply (620: Bahdanau's embedding size)
    assert ModelConfig(vocab_size=40, arch="rnn", d_model=620, n_heads=8).rnn["hidden"] == 620
    with pytest.raises(AtencionError, match="RNN encoder-decoder"):
        Transformer(ModelConfig(vocab_size=40, arch="rnn"))
    cfg = ModelConfig(vocab_size=40, arch="rnn", d_model=32, rnn={"attention": "luong"})
    assert cfg.rnn == {"cell": "gru", "hidden": 32, "bidirectional": True, "decoder_hidden": 32, "bridge": True,
                       "attention": "luong", "score": "general", "input_feeding": True}


def test_a_bad_rnn_setting_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    code = main(["train", "configs/toy_es_en_rnn.yaml", "--set", "model.rnn.attention=luong",
                 "--set", "model.rnn.score=cosine", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "rnn.score" in err[0] and "cosine" in err[0]
    assert not (tmp_path / "run").exists()


def test_save_and_load_give_the_same_model_and_the_same_outputs(tmp_path):
    model = rnn_model(**VARIANTS["lstm-bahdanau"])
    model.save(tmp_path / "m")
    src, tgt = batch()
    for loaded in (load_model(tmp_path / "m"), atencion.load(tmp_path / "m"), RNNSeq2Seq.load(tmp_path / "m")):
        assert isinstance(loaded, RNNSeq2Seq) and loaded.cfg == model.cfg
        with torch.no_grad():
            assert torch.equal(loaded.eval()(src, tgt), model(src, tgt))
    with pytest.raises(AtencionError, match="RNNSeq2Seq"):
        Transformer.load(tmp_path / "m")


def test_the_exporters_and_to_hf_refuse_an_rnn_in_one_line(tmp_path):
    from atencion.export import export
    from atencion.interop import to_hf

    model = rnn_model()
    for fmt in ("ctranslate2", "onnx"):
        with pytest.raises(AtencionError, match="arch='rnn'") as err:
            export(model, tmp_path / fmt, fmt)
        assert "\n" not in str(err.value)
    with pytest.raises(AtencionError, match="arch 'rnn'"):
        to_hf(model)


# the pipeline ---------------------------------------------------------------------------------

RNN_SETTINGS = {"model.arch": "rnn", "model.d_model": 32, "model.n_layers": 1, "model.rnn.hidden": 32,
                "model.rnn.decoder_hidden": 48}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small GRU + Bahdanau model trained on the number-word task (reversed order)."""
    tmp = tmp_path_factory.mktemp("rnn")
    data = write_corpus(tmp / "data", n=400)
    cfg = tiny_config(data, **RNN_SETTINGS, **{"train.max_steps": 150, "train.max_epochs": 100,
                                               "model.dropout": 0.0, "train.valid_every": 75})
    summary = train(cfg, tmp / "run")
    return tmp, summary


def test_training_an_rnn_brings_the_loss_far_below_its_start(trained):
    tmp, summary = trained
    records = [json.loads(line) for line in (tmp / "run" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert summary["steps"] == 150
    assert losses[-1] < 0.3 * losses[0], (losses[0], losses[-1])
    assert json.loads((tmp / "run" / "checkpoints" / "step_00000150" / "config.json").read_text())["arch"] == "rnn"


def test_translate_attention_and_aer_take_an_rnn_model(trained, tmp_path, capsys):
    tmp, _ = trained
    model_dir = tmp / "run" / "checkpoints" / "step_00000150"
    (tmp_path / "in.txt").write_text("uno dos tres\ncuatro cinco\n")
    assert main(["translate", "--model", str(model_dir), "--input", str(tmp_path / "in.txt"),
                 "--output", str(tmp_path / "out.txt"), "--beam", "3"]) == 0
    assert (tmp_path / "out.txt").read_text() == "three two one\nfive four\n"
    assert main(["attention", "--model", str(model_dir), "--src", "uno dos tres", "--out",
                 str(tmp_path / "maps")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["files"] == ["cross.png", "cross_mean.png", "bertviz.json", "attention.html"]
    bertviz = json.loads((tmp_path / "maps" / "bertviz.json").read_text())
    (cross,) = bertviz["cross_attention"]                 # one layer: (1, 1 head, target tokens, source tokens)
    assert len(cross[0][0][0]) == len(bertviz["encoder_tokens"]) and len(cross[0][0]) == len(bertviz["decoder_tokens"])
    assert summary["alignment"] == "2-0 1-1 0-2"  # reversed order: the last word translates first
    model, tokenizer = load_model_dir(model_dir)
    result = evaluate_alignment(model, tokenizer, ["uno dos tres", "cuatro cinco"], ["three two one", "five four"],
                                ["2-0 1-1 0-2", "1-0 0-1"])
    assert result["layers"] == [result["layers_mean"]] and len(result["heads"]) == 1
    assert result["layers_mean"] < 0.5
    attention = capture_attention(model, tokenizer, "uno dos", "two one")
    assert attention.encoder is None and attention.decoder is None and set(attention.maps()) == {"cross"}


def test_attention_maps_and_aer_refuse_an_rnn_without_attention_in_one_line(trained, tmp_path, capsys):
    from atencion.train.checkpoint import save_checkpoint

    tmp, _ = trained
    _, tokenizer = load_model_dir(tmp / "run" / "checkpoints" / "step_00000150")
    blind = build_model(ModelConfig(vocab_size=tokenizer.src_vocab_size, arch="rnn", d_model=32, n_layers=1,
                                    rnn={"attention": "none"}))
    save_checkpoint(tmp_path / "blind", blind, tokenizer)
    for name in ("src.txt", "tgt.txt", "align.txt"):
        (tmp_path / name).write_text({"src.txt": "uno\n", "tgt.txt": "one\n", "align.txt": "0-0\n"}[name])
    commands = [["attention", "--model", str(tmp_path / "blind"), "--src", "uno", "--out", str(tmp_path / "maps")],
                ["aer", "--model", str(tmp_path / "blind"), "--src", str(tmp_path / "src.txt"), "--tgt",
                 str(tmp_path / "tgt.txt"), "--align", str(tmp_path / "align.txt")]]
    for argv in commands:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "attention 'none'" in err[0], err
    assert not (tmp_path / "maps").exists()


def test_int8_decoding_of_an_rnn_stays_close_to_float32(trained):
    tmp, _ = trained
    model, _ = load_model_dir(tmp / "run" / "checkpoints" / "step_00000150")
    src, tgt = torch.tensor([[5, 6, 7, 3]]), torch.tensor([[2, 8, 9]])
    with torch.no_grad():
        reference = torch.log_softmax(model(src, tgt), -1)
        quantized = torch.log_softmax(quantize_int8(model)(src, tgt), -1)
    assert (quantized - reference).abs().max() < 0.2
    luong = rnn_model(attention="luong")  # input feeding reads o's width from the config, whatever o's layer is
    src, _ = batch()
    assert len(greedy_search(quantize_int8(luong), src, max_len_b=5)) == 3


def test_interrupted_and_resumed_rnn_run_ends_with_the_same_weights(tmp_path):
    data = write_corpus(tmp_path / "data")
    common = {**RNN_SETTINGS, "train.valid_every": 3, "train.max_epochs": 100}
    train(tiny_config(data, **common, **{"train.max_steps": 6}), tmp_path / "whole")
    train(tiny_config(data, **common, **{"train.max_steps": 3}), tmp_path / "split")
    train(tiny_config(data, **common, **{"train.max_steps": 6}), tmp_path / "split", resume=True)
    whole = weights(list_checkpoints(tmp_path / "whole" / "checkpoints")[-1])
    split = weights(list_checkpoints(tmp_path / "split" / "checkpoints")[-1])
    assert whole.keys() == split.keys() and any("decoder.attention" in name for name in whole)
    for name in whole:
        assert torch.equal(whole[name], split[name]), name


def test_averaged_rnn_checkpoints_are_the_mean_of_their_weights(tmp_path):
    data = write_corpus(tmp_path / "data")
    train(tiny_config(data, **RNN_SETTINGS, **{"train.max_steps": 4, "train.valid_every": 2}), tmp_path / "run")
    checkpoints = list_checkpoints(tmp_path / "run" / "checkpoints")
    average_checkpoints(checkpoints, tmp_path / "avg")
    a, b, averaged = weights(checkpoints[0]), weights(checkpoints[1]), load_file(str(tmp_path / "avg" /
                                                                                     "model.safetensors"))
    for name in averaged:
        torch.testing.assert_close(averaged[name], (a[name] + b[name]) / 2)
    assert isinstance(load_model(tmp_path / "avg"), RNNSeq2Seq)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_two_rnn_processes_equal_one_process_with_the_same_total_batch(tmp_path):
    data = write_corpus(tmp_path / "data")
    settings = {**data, **RNN_SETTINGS, "data.vocab_size": 40, "model.dropout": 0.0, "train.max_tokens": 256,
                "train.warmup": 20, "train.lr_peak": 0.01, "train.progress": False, "train.tensorboard": False,
                "train.threads": 1, "train.max_steps": 4, "train.device": "cpu"}
    one, two = map(weights, one_and_two_processes(settings, tmp_path, 29561))
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-6, rtol=1e-5)


def test_the_demo_config_builds_a_gru_with_bahdanau_attention():
    cfg = load_config("configs/toy_es_en_rnn.yaml")
    built = cfg.model_config(400, None)
    assert built.arch == "rnn" and built.rnn["cell"] == "gru" and built.rnn["attention"] == "bahdanau"
    assert isinstance(build_model(built), RNNSeq2Seq)


def test_scores_by_source_length_group_sentences_by_their_source_words():
    from atencion.evaluate import score_by_length

    sources = ["a b c d", "a b c d e", "a b c d e f g", "a b c d e f g h i j k l"]
    refs = ["x y z w", "x y z w v", "x y z w v u t", "x y z w v u t s r q p o"]
    hyps = ["x y z w", "x y z w v", "x y z w v u q", "no"]
    rows = score_by_length(sources, hyps, refs, [(1, 5), (6, 9), (10, 20), (21, 30)])
    assert [(r["words"], r["sentences"], r["exact_match"]) for r in rows] == [("1-5", 2, 1.0), ("6-9", 1, 0.0),
                                                                              ("10-20", 1, 0.0)]
    assert rows[0]["bleu"] == 100.0 and rows[2]["bleu"] == 0.0 and 0 < rows[1]["bleu"] < 100
    with pytest.raises(AtencionError, match="aligned line by line"):
        score_by_length(sources, hyps[:3], refs, [(1, 3)])


def test_the_server_translates_with_an_rnn_and_shows_its_one_attention(trained, tmp_path):
    from fastapi.testclient import TestClient

    from atencion.decode import DecodeConfig
    from atencion.decode.translate import translate_lines
    from atencion.serve.app import LoadedModel, create_app
    from atencion.train.checkpoint import save_checkpoint

    tmp, _ = trained
    model_dir = tmp / "run" / "checkpoints" / "step_00000150"
    model, tokenizer = load_model_dir(model_dir)
    # no attention: its maps are refused, its translations are not
    blind = build_model(ModelConfig(vocab_size=tokenizer.src_vocab_size, arch="rnn", d_model=32, n_layers=1,
                                    rnn={"attention": "none"}))
    save_checkpoint(tmp_path / "blind", blind, tokenizer)
    served = [LoadedModel("rnn", str(model_dir), model, tokenizer),
              LoadedModel("blind", str(tmp_path / "blind"), *load_model_dir(tmp_path / "blind"))]
    with TestClient(create_app(served)) as client:
        r = client.post("/translate", json={"model": "rnn", "sentences": ["uno dos tres"], "beam": 3,
                                            "attention": True})
        assert r.status_code == 200, r.text
        (item,) = r.json()["translations"]
        assert item["text"] == translate_lines(model, tokenizer, ["uno dos tres"], DecodeConfig(beam=3))[0][0].text
        assert set(item["attention"]["pieces"]) == {"cross"} and item["attention"]["alignment"] == [[0, 2], [1, 1],
                                                                                                    [2, 0]]
        assert client.get("/info").json()["models"][0]["arch"] == "rnn"
        r = client.post("/translate", json={"model": "blind", "sentences": ["uno"], "attention": True})
        assert r.status_code == 422 and "attention 'none'" in r.text
        assert client.post("/translate", json={"model": "blind", "sentences": ["uno"]}).status_code == 200
