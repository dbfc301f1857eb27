"""The recurrent encoder-decoder the Transformer replaced, with and without attention.

The encoder is a GRU or LSTM over the source embeddings (bidirectional by default), run by
torch's fused recurrent kernel over packed sequences, so padding costs nothing. Its states
h_1 … h_S are the memory; its summary is the top layer's final state, [→h_S; ←h_1] when
bidirectional. The decoder is a GRU or LSTM whose first state comes from the summary (through
a tanh "bridge" layer, or as it is), reading the previous target word y_{t-1}, and the output
o_t goes through the vocabulary projection tied to the target embeddings, as in the
Transformer. ``rnn.attention`` chooses what the decoder sees of the source:

* ``none`` — the summary alone, the bottleneck ("un solo vector debía resumir toda la
  oración"): the summary c is fed with every input word and to the output (Cho et al. 2014):
  s_t = RNN([E y_{t-1}; c], s_{t-1}), o_t = tanh(W_o [s_t; c; E y_{t-1}]).
* ``bahdanau`` — additive attention (Bahdanau et al. 2015) from the previous state:
  e_{t,i} = vᵀ tanh(W s_{t-1} + U h_i), α_{t,i} = softmax_i(e_{t,i}), c_t = Σ_i α_{t,i} h_i,
  then s_t = RNN([E y_{t-1}; c_t], s_{t-1}) and o_t = tanh(W_o [s_t; c_t; E y_{t-1}]).
* ``luong`` — multiplicative attention (Luong et al. 2015) from the new state: e_{t,i} =
  s_tᵀ h_i ("dot") or s_tᵀ W_a h_i ("general"), c_t as above, and the attentional vector
  h̃_t = tanh(W_c [c_t; s_t]) is the output; with input feeding, h̃_{t-1} joins the next input.

Teacher forcing runs the decoder's fused kernel over the whole target when no step needs the
attention of the step before (``none``, Luong without input feeding), and a step loop otherwise.
Incremental decoding follows the decoding protocol (decode/protocol.py): encode, init_state,
decode_step and the state's reorder, so greedy and beam search, translate and evaluate use it
unchanged. In a beam, the ``group`` hypotheses of a sentence share its memory (never copied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..config import ModelConfig
from ..errors import AtencionError
from .dropout import Dropout
from .layers import Generator
from .model import Model
from .model_dir import register_arch
from .positional import TokenEmbedding

CELLS = {"gru": nn.GRU, "lstm": nn.LSTM}


class RNNEncoder(nn.Module):
    """Embeddings, dropout, and a (bidirectional) GRU or LSTM over the real tokens only."""

    def __init__(self, cfg: ModelConfig, embed: TokenEmbedding):
        super().__init__()
        r = cfg.rnn
        self.embed = embed
        self.dropout = Dropout(cfg.dropout)
        self.rnn = CELLS[r["cell"]](cfg.d_model, r["hidden"], num_layers=cfg.n_layers, batch_first=True,
                                    dropout=cfg.dropout if cfg.n_layers > 1 else 0.0,
                                    bidirectional=r["bidirectional"])
        self.size = r["hidden"] * (2 if r["bidirectional"] else 1)

    def forward(self, src_ids: Tensor, real: Tensor) -> Tensor:
        """The top layer's states (batch, src_len, size), zero at padding; ``real`` (batch,
        src_len) is True at real tokens, which come first in each row."""
        x = self.dropout(self.embed(src_ids))
        lengths = real.sum(dim=1).clamp(min=1).cpu()
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        states, _ = self.rnn(packed)
        states, _ = pad_packed_sequence(states, batch_first=True, total_length=src_ids.size(1))
        return states


def summary(memory: Tensor, real: Tensor, bidirectional: bool) -> Tensor:
    """The encoder's final state read from its states: the forward direction's at the last real
    token, and (bidirectional) the backward direction's at the first, (batch, size)."""
    last = real.sum(dim=1).clamp(min=1) - 1
    rows = torch.arange(memory.size(0), device=memory.device)
    if not bidirectional:
        return memory[rows, last]
    half = memory.size(-1) // 2
    return torch.cat([memory[rows, last, :half], memory[:, 0, half:]], dim=-1)


class AdditiveAttention(nn.Module):
    """Bahdanau et al. (2015): e_{t,i} = vᵀ tanh(W s + U h_i)."""

    def __init__(self, query_size: int, memory_size: int, size: int):
        super().__init__()
        self.W = nn.Linear(query_size, size, bias=False)
        self.U = nn.Linear(memory_size, size)
        self.v = nn.Linear(size, 1, bias=False)

    def keys(self, memory: Tensor) -> Tensor:
        """U h_i for every source state, computed once per sentence: (batch, src_len, size)."""
        return self.U(memory)

    def energies(self, queries: Tensor, keys: Tensor) -> Tensor:
        """e (batch, queries, src_len) for ``queries`` (batch, queries, query_size)."""
        return self.v(torch.tanh(self.W(queries)[:, :, None, :] + keys[:, None, :, :])).squeeze(-1)


class MultiplicativeAttention(nn.Module):
    """Luong et al. (2015): e_{t,i} = s_tᵀ h_i ("dot") or s_tᵀ W_a h_i ("general")."""

    def __init__(self, query_size: int, memory_size: int, score: str):
        super().__init__()
        self.W_a = nn.Linear(memory_size, query_size, bias=False) if score == "general" else None

    def keys(self, memory: Tensor) -> Tensor:
        return memory if self.W_a is None else self.W_a(memory)

    def energies(self, queries: Tensor, keys: Tensor) -> Tensor:
        return queries @ keys.transpose(1, 2)


@dataclass
class RNNState:
    """What the decoder keeps between steps: per sentence the memory (encoder states), its
    attention keys, its real positions and its summary; per decoder row (``group`` rows a
    sentence in a beam) the recurrent state and, with input feeding, the last output."""

    memory: Tensor             # (sentences, src_len, size)
    keys: Tensor | None        # (sentences, src_len, ·): the attention's projection of the memory
    real: Tensor               # (sentences, src_len) True at real tokens
    context: Tensor            # (sentences, size): the summary, the only context of attention "none"
    hidden: Tensor             # (layers, rows, decoder_hidden)
    cell: Tensor | None        # LSTM: (layers, rows, decoder_hidden)
    feed: Tensor | None        # input feeding: (rows, d_model), the last attentional vector
    group: int = 1

    def reorder(self, sentences: Tensor, beams: Tensor | None = None) -> None:
        """Keep ``sentences`` (indices, in that order); in a beam, row j of kept sentence g
        continues slot ``beams[g, j]`` of that sentence (decode/protocol.py)."""
        if self.group > 1:
            if beams is None or beams.shape != (len(sentences), self.group):
                raise AtencionError(f"a beam state needs beams shaped ({len(sentences)}, {self.group}), got "
                                    f"{None if beams is None else tuple(beams.shape)}")
            rows = (sentences[:, None] * self.group + beams).flatten()
        else:
            rows = sentences
        self.hidden = self.hidden.index_select(1, rows)
        if self.cell is not None:
            self.cell = self.cell.index_select(1, rows)
        if self.feed is not None:
            self.feed = self.feed.index_select(0, rows)
        if not torch.equal(sentences, torch.arange(self.memory.size(0), device=sentences.device)):
            self.memory, self.real, self.context = (x.index_select(0, sentences)
                                                    for x in (self.memory, self.real, self.context))
            if self.keys is not None:
                self.keys = self.keys.index_select(0, sentences)


class RNNDecoder(nn.Module):
    """A GRU or LSTM decoder, with attention ``none``, ``bahdanau`` or ``luong`` (module
    docstring); ``output`` is o_t, of width d_model for the tied projection."""

    def __init__(self, cfg: ModelConfig, embed: TokenEmbedding, memory_size: int):
        super().__init__()
        r = cfg.rnn
        self.kind, self.feeding, self.lstm = r["attention"], r["input_feeding"], r["cell"] == "lstm"
        self.layers, self.size, self.d_model = cfg.decoder_layers, r["decoder_hidden"], cfg.d_model
        self.embed = embed
        self.dropout = Dropout(cfg.dropout)
        d = cfg.d_model
        extra = d if self.feeding else 0 if self.kind == "luong" else memory_size
        self.rnn = CELLS[r["cell"]](d + extra, self.size, num_layers=self.layers, batch_first=True,
                                    dropout=cfg.dropout if self.layers > 1 else 0.0)
        if self.kind == "bahdanau":
            self.attention = AdditiveAttention(self.size, memory_size, self.size)
        elif self.kind == "luong":
            self.attention = MultiplicativeAttention(self.size, memory_size, r["score"])
        else:
            self.attention = None
        # o_t from [c_t; s_t] (Luong's W_c), or from [s_t; c_t; E y_{t-1}]
        self.output = nn.Linear(memory_size + self.size + (0 if self.kind == "luong" else d), d)
        states = self.layers * self.size * (2 if self.lstm else 1)
        self.bridge = nn.Linear(memory_size, states) if r["bridge"] else None
        self.bidirectional = r["bidirectional"]

    # the state ---------------------------------------------------------------------------------

    def init_state(self, memory: Tensor, real: Tensor, group: int = 1) -> RNNState:
        context = summary(memory, real, self.bidirectional)
        if self.bridge is None:  # the summary itself, in every layer (sizes checked by the config)
            hidden = context.expand(self.layers, -1, -1)
            cell = torch.zeros_like(hidden) if self.lstm else None
        else:
            states = self.bridge(context).view(context.size(0), -1, self.layers, self.size).permute(1, 2, 0, 3)
            hidden = torch.tanh(states[0])
            cell = states[1] if self.lstm else None
        hidden = hidden.repeat_interleave(group, dim=1).contiguous()
        cell = cell.repeat_interleave(group, dim=1).contiguous() if cell is not None else None
        rows = memory.size(0) * group
        feed = memory.new_zeros(rows, self.d_model) if self.feeding else None  # (output may be int8 or LoRA)
        keys = self.attention.keys(memory) if self.attention is not None else None
        return RNNState(memory, keys, real, context, hidden, cell, feed, group)

    def _attend(self, queries: Tensor, state: RNNState) -> tuple[Tensor, Tensor]:
        """c and α for ``queries`` (rows, n, decoder_hidden): rows are sentences × group, and
        each sentence's group · n queries attend to its memory together."""
        rows, n, _ = queries.shape
        b = state.memory.size(0)
        e = self.attention.energies(queries.reshape(b, rows // b * n, -1), state.keys)
        padding = ~state.real[:, None, :]  # the lowest finite score: a row of padding alone gives zeros, not NaN
        alpha = torch.softmax(e.masked_fill(padding, torch.finfo(e.dtype).min), dim=-1).masked_fill(padding, 0.0)
        context = alpha @ state.memory
        return context.view(rows, n, -1), alpha.view(rows, n, -1)

    def _rows(self, x: Tensor, state: RNNState) -> Tensor:
        """A per-sentence tensor (sentences, ·) repeated for the ``group`` rows of each."""
        return x.repeat_interleave(state.group, dim=0) if state.group > 1 else x

    def _run(self, inputs: Tensor, state: RNNState) -> Tensor:
        """The recurrent layers over ``inputs`` (rows, n, ·) from the state, which they advance."""
        if self.lstm:
            out, (state.hidden, state.cell) = self.rnn(inputs, (state.hidden, state.cell))
        else:
            out, state.hidden = self.rnn(inputs, state.hidden)
        return out

    # the steps ---------------------------------------------------------------------------------

    def forward(self, tgt_ids: Tensor, state: RNNState) -> tuple[Tensor, Tensor | None]:
        """o (rows, n, d_model) for the target tokens ``tgt_ids`` (rows, n), advancing the
        state, and α (rows, n, src_len) (None without attention)."""
        y = self.dropout(self.embed(tgt_ids))
        n = y.size(1)
        if self.kind == "none":  # the context never changes: one fused pass over the target
            c = self._rows(state.context, state)[:, None, :].expand(-1, n, -1)
            s = self._run(torch.cat([y, c], dim=-1), state)
            return self._output(torch.cat([s, c, y], dim=-1)), None
        if self.kind == "luong" and not self.feeding:  # queries are the states: one fused pass
            s = self._run(y, state)
            c, alpha = self._attend(s, state)
            return self._output(torch.cat([c, s], dim=-1)), alpha
        outputs, alphas = [], []
        for t in range(n):
            y_t = y[:, t:t + 1]
            if self.kind == "bahdanau":
                c, alpha = self._attend(state.hidden[-1][:, None, :], state)
                s = self._run(torch.cat([y_t, c], dim=-1), state)
                o = self._output(torch.cat([s, c, y_t], dim=-1))
            else:  # Luong with input feeding
                s = self._run(torch.cat([y_t, state.feed[:, None, :]], dim=-1), state)
                c, alpha = self._attend(s, state)
                o = self._output(torch.cat([c, s], dim=-1))
                state.feed = o[:, 0]
            outputs.append(o)
            alphas.append(alpha)
        return torch.cat(outputs, dim=1), torch.cat(alphas, dim=1)

    def _output(self, x: Tensor) -> Tensor:
        return torch.tanh(self.output(x))


@register_arch("rnn")
class RNNSeq2Seq(Model):
    """The RNN encoder-decoder (arch ``rnn``), with the Transformer's interface: teacher-forced
    ``model(src_ids, tgt_in_ids)`` logits (batch, tgt_len, target vocab), and the decoding
    protocol (``encode``, ``init_state``, ``decode_step``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if cfg.arch != "rnn":
            raise AtencionError(f"RNNSeq2Seq(cfg): needs arch 'rnn', got {cfg.arch!r}")
        src_embed = TokenEmbedding(cfg.vocab_size, cfg.d_model, cfg.pad_id, cfg.scale_embedding)
        tgt_embed = src_embed if cfg.share_embeddings else \
            TokenEmbedding(cfg.target_vocab_size, cfg.d_model, cfg.pad_id, cfg.scale_embedding)
        self.encoder = RNNEncoder(cfg, src_embed)
        self.decoder = RNNDecoder(cfg, tgt_embed, self.encoder.size)
        self.generator = Generator(cfg.d_model, cfg.target_vocab_size, cfg.output_bias,
                                   tgt_embed.weight if cfg.tie_output else None)
        self.out_dropout = Dropout(cfg.dropout)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, src_ids: Tensor, tgt_in_ids: Tensor, src_mask: Tensor | None = None, *,
                return_attention: bool = False, select: Tensor | None = None, project: bool = True):
        """Teacher-forced logits (batch, tgt_len, vocab), as :class:`Transformer`'s: ``select``
        keeps the positions of a boolean (batch, tgt_len) mask, ``project=False`` returns o_t
        (what enters the vocabulary projection), and ``return_attention`` adds
        {"encoder": [], "decoder": [], "cross": [α (batch, 1, tgt_len, src_len)]} (the one
        "head" of the one attention; an empty list without attention)."""
        if not isinstance(tgt_in_ids, Tensor):
            raise AtencionError("an RNN encoder-decoder takes model(src_ids, tgt_in_ids)")
        self._check_ids("src_ids", src_ids, self.cfg.vocab_size)
        self._check_ids("tgt_in_ids", tgt_in_ids, self.cfg.target_vocab_size)
        if tgt_in_ids.size(0) != src_ids.size(0):
            raise AtencionError(f"src_ids and tgt_in_ids must have the same batch size, got "
                                f"{src_ids.size(0)} and {tgt_in_ids.size(0)}")
        memory, src_mask = self.encode(src_ids, src_mask)
        hidden, alpha = self.decoder(tgt_in_ids, self.init_state(memory, src_mask))
        hidden = self.out_dropout(hidden)
        if select is not None:
            if select.shape != tgt_in_ids.shape or select.dtype != torch.bool:
                raise AtencionError(f"select must be a boolean mask shaped like tgt_in_ids "
                                    f"{tuple(tgt_in_ids.shape)}, got {select.dtype} {tuple(select.shape)}")
            hidden = hidden[select]
        logits = self.generator(hidden) if project else hidden
        if return_attention:
            return logits, {"encoder": [], "decoder": [], "cross": [] if alpha is None else [alpha[:, None]]}
        return logits

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The encoder's states (batch, src_len, size) and the source mask (batch, 1, 1,
        src_len), True at real tokens; the real tokens of a row must come first."""
        self._check_ids("src_ids", src_ids, self.cfg.vocab_size)
        if src_mask is None:
            src_mask = self.padding_mask(src_ids)
        real = src_mask.reshape(src_ids.size(0), -1) if src_mask.numel() == src_ids.numel() else None
        if real is None or real.dtype != torch.bool or bool((real[:, 1:] & ~real[:, :-1]).any()):
            raise AtencionError(f"src_mask must be a boolean key-padding mask (batch, 1, 1, src_len) = "
                                f"{(src_ids.size(0), 1, 1, src_ids.size(1))}, True at real tokens, which come first")
        return self.encoder(src_ids, real), src_mask

    def init_state(self, memory: Tensor, src_mask: Tensor, group: int = 1) -> RNNState:
        """A fresh decoding state from the encoder's states; with ``group`` > 1 (a beam),
        ``group`` consecutive decoder rows per sentence, sharing its memory."""
        return self.decoder.init_state(memory, src_mask.reshape(memory.size(0), -1), group)

    def decode_step(self, tgt_ids: Tensor, state: RNNState) -> Tensor:
        """Logits (rows, new_len, vocab) for the new target tokens, advancing ``state``; equal
        to the teacher-forced pass at those positions."""
        self._check_ids("tgt_ids", tgt_ids, self.cfg.target_vocab_size)
        hidden, _ = self.decoder(tgt_ids, state)
        return self.generator(hidden)
