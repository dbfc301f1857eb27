"""Export a decoder-only model (GPT-2, the Llama family, Bloom) to CTranslate2 and generate with it
as atencion's greedy ``generate_ids`` does.

The model is described through CTranslate2's ``TransformerDecoderModelSpec``, every weight copied
from the atencion model (as ``ctranslate2.py`` does for the translator). How a decoder maps onto it:

* Blocks: pre-LN or post-LN (``pre_norm``), LayerNorm or RMSNorm (``rms_norm``; one ε,
  ``layer_norm_epsilon``), the final norm of a pre-LN stack, Bloom's LayerNorm on the embeddings
  (``layernorm_embedding``).
* Feed-forward: relu, gelu (erf), gelu-tanh (GPT-2); the gated ``swiglu`` and ``geglu`` as
  ``ffn_glu`` with Swish or GELU: ``linear_0`` is W1 (the gate, through the activation),
  ``linear_0_noact`` W3, ``linear_1`` W2.
* Attention: ``in_proj`` = [W^Q; W^K; W^V] is the fused ``linear[0]`` unchanged, also with
  g = ``n_kv_heads`` < h key/value heads (``num_heads_kv``): CTranslate2 splits the fused output
  into h·d_k, g·d_k and g·d_k features as atencion does and gives key/value head j to query heads
  j·h/g … (j+1)·h/g − 1, as :func:`~atencion.nn.attention.repeat_kv` does. ``qkv_bias`` (Qwen2)
  is the bias of ``linear[0]`` alone; ``scale_attention: false`` is ``queries_scale`` 1.
* Positions: a learned table whole, sinusoids for ``max(max_positions, 2048)`` rows, as
  ``position_encodings``; RoPE with ``rotary_dim`` = d_k and ``rotary_interleave=False``: atencion
  turns the pair (i, i + d_k/2) (``rotate_half``, Hugging Face's layout), which is CTranslate2's
  non-interleaved layout, so the rows of W^Q and W^K stay as they are; ``rope_base`` is
  ``rotary_base``; ``rope_scaling`` linear (CTranslate2 divides the positions by the factor,
  atencion the frequencies: the same angles) and llama3 (the same formula, with
  ``original_max_position_embeddings``). ALiBi: CTranslate2 adds slope_h · (j − n + 1) for key j
  of n, atencion −slope_h · (i − j); they differ by a constant along each query's row, which
  softmax ignores, and the slopes are the same (also for a head count that is not a power of two).
* ``attention: {kind: window, window: w}`` is ``sliding_window`` w: while generating, CTranslate2's
  cache keeps the last w keys, the new one included, so query i sees i − w < j ≤ i, as atencion's
  window does. A prompt read in one pass sees every earlier key, so :func:`ct2_generate` reads
  a prompt longer than w one token at a time instead; and CTranslate2's ``score_batch`` and
  ``forward_batch`` fail (inside CTranslate2) on a text longer than w + 1 tokens.
* Output: the tied table or the model's own, ``output_bias`` as the projection's bias, T5's
  ``scale_output`` as ``scale_outputs``; ``scale_embedding`` as ``scale_embeddings``.
* Vocabulary: ``vocabulary.json``, the tokens in id order (:func:`~atencion.export.ctranslate2.vocabulary`);
  ``atencion.json`` beside it holds the config, the position table's rows and the ids generation
  stops at (``stop_ids``: a Hugging Face tokenizer's end-of-sequence tokens, as ``atencion
  generate`` stops at them; none for atencion's own tokenizers, whose language models are not
  stopped).

Refused in one line naming the setting, nothing written (:func:`check_decoder`): T5's relative
positions, ``moe``, attention kinds other than full, flash and window, a classification head
(``num_labels``), ``embedding_norm`` with RMSNorm (CTranslate2 normalizes the embeddings with the
stack's kind of norm, atencion with LayerNorm).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..data.tokenizer import UNK_ID
from ..errors import AtencionError
from ..nn.layers import GATED
from .ctranslate2 import SINUSOID_ROWS, load_export, save_export, set_linear, set_norm, to_numpy, vocabulary

WHO = "export to ctranslate2"
ATTENTION_KINDS = ("full", "flash", "window")   # eq. (1) over every earlier key, or over a window of them


def check_decoder(cfg) -> None:
    """Raise an AtencionError naming the first setting of ``cfg`` (arch decoder) that CTranslate2's
    ``TransformerDecoderModelSpec`` cannot express."""
    if cfg.positional not in ("sinusoidal", "learned", "rope", "alibi"):
        raise AtencionError(f"{WHO}: positional={cfg.positional!r} cannot be expressed by CTranslate2's decoder, "
                            f"which takes sinusoidal, learned, rope and alibi positions")
    if cfg.moe is not None:
        raise AtencionError(f"{WHO}: moe (mixture-of-experts feed-forward layers) cannot be exported; CTranslate2's "
                            f"decoder takes one dense feed-forward network per layer")
    kind = "full" if cfg.attention is None else cfg.attention["kind"]
    if kind not in ATTENTION_KINDS:
        raise AtencionError(f"{WHO}: attention.kind {kind} cannot be expressed by CTranslate2's decoder, which "
                            f"attends to every earlier key or to a sliding window (kinds full, flash, window)")
    if cfg.num_labels:
        raise AtencionError(f"{WHO}: num_labels={cfg.num_labels} (a classification head) cannot be exported; "
                            f"CTranslate2's Generator predicts next tokens")
    if cfg.embedding_norm and cfg.norm == "rmsnorm":
        raise AtencionError(f"{WHO}: embedding_norm with norm='rmsnorm' cannot be expressed: CTranslate2 "
                            f"normalizes the embeddings with the stack's RMSNorm, atencion with a LayerNorm")


def _rope(cfg):
    """``from_config``'s RoPE arguments for ``cfg`` (none without RoPE)."""
    from ctranslate2.specs.attention_spec import RotaryScalingType

    if cfg.positional != "rope":
        return {}
    rope = dict(rotary_dim=cfg.d_k, rotary_interleave=False, rotary_base=cfg.rope_base)
    scaling = cfg.rope_scaling
    if scaling is not None:
        rope.update(rotary_scaling_type=RotaryScalingType.Linear if scaling["type"] == "linear"
                    else RotaryScalingType.Llama3, rotary_scaling_factor=scaling["factor"])
        if scaling["type"] == "llama3":
            rope["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    return rope


def build_decoder_spec(model, tokenizer=None):
    """A ``ctranslate2.specs.TransformerDecoderModelSpec`` holding every weight of ``model``
    (an atencion Transformer, arch decoder), laid out as the module's text says."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    check_decoder(cfg)
    act = common_spec.Activation
    activation = {"relu": act.RELU, "gelu": act.GELU, "gelu-tanh": act.GELUTanh, "swiglu": act.SWISH,
                  "geglu": act.GELU}[cfg.activation]
    window = cfg.attention["window"] if cfg.attention is not None and cfg.attention["kind"] == "window" else None
    spec = transformer_spec.TransformerDecoderModelSpec.from_config(
        cfg.n_layers, cfg.n_heads, pre_norm=cfg.norm_first, activation=activation,
        layernorm_embedding=cfg.embedding_norm, ffn_glu=cfg.activation in GATED,
        rms_norm=cfg.norm == "rmsnorm", alibi=cfg.positional == "alibi",
        num_heads_kv=cfg.kv_heads if cfg.kv_heads != cfg.n_heads else None, sliding_window=window, **_rope(cfg))
    dec, stack = model.decoder, spec.decoder
    stack.scale_embeddings = bool(cfg.scale_embedding)
    stack.embeddings.weight = to_numpy(dec.embed.weight)
    if dec.positions is not None:
        stack.position_encodings.encodings = to_numpy(dec.positions.vectors(position_rows(cfg)))
    if dec.embed_norm is not None:
        set_norm(stack.layernorm_embedding, dec.embed_norm)
    if dec.final_norm is not None:
        set_norm(stack.layer_norm, dec.final_norm)
    if cfg.scale_output:
        stack.scale_outputs = np.float32(cfg.d_model ** -0.5)
    for layer_spec, layer in zip(stack.layer, dec.layers):
        attn, ffn = layer.self_attn, layer.ffn
        set_linear(layer_spec.self_attention.linear[0], attn.in_proj.weight, attn.in_proj.bias)  # [W^Q; W^K; W^V]
        set_linear(layer_spec.self_attention.linear[1], attn.out_proj.weight, attn.out_proj.bias)
        set_norm(layer_spec.self_attention.layer_norm, layer.res_self.norm)
        if not cfg.scale_attention:
            layer_spec.self_attention.queries_scale = np.float32(1.0)
        set_linear(layer_spec.ffn.linear_0, ffn.linear1.weight, ffn.linear1.bias)
        if cfg.activation in GATED:
            set_linear(layer_spec.ffn.linear_0_noact, ffn.linear3.weight, ffn.linear3.bias)
        set_linear(layer_spec.ffn.linear_1, ffn.linear2.weight, ffn.linear2.bias)
        set_norm(layer_spec.ffn.layer_norm, layer.res_ffn.norm)
        if cfg.rope_scaling is not None and cfg.rope_scaling["type"] == "llama3":
            _llama3(layer_spec.self_attention, cfg.rope_scaling)
    set_linear(stack.projection, model.generator.weight, model.generator.bias)

    tokens = vocabulary(model, tokenizer, "source")
    spec.register_vocabulary(tokens)
    unk = tokenizer.specials.unk if tokenizer is not None and tokenizer.foreign else UNK_ID
    spec.config.unk_token = tokens[cfg.eos_id if unk is None else unk]  # GPT-2 has none: its EOS, as CTranslate2's
    spec.config.bos_token = tokens[cfg.bos_id]
    spec.config.eos_token = tokens[cfg.eos_id]
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    return spec


def _llama3(spec, scaling: dict) -> None:
    """llama3's keys on one attention spec. Its factor too: the spec declares ``rotary_scaling_factor``
    for linear scaling only (a spec takes no undeclared attribute, hence ``object.__setattr__``),
    and CTranslate2 reads 1 where it is missing, which leaves every frequency unscaled."""
    object.__setattr__(spec, "rotary_scaling_factor", np.float32(scaling["factor"]))
    spec.rotary_low_freq_factor = np.float32(scaling["low_freq_factor"])
    spec.rotary_high_freq_factor = np.float32(scaling["high_freq_factor"])


def position_rows(cfg) -> int | None:
    """The rows of the position table the export holds (a learned table whole, sinusoids for at
    least 2,048 positions), or None for relative positions, which have no limit."""
    if cfg.positional == "learned":
        return cfg.max_positions
    if cfg.positional == "sinusoidal":
        return max(cfg.max_positions, SINUSOID_ROWS)
    return None


def stop_ids(tokenizer) -> list[int]:
    """The ids atencion's ``generate`` stops at for this tokenizer: a Hugging Face tokenizer's
    end-of-sequence tokens; none for atencion's own (``tasks/lm.py``)."""
    return list(tokenizer.specials.stop) if tokenizer is not None and tokenizer.foreign else []


def export_ctranslate2_decoder(model, directory: str | os.PathLike, tokenizer=None) -> None:
    """Write a CTranslate2 decoder directory (model.bin, config.json, vocabulary.json,
    atencion.json, and the tokenizer's files) into the existing empty ``directory``."""
    save_export(build_decoder_spec(model, tokenizer), model, directory, tokenizer,
                position_rows=position_rows(model.cfg), stop_ids=stop_ids(tokenizer))


# generating ------------------------------------------------------------------------------------

def ct2_generate(export_dir: str | os.PathLike, prompt_id_lists: list[list[int]], max_new_tokens: int,
                 stop: Sequence[int] | None = None, compute_type: str = "float32", device: str = "cpu",
                 threads: int = 0, max_batch_size: int = 0) -> list[list[int]]:
    """Greedy continuations of each prompt by CTranslate2, as atencion's greedy
    :func:`~atencion.decode.sample.generate_ids` gives them: each prompt's new ids, at most
    ``max_new_tokens``, ending with the first stop id when one comes (``generate_ids`` then repeats
    it to the end of the row; here the row ends).

    ``prompt_id_lists``: token ids, of any lengths, as the model reads them (no BOS is added).
    ``stop``: the ids that end a continuation; None: the export's ``stop_ids`` (those ``atencion
    generate`` stops at for the model's tokenizer); ``[]``: none. ``threads`` 0 is CTranslate2's
    default; the generator is loaded once and cached (``release_translators`` drops it).

    How CTranslate2's ``generate_batch`` is set to atencion's greedy choice:

    * ``beam_size=1``, ``sampling_topk=1``: the argmax of each step; no repetition penalty, no
      n-gram blocking, no token suppressed (UNK included), ``min_length=0`` (a stop id may come
      first).
    * The stop ids are ``end_token`` (an empty list: none, where CTranslate2's default is its
      EOS), with ``return_end_token=True``.
    * Prompts are grouped by length, one ``generate_batch`` call per group, each read in one pass
      that fills the cache (``include_prompt_in_result=False``, ``max_length`` = ``max_new_tokens``),
      as ``decode_step`` reads atencion's prompt. (In one call with prompts of several lengths,
      CTranslate2 forces the longer prompts' last tokens through its decoding loop and counts
      them in ``max_length``.)
    * A sliding window (``sliding_window``): CTranslate2 reads a prompt in one pass without the
      window, so a prompt longer than the window is instead forced through the decoding loop one
      token at a time (``include_prompt_in_result=True``, ``max_length`` = length − 1 +
      ``max_new_tokens``, the prompt cut from the result: CTranslate2 leaves a first token that is
      its BOS out of it), where the cache keeps the window.
    """
    import ctranslate2  # noqa: F401  (a clear ImportError before anything else)

    loaded = load_export(export_dir, compute_type, device, threads)
    stops = list(loaded.info.get("stop_ids", [])) if stop is None else list(stop)
    _check_request(export_dir, loaded, prompt_id_lists, max_new_tokens, stops)
    vocab, window = loaded.target, loaded.cfg.attention and loaded.cfg.attention.get("window")
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(prompt_id_lists):
        groups.setdefault(len(ids), []).append(i)
    outputs: list[list[int]] = [[] for _ in prompt_id_lists]
    for length, rows in groups.items():
        stepped = window is not None and length > window   # the prompt through the decoding loop
        results = loaded.engine.generate_batch(
            [[vocab[t] for t in prompt_id_lists[i]] for i in rows], beam_size=1, sampling_topk=1,
            max_length=max_new_tokens + (length - 1 if stepped else 0), min_length=0, repetition_penalty=1.0,
            no_repeat_ngram_size=0, disable_unk=False, end_token=[vocab[i] for i in stops], return_end_token=True,
            include_prompt_in_result=stepped, max_batch_size=max_batch_size)
        for i, result in zip(rows, results):
            # the prompt in a stepped result, but for a first token that is BOS (CTranslate2 leaves it out)
            cut = length - (prompt_id_lists[i][0] == loaded.cfg.bos_id) if stepped else 0
            outputs[i] = [loaded.target_ids[t] for t in result.sequences[0][cut:]]
    return outputs


def _check_request(export_dir, loaded, prompt_id_lists, max_new_tokens, stops: list) -> None:
    """Refuse, in one line, what :func:`ct2_generate` cannot run."""
    cfg = loaded.cfg
    if cfg.arch != "decoder":
        raise AtencionError(f"{export_dir}: the export is a translator (arch {cfg.arch}); ct2_generate takes a "
                            f"decoder-only model's export (ct2_translate runs a translator's)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise AtencionError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    for what, ids in [*((f"prompt {i}", p) for i, p in enumerate(prompt_id_lists)), ("stop", stops)]:
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < cfg.vocab_size]
        if bad:
            raise AtencionError(f"{what} holds {bad[0]!r}, not a token id in [0, {cfg.vocab_size})")
        if what == "stop":
            continue
        if not ids:
            raise AtencionError(f"{what} is empty: generation needs at least one prompt token")
        if loaded.positions is not None and len(ids) + max_new_tokens - 1 > loaded.positions:  # the last is not read
            raise AtencionError(f"{what}: {len(ids)} tokens and {max_new_tokens} new ones, but the exported position "
                                f"table has {loaded.positions} rows")
