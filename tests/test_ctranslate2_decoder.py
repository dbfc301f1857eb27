"""CTranslate2 runs atencion's decoder-only models: the export's log-probabilities equal atencion's,
its greedy generation gives atencion's tokens (and transformers' for a Hugging Face directory), and
what CTranslate2 cannot express is refused in one line with nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.cli import main
from atencion.data.tokenizer import Tokenizer
from atencion.decode.sample import generate_ids
from atencion.export import export
from test_hf_dirs import DECODERS, TEXTS, hf_tokenizer, save_llama_dir

ctranslate2 = pytest.importorskip("ctranslate2")

VOCAB = 64
LLAMA3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # with d_k 32, frequencies kept, interpolated and divided
VARIANTS = {  # preset and overrides: every setting the decoder export maps differently
    "gpt-tiny": ("gpt-tiny", {}),  # pre-LN LayerNorm, gelu-tanh, learned positions, tied output, biases
    "llama-tiny": ("llama-tiny", {}),  # RMSNorm, SwiGLU, RoPE, 2 key/value heads of 4, own output, no biases
    "multi-query-geglu": ("llama-tiny", dict(n_kv_heads=1, activation="geglu", rope_base=500000.0)),
    "qwen2-qkv-bias": ("llama-tiny", dict(qkv_bias=True, rope_base=1000000.0, layer_norm_eps=1e-6)),
    "mistral-window": ("llama-tiny", dict(attention={"kind": "window", "window": 6})),
    "rope-linear": ("llama-tiny", dict(rope_scaling={"type": "linear", "factor": 4.0})),
    "rope-llama3": ("llama-tiny", dict(rope_scaling=LLAMA3)),
    # Bloom: ALiBi with 6 heads (not a power of two), a LayerNorm on the embeddings (and an output of its
    # own, as in the next: with the tied table, these random models repeat the last token)
    "bloom-alibi": ("gpt-tiny", dict(positional="alibi", embedding_norm=True, d_model=96, n_heads=6, d_ff=384,
                                     tie_output=False)),
    # the paper's blocks as a decoder: post-LN, sinusoids, ReLU, embeddings × √d_model; and an output bias
    "paper-post-ln": ("tiny", dict(arch="decoder", output_bias=True, tie_output=False)),
    # T5's unscaled attention and scaled output, flash attention (eq. 1 once exported)
    "t5-scaling-flash": ("llama-tiny", dict(scale_attention=False, scale_output=True, tie_output=True, bias=True,
                                            attention={"kind": "flash"})),
}


def variant_model(name: str, seed: int = 0) -> Transformer:
    """A random model of the variant, every parameter moved off its initial value (norm gains
    from 1, biases from 0) so that each one's place in the export shows."""
    preset, overrides = VARIANTS[name]
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.preset(preset, vocab_size=VOCAB, dropout=0.0, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def exported(model, tmp_path, tokenizer=None):
    """The export of ``model`` and its vocabulary."""
    export(model, tmp_path / "ct2", "ctranslate2", tokenizer)
    return tmp_path / "ct2", json.loads((tmp_path / "ct2" / "vocabulary.json").read_text())


def ct2_generate(*args, **kwargs):
    """One CTranslate2 thread, as in test_export.py (its OpenMP runtime beside torch's on a busy machine)."""
    from atencion.export.ctranslate2_decoder import ct2_generate as generate

    return generate(*args, threads=1, **kwargs)


def greedy(model, prompts: list[list[int]], new: int, stop=None) -> list[list[int]]:
    """atencion's greedy ``generate_ids``, one prompt at a time, each row cut after its first stop id."""
    rows = []
    for prompt in prompts:
        row = generate_ids(model, torch.tensor([prompt]), new, temperature=0.0, stop_id=stop)[0].tolist()
        ends = [i for i, t in enumerate(row) if stop is not None and t in stop]
        rows.append(row[: ends[0] + 1] if ends else row)
    return rows


def random_prompts(lengths, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("variant", VARIANTS)
def test_ctranslate2_scores_equal_atencions_log_probabilities(variant, tmp_path):
    """``Generator.score_batch``: log p(x_t | x_<t) of each token after the first, ≤ 1e-4 of atencion's.
    (CTranslate2 fails inside ``score_batch`` on a text longer than its sliding window + 1, so the
    window's texts are 7 tokens; its generation, below, goes far past the window.)"""
    model = variant_model(variant)
    directory, vocab = exported(model, tmp_path)
    length = 7 if variant == "mistral-window" else 16
    ids = torch.tensor(random_prompts([length] * 3))
    results = ctranslate2.Generator(str(directory), intra_threads=1).score_batch(
        [[vocab[i] for i in row] for row in ids.tolist()])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids), dim=-1)[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
    assert (torch.tensor([r.log_probs for r in results]) - log_probs).abs().max() <= 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_ctranslate2_greedy_generation_gives_atencions_tokens(variant, tmp_path):
    """Prompts of 1 to 10 tokens, several of each length, in one call: 24 new tokens each, those of
    atencion's greedy ``generate_ids`` (the window's 10-token prompts are longer than its 6 keys)."""
    model = variant_model(variant)
    directory, _ = exported(model, tmp_path)
    prompts = random_prompts([1, 4, 4, 10, 10, 10])
    expected = greedy(model, prompts, 24)
    assert ct2_generate(directory, prompts, 24) == expected
    assert any(len(set(row)) > 3 for row in expected)  # texts that vary, not one token repeated
    assert [len(row) for row in ct2_generate(directory, prompts, 24, compute_type="int8")] == [24] * len(prompts)


def test_ctranslate2_stops_where_atencion_stops(tmp_path):
    """A model that likes EOS: with stop ids, each row ends at its first one, as ``generate_ids``'s
    rows do; with none (the export's default for atencion's own tokenizers, as ``atencion generate``
    does), generation goes on past EOS, where CTranslate2 would stop by default."""
    model = variant_model("llama-tiny")
    with torch.no_grad():
        model.generator.weight[3] = 3 * model.generator.weight[16]
    directory, _ = exported(model, tmp_path)
    prompts = random_prompts([2, 5, 5, 8], seed=4)
    with_stop = greedy(model, prompts, 16, stop=[3, 7])
    assert any(row[-1] == 3 and len(row) < 16 for row in with_stop)
    assert ct2_generate(directory, prompts, 16, stop=[3, 7]) == with_stop
    through = greedy(model, prompts, 16)
    assert any(3 in row[:-1] for row in through)
    assert json.loads((directory / "atencion.json").read_text())["stop_ids"] == []
    assert ct2_generate(directory, prompts, 16) == ct2_generate(directory, prompts, 16, stop=[]) == through


def test_learned_positions_take_as_many_tokens_as_the_table_has(tmp_path):
    """A 16-row learned table reads a 10-token prompt and 6 chosen tokens (the 7th is chosen, not
    read); one more is refused in one line."""
    model = Transformer(ModelConfig.preset("gpt-tiny", vocab_size=VOCAB, dropout=0.0, max_positions=16)).eval()
    directory, _ = exported(model, tmp_path)
    prompt = random_prompts([10])
    assert ct2_generate(directory, prompt, 7) == greedy(model, prompt, 7)
    with pytest.raises(ValueError, match="prompt 0: 10 tokens and 8 new ones, but the exported position table has 16"):
        ct2_generate(directory, prompt, 8)


@pytest.mark.parametrize("kind", ["char", "whitespace", "sentencepiece"])
def test_export_command_writes_a_decoder_with_its_tokenizers_vocabulary(kind, tmp_path, capsys):
    """`atencion export --format ctranslate2` on a decoder's directory: CTranslate2's decoder spec
    (vocabulary.json holds the tokenizer's pieces in id order), and the same greedy tokens."""
    tokenizer = Tokenizer.train_text(TEXTS, kind, vocab_size=60)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("gpt-tiny", vocab_size=tokenizer.vocab_size, dropout=0.0)).eval()
    model.save(tmp_path / "model")
    tokenizer.save(tmp_path / "model")
    out = tmp_path / "ct2"
    assert main(["export", "--model", str(tmp_path / "model"), "--format", "ctranslate2", "--out", str(out)]) == 0
    assert {"model.bin", "vocabulary.json", "atencion.json", "tokenizer.json"} <= set(
        json.loads(capsys.readouterr().out)["files"])
    assert json.loads((out / "vocabulary.json").read_text()) == [tokenizer.piece(i) for i in
                                                                 range(tokenizer.vocab_size)]
    prompt = [tokenizer.encode("the quick brown fox")]
    assert ct2_generate(out, prompt, 12) == greedy(model, prompt, 12)


@pytest.mark.parametrize("family", DECODERS)
def test_a_hugging_face_llama_directory_exports_and_generates_transformers_greedy_tokens(family, tmp_path):
    """Llama (2 key/value heads of 4), Mistral (a window of 6 keys, 24 tokens generated) and Qwen2
    (q/k/v biases) as save_pretrained writes them, exported from the command line: CTranslate2
    generates the tokens of transformers' greedy ``generate``, stopping at the tokenizer's EOS as both do."""
    import transformers

    llama_dir = save_llama_dir(family, tmp_path / family)
    out = tmp_path / "ct2"
    assert main(["export", "--model", str(llama_dir), "--format", "ctranslate2", "--out", str(out)]) == 0
    hf = getattr(transformers, DECODERS[family][0]).from_pretrained(llama_dir).eval()
    theirs = []
    prompts = [hf_tokenizer(llama_dir)(text).input_ids for text in ("the cat sat", "a dog ran in the park")]
    for ids in prompts:
        theirs.append(hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)[0, len(ids):].tolist())
    assert json.loads((out / "atencion.json").read_text())["stop_ids"] == [hf.generation_config.eos_token_id]
    assert ct2_generate(out, prompts, 24) == theirs
    assert all(len(set(row)) > 3 for row in theirs)


REFUSED = {  # a setting CTranslate2's decoder cannot express, and a word of the one line that refuses it
    "positional": (dict(positional="t5"), "positional='t5'"),
    "moe": (dict(moe={"experts": 2, "top_k": 1}), "moe"),
    "attention.kind": (dict(attention={"kind": "performer"}), "attention.kind performer"),
    "num_labels": (dict(num_labels=2), "num_labels=2"),
    "embedding_norm": (dict(embedding_norm=True), "embedding_norm with norm='rmsnorm'"),
}


@pytest.mark.parametrize("setting", REFUSED)
def test_what_ctranslate2_cannot_express_is_refused_in_one_line(setting, tmp_path, capsys):
    overrides, words = REFUSED[setting]
    model = Transformer(ModelConfig.preset("llama-tiny", vocab_size=VOCAB, **overrides))
    with pytest.raises(ValueError, match=words) as refused:
        export(model, tmp_path / "ct2", "ctranslate2")
    assert "\n" not in str(refused.value) and not (tmp_path / "ct2").exists()
    model.save(tmp_path / "model")
    assert main(["export", "--model", str(tmp_path / "model"), "--format", "ctranslate2",
                 "--out", str(tmp_path / "ct2")]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and not (tmp_path / "ct2").exists()


def test_each_engine_refuses_the_other_kind_of_export(tmp_path):
    from atencion.export.ctranslate2 import ct2_translate
    from conftest import small_model

    export(small_model(), tmp_path / "translator", "ctranslate2")
    directory, _ = exported(variant_model("gpt-tiny"), tmp_path)
    with pytest.raises(ValueError, match="the export is a translator"):
        ct2_generate(tmp_path / "translator", [[5, 6]], 4)
    with pytest.raises(ValueError, match="the export is a decoder-only model's"):
        ct2_translate(directory, [[5, 6, 3]], threads=1)
    with pytest.raises(ValueError, match="prompt 1 holds 64, not a token id"):
        ct2_generate(directory, [[5], [64]], 4)


def test_a_vocabulary_whose_tokens_repeat_is_refused_naming_the_token(tmp_path):
    """CTranslate2 maps tokens by name: a token twice would give two ids one name."""
    from atencion.data.tokenizer import SPECIALS, CharVocab

    tokenizer = Tokenizer(CharVocab([*SPECIALS, "a", "b", "a"]))
    model = Transformer(ModelConfig.preset("gpt-tiny", vocab_size=tokenizer.vocab_size))
    with pytest.raises(ValueError, match="the tokenizer has the token 'a' more than once"):
        export(model, tmp_path / "ct2", "ctranslate2", tokenizer)
    assert not (tmp_path / "ct2").exists()
