"""Exports to CTranslate2, Hugging Face Marian and ONNX compute what atencion computes."""

import json
import random

import pytest
import torch

from atencion import Transformer
from atencion.cli import main
from atencion.data.tokenizer import Tokenizer
from atencion.decode.search import beam_search, greedy_search
from atencion.export import export
from conftest import random_batch, small_model
from test_training import WORDS, tiny_config, write_corpus

VARIANTS = {  # every setting an exporter maps differently, each away from its default
    "post-LN": {},
    "pre-LN": dict(norm_first=True),
    "learned-positions": dict(positional="learned", max_positions=64),
    "gelu-output-bias": dict(activation="gelu", output_bias=True),
    "separate-vocab": dict(share_embeddings=False, tgt_vocab_size=50, tie_output=False),
    "no-bias-no-scale": dict(bias=False, scale_embedding=False, n_decoder_layers=3, layer_norm_eps=1e-6),
}


def variant_model(settings: dict) -> Transformer:
    model = small_model(**settings)
    if model.cfg.output_bias:
        with torch.no_grad():
            model.generator.bias.normal_()
    return model


def ct2_vocabularies(directory) -> tuple[list[str], list[str]]:
    if (directory / "shared_vocabulary.json").is_file():
        shared = json.loads((directory / "shared_vocabulary.json").read_text())
        return shared, shared
    return tuple(json.loads((directory / f"{side}_vocabulary.json").read_text())
                 for side in ("source", "target"))


def padded(cfg, id_lists) -> torch.Tensor:
    batch = torch.full((len(id_lists), max(map(len, id_lists))), cfg.pad_id, dtype=torch.long)
    for row, ids in enumerate(id_lists):
        batch[row, : len(ids)] = torch.tensor(ids)
    return batch


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for a few seconds with a real SentencePiece tokenizer, and test sources
    as atencion's model receives them (subwords + EOS)."""
    from atencion.train.trainer import train

    tmp = tmp_path_factory.mktemp("trained")
    data = write_corpus(tmp / "data", n=300)
    train(tiny_config(data, **{"train.max_steps": 250, "train.max_epochs": 100, "model.dropout": 0.0}),
          tmp / "run")
    model_dir = sorted((tmp / "run" / "checkpoints").iterdir())[-1]
    model, tokenizer = Transformer.load(model_dir).eval(), Tokenizer.load(model_dir)
    rng = random.Random(7)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9))) for _ in range(16)]
    sources = [tokenizer.encode_src(text) + [model.cfg.eos_id] for text in texts]
    return model_dir, model, tokenizer, texts, sources


def ct2_translate(*args, **kwargs):
    """One CTranslate2 thread: its bundled OpenMP runtime, next to torch's on a busy 2-core
    machine, can spin-wait for seconds per call with more (OMP_WAIT_POLICY=PASSIVE avoids it)."""
    from atencion.export.ctranslate2 import ct2_translate as translate

    return translate(*args, threads=1, **kwargs)


def atencion_tokens(model, sources, beam, alpha, a, b) -> list[list[int]]:
    src = padded(model.cfg, sources)
    if beam == 1:
        return greedy_search(model, src, a, b)
    return [hyps[0].tokens for hyps in beam_search(model, src, beam, alpha, a, b)]


SEARCHES = [(1, 0.6, 1.0, 50), (1, 0.6, 0.5, 1),  # greedy; then beam with the paper's α,
            (4, 0.6, 1.0, 50), (4, 0.0, 1.0, 50), (4, 1.0, 1.0, 50), (5, 0.6, 1.0, 50),  # α 0 and 1,
            (4, 0.6, 0.0, 2)]  # and a maximum length that forces ends


# CTranslate2 ------------------------------------------------------------------------------------

def test_ctranslate2_export_translates_to_atencions_tokens(trained, tmp_path, capsys):
    """Greedy and beam search (several beams, α and maximum lengths): the same tokens."""
    pytest.importorskip("ctranslate2")
    model_dir, model, _, _, sources = trained
    out = tmp_path / "ct2"
    assert main(["export", "--model", str(model_dir), "--format", "ctranslate2", "--out", str(out)]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert {"model.bin", "config.json", "shared_vocabulary.json", "spm.model", "tokenizer.json"} <= set(files)
    for beam, alpha, a, b in SEARCHES:
        translated = ct2_translate(out, sources, beam, alpha, a, b)
        assert translated == atencion_tokens(model, sources, beam, alpha, a, b), (beam, alpha, a, b)
    assert len(ct2_translate(out, sources, 4, compute_type="int8")) == len(sources)


@pytest.mark.parametrize("variant", VARIANTS)
def test_ctranslate2_scores_equal_atencions_log_probabilities(variant, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    model = variant_model(VARIANTS[variant])
    export(model, tmp_path / "ct2", "ctranslate2")
    cfg = model.cfg
    source, target = ct2_vocabularies(tmp_path / "ct2")
    src, tgt = random_batch(cfg, batch=4, src_len=9, tgt_len=7)
    srcs = [[i for i in row if i != cfg.pad_id] for row in src.tolist()]
    tgts = [row[1:] for row in tgt.tolist()]  # without BOS; CTranslate2 adds BOS and scores EOS
    results = ctranslate2.Translator(str(tmp_path / "ct2"), intra_threads=1).score_batch(
        [[source[i] for i in s] for s in srcs], [[target[i] for i in t] for t in tgts])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(src, tgt), dim=-1)
    for row, (t, result) in enumerate(zip(tgts, results)):
        expected = log_probs[row].gather(1, torch.tensor(t + [cfg.eos_id])[:, None]).squeeze(1)
        assert (torch.tensor(result.log_probs) - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("variant", ["post-LN", "learned-positions", "separate-vocab"])
def test_ctranslate2_search_equals_atencions_on_random_models(variant, tmp_path):
    """Random models, where PAD and BOS hold real probability and many hypotheses reach the
    maximum length: greedy and beam search give the same tokens."""
    pytest.importorskip("ctranslate2")
    model = variant_model(VARIANTS[variant])
    export(model, tmp_path / "ct2", "ctranslate2")
    g = torch.Generator().manual_seed(2)
    sources = [torch.randint(4, model.cfg.vocab_size, (n,), generator=g).tolist() + [model.cfg.eos_id]
               for n in torch.randint(1, 9, (20,), generator=g).tolist()]
    greedy = atencion_tokens(model, sources, 1, 0.6, 1.0, 10)
    assert ct2_translate(tmp_path / "ct2", sources, 1, 0.6, 1.0, 10) == greedy
    beam = atencion_tokens(model, sources, 4, 0.6, 1.0, 10)
    assert ct2_translate(tmp_path / "ct2", sources, 4, 0.6, 1.0, 10) == beam


def test_ctranslate2_translate_refuses_a_source_without_eos(tmp_path):
    pytest.importorskip("ctranslate2")
    export(small_model(), tmp_path / "ct2", "ctranslate2")
    with pytest.raises(ValueError, match="must end with the EOS id 3"):
        ct2_translate(tmp_path / "ct2", [[5, 6, 3], [5, 6]])


# Hugging Face Marian ----------------------------------------------------------------------------

MARIAN_VARIANTS = {  # Marian's LayerNorm ε is fixed at 1e-5
    name: {**settings, "layer_norm_eps": 1e-5} for name, settings in VARIANTS.items()
    if name not in ("pre-LN", "learned-positions")
}


@pytest.mark.parametrize("variant", MARIAN_VARIANTS)
def test_hf_export_loads_as_marian_with_the_same_logits_and_imports_back(variant, tmp_path):
    transformers = pytest.importorskip("transformers")
    from atencion.interop.marian import from_marian

    model = variant_model(MARIAN_VARIANTS[variant])
    export(model, tmp_path / "hf", "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.decoder_start_token_id == model.cfg.bos_id
    src, tgt = random_batch(model.cfg, batch=4, src_len=9, tgt_len=7)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=src != model.cfg.pad_id, decoder_input_ids=tgt).logits
        assert (theirs - model(src, tgt)).abs().max() <= 1e-4
    back = from_marian(hf).state_dict()
    ours = model.state_dict()
    for name, tensor in back.items():  # biases Marian always has are zeros where ours had none
        torch.testing.assert_close(tensor, ours.get(name, torch.zeros_like(tensor)), rtol=0, atol=0)


@pytest.mark.parametrize("setting", [dict(norm_first=True), dict(positional="learned"),
                                     dict(layer_norm_eps=1e-6)], ids=["norm_first", "positional", "layer_norm_eps"])
def test_hf_export_refuses_what_marian_cannot_express(setting, tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=next(iter(setting))):
        export(small_model(**setting), tmp_path / "hf", "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_hf_export_tokenizes_and_generates_greedily_like_atencion(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    _, model, tokenizer, texts, sources = trained
    export(model, tmp_path / "hf", "hf", tokenizer)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    batch = hf_tokenizer(texts, return_tensors="pt", padding=True)
    assert [[i for i in row if i != model.cfg.pad_id] for row in batch.input_ids.tolist()] == sources
    generated = hf.generate(**batch, num_beams=1, max_new_tokens=30)
    special = (model.cfg.pad_id, model.cfg.eos_id)
    assert [[i for i in row[1:] if i not in special] for row in generated.tolist()] == \
        atencion_tokens(model, sources, 1, 0.0, 0.0, 30)


# ONNX -------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:# The axis name", "ignore:.*treespec, LeafSpec")
def test_onnx_encoder_and_decoder_steps_match_atencion(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import numpy as np

    from atencion.export.onnx import OnnxTranslator

    # one export (they take seconds) with every path that differs from the default: pre-LN,
    # learned positions, GELU, output bias, separate vocabularies, more decoder than encoder layers
    model = variant_model({**VARIANTS["pre-LN"], **VARIANTS["learned-positions"], **VARIANTS["gelu-output-bias"],
                           **VARIANTS["separate-vocab"], "n_decoder_layers": 3})
    export(model, tmp_path / "onnx", "onnx")
    runtime = OnnxTranslator(tmp_path / "onnx")
    cfg = model.cfg
    src, tgt = random_batch(cfg, batch=4, src_len=9, tgt_len=7)
    memory = runtime.encode(src.numpy())
    with torch.no_grad():
        expected, src_mask = model.encode(src)
        assert np.abs(memory - expected.numpy()).max() <= 1e-4
        state = model.init_state(expected, src_mask)
        real = (src != cfg.pad_id).numpy()
        empty = np.zeros((cfg.decoder_layers, 4, cfg.n_heads, 0, cfg.d_k), np.float32)
        keys, values, last = empty, empty, tgt[:, :1]
        for _ in range(5):  # greedy steps, the cache growing by one each time
            step = model.decode_step(last, state)
            logits, keys, values = runtime.step(last.numpy(), memory, real, keys, values)
            assert np.abs(logits - step.numpy()).max() <= 1e-4
            last = step[:, -1].argmax(-1, keepdim=True)
        # several new tokens in one step see each other causally, as in teacher forcing
        logits, _, _ = runtime.step(tgt.numpy(), memory, real, empty, empty)
        assert np.abs(logits - model(src, tgt).numpy()).max() <= 1e-4
    assert runtime.greedy(src.numpy(), 8) == greedy_search(model, src, 0.0, 8)


# the command ------------------------------------------------------------------------------------

def test_export_command_refuses_a_directory_that_is_not_empty(trained, tmp_path, capsys):
    model_dir = trained[0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert main(["export", "--model", str(model_dir), "--format", "onnx", "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "keep me"
