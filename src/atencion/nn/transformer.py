"""§3.1, Figure 1: the encoder, the decoder, the generator and the whole Transformer; and the
family built from the same blocks: encoder-only (BERT, with its masked-LM head) and decoder-only
(GPT, with a tied LM head), plus a sequence-classification head. The encoder reads tokens or,
as ``model.inputs`` says, another kind of input (nn/inputs.py: image patches, ViT)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..allocator import to_huge_pages
from ..config import ModelConfig
from ..errors import AtencionError
from . import fused
from .attention import RelativeTerms, causal_mask, check_mask
from .cache import BeamKVCache, DecoderState, KVCache, Packing
from .dropout import Dropout
from .inputs import input_kind
from .kinds import full_attention, shared_module
from .layers import ACTIVATIONS, Block, Generator, make_norm
from .model import Model
from .model_dir import register_arch
from .positional import TokenEmbedding, absolute_positions, relative_positions, rotates
from .prefix import places, visible_first


def _relative_terms(relative: nn.Module | None, offset: int, length: int, q_pos: Tensor | None,
                    k_pos: Tensor | None, causal: bool) -> RelativeTerms:
    """The relative-position terms of one stack's self-attention: new tokens at offset, …,
    offset + length − 1 (RoPE turns them), queries at ``q_pos`` and keys at ``k_pos`` in the layout
    of the scores (what a score bias or a kind's pattern reads)."""
    if rotates(relative):
        return RelativeTerms(rotary=relative.span(offset, length), q_pos=q_pos, k_pos=k_pos, causal=causal)
    return RelativeTerms(relative=relative, q_pos=q_pos, k_pos=k_pos, causal=causal)


def _first_key(state: DecoderState | None) -> int:
    """The position of the first key self-attention sees at this step: 0, or, for one row per
    sentence, the oldest key its cache holds (a sliding window's keeps its last ``window`` only, a
    Performer's none), so that a step's positions cost what its keys cost, not the whole text."""
    if state is None or state.group > 1 or not state.self_caches:
        return 0
    held = state.self_caches[0].k
    return state.offset - (0 if held is None else held.size(2))


def _check_select(select: Tensor, tgt_in_ids: Tensor) -> None:
    """``select`` (Transformer.forward) must be a boolean mask shaped like the target ids."""
    if select.shape != tgt_in_ids.shape or select.dtype != torch.bool:
        raise AtencionError(f"select must be a boolean mask shaped like tgt_in_ids "
                            f"{tuple(tgt_in_ids.shape)}, got {select.dtype} {tuple(select.shape)}")


class Encoder(nn.Module):
    """§3.1: a stack of N identical layers over embeddings + positions (with dropout, §5.4).
    BERT adds token-type embeddings and a LayerNorm on the sum (``type_vocab_size``,
    ``embedding_norm``). ``embed`` is the token embedding or, for another kind of input
    (``model.inputs``), its module (nn/inputs.py), which ``Transformer._encode`` calls."""

    def __init__(self, cfg: ModelConfig, embed: nn.Module):
        super().__init__()
        self.embed = embed
        self.tokens = input_kind(cfg).tokens
        self.positions = absolute_positions(cfg)
        self.relative = relative_positions(cfg)
        self.token_types = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.embed_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.embedding_norm else None
        self.dropout = Dropout(cfg.dropout)
        self.full = full_attention(cfg)
        shared = shared_module(cfg)
        self.layers = nn.ModuleList(Block(cfg, index=i, shared=shared) for i in range(cfg.n_layers))
        self.final_norm = make_norm(cfg) if cfg.norm_first else None
        self.prefix = self.prompt = None  # virtual tokens (nn/prefix.py), when the model is adapted by them

    def forward(self, src_ids: Tensor, mask: Tensor | None, need_weights: bool = False, pack: bool = False,
                token_type_ids: Tensor | None = None):
        """The encoder output (batch, src_len, d_model) and, with ``need_weights``, each layer's
        attention weights. With ``pack`` (and a key-padding ``mask``, (batch, 1, 1, src_len)),
        the layers compute on the real positions only and the output is zero at the masked ones;
        nothing reads them, as the mask hides them from every query. ``src_ids``: token ids or,
        for an encoder of another input kind, the embeddings (batch, length, d_model) its module
        made of the raw batch (``Transformer._encode``). A prompt's places come first (``mask``
        covers them: ``_encode`` extended it); a prefix's keys come before every layer's keys, and
        the tokens take the places after them (nn/prefix.py)."""
        x, offset, prefix = self._inputs(src_ids, token_type_ids)
        positions = None
        if self.relative is not None or not self.full:  # bidirectional: every query sees every key
            where = torch.arange(offset, offset + x.size(1), device=x.device)
            positions = _relative_terms(self.relative, offset, x.size(1), where, where, False)
        packing = None
        if pack and not need_weights and mask is not None and mask.shape[1:3] == (1, 1) and not mask.all():
            packing = Packing(mask[:, 0, 0, :].expand(x.shape[:2]))
            x = packing.pack(x)
        if prefix is not None and mask is not None:  # every query sees the prefix
            mask = visible_first(mask, offset)
        x = self.dropout(x)
        attentions = []
        for i, layer in enumerate(self.layers):
            x, weights, _ = layer(x, mask, need_weights=need_weights, packing=packing, positions=positions,
                                  prefix=None if prefix is None else prefix[i])
            attentions.append(weights)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if packing is not None:
            x = packing.unpack(x)
        return x, attentions

    def _inputs(self, src_ids: Tensor, token_type_ids: Tensor | None) -> tuple[Tensor, int, list | None]:
        """What the first layer reads: the embeddings (a prompt's places first) plus the absolute
        positions and the token types, normalised if BERT's; with the place of the first token
        (after a prefix's) and the prefix's keys and values per layer (or None)."""
        x = self.embed(src_ids) if self.tokens else src_ids
        offset, prefix = 0, None
        if self.prompt is not None:
            x = self.prompt.prepend(x)
            if token_type_ids is not None:  # the prompt's places are of type 0 (as PEFT gives them)
                token_type_ids = torch.cat([token_type_ids.new_zeros(x.size(0), self.prompt.length), token_type_ids], 1)
        if self.prefix is not None:
            prefix, offset = self.prefix(), self.prefix.length
        if self.positions is not None:
            x = x + self.positions(x.size(1), offset)
        if self.token_types is not None:
            types = token_type_ids if token_type_ids is not None else x.new_zeros(x.shape[:2], dtype=torch.long)
            x = x + self.token_types(types)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return x, offset, prefix


class Decoder(nn.Module):
    """§3.1: a stack of N layers, each with masked self-attention and encoder-decoder attention
    (``cross``); without ``cross``, GPT's stack of masked self-attention alone."""

    def __init__(self, cfg: ModelConfig, embed: TokenEmbedding, cross: bool = True):
        super().__init__()
        self.embed = embed
        self.positions = absolute_positions(cfg)
        self.relative = relative_positions(cfg)
        # Bloom normalizes its embeddings too (decoder-only models only: BERT's is the encoder's)
        self.embed_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) \
            if cfg.embedding_norm and not cross else None
        self.dropout = Dropout(cfg.dropout)
        self.full = full_attention(cfg)
        self.layers = nn.ModuleList(Block(cfg, cross=cross, index=i, causal=True)
                                    for i in range(cfg.decoder_layers))
        self.final_norm = make_norm(cfg) if cfg.norm_first else None
        self.prefix = self.prompt = None  # virtual tokens (nn/prefix.py), when the model is adapted by them

    def forward(self, tgt_ids, memory, self_mask, memory_mask, state=None, need_weights=False, first=True):
        """``first``: the first step (or the whole text), where virtual tokens enter: a prompt's
        places before the tokens', a prefix's keys before every layer's (its places already in
        ``state``'s offset: ``DecoderState.skip``). ``self_mask`` covers them."""
        prompt, skipped = places(self) if first else (0, 0)
        offset = state.offset if state is not None else skipped
        x = self.embed(tgt_ids)
        if prompt:
            x = self.prompt.prepend(x)
        prefix = self.prefix() if skipped else None
        length = x.size(1)
        if self.positions is not None:
            x = x + self.positions(length, offset)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.dropout(x)
        positions = None
        if self.relative is not None or not self.full:
            q_pos = k_pos = None
            if not (self.full and rotates(self.relative)):  # (a rotation reads the new places alone)
                new = torch.arange(offset, offset + length, device=tgt_ids.device)
                group = state.group if state is not None else 1
                keys = torch.arange(_first_key(state), offset + length, device=tgt_ids.device)
                # a beam's rows share one cache: queries stacked by beam slot, keys interleaved by step
                q_pos, k_pos = new.repeat(group), keys.repeat_interleave(group)
            positions = _relative_terms(self.relative, offset, length, q_pos, k_pos, True)
        stepped = None if need_weights else fused.step(self, x, self_mask, state, positions)  # every layer in one call
        if stepped is not None:
            x, self_attn, cross_attn = stepped, [None] * len(self.layers), [None] * len(self.layers)
        else:
            self_attn, cross_attn = [], []
            for i, layer in enumerate(self.layers):
                self_cache = state.self_caches[i] if state is not None else None
                cross_cache = state.cross_caches[i] if state is not None else None
                x, w_self, w_cross = layer(x, self_mask, memory, memory_mask, self_cache, cross_cache, need_weights,
                                           positions=positions, prefix=None if prefix is None else prefix[i])
                self_attn.append(w_self)
                cross_attn.append(w_cross)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if state is not None:
            state.offset += length
        return x, self_attn, cross_attn


class MaskedLMHead(nn.Module):
    """BERT's masked-LM head: a dense transform, the activation, a LayerNorm, then the output
    projection tied to the token embeddings, with a bias of its own."""

    def __init__(self, cfg: ModelConfig, tied_weight: nn.Parameter):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.activation = ACTIVATIONS[cfg.activation]
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.weight = tied_weight
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def transform(self, x: Tensor) -> Tensor:
        """Everything before the vocabulary projection."""
        return self.norm(self.activation(self.dense(x)))

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(self.transform(x), self.weight, self.bias)


class ClassificationHead(nn.Module):
    """Sequence classification: the output of the first token (BERT's [CLS]), of the last real
    token (GPT's: the only one that has seen the whole sentence under a causal mask), or the
    mean over the real tokens (``pooling``), with BERT's pooler tanh(W·x + b) if ``pooler``,
    through dropout and one linear layer to ``num_labels`` logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pooling = cfg.pooling
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if cfg.pooler else None
        self.dropout = Dropout(cfg.dropout)
        self.linear = nn.Linear(cfg.d_model, cfg.num_labels)

    def forward(self, hidden: Tensor, real: Tensor) -> Tensor:
        """``hidden`` (batch, length, d_model), ``real`` (batch, length) True at real tokens."""
        if self.pooling == "first":
            pooled = hidden[:, 0]
        elif self.pooling == "last":
            last = real.long().cumsum(1).argmax(1)  # the last real position (right padding or none)
            pooled = hidden[torch.arange(hidden.size(0), device=hidden.device), last]
        else:
            weights = real.to(hidden.dtype)[:, :, None]
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(pooled))
        return self.linear(self.dropout(pooled))


@register_arch("encoder-decoder", "encoder", "decoder")
class Transformer(Model):
    """The encoder-decoder Transformer of Vaswani et al. (2017), Figure 1.

    ``model(src_ids, tgt_in_ids)`` returns pre-softmax logits (batch, tgt_len, target vocab).
    Padding masks come from ``cfg.pad_id`` unless given. Targets are right-padded, so the causal
    mask already keeps every real position from seeing a pad.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if cfg.arch == "rnn":
            raise AtencionError("Transformer(cfg): arch 'rnn' is the RNN encoder-decoder; build it with "
                                "atencion.nn.model.build_model(cfg) or RNNSeq2Seq(cfg)")
        tokens = input_kind(cfg).tokens
        src_embed = input_kind(cfg).build(cfg)  # the token embedding, or the module of model.inputs
        if cfg.arch == "encoder":
            self.encoder = Encoder(cfg, src_embed)
            self.mlm_head = MaskedLMHead(cfg, src_embed.weight) if tokens else None  # no vocabulary to predict
        elif cfg.arch == "decoder":
            self.decoder = Decoder(cfg, src_embed, cross=False)
            self.generator = Generator(cfg.d_model, cfg.vocab_size, cfg.output_bias,
                                       src_embed.weight if cfg.tie_output else None)
        else:
            tgt_embed = src_embed if cfg.share_embeddings else \
                TokenEmbedding(cfg.target_vocab_size, cfg.d_model, cfg.pad_id, cfg.scale_embedding)
            self.encoder = Encoder(cfg, src_embed)
            self.decoder = Decoder(cfg, tgt_embed)
            self.generator = Generator(cfg.d_model, cfg.target_vocab_size, cfg.output_bias,
                                       tgt_embed.weight if cfg.tie_output else None)
        self.classifier = ClassificationHead(cfg) if cfg.num_labels else None
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    # the forward pass ------------------------------------------------------------------------

    def forward(self, src_ids: Tensor, tgt_in_ids: Tensor | None = None, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, return_attention: bool = False,
                select: Tensor | None = None, project: bool = True, token_type_ids: Tensor | None = None,
                classify: bool = False, lengths: Tensor | None = None):
        """Teacher-forced logits (batch, tgt_len, vocab); for the single-stack archs,
        ``model(input_ids)``: the masked-LM head's logits (``encoder``, bidirectional, padding
        masked) or the next-token logits (``decoder``, causal), (batch, length, vocab).

        ``select``, a boolean (batch, tgt_len) mask, keeps only those positions: the result is
        (n_selected, vocab), so training skips the vocabulary projection of padding, its largest
        matrix product. ``project=False`` returns what goes into the vocabulary projection (the
        decoder output before the generator; for an encoder, after the masked-LM head's transform),
        for a loss that applies the projection itself (tasks/loss.py: ``sequence_loss``). With ``return_attention``,
        also a dict of per-layer attention weights (batch, h, queries, keys) under "encoder",
        "decoder" (masked self) and "cross". ``classify``: the classification logits instead
        (``classify()``, through forward so that DistributedDataParallel sees the call).

        An encoder of another input kind (``model.inputs``: images) takes that raw batch in place
        of ``src_ids`` (and ``lengths``, when its examples differ in length), makes its own mask,
        and, having no vocabulary, returns its output (batch, length, d_model) in place of logits."""
        if classify:
            return self.classify(src_ids, token_type_ids, lengths)
        if self.cfg.arch != "encoder-decoder":
            if tgt_in_ids is not None:
                raise AtencionError(f"a {self.cfg.arch}-only model takes one sequence: model(input_ids)")
            return self._one_stack(src_ids, src_mask, return_attention, select, project, token_type_ids, lengths)
        if tgt_in_ids is None:
            raise AtencionError("an encoder-decoder model takes model(src_ids, tgt_in_ids)")
        # the encoder skips the source padding here (its output there is never read)
        memory, src_mask, enc_attn = self._encode(src_ids, src_mask, return_attention, pack=True, lengths=lengths)
        self._check_ids("tgt_in_ids", tgt_in_ids, self.cfg.target_vocab_size)
        if tgt_in_ids.size(0) != src_ids.size(0):
            raise AtencionError(f"src_ids and tgt_in_ids must have the same batch size, got "
                             f"{src_ids.size(0)} and {tgt_in_ids.size(0)}")
        length, prefix = tgt_in_ids.size(1), places(self.decoder)[1]  # a prefix's keys first (nn/prefix.py)
        if tgt_mask is None and self.decoder.full:  # another kind builds no mask: it knows it is causal
            tgt_mask = causal_mask(length, prefix, device=tgt_in_ids.device)
        check_mask(tgt_mask, "tgt_mask", tgt_in_ids.size(0), length, prefix + length)
        hidden, dec_attn, cross_attn = self.decoder(tgt_in_ids, memory, tgt_mask, src_mask,
                                                    need_weights=return_attention)
        if select is not None:
            _check_select(select, tgt_in_ids)
            hidden = hidden[select]
        if self.cfg.scale_output:
            hidden = hidden * self.cfg.d_model ** -0.5
        logits = self.generator(hidden) if project else hidden
        if return_attention:
            return logits, {"encoder": enc_attn, "decoder": dec_attn, "cross": cross_attn}
        return logits

    def _one_stack(self, input_ids, mask, return_attention, select, project, token_type_ids, lengths):
        """``forward`` of the single-stack archs: the masked-LM head's logits (or its transform), the
        next-token logits (or the stack's output), or, for an encoder that reads no tokens, its output."""
        hidden, attentions = self.hidden(input_ids, mask, return_attention, token_type_ids, lengths)
        if select is not None:
            hidden = hidden[select]
        if self.cfg.arch == "encoder" and self.mlm_head is None:
            logits = hidden
        elif self.cfg.arch == "encoder":
            logits = self.mlm_head(hidden) if project else self.mlm_head.transform(hidden)
        else:
            logits = self.generator(hidden) if project else hidden
        return (logits, attentions) if return_attention else logits

    def hidden(self, input_ids: Tensor, mask: Tensor | None = None, return_attention: bool = False,
               token_type_ids: Tensor | None = None, lengths: Tensor | None = None) -> tuple[Tensor, dict[str, list]]:
        """The single stack's output (batch, length, d_model) for ``encoder`` and ``decoder``
        models, and its attention weights by kind when asked."""
        if self.cfg.arch == "encoder":
            memory, _, attentions = self._encode(input_ids, mask, return_attention, pack=not return_attention,
                                                 token_type_ids=token_type_ids, lengths=lengths)
            return memory[:, places(self.encoder)[0]:], {"encoder": attentions}
        hidden, attentions = self._decode_all(input_ids, mask, return_attention)
        return hidden[:, places(self.decoder)[0]:], {"decoder": attentions}

    def _decode_all(self, input_ids: Tensor, mask: Tensor | None, need_weights: bool) -> tuple[Tensor, list]:
        """A decoder-only model's stack output at every place, a prompt's (nn/prefix.py) first; a
        given ``mask`` covers the virtual places too."""
        self._check_ids("input_ids", input_ids, self.cfg.vocab_size)
        prompt, prefix = places(self.decoder)
        queries = prompt + input_ids.size(1)
        if mask is None and self.decoder.full:  # another kind builds no mask: it knows it is causal
            mask = causal_mask(queries, prefix, device=input_ids.device)
        check_mask(mask, "mask", input_ids.size(0), queries, prefix + queries)
        hidden, attentions, _ = self.decoder(input_ids, None, mask, None, need_weights=need_weights)
        if self.cfg.scale_output:
            hidden = hidden * self.cfg.d_model ** -0.5
        return hidden, attentions

    def classify(self, input_ids: Tensor, token_type_ids: Tensor | None = None,
                 lengths: Tensor | None = None) -> Tensor:
        """Sequence-classification logits (batch, num_labels), from the classification head; an
        encoder of another input kind takes its raw batch (and ``lengths``) for ``input_ids``."""
        if self.classifier is None:
            raise AtencionError("this model has no classification head (num_labels is 0)")
        if self.cfg.arch == "encoder-decoder":
            raise AtencionError("classification takes a single-stack model (arch encoder or decoder)")
        if self.cfg.arch == "decoder":  # the pooled places include a prompt's (nn/prefix.py), as PEFT's do
            hidden, _ = self._decode_all(input_ids, None, False)
            return self.classifier(hidden, visible_first(input_ids != self.cfg.pad_id, places(self.decoder)[0]))
        hidden, mask, _ = self._encode(input_ids, None, False, pack=True, token_type_ids=token_type_ids,
                                       lengths=lengths)
        real = mask[:, 0, 0, :] if mask is not None else hidden.new_ones(hidden.shape[:2], dtype=torch.bool)
        return self.classifier(hidden, real)

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None,
               lengths: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The encoder output (batch, src_len, d_model) and the source mask it used (None: an
        input kind whose every position is real)."""
        memory, src_mask, _ = self._encode(src_ids, src_mask, False, lengths=lengths)
        return memory, src_mask

    def _encode(self, src_ids, src_mask, need_weights, pack=False, token_type_ids=None, lengths=None):
        if not self.encoder.tokens:  # the input kind's module makes the embeddings and the mask (nn/inputs.py)
            if src_mask is not None or token_type_ids is not None:
                raise AtencionError(f"an encoder of inputs kind {self.cfg.inputs['kind']!r} makes its own mask and "
                                    f"has no token types: give it the raw batch (and lengths) only")
            embedded, src_mask = self.encoder.embed(src_ids, lengths)
            memory, attentions = self.encoder(embedded, src_mask, need_weights, pack)
            return memory, src_mask, attentions
        if lengths is not None:
            raise AtencionError("lengths are for an encoder of inputs other than tokens; token ids are padded with "
                                "pad_id, and the mask is made from it")
        self._check_ids("src_ids", src_ids, self.cfg.vocab_size)
        if src_mask is None:
            src_mask = self.padding_mask(src_ids)
        check_mask(src_mask, "src_mask", src_ids.size(0), 1, src_ids.size(1))
        if self.encoder.prompt is not None:  # the prompt's places come first, seen by every query
            src_mask = visible_first(src_mask.expand(src_ids.size(0), 1, 1, -1), self.encoder.prompt.length)
        if token_type_ids is not None:
            self._check_ids("token_type_ids", token_type_ids, max(self.cfg.type_vocab_size, 1))
            if token_type_ids.shape != src_ids.shape:
                raise AtencionError(f"token_type_ids must be shaped like the input ids {tuple(src_ids.shape)}, "
                                    f"got {tuple(token_type_ids.shape)}")
        memory, attentions = self.encoder(src_ids, src_mask, need_weights, pack, token_type_ids)
        return memory, src_mask, attentions

    # incremental decoding --------------------------------------------------------------------

    def init_state(self, memory: Tensor | None = None, src_mask: Tensor | None = None,
                   group: int = 1) -> DecoderState:
        """A fresh decoding state; cross-attention keys/values are filled from ``memory`` on the
        first step. With ``group`` > 1 (a beam), each sentence of ``memory`` is decoded by
        ``group`` consecutive rows that share its cross-attention keys and values: they are
        neither copied per beam nor reordered with the beams. A decoder-only model takes no
        ``memory``."""
        if self.cfg.arch == "encoder":
            raise AtencionError("an encoder-only model has no decoder: it cannot decode step by step")
        self._weights_on_huge_pages()
        n = len(self.decoder.layers)
        self_caches = [KVCache() if group == 1 else BeamKVCache(group) for _ in range(n)] if self.decoder.full \
            else [layer.self_attn.kind.new_cache(group) for layer in self.decoder.layers]
        return DecoderState(src_mask, self_caches, [KVCache() for _ in range(n)], memory=memory, group=group)

    def _weights_on_huge_pages(self) -> None:
        """A model decoding on the CPU, in eval mode, reads its weights from transparent huge pages
        (allocator.py ``to_huge_pages``: every step reads them all, and reads them faster there); moved
        once, and again only if its weights were replaced since."""
        first = next(self.parameters(), None)
        if self.training or first is None or first.device.type != "cpu" or \
                getattr(self, "_huge_pages_at", None) == first.data_ptr():
            return
        to_huge_pages([*self.parameters(), *self.buffers()])
        self._huge_pages_at = next(self.parameters()).data_ptr()

    def decode_step(self, tgt_ids: Tensor, state: DecoderState, last: int | None = None) -> Tensor:
        """Logits (batch, new_len, vocab) for the new target tokens ``tgt_ids``, using and
        extending ``state``; equal to the full forward pass at those positions. With ``last``,
        those of the last ``last`` new positions only (batch, last, vocab): a prompt read whole
        needs its last position's alone, and the projection to the vocabulary is the largest
        product of a small model (Hugging Face's ``logits_to_keep``)."""
        self._check_ids("tgt_ids", tgt_ids, self.cfg.target_vocab_size)
        if self.cfg.arch == "encoder":
            raise AtencionError("an encoder-only model has no decoder: it cannot decode step by step")
        first = state.offset == 0
        prompt, prefix = places(self.decoder) if first else (0, 0)
        if prefix:  # the prefix's places, before the first token's (nn/prefix.py)
            state.skip(prefix, tgt_ids.size(0), tgt_ids.device)
        self_mask = state.self_attention_mask(tgt_ids.size(0), prompt + tgt_ids.size(1), tgt_ids.device)
        hidden, _, _ = self.decoder(tgt_ids, state.memory, self_mask, state.memory_mask, state, first=first)
        hidden = hidden[:, prompt:] if last is None else hidden[:, max(prompt, hidden.size(1) - last):]
        state.memory = None  # now in the cross-attention caches
        if self.cfg.scale_output:
            hidden = hidden * self.cfg.d_model ** -0.5
        return self.generator(hidden)

