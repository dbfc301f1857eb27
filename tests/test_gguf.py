"""GGUF export (llama.cpp): every tensor and key read back with gguf's own reader, the file read as
the same model by Hugging Face's independent GGUF loader, RoPE's pairs as llama.cpp turns them, and
what llama.cpp has no architecture for refused in one line. llama.cpp itself (llama-cpp-python,
built from source) is an opt-in check: its test skips when the package is absent."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from atencion.cli import main
from atencion.data.tokenizer import Tokenizer
from atencion.errors import AtencionError
from atencion.export import export, export_model_dir
from atencion.nn.model_dir import save_model_dir
from conftest import small_model
from test_training import WORDS

gguf = pytest.importorskip("gguf")

GPT2 = dict(arch="decoder", positional="learned", norm_first=True, activation="gelu-tanh", scale_embedding=False,
            dropout=0.0, n_heads=4, d_ff=128, max_positions=1024)  # d_ff 4·d_model: what transformers' reader assumes
LLAMA = dict(arch="decoder", positional="rope", norm="rmsnorm", norm_first=True, activation="swiglu", bias=False,
             scale_embedding=False, dropout=0.0, n_heads=4, max_positions=64)
MODELS = {
    "gpt2": dict(GPT2),
    "gpt2-untied-qkv-bias-only": dict(GPT2, tie_output=False, bias=False, qkv_bias=True),
    "llama-gqa-untied": dict(LLAMA, n_kv_heads=2, tie_output=False),
    "llama-mqa": dict(LLAMA, n_kv_heads=1),
    "llama-mqa-biases": dict(LLAMA, n_kv_heads=1, bias=True),
    "llama-qkv-bias-linear-rope": dict(LLAMA, qkv_bias=True, rope_scaling={"type": "linear", "factor": 2.0},
                                       rope_base=500.0),
    "llama3-rope": dict(LLAMA, n_kv_heads=2, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 16}),
}


@pytest.fixture(scope="module")
def lines() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(300)]


@pytest.fixture(scope="module")
def tokenizers(lines) -> dict[str, Tokenizer]:
    return {"char": Tokenizer.train_text(lines + ["\n"], kind="char"),
            "sentencepiece": Tokenizer.train_text(lines, vocab_size=60)}


def model_for(name: str, tokenizer: Tokenizer, seed: int = 0):
    model = small_model(seed, vocab_size=tokenizer.vocab_size, **MODELS[name])
    with torch.no_grad():   # biases start at 0 in some layers; randomise them so the test sees each
        for param_name, p in model.named_parameters():
            if param_name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model


def read(directory):
    reader = gguf.GGUFReader(directory / "model.gguf")
    keys = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return reader, keys


def per_head_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Row h·d_k + 2i of the result is row h·d_k + i of ``w``, row h·d_k + 2i + 1 is row h·d_k + i + d_k/2."""
    out = torch.empty_like(w)
    dk = w.shape[0] // heads
    for h in range(heads):
        for i in range(dk // 2):
            out[h * dk + 2 * i] = w[h * dk + i]
            out[h * dk + 2 * i + 1] = w[h * dk + i + dk // 2]
    return out


def expected_tensors(model) -> dict[str, torch.Tensor]:
    """llama.cpp's tensors of ``model``, written out by hand from its state dict."""
    cfg, s = model.cfg, {k: v.detach() for k, v in model.state_dict().items()}
    gpt2 = cfg.positional == "learned"
    out = {"token_embd.weight": s["decoder.embed.weight"], "output_norm.weight": s["decoder.final_norm.weight"]}
    if gpt2:
        out["position_embd.weight"] = s["decoder.positions.weight"]
        out["output_norm.bias"] = s["decoder.final_norm.bias"]
    if not cfg.tie_output:
        out["output.weight"] = s["generator.weight"]
    h, g, dk = cfg.n_heads, cfg.kv_heads, cfg.d_k
    for i in range(cfg.n_layers):
        p, b = f"decoder.layers.{i}.", f"blk.{i}."
        names = ({"attn_norm": "res_self.norm", "attn_qkv": "self_attn.in_proj", "attn_output": "self_attn.out_proj",
                  "ffn_norm": "res_ffn.norm", "ffn_up": "ffn.linear1", "ffn_down": "ffn.linear2"} if gpt2 else
                 {"attn_norm": "res_self.norm", "attn_output": "self_attn.out_proj", "ffn_norm": "res_ffn.norm",
                  "ffn_gate": "ffn.linear1", "ffn_up": "ffn.linear3", "ffn_down": "ffn.linear2"})
        for theirs, ours in names.items():
            out[b + theirs + ".weight"] = s[p + ours + ".weight"]
            if p + ours + ".bias" in s:
                out[b + theirs + ".bias"] = s[p + ours + ".bias"]
            elif gpt2:   # llama.cpp's gpt2 has every bias: zeros
                out[b + theirs + ".bias"] = torch.zeros(s[p + ours + ".weight"].shape[0])
        if not gpt2:
            for param in ("weight", "bias"):
                if p + "self_attn.in_proj." + param in s:
                    w = s[p + "self_attn.in_proj." + param]
                    out[b + "attn_q." + param] = per_head_interleaved(w[: h * dk], h)
                    out[b + "attn_k." + param] = per_head_interleaved(w[h * dk: (h + g) * dk], g)
                    out[b + "attn_v." + param] = w[(h + g) * dk:]
    if cfg.rope_scaling is not None and cfg.rope_scaling["type"] == "llama3":
        out["rope_freqs.weight"] = rope_divisors_llama3(cfg)
    return out


def rope_divisors_llama3(cfg) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py rule for Llama 3.1's rope_freqs, one frequency at a time."""
    import math

    sc, out = cfg.rope_scaling, []
    low_wavelength = sc["original_max_position_embeddings"] / sc["low_freq_factor"]
    high_wavelength = sc["original_max_position_embeddings"] / sc["high_freq_factor"]
    for i in range(0, cfg.d_k, 2):
        wavelength = 2 * math.pi * cfg.rope_base ** (i / cfg.d_k)
        if wavelength < high_wavelength:
            out.append(1.0)
        elif wavelength > low_wavelength:
            out.append(sc["factor"])
        else:
            smooth = (sc["original_max_position_embeddings"] / wavelength - sc["low_freq_factor"]) / (
                sc["high_freq_factor"] - sc["low_freq_factor"])
            out.append(1 / ((1 - smooth) / sc["factor"] + smooth))
    return torch.tensor(out)


def expected_keys(model, tokenizer, file_type: int) -> dict:
    cfg = model.cfg
    arch = "gpt2" if cfg.positional == "learned" else "llama"
    f32 = lambda x: float(np.float32(x))  # noqa: E731  (GGUF stores these as float32)
    keys = {"general.architecture": arch, "general.name": "atencion", "general.file_type": file_type,
            "general.quantization_version": 2, f"{arch}.context_length": cfg.max_positions,
            f"{arch}.embedding_length": cfg.d_model, f"{arch}.block_count": cfg.n_layers,
            f"{arch}.feed_forward_length": cfg.d_ff, f"{arch}.attention.head_count": cfg.n_heads,
            f"{arch}.vocab_size": cfg.vocab_size, "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 3, "tokenizer.ggml.unknown_token_id": 1,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": False,
            "tokenizer.ggml.add_eos_token": False}
    if arch == "gpt2":
        keys["gpt2.attention.layer_norm_epsilon"] = f32(cfg.layer_norm_eps)
    else:
        keys.update({"llama.attention.head_count_kv": cfg.kv_heads, "llama.rope.dimension_count": cfg.d_k,
                     "llama.attention.layer_norm_rms_epsilon": f32(cfg.layer_norm_eps),
                     "llama.rope.freq_base": f32(cfg.rope_base)})
        if cfg.rope_scaling is not None and cfg.rope_scaling["type"] == "linear":
            keys.update({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": cfg.rope_scaling["factor"]})
    if tokenizer.kind == "char":
        pieces = [p.replace(" ", "\u2581") for p in tokenizer.src.pieces]
        keys.update({"tokenizer.ggml.tokens": pieces, "tokenizer.ggml.scores": [0.0] * len(pieces),
                     "tokenizer.ggml.token_type": [3, 2, 3, 3] + [1] * (len(pieces) - 4),
                     "tokenizer.ggml.add_space_prefix": False})
    else:
        spm = tokenizer.src
        n = spm.get_piece_size()
        keys.update({"tokenizer.ggml.tokens": [spm.id_to_piece(i) for i in range(n)],
                     "tokenizer.ggml.scores": [f32(spm.get_score(i)) for i in range(n)],
                     "tokenizer.ggml.token_type": [3, 2, 3, 3] + [1] * (n - 4),
                     "tokenizer.ggml.add_space_prefix": True})
    return keys


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gguf_holds_every_tensor_and_key_as_llama_cpp_names_them(name, dtype, tokenizers, tmp_path):
    tokenizer = tokenizers["char" if "gpt2" in name else "sentencepiece"]
    model = model_for(name, tokenizer)
    export(model, tmp_path / "out", "gguf", tokenizer, None if dtype == "float32" else dtype)
    reader, keys = read(tmp_path / "out")
    assert keys == expected_keys(model, tokenizer, 0 if dtype == "float32" else 1)
    expected = expected_tensors(model)
    assert sorted(t.name for t in reader.tensors) == sorted(expected)
    for t in reader.tensors:
        want = expected[t.name]
        half = dtype == "float16" and want.dim() == 2 and t.name != "position_embd.weight"
        assert t.tensor_type == (gguf.GGMLQuantizationType.F16 if half else gguf.GGMLQuantizationType.F32), t.name
        assert list(t.shape) == list(reversed(want.shape)), t.name   # GGUF's ne: the innermost dimension first
        want = want.half() if half else want.float()
        assert torch.equal(torch.from_numpy(np.array(t.data)).reshape(want.shape), want), t.name


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["gpt2", "gpt2-untied-qkv-bias-only", "llama-gqa-untied", "llama-mqa"])
def test_transformers_reads_the_gguf_as_the_same_model(name, dtype, tokenizers, tmp_path):
    """Hugging Face's GGUF loader (its own tensor map, and its inverse of the q/k permutation)
    computes atencion's logits: exactly the float32 model's, or the model with its matrices
    rounded to float16. (It drops a llama file's biases and ignores rope_freqs: those are
    proven by the tensor and RoPE tests.)"""
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizers["char"]
    model = model_for(name, tokenizer)
    export(model, tmp_path / "out", "gguf", tokenizer, dtype)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()
    if dtype == "float16":
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if p.dim() == 2 and "positions" not in param_name:
                    p.copy_(p.half().float())
    ids = torch.randint(4, tokenizer.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=1e-5)


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """llama.cpp's RoPE (ggml_rope, mode 0): the pair (2i, 2i + 1) of each head turned by position · θ_i."""
    angle = positions[:, None].double() * theta[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    even, odd = x[..., 0::2].double(), x[..., 1::2].double()
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-qkv-bias-linear-rope", "llama3-rope"])
def test_rope_as_llama_cpp_turns_the_exported_queries_and_keys_gives_atencions_scores(name, tokenizers, tmp_path):
    """Queries and keys from the GGUF's attn_q and attn_k, turned as llama.cpp turns them (pairs 2i,
    2i + 1; θ_i = freq_base^(−2i/dims) ÷ rope_freqs, positions × 1/scaling.factor), score every key
    as atencion's attention does (its own queries and keys, turned by its own RoPE)."""
    tokenizer = tokenizers["sentencepiece"]
    model = model_for(name, tokenizer)
    cfg = model.cfg
    export(model, tmp_path / "out", "gguf", tokenizer)
    reader, keys = read(tmp_path / "out")
    tensors = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    h, g, dk, n = cfg.n_heads, cfg.kv_heads, cfg.d_k, 9
    x = torch.randn(n, cfg.d_model, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(n)

    def project(name, heads):
        y = x @ tensors[f"blk.0.{name}.weight"].T + tensors.get(f"blk.0.{name}.bias", 0)
        return y.reshape(n, heads, dk)

    dims = keys["llama.rope.dimension_count"]
    theta = keys["llama.rope.freq_base"] ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    theta = theta / tensors["rope_freqs.weight"].double() if "rope_freqs.weight" in tensors else theta
    scaled = positions / keys.get("llama.rope.scaling.factor", 1.0)
    q = rope_interleaved(project("attn_q", h), scaled, theta)
    k = rope_interleaved(project("attn_k", g), scaled, theta).repeat_interleave(h // g, dim=1)
    theirs = torch.einsum("qhd,khd->hqk", q, k)

    attn = model.decoder.layers[0].self_attn
    qkv = attn.in_proj(x)
    ours_q, ours_k = qkv[:, : h * dk].reshape(n, h, dk), qkv[:, h * dk: (h + g) * dk].reshape(n, g, dk)
    inv_freq = _rotary_of(model).inv_freq.double()
    angle = positions[:, None].double() * inv_freq[None, :]
    cos, sin = torch.cat([angle, angle], -1).cos()[:, None], torch.cat([angle, angle], -1).sin()[:, None]

    def rotate_half(t):
        t = t.double()
        return t * cos + torch.cat([-t[..., dk // 2:], t[..., : dk // 2]], -1) * sin

    ours = torch.einsum("qhd,khd->hqk", rotate_half(ours_q), rotate_half(ours_k).repeat_interleave(h // g, dim=1))
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def _rotary_of(model):
    from atencion.nn.positional import RotaryPositions

    return next(m for m in model.modules() if isinstance(m, RotaryPositions))


def test_q8_0_stores_each_block_within_half_a_step_and_odd_rows_in_float16(tokenizers, tmp_path):
    """Q8_0: blocks of 32 values, one scale d = max|x|/127 each (stored in float16), every value
    within d/2 of the model's (plus 127 times the scale's float16 rounding);
    a matrix whose rows are not a multiple of 32 (ffn_down, d_ff 48) is float16, as llama.cpp's converter does."""
    tokenizer = tokenizers["sentencepiece"]
    model = small_model(vocab_size=tokenizer.vocab_size, **dict(LLAMA, d_ff=48))
    export(model, tmp_path / "out", "gguf", tokenizer, "q8_0")
    reader, keys = read(tmp_path / "out")
    assert keys["general.file_type"] == 7
    expected = expected_tensors(model)
    for t in reader.tensors:
        want = expected[t.name].float()
        if want.dim() == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
        elif want.shape[1] % 32:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16, t.name
            assert torch.equal(torch.from_numpy(np.array(t.data)).reshape(want.shape), want.half())
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0, t.name
            got = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type)).reshape(want.shape)
            blocks, wanted = got.reshape(-1, 32), want.reshape(-1, 32)
            step = wanted.abs().amax(1, keepdim=True) / 127   # stored as float16: 127 steps off by its rounding
            bound = step / 2 + 127 * (step - step.half().float()).abs()
            assert ((blocks - wanted).abs() <= bound * (1 + 1e-6)).all(), t.name
    assert "blk.0.ffn_down.weight" in expected and "blk.0.ffn_gate.weight" in expected


def test_transformers_tokenizes_the_exported_sentencepiece_vocabulary_as_atencion(tokenizers, lines, tmp_path):
    """The tokenizer keys, read by Hugging Face's GGUF tokenizer reader, give atencion's ids."""
    from transformers import AutoTokenizer

    tokenizer = tokenizers["sentencepiece"]
    export(model_for("llama-gqa-untied", tokenizer), tmp_path / "out", "gguf", tokenizer)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "out", gguf_file="model.gguf")
    for line in lines[:20]:
        assert theirs(line, add_special_tokens=False)["input_ids"] == tokenizer.encode(line)


def test_export_command_writes_a_gguf_and_refuses_an_encoder_decoder_in_one_line(tokenizers, tmp_path, capsys):
    tokenizer = tokenizers["sentencepiece"]
    save_model_dir(tmp_path / "lm", model_for("llama-gqa-untied", tokenizer), tokenizer)
    assert main(["export", "--model", str(tmp_path / "lm"), "--format", "gguf", "--dtype", "float16",
                 "--out", str(tmp_path / "lm.gguf")]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == ["model.gguf"]
    assert read(tmp_path / "lm.gguf")[1]["general.file_type"] == 1

    save_model_dir(tmp_path / "mt", small_model(vocab_size=tokenizer.vocab_size), tokenizer)
    assert main(["export", "--model", str(tmp_path / "mt"), "--format", "gguf", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "arch='encoder-decoder' cannot be exported" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists()


REFUSED = {
    "encoder": (dict(arch="encoder"), "arch='encoder'"),
    "window": (dict(LLAMA, attention={"kind": "window", "window": 4}), "attention.kind window"),
    "alibi": (dict(LLAMA, positional="alibi"), "positional='alibi'"),
    "moe": (dict(LLAMA, moe={"experts": 2, "top_k": 1}), "moe"),
    "geglu": (dict(LLAMA, activation="geglu"), "activation='geglu'"),
    "gpt2-erf-gelu": (dict(GPT2, activation="gelu"), "activation='gelu'"),
    "gpt2-gqa": (dict(GPT2, n_kv_heads=2), "n_kv_heads=2"),
    "post-ln": (dict(LLAMA, norm_first=False), "norm_first=False"),
    "scaled-embeddings": (dict(LLAMA, scale_embedding=True), "scale_embedding=True"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_gguf_export_refuses_what_llama_cpp_has_no_architecture_for(case, tokenizers, tmp_path):
    settings, named = REFUSED[case]
    tokenizer = tokenizers["sentencepiece"]
    model = small_model(vocab_size=tokenizer.vocab_size, **settings)
    with pytest.raises(AtencionError) as err:
        export(model, tmp_path / "out", "gguf", tokenizer)
    assert named in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_gguf_export_refuses_tokenizers_llama_cpp_would_read_otherwise(lines, tmp_path):
    unigram = Tokenizer.train_text(lines, vocab_size=60, model_type="unigram")
    whitespace = Tokenizer.train_text(lines, kind="whitespace")
    subwords = Tokenizer.train_text(lines, kind="subword-nmt", vocab_size=20)
    for tokenizer, named in [(unigram, "a unigram SentencePiece model"), (whitespace, "whitespace"),
                             (subwords, "data.tokenizer subword-nmt cannot be exported"), (None, "no tokenizer")]:
        size = tokenizer.vocab_size if tokenizer is not None else 60
        with pytest.raises(AtencionError, match=named):
            export(small_model(vocab_size=size, **LLAMA), tmp_path / "out", "gguf", tokenizer)
    with pytest.raises(AtencionError, match="--dtype is for --format gguf"):
        export(small_model(), tmp_path / "out", "onnx", None, "float16")
    assert not (tmp_path / "out").exists()


def test_llama_cpp_continues_greedily_as_atencion(tokenizers, lines, tmp_path):
    """Opt-in (llama-cpp-python builds llama.cpp from source): llama.cpp, on the exported file,
    gives atencion's greedy continuation of the same prompt ids, for GPT-2 and Llama."""
    llama_cpp = pytest.importorskip("llama_cpp")
    tokenizer = tokenizers["char"]
    for name in ("gpt2", "llama-gqa-untied"):
        model = model_for(name, tokenizer)
        export(model, tmp_path / name, "gguf", tokenizer)
        llm = llama_cpp.Llama(str(tmp_path / name / "model.gguf"), n_ctx=64, n_threads=1, verbose=False)
        ours, theirs = greedy_continuations(model, llm, tokenizer.encode(lines[0][:12]), 16)
        assert theirs == ours, name


def greedy_continuations(model, llm, prompt: list[int], count: int) -> tuple[list[int], list[int]]:
    """The ``count`` greedy tokens after ``prompt`` of atencion's ``model`` (full passes) and of llama.cpp's ``llm``."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(count):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    theirs = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
        theirs.append(token)
        if len(theirs) == count:
            break
    return ids[0, len(prompt):].tolist(), theirs


# A Hugging Face directory's byte-level BPE, each way its pre_tokenizer can split text for llama.cpp:
# (pre_tokenizer, the BPE model's ignore_merges, NFC normalizer), the regexes as Llama 3's and Qwen2's
# tokenizer.json spell them
def byte_level_splits():
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pre

    words = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
    rest = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=False)
    return {"gpt-2": (pre.ByteLevel(add_prefix_space=False), False, False),
            "smollm": (pre.Sequence([pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False)]),
                       False, False),
            "llama-bpe": (pre.Sequence([pre.Split(Regex(words + r"\p{N}{1,3}" + rest), "isolated"), byte_level]),
                          True, False),
            "qwen2": (pre.Sequence([pre.Split(Regex(words + r"\p{N}" + rest), "isolated"), byte_level]), False, True)}


# texts where the four ways of splitting part: digit runs, contractions, runs of spaces and line breaks
PROBES = ["I've 12345 tomatoes, 3.14 and 2024 pears", "  two  spaces\n\n\tand  a tab", "WE'LL see it's 7:05",
          "ñandú über 東京 😀", "3333333 333 33", "<think>who goes</think>", "(the) [the] \"the\" I'LL"]


def hf_byte_level_dir(path, split: str, lines: list[str], bos: bool = False):
    """A Hugging Face Llama directory (random weights, a vocabulary 3 ids larger than the tokenizer's)
    with a byte-level BPE trained here, split as ``split``; its post-processor adds BOS with ``bos``."""
    import transformers
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, processors, trainers
    from tokenizers import pre_tokenizers as pre

    pre_tokenizer, ignore_merges, nfc = byte_level_splits()[split]
    backend = Backend(models.BPE(ignore_merges=ignore_merges))
    backend.pre_tokenizer, backend.decoder = pre_tokenizer, decoders.ByteLevel()
    if nfc:
        backend.normalizer = normalizers.NFC()
    digits = [" ".join(str(random.Random(i).randrange(10 ** (i % 7 + 1))) for _ in range(4)) for i in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre.ByteLevel.alphabet())
    backend.train_from_iterator(lines + digits + ["I've we'll it's WE'LL (the) [the] \"the\"  \n\n  "] * 20, trainer)
    backend.add_tokens(["<think>", "</think>"])
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                               special_tokens=[("<|endoftext|>", 0)])
    path.mkdir(parents=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "chat_template": "{{ messages[0]['content'] }}"}))
    config = transformers.LlamaConfig(vocab_size=backend.get_vocab_size() + 3, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return backend


@pytest.mark.parametrize("split", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_a_hugging_face_byte_level_bpe_goes_in_as_llama_cpps_gpt2_tokenizer(split, lines, tmp_path):
    backend = hf_byte_level_dir(tmp_path / "hf", split, lines, bos=split == "llama-bpe")
    assert main(["export", "--model", str(tmp_path / "hf"), "--format", "gguf", "--out", str(tmp_path / "out")]) == 0
    _, keys = read(tmp_path / "out")
    size = backend.get_vocab_size() + 3
    added = {backend.token_to_id("<think>"), backend.token_to_id("</think>")}
    merges = json.loads(backend.to_str())["model"]["merges"]
    assert keys["tokenizer.ggml.model"] == "gpt2" and keys["tokenizer.ggml.pre"] == split
    assert keys["tokenizer.ggml.tokens"] == [backend.id_to_token(i) or f"[PAD{i}]" for i in range(size)]
    assert keys["tokenizer.ggml.token_type"] == [3 if i == 0 else 4 if i in added else 5 if i >= size - 3 else 1
                                                 for i in range(size)]
    assert keys["tokenizer.ggml.merges"] == [" ".join(m) for m in merges] and len(merges) > 40
    assert keys["tokenizer.ggml.bos_token_id"] == keys["tokenizer.ggml.eos_token_id"] == 0
    assert keys["tokenizer.ggml.add_bos_token"] is (split == "llama-bpe")
    assert keys["tokenizer.ggml.add_eos_token"] is False
    assert keys["tokenizer.chat_template"] == "{{ messages[0]['content'] }}"
    assert "tokenizer.ggml.scores" not in keys and keys["llama.vocab_size"] == size


@pytest.mark.parametrize("split", ["gpt-2", "llama-bpe", "qwen2"])
def test_transformers_tokenizes_the_exported_byte_level_bpe_as_the_directory(split, lines, tmp_path):
    """Hugging Face's GGUF reader (which knows these three splits by their names) gives the directory's
    own ids (a wrong name, merge or added token would part them on the probes) and its model's logits."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    backend = hf_byte_level_dir(tmp_path / "hf", split, lines)
    assert main(["export", "--model", str(tmp_path / "hf"), "--format", "gguf", "--out", str(tmp_path / "out")]) == 0
    theirs = AutoTokenizer.from_pretrained(tmp_path / "out", gguf_file="model.gguf")
    for text in PROBES + lines[:10]:
        assert theirs(text, add_special_tokens=False)["input_ids"] == backend.encode(text,
                                                                                    add_special_tokens=False).ids
    ids = torch.tensor([backend.encode(" ".join(PROBES)).ids])
    with torch.no_grad():
        want = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
        got = LlamaForCausalLM.from_pretrained(tmp_path / "out", gguf_file="model.gguf").eval()(ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=0)


def test_gguf_export_refuses_a_tokenizer_json_llama_cpp_would_read_otherwise(lines, tmp_path, capsys):
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    def both_ends(info):
        backend = Backend.from_str(json.dumps(info))
        think = backend.token_to_id("<think>")
        backend.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A <think>", special_tokens=[("<|endoftext|>", 0), ("<think>", think)])
        return json.loads(backend.to_str())

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    cases = {"metaspace": (lambda info: dict(info, pre_tokenizer={"type": "Metaspace", "replacement": "\u2581",
                                                                  "prepend_scheme": "always", "split": True}),
                           "a BPE model without a ByteLevel pre-tokenizer"),
             "whitespace-split": (lambda info: dict(info, pre_tokenizer={"type": "Sequence", "pretokenizers": [
                                      {"type": "WhitespaceSplit"}, byte_level]}),
                                  "splits text in a way llama.cpp has no pre-tokenizer for"),
             "prefix-space": (lambda info: dict(info, pre_tokenizer=dict(byte_level, add_prefix_space=True)),
                              "splits text in a way llama.cpp has no pre-tokenizer for"),
             "ignore-merges": (lambda info: dict(info, model=dict(info["model"], ignore_merges=True)),
                               "model.ignore_merges True cannot be exported with this pre_tokenizer; llama.cpp's "
                               "gpt-2 sets it False"),
             "lowercase": (lambda info: dict(info, normalizer={"type": "Lowercase"}), "normalizer Lowercase"),
             "both-ends": (both_ends, "llama.cpp adds at most BOS before a prompt and EOS after it")}
    for name, (change, named) in cases.items():
        directory = tmp_path / name
        hf_byte_level_dir(directory, "gpt-2", lines)
        info = json.loads((directory / "tokenizer.json").read_text())
        (directory / "tokenizer.json").write_text(json.dumps(change(info)))
        capsys.readouterr()  # (transformers' progress bar, writing the directory)
        assert main(["export", "--model", str(directory), "--format", "gguf", "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert named in err and f"{directory / 'tokenizer.json'}" in err and len(err.splitlines()) == 1, (name, err)
        assert not (tmp_path / "x").exists()


def test_llama_cpp_tokenizes_and_continues_a_hugging_face_directory_as_atencion(lines, tmp_path):
    """Opt-in (llama-cpp-python): llama.cpp, on the GGUF of a Hugging Face directory, cuts every probe
    into the ids the directory's tokenizer.json gives, for each of the four splits, and continues a
    prompt greedily as `atencion generate` does on the directory itself."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from atencion.nn.model_dir import load_model_dir

    for split in ("gpt-2", "smollm", "llama-bpe", "qwen2"):
        backend = hf_byte_level_dir(tmp_path / split, split, lines, bos=split == "llama-bpe")
        export_model_dir(tmp_path / split, tmp_path / f"{split}.gguf", "gguf")
        llm = llama_cpp.Llama(str(tmp_path / f"{split}.gguf" / "model.gguf"), n_ctx=64, n_threads=1, verbose=False)
        for text in PROBES + lines[:10]:
            ours = backend.encode(text).ids   # with BOS where the post-processor adds it
            assert llm.tokenize(text.encode(), add_bos=split == "llama-bpe", special=True) == ours, (split, text)
        model, _ = load_model_dir(tmp_path / split)
        ours, theirs = greedy_continuations(model, llm, backend.encode(lines[0]).ids, 12)
        assert theirs == ours, split
