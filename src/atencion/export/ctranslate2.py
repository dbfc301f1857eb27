"""Export to CTranslate2 (a C++ inference engine for Transformers) and decode with it like atencion.

The model is described through CTranslate2's Python specification API (``TransformerSpec``) and
every weight is copied from the atencion model; no converter of another toolkit is involved. This
module holds the translator's spec and what both specs share (the vocabulary, writing and loading
an export); a decoder-only model's spec and generation are in ``ctranslate2_decoder.py``.

How atencion maps onto a ``TransformerSpec``:

* W^Q, W^K, W^V: self-attention takes our stacked ``in_proj`` = [W^Q; W^K; W^V] as its fused
  ``linear[0]`` unchanged; encoder-decoder attention takes W^Q as ``linear[0]`` and [W^K; W^V]
  as ``linear[1]``; W^O is the last linear of each.
* Positions: the table is written into the spec (``position_encodings.encodings``), row p = the
  vector added at position p. CTranslate2's own sinusoids (used when no table is given) put
  sines before cosines and start at position 1; with our table nothing needs permuting and
  learned positions export the same way. Sinusoidal tables get ``max(max_positions, 2048)``
  rows; a longer input is refused by :func:`ct2_translate`.
* Embeddings × √d_model: ``scale_embeddings`` follows ``scale_embedding``; shared or tied
  tables are the same array (CTranslate2 stores them once); ``output_bias`` becomes the bias
  of the output projection.
* Vocabularies: the SentencePiece pieces in id order, so CTranslate2's token i is our id i.
  Its ``unk_token``/``bos_token``/``eos_token``/``decoder_start_token`` are the pieces at ids
  1, ``bos_id``, ``eos_id`` (``<unk>``, ``<s>``, ``</s>``); CTranslate2 has no padding token:
  it masks by length, and ``<pad>`` (id 0) is an ordinary entry that the search suppresses.
  Sources are given exactly as atencion's model sees them (``encode_src(text) + [eos]``), so
  ``add_source_bos``/``add_source_eos`` stay off.

:func:`ct2_translate` sets CTranslate2's search to atencion's (``decode/search.py``); where the
two differ is written there.
"""

from __future__ import annotations

import functools
import gc
import json
import os
from pathlib import Path

import torch

from ..data.tokenizer import UNK_ID
from ..decode.search import length_penalty
from ..errors import AtencionError, MissingFileError

SINUSOID_ROWS = 2048            # rows written for sinusoidal positions (at least max_positions)
TINY_LENGTH_PENALTY = 1e-30     # see ct2_translate: length^1e-30 == 1.0f, but not "no penalty"
INFO_FILE = "atencion.json"     # the atencion config and the position table's size, beside CTranslate2's files


def to_numpy(t: torch.Tensor):
    return t.detach().to(torch.float32).cpu().contiguous().numpy()


def vocabulary(model, tokenizer, side: str) -> list[str]:
    """The tokens of one side (``source``, ``target``; a decoder-only model's one vocabulary is its
    ``source``), in id order: the tokenizer's pieces (SentencePiece's, a character or whitespace
    vocabulary's, a Hugging Face tokenizer's tokens), or placeholders without a tokenizer. A Hugging
    Face tokenizer may have fewer tokens than the model's table (Hugging Face rounds tables up):
    the ids past it, and ids it has no token for, get the placeholder ``<id_i>``. CTranslate2 maps
    tokens by name, so they must be unique."""
    cfg = model.cfg
    size = cfg.vocab_size if side == "source" else cfg.target_vocab_size
    if tokenizer is None:
        names = {cfg.pad_id: "<pad>", cfg.bos_id: "<s>", cfg.eos_id: "</s>"}
        names.setdefault(UNK_ID, "<unk>")
        return [names.get(i, f"<id_{i}>") for i in range(size)]
    vocab = tokenizer.src if side == "source" else tokenizer.tgt
    pieces = [vocab.id_to_piece(i) for i in range(vocab.get_piece_size())]
    if tokenizer.foreign and len(pieces) <= size:
        pieces = [piece or f"<id_{i}>" for i, piece in enumerate(pieces)]
        pieces += [f"<id_{i}>" for i in range(len(pieces), size)]
    which = "the tokenizer" if cfg.arch == "decoder" else f"the {side} tokenizer"
    if len(pieces) != size:
        raise AtencionError(f"{which} has {len(pieces)} tokens but the model's vocabulary has {size} entries")
    seen: set[str] = set()
    for piece in pieces:
        if piece in seen:
            raise AtencionError(f"{which} has the token {piece!r} more than once; CTranslate2 maps tokens by "
                                f"name and needs them unique")
        seen.add(piece)
    return pieces


def set_linear(spec, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    spec.weight = to_numpy(weight)
    if bias is not None:
        spec.bias = to_numpy(bias)


def set_norm(spec, norm: torch.nn.Module) -> None:
    """A LayerNorm's γ and β, or an RMSNorm's γ (it has no β)."""
    spec.gamma = to_numpy(norm.weight)
    if getattr(norm, "bias", None) is not None:
        spec.beta = to_numpy(norm.bias)


def _ffn(spec, ffn, norm) -> None:
    set_linear(spec.linear_0, ffn.linear1.weight, ffn.linear1.bias)
    set_linear(spec.linear_1, ffn.linear2.weight, ffn.linear2.bias)
    set_norm(spec.layer_norm, norm)


def _self_attention(spec, attn, norm) -> None:
    set_linear(spec.linear[0], attn.in_proj.weight, attn.in_proj.bias)  # fused [W^Q; W^K; W^V]
    set_linear(spec.linear[1], attn.out_proj.weight, attn.out_proj.bias)
    set_norm(spec.layer_norm, norm)


def _cross_attention(spec, attn, norm) -> None:
    d = attn.d_model
    bias = attn.in_proj.bias
    set_linear(spec.linear[0], attn.in_proj.weight[:d], None if bias is None else bias[:d])    # W^Q
    set_linear(spec.linear[1], attn.in_proj.weight[d:], None if bias is None else bias[d:])    # [W^K; W^V]
    set_linear(spec.linear[2], attn.out_proj.weight, attn.out_proj.bias)
    set_norm(spec.layer_norm, norm)


def _position_table(model, stack) -> torch.Tensor:
    """The stack's absolute positions as one table: a learned one whole, sinusoids for at least SINUSOID_ROWS."""
    return stack.positions.vectors(max(model.cfg.max_positions, SINUSOID_ROWS))


def build_spec(model, tokenizer=None):
    """A ``ctranslate2.specs.TransformerSpec`` holding every weight of ``model`` (an atencion Transformer)."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[cfg.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.n_layers, cfg.decoder_layers), cfg.n_heads, pre_norm=cfg.norm_first, activation=activation)
    enc, dec = model.encoder, model.decoder
    for stack_spec, stack in ((spec.encoder, enc), (spec.decoder, dec)):
        stack_spec.scale_embeddings = bool(cfg.scale_embedding)
        stack_spec.position_encodings.encodings = to_numpy(_position_table(model, stack))
        if cfg.norm_first:
            set_norm(stack_spec.layer_norm, stack.final_norm)
    spec.encoder.embeddings[0].weight = to_numpy(enc.embed.weight)
    spec.decoder.embeddings.weight = to_numpy(dec.embed.weight)
    for layer_spec, layer in zip(spec.encoder.layer, enc.layers):
        _self_attention(layer_spec.self_attention, layer.self_attn, layer.res_self.norm)
        _ffn(layer_spec.ffn, layer.ffn, layer.res_ffn.norm)
    for layer_spec, layer in zip(spec.decoder.layer, dec.layers):
        _self_attention(layer_spec.self_attention, layer.self_attn, layer.res_self.norm)
        _cross_attention(layer_spec.attention, layer.cross_attn, layer.res_cross.norm)
        _ffn(layer_spec.ffn, layer.ffn, layer.res_ffn.norm)
    set_linear(spec.decoder.projection, model.generator.weight, model.generator.bias)

    source, target = vocabulary(model, tokenizer, "source"), vocabulary(model, tokenizer, "target")
    if source[UNK_ID] != target[UNK_ID]:
        raise AtencionError(f"the unknown token differs between source ({source[UNK_ID]!r}) and target "
                         f"({target[UNK_ID]!r}); CTranslate2 has one unk_token")
    spec.register_source_vocabulary(source)
    spec.register_target_vocabulary(target)
    spec.config.unk_token = target[UNK_ID]
    spec.config.bos_token = target[cfg.bos_id]
    spec.config.eos_token = target[cfg.eos_id]
    spec.config.decoder_start_token = target[cfg.bos_id]
    spec.config.add_source_bos = False
    spec.config.add_source_eos = False   # the caller's source already ends with EOS
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    return spec


def save_export(spec, model, directory: str | os.PathLike, tokenizer=None, **info) -> None:
    """Write ``spec`` (float32 weights; int8 is chosen when loading) into the existing empty
    ``directory``, with ``atencion.json`` (the model's config and ``info``) and the tokenizer's files."""
    spec.validate()
    spec.optimize(quantization=None)
    spec.save(str(directory))
    info = {"format": "ctranslate2", **info, "model": model.cfg.to_dict()}
    (Path(directory) / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save(directory)


def export_ctranslate2(model, directory: str | os.PathLike, tokenizer=None) -> None:
    """Write a CTranslate2 model directory (model.bin, config.json, vocabularies) into the
    existing empty ``directory``, plus the SentencePiece model(s) and tokenizer.json."""
    rows = _position_table(model, model.encoder).size(0)
    save_export(build_spec(model, tokenizer), model, directory, tokenizer, position_rows=int(rows))


# loading ---------------------------------------------------------------------------------------

class Loaded:
    """An export loaded: its engine (a ``ctranslate2.Translator`` for a translator, a
    ``ctranslate2.Generator`` for a decoder-only model), its config and what decoding needs from
    ``atencion.json`` (``info``): the vocabularies, the rows of the position table (``positions``,
    None: no limit)."""

    def __init__(self, directory: Path, compute_type: str, device: str, threads: int):
        import ctranslate2

        from ..config import ModelConfig

        def read(name):
            return json.loads((directory / name).read_text(encoding="utf-8"))

        if not (directory / INFO_FILE).is_file():
            raise MissingFileError(f"{directory / INFO_FILE}: not found; export the model with "
                                    f"`atencion export --format ctranslate2`")
        self.info = read(INFO_FILE)
        self.cfg = ModelConfig.from_dict(self.info["model"], source=str(directory / INFO_FILE))
        self.positions = self.info["position_rows"]
        if (directory / "vocabulary.json").is_file():   # a decoder-only model's
            self.source = self.target = read("vocabulary.json")
        elif (directory / "shared_vocabulary.json").is_file():
            self.source = self.target = read("shared_vocabulary.json")
        else:
            self.source, self.target = read("source_vocabulary.json"), read("target_vocabulary.json")
        self.target_ids = {token: i for i, token in enumerate(self.target)}
        engine = ctranslate2.Generator if self.cfg.arch == "decoder" else ctranslate2.Translator
        self.engine = engine(str(directory), device=device, compute_type=compute_type, intra_threads=threads)


@functools.lru_cache(maxsize=4)
def _load(directory: str, mtime: float, compute_type: str, device: str, threads: int) -> Loaded:
    return Loaded(Path(directory), compute_type, device, threads)


def load_export(export_dir: str | os.PathLike, compute_type: str = "float32", device: str = "cpu",
                threads: int = 0) -> Loaded:
    """The export in ``export_dir``, loaded once and cached (per directory, compute_type, device,
    threads); ``threads`` 0 is CTranslate2's default."""
    directory = Path(export_dir)
    if not (directory / "model.bin").is_file():
        raise MissingFileError(f"{directory}: not a CTranslate2 model directory (no model.bin)")
    return _load(str(directory.resolve()), (directory / "model.bin").stat().st_mtime, compute_type, device, threads)


def release_translators() -> None:
    """Drop the translators and generators that :func:`ct2_translate` and ``ct2_generate`` keep
    loaded. A loaded CTranslate2 engine keeps threads that slow other work in the process while
    it waits (PyTorch ran about 30% slower beside one in ``benchmarks/speed.py``)."""
    _load.cache_clear()
    gc.collect()  # the engine goes now, with its threads


# translating -----------------------------------------------------------------------------------

def _length_groups(loaded: Loaded, src_id_lists: list[list[int]], max_len_a: float,
                   max_len_b: int) -> dict[int, list[int]]:
    """The indices of the sources by maximum output length, each source checked against the export."""
    cfg = loaded.cfg
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(src_id_lists):
        if not ids or ids[-1] != cfg.eos_id:
            raise AtencionError(f"source {i} must end with the EOS id {cfg.eos_id}, as atencion feeds "
                             f"it (encode_src(text) + [eos_id]); got {list(ids)[-3:]}")
        max_len = int(max_len_a * len(ids) + max_len_b)
        if max_len < 1:
            raise AtencionError(f"max_len_a * source length + max_len_b must allow at least one token; "
                             f"source {i} gets {max_len}")
        if max(len(ids), max_len) > loaded.positions:
            raise AtencionError(f"source {i}: {len(ids)} tokens and up to {max_len} output tokens, but the "
                             f"exported position table has {loaded.positions} rows")
        groups.setdefault(max_len, []).append(i)
    return groups


def ct2_translate(export_dir: str | os.PathLike, src_id_lists: list[list[int]], beam: int = 4,
                  alpha: float = 0.6, max_len_a: float = 1.0, max_len_b: int = 50,
                  compute_type: str = "float32", device: str = "cpu", threads: int = 0,
                  batch_tokens: int = 4096) -> list[list[int]]:
    """Translate with CTranslate2 as atencion's :func:`~atencion.decode.search.beam_search`
    (``beam`` > 1) or :func:`~atencion.decode.search.greedy_search` (``beam`` = 1) would:
    returns the best hypothesis of each source as target ids, without BOS and EOS.

    ``src_id_lists`` are the sources as atencion's model receives them, without padding:
    ``tokenizer.encode_src(text) + [eos_id]``. The translator is loaded once and cached
    (per directory, compute_type, device, threads); ``threads`` 0 is CTranslate2's default.

    How the settings match atencion's search:

    * Maximum length: sentence i may generate ``int(max_len_a * len(src_i) + max_len_b)``
      tokens. ``max_decoding_length`` is one number per call, so sources are grouped by length
      and each group is one ``translate_batch`` call. A hypothesis reaching that length without
      EOS ends there in both (CTranslate2's "last step" = atencion's forced end).
    * Early stopping: a sentence stops once ``beam`` hypotheses have finished (``patience=1``).
      CTranslate2 stops at the first finished top beam instead when ``length_penalty`` is 0,
      so it is never 0 here.
    * Length penalty: CTranslate2 divides by ``|Y| ** length_penalty``; atencion by
      ``((5 + |Y|) / 6) ** alpha``. So CTranslate2 runs with ``length_penalty`` = 1e-30
      (its scores stay the raw log-probabilities, and its stopping rule stays the one above),
      returns its ``beam`` finished hypotheses with ``return_end_token=True`` (so |Y| counts
      the EOS as atencion's does) and they are re-ranked here with atencion's penalty.
    * ``min_decoding_length=0`` (EOS allowed first, as in atencion; CTranslate2's default 1 is
      not), ``max_input_length=0`` (no truncation), PAD and BOS suppressed before the softmax
      (as atencion's search does), UNK allowed (as in atencion).

    Remaining differences:

    * CTranslate2 keeps at most ``beam`` finished hypotheses, by raw log-probability, for the
      re-ranking; atencion ranks every finished one. If more than ``beam`` finish in the last
      step, atencion's choice could be one that CTranslate2 dropped (not seen in the tests).
    * Ties between equal scores may be broken in another order.
    """
    import ctranslate2  # noqa: F401  (a clear ImportError before anything else)

    if not isinstance(beam, int) or beam < 1:
        raise AtencionError(f"beam must be an integer >= 1, got {beam!r}")
    if not (max_len_a >= 0 and max_len_b >= 0):
        raise AtencionError(f"max_len_a and max_len_b must be >= 0, got {max_len_a!r} and {max_len_b!r}")
    loaded = load_export(export_dir, compute_type, device, threads)
    cfg = loaded.cfg
    if cfg.arch == "decoder":
        raise AtencionError(f"{export_dir}: the export is a decoder-only model's; ct2_translate takes a "
                            f"translator's (ct2_generate runs a decoder-only model's)")
    never = [[loaded.target[i]] for i in sorted({cfg.pad_id, cfg.bos_id} - {cfg.eos_id})]  # as in search.py
    eos = loaded.target[cfg.eos_id]
    groups = _length_groups(loaded, src_id_lists, max_len_a, max_len_b)

    outputs: list[list[int]] = [[] for _ in src_id_lists]
    for max_len, rows in groups.items():
        sources = [[loaded.source[t] for t in src_id_lists[i]] for i in rows]
        results = loaded.engine.translate_batch(
            sources, beam_size=beam, patience=1, num_hypotheses=beam,
            length_penalty=TINY_LENGTH_PENALTY, return_scores=beam > 1, return_end_token=True,
            max_decoding_length=max_len, min_decoding_length=0, max_input_length=0,
            suppress_sequences=never or None, max_batch_size=batch_tokens,
            batch_type="tokens")
        for i, result in zip(rows, results):
            hypotheses = result.hypotheses
            if beam > 1:   # re-rank with atencion's penalty; |Y| counts the EOS when there is one
                best = max(range(len(hypotheses)), key=lambda j: result.scores[j] /
                           length_penalty(len(hypotheses[j]), alpha))
            else:
                best = 0
            tokens = hypotheses[best]
            if tokens and tokens[-1] == eos:
                tokens = tokens[:-1]
            outputs[i] = [loaded.target_ids[t] for t in tokens]
    return outputs
