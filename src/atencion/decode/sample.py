"""Sampling from a decoder-only model (GPT): text continued one token at a time through the
key/value cache, each token drawn from the model's next-token distribution, sharpened or
flattened by a temperature and truncated to the top-k tokens (Fan et al. 2018) and/or to the
nucleus, the smallest set of most likely tokens whose probability reaches top-p (Holtzman et al.
2020). Temperature 0 (or top-k 1) is greedy decoding.

The sampler computes in float32: a temperature so small that it is 0 there (at most 2**-150,
about 7e-46, e.g. 1e-300) is greedy, as 0 is; a top-p that small is refused, as 0 is.

The order is Hugging Face's: logits / temperature, then top-k, then top-p on what top-k kept, then
one draw from the renormalised distribution. ``choose_next`` is that whole choice for one step,
so it can be checked on logits whose distribution a test fixes; ``generate_ids`` runs it over a
model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..errors import AtencionError
from ..nn.positional import position_limit

FLOAT32_ZERO = 2.0 ** -150  # the largest number that is 0 in float32 (half the least subnormal, rounded to even)


def is_float32_zero(value: float) -> bool:
    """Whether ``value`` is 0 in float32, the precision the sampler computes in (1e-300 is)."""
    return abs(value) <= FLOAT32_ZERO


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise AtencionError naming the option unless the sampling settings make sense:
    temperature >= 0 and finite, top_k >= 0 (0: off), top_p in (0, 1] (1: off).

    The sampler computes in float32, so a number is taken as float32 takes it: a temperature
    that is 0 there (at most 2**-150, about 7e-46, e.g. 1e-300) is greedy, as 0 is (see
    ``choose_next``), and a top_p that is 0 there is refused, as 0 is."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not (math.isfinite(temperature) and temperature >= 0):
        raise AtencionError(f"--temperature must be >= 0 and finite (0: greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise AtencionError(f"--top-k must be an integer >= 0 (0: off), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise AtencionError(f"--top-p must be in (0, 1], got {top_p!r}")
    if is_float32_zero(top_p):
        raise AtencionError(f"--top-p must be in (0, 1], got {top_p!r}, which is 0 in float32 (the precision "
                            f"the sampler computes in)")


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``logits`` (batch, vocab) with -inf outside the ``top_k`` most likely tokens (exactly k:
    among equal logits at the boundary, topk's choice) and outside the nucleus: the smallest set
    of most likely tokens whose probability, renormalised over what top-k kept, reaches
    ``top_p``. The most likely token is always kept. A new tensor; ``logits`` is left as is."""
    if 0 < top_k < logits.size(-1):
        values, index = logits.topk(top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, index, values)
    if top_p < 1.0:
        ranked, order = logits.sort(dim=-1, descending=True)
        probs = ranked.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the probability of the more likely tokens
        drop = before >= top_p                 # the most likely token has 0 before it: kept
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def is_greedy(temperature: float, top_k: int) -> bool:
    """Whether these settings choose the argmax: ``temperature`` 0 (or 0 in float32) or ``top_k`` 1."""
    return is_float32_zero(temperature) or top_k == 1


def next_probs(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The distribution a token is drawn from, (…, vocab) in float32: softmax(logits / temperature)
    truncated by :func:`filter_logits` (not for greedy settings, :func:`is_greedy`). The row
    maximum is subtracted before dividing by the temperature, so a tiny temperature tends to
    greedy instead of overflowing."""
    logits = logits.float()
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    return filter_logits(scaled, top_k, top_p).softmax(dim=-1)


def choose_next(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> Tensor:
    """The next token of each row, (batch,), from next-token ``logits`` (batch, vocab).

    Greedy (the argmax, no random number drawn) with ``temperature`` 0 (or so small that it is 0
    in float32: dividing by it would give NaN) or ``top_k`` 1; otherwise one ``torch.multinomial``
    draw per row from :func:`next_probs`, with ``generator`` (on the logits' device) so that a
    seeded generator gives the same tokens again."""
    if is_greedy(temperature, top_k):
        return logits.argmax(dim=-1)
    probs = next_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def check_request(model, prompt: Tensor, max_new_tokens: int, stop_id: int | Sequence[int] | None) -> None:
    """Everything ``generate_ids`` can refuse, checked before any work is done."""
    cfg = getattr(model, "cfg", None)
    arch = getattr(cfg, "arch", None)
    if arch != "decoder":
        kinds = {"encoder": "encoder-only (arch encoder, BERT-style: it fills in masked tokens)",
                 "encoder-decoder": "an encoder-decoder (arch encoder-decoder: it translates a source)",
                 "rnn": "an RNN encoder-decoder (arch rnn: it translates a source)"}
        raise AtencionError(f"generate needs a decoder-only model (arch decoder); this model is "
                            f"{kinds.get(arch, repr(arch))}")
    if not isinstance(prompt, Tensor) or prompt.dtype not in (torch.int64, torch.int32) or prompt.dim() != 2:
        what = f"{prompt.dtype} {tuple(prompt.shape)}" if isinstance(prompt, Tensor) else type(prompt).__name__
        raise AtencionError(f"--prompt must be integer token ids shaped (batch, length), got {what}")
    batch, length = prompt.shape
    if batch == 0 or length == 0:
        raise AtencionError(f"--prompt is empty {tuple(prompt.shape)}: generate needs at least one prompt token "
                            f"per row (prepend BOS for an unconditional sample)")
    low, high = int(prompt.min()), int(prompt.max())
    if low < 0 or high >= cfg.vocab_size:
        raise AtencionError(f"--prompt holds token id {low if low < 0 else high}, outside the vocabulary "
                            f"[0, {cfg.vocab_size})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise AtencionError(f"--max-new-tokens must be a positive integer, got {max_new_tokens!r}")
    stops = [] if stop_id is None else [stop_id] if isinstance(stop_id, int) else list(stop_id)
    if stop_id is not None and (not stops or not all(isinstance(s, int) and 0 <= s < cfg.vocab_size for s in stops)):
        raise AtencionError(f"stop_id must be a token id in [0, {cfg.vocab_size}) or several, got {stop_id!r}")
    limit = position_limit(cfg)
    if limit is not None and length > limit:
        raise AtencionError(f"--prompt of {length} tokens is longer than this model's learned positions "
                            f"(max_positions={limit}); shorten it")


def generate_ids(model, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None,
                 stop_id: int | Sequence[int] | None = None,
                 on_step: Callable[[int, Tensor], None] | None = None) -> Tensor:
    """The tokens a decoder-only ``model`` appends to ``prompt``, (batch, n_new), n_new <= max_new_tokens.

    ``prompt`` is (batch, length) token ids, every row as long (several samples of one prompt, or
    prompts of one length): one ``decode_step`` reads it whole and fills the key/value cache, then
    each step feeds the one token just chosen (:func:`choose_next`: ``temperature``, ``top_k``,
    ``top_p``, ``generator``). A row that emits ``stop_id`` (or one of several) is done: it keeps
    computing with the batch but its later tokens are that id (the first of several), and
    generation ends once every row is done.
    ``on_step(step, tokens)``, if given, sees each step's tokens (batch,) as they are chosen.
    A model with learned positions reads at most ``max_positions`` tokens: once the text is
    longer, each step reads its last ``max_positions`` tokens afresh, without the cache (nanoGPT's
    ``generate`` crops the context the same way).

    Runs under ``torch.inference_mode()`` with the model in eval mode (no dropout); the model's
    own mode is restored afterwards. Refused, before any work, with an AtencionError: an encoder
    or encoder-decoder model, bad sampling settings, an empty prompt, and a prompt longer than a
    learned position table.
    """
    check_sampling(temperature, top_k, top_p)
    check_request(model, prompt, max_new_tokens, stop_id)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            return _generate(model, prompt, max_new_tokens, temperature, top_k, top_p, generator, stop_id, on_step)
    finally:
        model.train(was_training)


def _generate(model, prompt, max_new_tokens, temperature, top_k, top_p, generator, stop_id, on_step) -> Tensor:
    window = position_limit(model.cfg)
    state = model.init_state()
    logits = model.decode_step(prompt, state, last=1)[:, -1]
    text = prompt
    done = torch.zeros(prompt.size(0), dtype=torch.bool, device=prompt.device)
    stops = None if stop_id is None else torch.tensor(stop_id, device=prompt.device).reshape(-1)
    chosen = []
    for step in range(max_new_tokens):
        tokens = choose_next(logits, temperature, top_k, top_p, generator)
        if stops is not None:
            tokens = tokens.masked_fill(done, int(stops[0]))
            done |= torch.isin(tokens, stops)
        chosen.append(tokens)
        if on_step is not None:
            on_step(step, tokens)
        if step == max_new_tokens - 1 or (stop_id is not None and bool(done.all())):
            break
        text = torch.cat([text, tokens[:, None]], dim=1)
        if window is None or text.size(1) <= window:
            logits = model.decode_step(tokens[:, None], state)[:, -1]
        else:  # past the learned positions: the last window of the text, read afresh
            logits = model(text[:, -window:])[:, -1]
    return torch.stack(chosen, dim=1)
