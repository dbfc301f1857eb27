"""Greedy and beam search for the Transformer (Vaswani et al., 2017, §6.1).

The paper translates "using beam search with a beam size of 4 and length penalty α = 0.6",
the penalty of Wu et al. (2016), and sets "the maximum output length during inference to
input length + 50, but terminate[s] early when possible". Both searches here are batched over
sentences, feed one new token per step through the decoder's key/value caches
(:meth:`Transformer.decode_step`), and drop sentences that are done from the batch.

Conventions:

* Scores are log-probabilities of the model's distribution over the tokens that can be
  generated: PAD and BOS get -inf logits, then a float32 log-softmax (CTranslate2 and Hugging
  Face's ``suppress_tokens`` do the same, so the decoders agree). A hypothesis's ``log_prob`` is
  the sum a teacher-forced forward pass gives for tokens (+ EOS) under that distribution.
* Maximum length: sentence i may generate at most ``int(a * n_i + b)`` tokens, with n_i its
  real (non-pad) source length. A hypothesis that reaches that length without EOS is finished
  there (a *forced end*): no EOS is appended or scored; it keeps the log-prob it has.
* |Y| in the length penalty counts the tokens whose log-probabilities were summed: the
  generated tokens, plus the EOS for a hypothesis that ended with EOS. So |Y| is never more
  than the maximum length.
* The caller passes a model in eval mode; a model in training mode (dropout on) is refused.
* The searches use only the decoding protocol (protocol.py): ``encode``, ``init_state``,
  ``decode_step`` and the state's ``reorder``, so any model that implements it is searched alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import AtencionError
from .protocol import Decodable


@dataclass
class Hypothesis:
    """One finished translation."""

    tokens: list[int]  # generated ids, without BOS and without the final EOS
    score: float       # the ranking score: log_prob / length_penalty(|Y|, alpha)
    log_prob: float    # sum of token log-probabilities, EOS included when it ended with EOS


def length_penalty(length: int, alpha: float) -> float:
    """Wu et al. (2016), eq. 14: lp(Y) = ((5 + |Y|) / 6) ** α.

    ``length`` is |Y|, the number of scored tokens: generated tokens including the EOS (a
    hypothesis cut at the maximum length has no EOS, and |Y| is its token count). α = 0 gives
    lp = 1, i.e. plain log-probability.
    """
    return ((5.0 + length) / 6.0) ** alpha


# helpers ---------------------------------------------------------------------------------------

def _check_eval(model) -> None:
    if not isinstance(model, Decodable):
        raise AtencionError(f"{type(model).__name__} does not implement the decoding protocol "
                            f"(encode, init_state, decode_step; see decode/protocol.py)")
    if getattr(model.cfg, "arch", "encoder-decoder") == "encoder":
        raise AtencionError("an encoder-only model has no decoder: it cannot be searched (beam or greedy)")
    if model.training:
        raise AtencionError("the model is in training mode, so dropout would run during search; "
                         "call model.eval() first")


def _encode(model, src_ids: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The encoder's output and source mask; ``lengths`` for a source of another input kind
    (log-mel frames of different lengths, nn/inputs.py)."""
    return model.encode(src_ids) if lengths is None else model.encode(src_ids, lengths=lengths)


def _max_lengths(memory: Tensor, src_mask: Tensor | None, a: float, b: float) -> list[int]:
    """Per sentence, int(a * real source length + b): the most tokens it may generate. The real
    length is the number of source positions the mask lets through (the tokens that are not
    padding; for log-mel frames, the encoder's positions), all of them without a mask."""
    if not (a >= 0 and b >= 0):
        raise AtencionError(f"max_len_a and max_len_b must be >= 0, got {a!r} and {b!r}")
    if src_mask is None:
        real = [memory.size(1)] * memory.size(0)
    else:
        real = src_mask.reshape(memory.size(0), -1).sum(dim=1).tolist()
    lengths = [int(a * n + b) for n in real]
    if min(lengths) < 1:
        raise AtencionError(f"max_len_a * source length + max_len_b must allow at least one token, "
                         f"got max lengths {lengths}")
    return lengths


def _next_logits(model, last: Tensor, state) -> Tensor:
    """(rows, vocab) float32 logits of the next token, PAD and BOS set to -inf (never generated)."""
    logits = model.decode_step(last.unsqueeze(1), state)[:, -1].float()
    cfg = model.cfg
    banned = sorted({cfg.pad_id, cfg.bos_id} - {cfg.eos_id})
    logits[:, banned] = float("-inf")
    return logits


def _top_log_probs(logits: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The ``n`` best tokens of each row and their log-probabilities (log_softmax over the
    vocabulary; on a CPU torch's log_softmax kernel is several times faster than logsumexp)."""
    return topk_rows(torch.log_softmax(logits, dim=-1), n)


def topk_rows(x: Tensor, n: int, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """``x.topk(n, dim=1)`` for a (rows, vocab) tensor, best first, through chunk maxima.

    A row is cut into chunks of ``chunk`` entries; the n best entries lie in the n chunks with
    the largest maxima (an entry outside them has n chunk maxima, n distinct entries, at least
    as large), so one top-k runs over those n chunks (plus the row's last, partial chunk) only.
    Vectorized maxima make this 2-3x faster than torch's top-k over a 10,000-token vocabulary
    on a CPU. Same values as ``topk``; among exactly equal values the indices chosen may differ.
    Small vocabularies (under 4 · n chunks) go to ``topk`` directly.
    """
    rows, vocab = x.shape
    whole = vocab // chunk
    if whole < 4 * n:
        return x.topk(n, dim=1)
    main = x[:, : whole * chunk].view(rows, whole, chunk)
    best_chunks = main.amax(dim=2).topk(n, dim=1).indices                          # (rows, n)
    values = main.gather(1, best_chunks[:, :, None].expand(-1, -1, chunk)).view(rows, n * chunk)
    index = (best_chunks[:, :, None] * chunk + torch.arange(chunk, device=x.device)).view(rows, n * chunk)
    if whole * chunk < vocab:
        values = torch.cat([values, x[:, whole * chunk:]], dim=1)
        index = torch.cat([index, torch.arange(whole * chunk, vocab, device=x.device).expand(rows, -1)], dim=1)
    top, where = values.topk(n, dim=1)
    return top, index.gather(1, where)


# greedy ----------------------------------------------------------------------------------------

@torch.no_grad()
def greedy_search(model, src_ids: Tensor, max_len_a: float = 1.0, max_len_b: int = 50,
                  lengths: Tensor | None = None) -> list[list[int]]:
    """Batched greedy decoding: at each step take the most probable token (never PAD or BOS).

    Output i (without BOS and EOS) has at most ``int(max_len_a * src_len_i + max_len_b)``
    tokens, src_len_i counting the real tokens of row i; the defaults give the paper's
    "input length + 50". A sentence leaves the batch as soon as it emits EOS or reaches its
    maximum length. ``lengths``: each source's length, for a source that is not token ids
    (log-mel frames). The model must be in eval mode.
    """
    _check_eval(model)
    memory, src_mask = _encode(model, src_ids, lengths)
    max_lens = _max_lengths(memory, src_mask, max_len_a, max_len_b)
    eos = model.cfg.eos_id
    state = model.init_state(memory, src_mask)
    outputs: list[list[int]] = [[] for _ in max_lens]
    rows = list(range(len(max_lens)))  # the sentence decoded by each batch row
    last = torch.full((len(rows),), model.cfg.bos_id, dtype=torch.long, device=src_ids.device)
    while True:
        top, best = _next_logits(model, last, state).max(dim=-1)  # the argmax of the log-softmax
        if bool(top.isnan().any()):  # max() is NaN where a row holds a NaN
            raise AtencionError("the model's scores are not finite (NaN): its weights are broken")
        keep = []
        for row, (sent, token) in enumerate(zip(rows, best.tolist())):
            if token != eos:
                outputs[sent].append(token)
                if len(outputs[sent]) < max_lens[sent]:
                    keep.append(row)
        if not keep:
            return outputs
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=best.device)
            state.reorder(index)
            best = best.index_select(0, index)
            rows = [rows[row] for row in keep]
        last = best


# beam search -----------------------------------------------------------------------------------

def _add_finished(kept: list[Hypothesis], tokens: list[int], log_prob: float, length: int,
                  alpha: float, beam_size: int) -> None:
    """Insert a finished hypothesis, keeping the ``beam_size`` best by score, best first."""
    kept.append(Hypothesis(tokens, log_prob / length_penalty(length, alpha), log_prob))
    kept.sort(key=lambda h: -h.score)  # stable: on a tie the earlier hypothesis stays first
    del kept[beam_size:]


def _mark_done(done: list[bool], active: list[int], live_scores: list[list[float]], tokens: Tensor,
               finished: list[list[Hypothesis]], max_lens: list[int], step: int, alpha: float, k: int,
               early_stop: bool) -> None:
    """Mark each group done at its maximum length (finishing its live hypotheses), with nothing
    left to extend, or (``early_stop``) once its sentence holds ``k`` finished hypotheses."""
    for g, sent in enumerate(active):
        if done[g]:
            continue
        live = live_scores[g]
        if step == max_lens[sent]:  # forced end: every live hypothesis stops here
            for j in range(k):
                if math.isfinite(live[j]):
                    _add_finished(finished[sent], tokens[g, j].tolist(), live[j], step, alpha, k)
            done[g] = True
        elif not math.isfinite(max(live)):  # nothing left to extend
            done[g] = True
        elif early_stop and len(finished[sent]) == k:
            done[g] = True


@torch.no_grad()
def beam_search(model, src_ids: Tensor, beam_size: int = 4, alpha: float = 0.6,
                max_len_a: float = 1.0, max_len_b: int = 50, nbest: int = 1,
                _drop_finished: bool = True, _early_stop: bool = True,
                lengths: Tensor | None = None) -> list[list[Hypothesis]]:
    """Batched beam search with the length penalty of Wu et al. (2016); returns, per sentence,
    up to ``nbest`` finished hypotheses, best score first.

    Every sentence keeps ``beam_size`` live hypotheses (batch × beam rows of the decoder). At
    each step the 2·beam best extensions of a sentence are ranked by log-probability; an EOS
    among the first ``beam_size`` of them finishes that hypothesis (it leaves the beam and
    expands no more), and the best ``beam_size`` non-EOS extensions form the next beam. At
    step 0 all beams are the same BOS, so only the first is expanded. A sentence keeps the
    ``beam_size`` best finished hypotheses by score = log_prob / lp(|Y|) and is done

    * at its maximum length ``int(max_len_a * src_len + max_len_b)``, where every live
      hypothesis is finished as it stands (forced end, no EOS scored), or
    * as soon as it holds ``beam_size`` finished hypotheses ("terminate early when possible",
      §6.1; the rule of fairseq and of Hugging Face's ``early_stopping=True``). A live
      hypothesis might still have ended with a better normalized score: ``_early_stop=False``
      searches on to the maximum length instead (exhaustive when the beam holds every prefix).

    Done sentences leave the batch (their rows are dropped from the caches). With
    ``beam_size=1`` this is exactly :func:`greedy_search`, whatever α. ``lengths``: each
    source's length, for a source that is not token ids (log-mel frames).
    The model must be in eval mode.
    """
    _check_eval(model)
    if not isinstance(beam_size, int) or beam_size < 1:
        raise AtencionError(f"beam_size must be an integer >= 1, got {beam_size!r}")
    if not isinstance(nbest, int) or not 1 <= nbest <= beam_size:
        raise AtencionError(f"nbest must be an integer in [1, beam_size], got nbest={nbest!r} "
                         f"with beam_size={beam_size}")
    if not (isinstance(alpha, (int, float)) and 0 <= alpha < math.inf):
        raise AtencionError(f"alpha (the length penalty exponent) must be a number >= 0, got {alpha!r}")
    memory, src_mask = _encode(model, src_ids, lengths)
    max_lens = _max_lengths(memory, src_mask, max_len_a, max_len_b)
    k, vocab, eos = beam_size, model.cfg.target_vocab_size, model.cfg.eos_id
    device, n = src_ids.device, len(max_lens)
    # One group of k decoder rows per sentence; the k rows share their sentence's
    # cross-attention keys and values (computed once, never copied per beam) and one
    # self-attention cache, where each hypothesis sees its ancestors' keys through a mask:
    # re-ranking the beams moves no keys (DecoderState.reorder).
    state = model.init_state(memory, src_mask, group=k)
    finished: list[list[Hypothesis]] = [[] for _ in range(n)]
    active = list(range(n))   # the sentence of each group of k rows
    done = [False] * n        # per group; done groups stay only when not dropping
    scores = torch.full((n, k), float("-inf"), device=device)
    scores[:, 0] = 0.0        # step 0: only the first beam is expanded
    tokens = torch.empty((n, k, 0), dtype=torch.long, device=device)
    last = torch.full((n * k,), model.cfg.bos_id, dtype=torch.long, device=device)
    step = 0
    while True:
        groups = len(active)
        # The 2k best extensions of a sentence are among the 2k best tokens of each of its beams.
        n_top = min(2 * k, vocab)
        log_probs, tokens_of = _top_log_probs(_next_logits(model, last, state), n_top)
        candidates = (scores.unsqueeze(-1) + log_probs.view(groups, k, n_top)).view(groups, k * n_top)
        top_scores, top_index = candidates.topk(min(2 * k, k * n_top), dim=1)  # best first
        top_beam = top_index // n_top
        top_token = tokens_of.view(groups, k * n_top).gather(1, top_index)
        is_eos = top_token == eos
        # The k best non-EOS extensions continue: a stable sort puts them first, in rank order
        # (each beam has one EOS extension, so at least k of the 2k are not EOS).
        pick = is_eos.to(torch.uint8).sort(dim=1, stable=True).indices[:, :k]
        beam = top_beam.gather(1, pick)
        scores = top_scores.gather(1, pick)
        new_tokens = top_token.gather(1, pick)
        # An EOS among the k best extensions finishes that hypothesis.
        ended = is_eos[:, :k] & top_scores[:, :k].isfinite()
        for g, j in ended.nonzero().tolist():
            if not done[g]:
                _add_finished(finished[active[g]], tokens[g, top_beam[g, j]].tolist(),
                              top_scores[g, j].item(), step + 1, alpha, k)
        tokens = torch.cat([tokens.gather(1, beam[:, :, None].expand(-1, -1, step)),
                            new_tokens[:, :, None]], dim=2)
        step += 1
        live_scores = scores.tolist()  # one device sync per step
        _mark_done(done, active, live_scores, tokens, finished, max_lens, step, alpha, k, _early_stop)
        if all(done):
            break
        keep = [g for g in range(groups) if not done[g]] if _drop_finished else list(range(groups))
        keep_index = torch.tensor(keep, device=device)
        state.reorder(keep_index, beam.index_select(0, keep_index))
        scores, tokens = scores.index_select(0, keep_index), tokens.index_select(0, keep_index)
        last = new_tokens.index_select(0, keep_index).flatten()
        active, done = [active[g] for g in keep], [done[g] for g in keep]
    return [kept[:nbest] for kept in finished]
