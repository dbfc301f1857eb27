"""Export a decoder-only model to GGUF, the single-file format llama.cpp runs, with the tensor names,
keys and layouts that llama.cpp's own converter (``convert_hf_to_gguf.py``) writes for GPT-2 and Llama.

Two of llama.cpp's architectures take atencion's decoders:

* ``gpt2`` (Radford et al. 2019): learned positions, pre-LN LayerNorm, GELU (tanh form), the fused
  [W^Q; W^K; W^V] of ``in_proj`` as ``attn_qkv`` unchanged. llama.cpp's gpt2 has biases on every
  projection: a model with ``bias: false`` gets zeros.
* ``llama`` (Touvron et al. 2023): RoPE, RMSNorm, SwiGLU (``linear1`` is ``ffn_gate``, ``linear3``
  ``ffn_up``), grouped-query attention (``head_count_kv``), biases where the model has them (all
  optional in llama.cpp), RoPE scaling ``linear`` as its keys and ``llama3`` as ``rope_freqs``
  (one divisor of each frequency, the base frequency over atencion's scaled one). llama.cpp turns
  the pairs (2i, 2i + 1) of a head, atencion (and Hugging Face) the pairs (i, i + d_k/2): the rows
  of W^Q and W^K (and their biases) are reordered within each head so that row 2i is row i and row
  2i + 1 is row i + d_k/2 (:func:`interleave_heads`, the converter's ``permute``). The scores
  q·k are unchanged, since both are reordered alike.

Weights are stored as PyTorch's (out, in) arrays, which GGUF records as ne = (in, out), as the
converter does. ``dtype``: ``float32``; ``float16`` (1-D tensors, norms and biases, stay float32, as
the converter keeps them); ``q8_0`` (blocks of 32 values with one scale; a matrix whose rows are not
a multiple of 32 falls back to float16, as in the converter). Learned positions stay float32.

The tokenizer goes into the metadata (``tokenizer.ggml.*``) as llama.cpp's SentencePiece tokenizer
(``llama``) reads it: a BPE SentencePiece model's pieces, scores and piece types, its
``add_dummy_prefix`` as ``add_space_prefix``; a character vocabulary as single-character pieces
(a space as ▁, which llama.cpp's tokenizer turns spaces into), score 0, no space prefix, so that
each character is one token. No BOS or EOS is added to a prompt (atencion's language models
continue the prompt's ids as they are). A Hugging Face directory's byte-level BPE (``tokenizer.json``:
GPT-2's, SmolLM's, Llama 3's, Qwen2's) goes in as llama.cpp's ``gpt2`` tokenizer, as its converter
writes it: the tokens by id (``[PAD{i}]`` where the model's vocabulary has an id the tokenizer lacks),
their types (added special tokens CONTROL, other added tokens USER_DEFINED), the merges, the chat
template, and ``tokenizer.ggml.pre``, the llama.cpp pre-tokenizer whose split of text is the one the
file's ``pre_tokenizer`` describes (:data:`BYTE_LEVEL_SPLITS`; llama.cpp's converter finds it by
hashing the ids of a test text, which only known vocabularies match); BOS and EOS are added to a
prompt where its post-processor adds them, as atencion's ``generate`` reads such a prompt.
Refused in one line each: a unigram SentencePiece model (llama.cpp's tokenizer merges pairs by
score, which is BPE's rule, so its ids would differ), a whitespace vocabulary, a ``tokenizer.json``
that is not byte-level BPE or splits text in a way llama.cpp has no pre-tokenizer for, a missing
tokenizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..data.tokenizer import MASK, SPECIALS, UNK_ID
from ..errors import AtencionError
from ..interop.common import require

FILE = "model.gguf"
DTYPES = ("float32", "float16", "q8_0")
PROBE = "a b"      # a text whose ids show what a post-processor adds around a prompt
SPACE = "\u2581"   # ▁, SentencePiece's (and llama.cpp's) visible space
WHO = "export to gguf"
# llama.cpp's name of each layer's modules → atencion's (llama's q, k, v and norms are split or named apart)
GPT2_MODULES = {"attn_norm": "res_self.norm", "attn_qkv": "self_attn.in_proj", "attn_output": "self_attn.out_proj",
                "ffn_norm": "res_ffn.norm", "ffn_up": "ffn.linear1", "ffn_down": "ffn.linear2"}
LLAMA_MODULES = {"attn_output": "self_attn.out_proj", "ffn_gate": "ffn.linear1", "ffn_up": "ffn.linear3",
                 "ffn_down": "ffn.linear2"}
# llama.cpp's pre-tokenizer (tokenizer.ggml.pre) → how a tokenizer.json splits text for it: its
# pre_tokenizer steps, as (type, setting, ...) from the file, and the BPE model's ignore_merges, which
# llama.cpp sets by the pre-tokenizer (a whole word found in the vocabulary is one token)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL_SPLITS = {
    "gpt-2": ((("ByteLevel", False, True),), False),
    "smollm": ((("Digits", True), ("ByteLevel", False, True)), False),
    "llama-bpe": ((("Split", LLAMA3_SPLIT, "Isolated", False), ("ByteLevel", False, False)), True),
    "qwen2": ((("Split", QWEN2_SPLIT, "Isolated", False), ("ByteLevel", False, False)), False),
}


def gguf_arch(cfg) -> str:
    """llama.cpp's architecture for ``cfg``, or an AtencionError naming the first setting it lacks."""
    if cfg.arch != "decoder":
        raise AtencionError(f"{WHO}: arch={cfg.arch!r} cannot be exported; llama.cpp's gpt2 and llama "
                            f"architectures are decoder-only (arch 'decoder')")
    if cfg.moe is not None:
        raise AtencionError(f"{WHO}: moe (mixture-of-experts feed-forward layers) cannot be exported; llama.cpp's "
                            f"gpt2 and llama take one dense feed-forward network per layer")
    kind = "full" if cfg.attention is None else cfg.attention["kind"]
    if kind not in ("full", "flash"):
        raise AtencionError(f"{WHO}: attention.kind {kind} cannot be exported; llama.cpp's gpt2 and llama "
                            f"architectures attend to every earlier token (kinds full and flash)")
    common = [("norm_first", True), ("scale_attention", True), ("scale_embedding", False),
              ("scale_output", False), ("output_bias", False), ("embedding_norm", False), ("num_labels", 0)]
    if cfg.positional == "learned":
        require(cfg, [*common, ("norm", "layernorm"), ("activation", "gelu-tanh")], WHO,
                "llama.cpp's gpt2 architecture")
        if cfg.kv_heads != cfg.n_heads:
            raise AtencionError(f"{WHO}: n_kv_heads={cfg.n_kv_heads} (grouped-query attention) cannot be expressed by "
                                f"llama.cpp's gpt2 architecture; its llama architecture (positional rope) can")
        return "gpt2"
    if cfg.positional == "rope":
        require(cfg, [*common, ("norm", "rmsnorm"), ("activation", "swiglu")], WHO, "llama.cpp's llama architecture")
        return "llama"
    raise AtencionError(f"{WHO}: positional={cfg.positional!r} cannot be exported; llama.cpp's gpt2 takes "
                        f"learned positions and its llama rope")


def check_tokenizer(tokenizer) -> None:
    """Refuse, in one line, a tokenizer llama.cpp's SentencePiece tokenizer would not read as atencion does."""
    if tokenizer is None:
        raise AtencionError(f"{WHO}: the model has no tokenizer (tokenizer.json in the model directory); "
                            f"llama.cpp reads the vocabulary from the GGUF file")
    if tokenizer.kind in ("whitespace", "subword-nmt"):
        raise AtencionError(f"{WHO}: data.tokenizer {tokenizer.kind} cannot be exported; llama.cpp has no "
                            f"whitespace-separated vocabulary")
    if tokenizer.kind == "char":
        if SPACE in tokenizer.src.pieces:
            raise AtencionError(f"{WHO}: the character vocabulary holds {SPACE!r}, which llama.cpp reads as a space")
        return
    if tokenizer.kind == "huggingface":
        byte_level_pre(tokenizer, json.loads(tokenizer.src.files["tokenizer.json"]))
        prompt_specials(tokenizer)
        return
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto.FromString(tokenizer.src.serialized_model_proto())
    if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        kind = sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()
        raise AtencionError(f"{WHO}: a {kind} SentencePiece model cannot be exported; llama.cpp's SentencePiece "
                            f"tokenizer merges by score (BPE), so train with data.model_type bpe")


def check_gguf(cfg, tokenizer, dtype: str) -> str:
    """Everything :func:`export_gguf` refuses, before anything is written; returns the architecture."""
    if dtype not in DTYPES:
        raise AtencionError(f"--dtype {dtype!r}: GGUF export writes {', '.join(DTYPES)}")
    arch = gguf_arch(cfg)
    check_tokenizer(tokenizer)
    if tokenizer.kind == "huggingface":  # a model's vocabulary may be padded past its tokenizer's ids
        size = max(tokenizer.src.backend.get_vocab(with_added_tokens=True).values()) + 1
        if size > cfg.vocab_size:
            raise AtencionError(f"{WHO}: tokenizer.json has ids up to {size - 1} but the model's vocabulary "
                                f"{cfg.vocab_size} entries")
    elif tokenizer.vocab_size != cfg.vocab_size:
        raise AtencionError(f"{WHO}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
                            f"{cfg.vocab_size}")
    return arch


def _split_steps(pre_tokenizer) -> tuple | None:
    """A tokenizer.json ``pre_tokenizer`` as the (type, setting, ...) steps of :data:`BYTE_LEVEL_SPLITS`."""
    steps = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    out = []
    for step in steps if isinstance(steps, list) else ():
        kind = step.get("type") if isinstance(step, dict) else None
        if kind == "ByteLevel":
            out.append((kind, step.get("add_prefix_space", True), step.get("use_regex", True)))
        elif kind == "Digits":
            out.append((kind, step.get("individual_digits", False)))
        elif kind == "Split" and isinstance(step.get("pattern"), dict) and "Regex" in step["pattern"]:
            out.append((kind, step["pattern"]["Regex"], step.get("behavior"), step.get("invert", False)))
        else:
            return None
    return tuple(out)


def prompt_specials(tokenizer) -> tuple[bool, bool]:
    """Whether a Hugging Face tokenizer's post-processor puts BOS before a prompt and EOS after it (as
    `generate` reads a prompt: tasks/lm.py's ``prompt_ids``), or an AtencionError if it adds other ids."""
    backend, specials = tokenizer.src.backend, tokenizer.specials
    plain, around = backend.encode(PROBE, add_special_tokens=False).ids, backend.encode(PROBE).ids
    start = next((i for i in range(len(around)) if around[i:i + len(plain)] == plain), None)
    before, after = ([], []) if start is None else (around[:start], around[start + len(plain):])
    if start is None or before not in ([], [specials.bos]) or after not in ([], [specials.eos]):
        raise AtencionError(f"{WHO}: {tokenizer.src.directory / 'tokenizer.json'}: its post_processor puts "
                            f"{around} around {plain}; llama.cpp adds at most BOS before a prompt and EOS after it")
    return bool(before), bool(after)


def byte_level_pre(tokenizer, info: dict) -> str:
    """llama.cpp's pre-tokenizer for a Hugging Face tokenizer (``info``: its ``tokenizer.json`` parsed),
    or an AtencionError in one line saying what llama.cpp could not read as the file does."""
    where = f"{WHO}: {tokenizer.src.directory / 'tokenizer.json'}"
    model, pre, normalizer = info.get("model") or {}, info.get("pre_tokenizer") or {}, info.get("normalizer")
    byte_level = model.get("type") == "BPE" and "ByteLevel" in json.dumps(pre)
    if not byte_level or model.get("byte_fallback") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix") or model.get("dropout"):
        raise AtencionError(f"{where}: a {model.get('type')} model without a ByteLevel pre-tokenizer (or with "
                            f"byte fallback, subword marks or dropout) cannot be exported; llama.cpp's gpt2 tokenizer "
                            f"reads byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen2)")
    if normalizer is not None and normalizer.get("type") != "NFC":   # NFC: Qwen2's, which llama.cpp's converter keeps
        raise AtencionError(f"{where}: normalizer {normalizer.get('type')} cannot be exported; llama.cpp's gpt2 "
                            f"tokenizer does not normalize text")
    steps = _split_steps(pre)
    for name, (split, ignore_merges) in BYTE_LEVEL_SPLITS.items():
        if steps == split:
            if bool(model.get("ignore_merges", False)) != ignore_merges:
                raise AtencionError(f"{where}: model.ignore_merges {bool(model.get('ignore_merges'))} cannot be "
                                    f"exported with this pre_tokenizer; llama.cpp's {name} sets it {ignore_merges}")
            return name
    raise AtencionError(f"{where}: pre_tokenizer {json.dumps(pre)[:200]} splits text in a way llama.cpp has no "
                        f"pre-tokenizer for here; exported: GPT-2's, SmolLM's, Llama 3's and Qwen2's")


def interleave_heads(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of a query or key projection (or its bias) with each head's halves interleaved:
    row 2i of a head is its row i, row 2i + 1 its row i + d_k/2 (RoPE's pairs as llama.cpp turns them)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape)


def gguf_tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file of ``model`` under llama.cpp's name, in float32, laid out as
    the module's text says for each architecture."""
    cfg = model.cfg
    arch = gguf_arch(cfg)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["decoder.embed.weight"]}
    if arch == "gpt2":
        out["position_embd.weight"] = state["decoder.positions.weight"]
    for i in range(len(model.decoder.layers)):
        ours, blk = f"decoder.layers.{i}", f"blk.{i}"
        out.update(_gpt2_block(state, ours, blk) if arch == "gpt2" else _llama_block(state, ours, blk, cfg))
    out["output_norm.weight"] = state["decoder.final_norm.weight"]
    if arch == "gpt2":
        out["output_norm.bias"] = state.get("decoder.final_norm.bias", torch.zeros(cfg.d_model))
    if not cfg.tie_output:
        out["output.weight"] = state["generator.weight"]
    if arch == "llama" and cfg.rope_scaling is not None and cfg.rope_scaling["type"] == "llama3":
        out["rope_freqs.weight"] = rope_divisors(cfg)
    return out


def _gpt2_block(state: dict[str, torch.Tensor], ours: str, blk: str) -> dict[str, torch.Tensor]:
    """The tensors of GPT-2 block ``blk`` (atencion's layer ``ours``), each weight with a bias (zeros if none)."""
    out = {}
    for theirs, name in GPT2_MODULES.items():
        weight = state[f"{ours}.{name}.weight"]
        out[f"{blk}.{theirs}.weight"] = weight
        out[f"{blk}.{theirs}.bias"] = state.get(f"{ours}.{name}.bias", torch.zeros(weight.shape[0]))
    return out


def _llama_block(state: dict[str, torch.Tensor], ours: str, blk: str, cfg) -> dict[str, torch.Tensor]:
    """The tensors of llama block ``blk`` (atencion's layer ``ours``): Q, K, V split, Q and K's heads interleaved."""
    h, g, dk = cfg.n_heads, cfg.kv_heads, cfg.d_k
    out = {}
    parts = {"weight": state[f"{ours}.self_attn.in_proj.weight"]}
    if f"{ours}.self_attn.in_proj.bias" in state:
        parts["bias"] = state[f"{ours}.self_attn.in_proj.bias"]
    for param, value in parts.items():
        q, k, v = value.split([h * dk, g * dk, g * dk])
        out[f"{blk}.attn_q.{param}"] = interleave_heads(q, h)
        out[f"{blk}.attn_k.{param}"] = interleave_heads(k, g)
        out[f"{blk}.attn_v.{param}"] = v
    for theirs, name in LLAMA_MODULES.items():
        for param in ("weight", "bias"):
            if f"{ours}.{name}.{param}" in state:
                out[f"{blk}.{theirs}.{param}"] = state[f"{ours}.{name}.{param}"]
    out[f"{blk}.attn_norm.weight"] = state[f"{ours}.res_self.norm.weight"]
    out[f"{blk}.ffn_norm.weight"] = state[f"{ours}.res_ffn.norm.weight"]
    return out


def rope_divisors(cfg) -> torch.Tensor:
    """llama.cpp's ``rope_freqs``: what each RoPE frequency base^(−2i/d_k) is divided by under
    ``rope_scaling`` (the unscaled frequency over atencion's scaled one)."""
    from ..nn.positional import scaled_frequencies

    base = cfg.rope_base ** (-torch.arange(0, cfg.d_k, 2, dtype=torch.float64) / cfg.d_k)
    return (base / scaled_frequencies(base, cfg.rope_scaling)).float()


def _vocabulary(tokenizer) -> tuple[list[str], list[float], list[int], bool]:
    """Pieces, scores, llama.cpp token types and add_space_prefix of ``tokenizer``."""
    from gguf import TokenType

    if tokenizer.kind == "char":
        pieces = tokenizer.src.pieces
        types = [TokenType.UNKNOWN if i == UNK_ID else TokenType.CONTROL if p in SPECIALS or p == MASK
                 else TokenType.NORMAL for i, p in enumerate(pieces)]
        return [p.replace(" ", SPACE) for p in pieces], [0.0] * len(pieces), [int(t) for t in types], False
    from sentencepiece import sentencepiece_model_pb2

    spm = tokenizer.src
    pieces, scores, types = [], [], []
    for i in range(spm.get_piece_size()):
        pieces.append(spm.id_to_piece(i))
        scores.append(float(spm.get_score(i)))
        types.append(TokenType.UNKNOWN if spm.is_unknown(i) else TokenType.CONTROL if spm.is_control(i)
                     else TokenType.UNUSED if spm.is_unused(i) else TokenType.BYTE if spm.is_byte(i)
                     else TokenType.USER_DEFINED if spm.id_to_piece(i) == MASK else TokenType.NORMAL)
    proto = sentencepiece_model_pb2.ModelProto.FromString(spm.serialized_model_proto())
    return pieces, scores, [int(t) for t in types], bool(proto.normalizer_spec.add_dummy_prefix)


def _metadata(writer, model, arch: str, tokenizer, file_type: int) -> None:
    """The keys llama.cpp reads: hyperparameters under ``{arch}.`` and the tokenizer under ``tokenizer.ggml.``."""
    import gguf

    cfg = model.cfg
    writer.add_name("atencion")
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(cfg.max_positions)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(len(model.decoder.layers))
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "gpt2":
        writer.add_layer_norm_eps(cfg.layer_norm_eps)
    else:
        writer.add_head_count_kv(cfg.kv_heads)
        writer.add_layer_norm_rms_eps(cfg.layer_norm_eps)
        writer.add_rope_freq_base(cfg.rope_base)
        writer.add_rope_dimension_count(cfg.d_k)
        if cfg.rope_scaling is not None and cfg.rope_scaling["type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(cfg.rope_scaling["factor"])
    if tokenizer.kind == "huggingface":
        _byte_level_keys(writer, tokenizer, cfg.vocab_size)
        return
    pieces, scores, types, space_prefix = _vocabulary(tokenizer)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(space_prefix)
    writer.add_bos_token_id(cfg.bos_id)
    writer.add_eos_token_id(cfg.eos_id)
    writer.add_unk_token_id(UNK_ID)
    writer.add_pad_token_id(cfg.pad_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def _byte_level_keys(writer, tokenizer, size: int) -> None:
    """A Hugging Face byte-level BPE as llama.cpp's converter writes it (``_set_vocab_gpt2``): the
    module's text says what."""
    from gguf import TokenType

    backend, specials = tokenizer.src.backend, tokenizer.specials
    by_id = {i: token for token, i in backend.get_vocab(with_added_tokens=True).items()}
    added = backend.get_added_tokens_decoder()
    types = [TokenType.UNUSED if i not in by_id else TokenType.NORMAL if i not in added
             else TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED for i in range(size)]
    info = json.loads(tokenizer.src.files["tokenizer.json"])
    merges = info["model"].get("merges", [])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(byte_level_pre(tokenizer, info))
    writer.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(size)])
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for add, value in ((writer.add_bos_token_id, specials.bos), (writer.add_eos_token_id, specials.eos),
                       (writer.add_unk_token_id, specials.unk), (writer.add_pad_token_id, specials.pad)):
        if value is not None:
            add(value)
    add_bos, add_eos = prompt_specials(tokenizer)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)


def _stored(name: str, value: torch.Tensor, dtype: str):
    """(array, GGML type) of one tensor as ``dtype`` stores it (the module's text)."""
    from gguf import GGMLQuantizationType, quants

    array = value.contiguous().numpy().astype(np.float32)
    if value.dim() == 1 or dtype == "float32" or name == "position_embd.weight":
        return array, GGMLQuantizationType.F32
    if dtype == "q8_0" and array.shape[-1] % 32 == 0:
        return quants.quantize(array, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    return array.astype(np.float16), GGMLQuantizationType.F16


def export_gguf(model, directory: str | os.PathLike, tokenizer=None, dtype: str = "float32") -> None:
    """Write ``model.gguf`` (weights and tokenizer) into the existing empty ``directory``."""
    import gguf

    arch = check_gguf(model.cfg, tokenizer, dtype)
    file_type = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
    writer = gguf.GGUFWriter(Path(directory) / FILE, arch)
    _metadata(writer, model, arch, tokenizer, int(file_type))
    for name, value in gguf_tensors(model).items():
        array, kind = _stored(name, value, dtype)
        writer.add_tensor(name, array, raw_dtype=kind if kind == gguf.GGMLQuantizationType.Q8_0 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
