"""Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"): a small draft model proposes ``k`` tokens one at a time, the target model scores them
all in one ``decode_step`` over k + 1 positions, and the modified rejection sampling rule keeps
the longest prefix that the target's own distribution would have produced, so that the text
comes from the target's exact distribution while the target runs once per round instead of once
per token.

The rule (Leviathan et al., Algorithm 1; Chen et al., Algorithm 2): draft token x, drawn from the
draft's q, is accepted with probability min(1, p(x) / q(x)), where p is the target's
distribution at the same position; at the first rejection the token is drawn instead from
norm(max(0, p − q)), and the round ends; if all k are accepted, one more token is drawn from the
target's p after them. p and q are both the distributions the sampler draws from (decode/sample.py:
temperature, top-k, top-p applied alike). Greedy settings accept a draft token when it is the
target's argmax and otherwise take the target's argmax: the text is the target's own greedy text.

After a round both key/value caches are rolled back (``DecoderState.truncate``) to the accepted
text. A cache that cannot forget keys (a sliding window's, a Performer's running sums) is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import AtencionError
from ..nn.positional import position_limit
from .sample import check_request, check_sampling, is_greedy, next_probs

log = logging.getLogger(__name__)


@dataclass
class SpeculativeStats:
    """What one speculative generation did: tokens the draft proposed and the target accepted,
    rounds (target passes), new tokens and the seconds it took."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed one (Leviathan et al.'s α, measured); 0 when none were proposed."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def check_draft(target, draft, draft_tokens: int, target_name: str = "--model", draft_name: str = "--draft") -> None:
    """Refuse, in one line, a draft that is not a decoder-only model over the target's token ids,
    a ``draft_tokens`` below 1, and a model whose cache cannot be rolled back; ``target_name`` and
    ``draft_name`` say where each came from (a server names the directories)."""
    if getattr(getattr(draft, "cfg", None), "arch", None) != "decoder":
        raise AtencionError(f"{draft_name} must be a decoder-only model (arch decoder), got arch "
                            f"{getattr(getattr(draft, 'cfg', None), 'arch', None)!r}")
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise AtencionError(f"{draft_name} has a vocabulary of {draft.cfg.vocab_size} tokens, the target "
                            f"({target_name}) of {target.cfg.vocab_size}: a draft must share the target's vocabulary")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise AtencionError(f"--draft-tokens must be a positive integer, got {draft_tokens!r}")
    for name, model in ((target_name, target), (draft_name, draft)):
        if not model.init_state().rewinds:
            kind = (model.cfg.attention or {}).get("kind")
            raise AtencionError(f"{name}: speculative decoding rolls the key/value cache back, which model.attention "
                                f"kind {kind!r} cannot (it keeps only recent keys or running sums); use the model "
                                f"without --draft")


def speculative_ids(target, draft, prompt: Tensor, max_new_tokens: int, draft_tokens: int = 4,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    generator: torch.Generator | None = None, stop_id: int | Sequence[int] | None = None,
                    on_step: Callable[[int, Tensor], None] | None = None) -> tuple[Tensor, SpeculativeStats]:
    """The tokens ``target`` appends to ``prompt`` (1, length), (1, n_new), n_new <= max_new_tokens,
    with ``draft`` proposing ``draft_tokens`` at a time, and what the speculation did. The text
    ends at ``stop_id`` (or one of several), the stop token included, as ``generate_ids``'s does.

    Drawn from the target's own distribution (``generate_ids`` with the same ``temperature``,
    ``top_k``, ``top_p``): greedy settings give the target's greedy text token for token; sampled
    ones draw their random numbers differently, so the same seed gives another sample.
    ``on_step(step, tokens)`` sees each new token, shaped (1,), in order. Text past the target's
    learned positions is continued by the target alone, reading its last ``max_positions``
    tokens afresh as ``generate_ids`` does; the draft, past its own, rereads the latter half of
    its positions and continues from there (what it proposes only changes the speed).
    Both models run in eval mode under ``torch.inference_mode()``; their modes are restored.
    """
    check_sampling(temperature, top_k, top_p)
    check_request(target, prompt, max_new_tokens, stop_id)
    if prompt.size(0) != 1:
        raise AtencionError(f"speculative decoding continues one text at a time: the prompt is shaped "
                            f"{tuple(prompt.shape)}, not (1, length)")
    check_draft(target, draft, draft_tokens)
    modes = target.training, draft.training
    target.eval()
    draft.eval()
    try:
        with torch.inference_mode():
            return _speculate(target, draft, prompt, max_new_tokens, draft_tokens,
                              (temperature, top_k, top_p), generator, stop_id, on_step)
    finally:
        target.train(modes[0])
        draft.train(modes[1])


class _Reader:
    """One model reading a growing text with its cache: the cache holds ``text[start : start + held]``
    (``start`` > 0 once a draft has reread the end of a text longer than its positions)."""

    def __init__(self, model):
        self.model, self.limit = model, position_limit(model.cfg)
        self.state, self.start = model.init_state(), 0

    @property
    def held(self) -> int:
        return self.state.offset

    def read(self, text: Tensor, upto: int, last: int) -> Tensor:
        """Logits (last, vocab) after each of the last ``last`` tokens of ``text[start + held : upto]``,
        all of which are now cached."""
        return self.model.decode_step(text[:, self.start + self.held: upto], self.state, last=last)[0]

    def keep(self, upto: int) -> None:
        """Forget the cached tokens from ``text[upto]`` on."""
        self.state.truncate(min(self.held, upto - self.start))

    def restart(self, start: int) -> None:
        """Read the text afresh from ``start`` (at position 0), with an empty cache."""
        self.state, self.start = self.model.init_state(), start


def _speculate(target, draft, prompt, max_new_tokens, k, sampling, generator, stop_id, on_step):
    greedy = is_greedy(sampling[0], sampling[1])
    stats = SpeculativeStats()
    began = time.perf_counter()
    device = prompt.device
    text = torch.empty(1, prompt.size(1) + max_new_tokens + k, dtype=prompt.dtype, device=device)
    text[:, :prompt.size(1)] = prompt
    n = prompt.size(1)  # tokens of text so far; both caches hold at most n − 1 of them
    end = n + max_new_tokens
    verifier, proposer = _Reader(target), _Reader(draft)
    stops = set() if stop_id is None else {stop_id} if isinstance(stop_id, int) else set(stop_id)

    def distribution(logits: Tensor) -> Tensor:
        """What a token is chosen from: the logits themselves when greedy (their argmax), else ``next_probs``."""
        return logits if greedy else next_probs(logits, *sampling)

    def choose(probs: Tensor) -> int:
        return int(probs.argmax()) if greedy else int(torch.multinomial(probs, 1, generator=generator))

    while n < end:
        if verifier.limit is not None and n > verifier.limit:  # past the target's positions: the target alone
            new = [choose(distribution(target(text[:, n - verifier.limit: n])[0, -1]))]
        else:
            kk = min(k, end - n - 1)  # this round's draft tokens: the budget's last token is the target's
            if verifier.limit is not None:
                kk = min(kk, verifier.limit - n)  # the target reads positions up to n + kk − 1
            if proposer.limit is not None:
                kk = min(kk, proposer.limit)  # the draft, rereading, keeps at least one token of the text
            drafts, q = _propose(proposer, text, n, kk, distribution, choose)
            p = distribution(verifier.read(text, n + kk, kk + 1))  # (kk + 1, vocab)
            accepted, new = _verify(drafts, q, p, greedy, choose, generator)
            verifier.keep(n + accepted)
            proposer.keep(n + accepted)
            stats.drafted += kk
            stats.accepted += accepted
            stats.rounds += 1
        for token in new:
            text[0, n] = token
            if on_step is not None:
                on_step(n - prompt.size(1), text[:, n].clone())
            n += 1
            if token in stops:
                end = n
                break
    stats.new_tokens = end - prompt.size(1)
    stats.seconds = time.perf_counter() - began
    log.info("speculative decoding: %d tokens in %.2f s (%.1f tokens/s), %d rounds, %d of %d draft tokens "
             "accepted (%.1f%%)", stats.new_tokens, stats.seconds, stats.tokens_per_second, stats.rounds,
             stats.accepted, stats.drafted, 100 * stats.acceptance_rate)
    return text[:, prompt.size(1): end].clone(), stats


def _propose(proposer: _Reader, text: Tensor, n: int, k: int, distribution, choose) -> tuple[list[int], Tensor | None]:
    """``k`` draft tokens after ``text[:n]``, written into ``text[n : n + k]``, and the draft's
    distributions they were drawn from, (k, vocab) (None when k is 0)."""
    if k == 0:
        return [], None
    if proposer.limit is not None and n + k - 1 - proposer.start > proposer.limit:
        # the draft would read past its positions: it rereads the latter half of them (at least 1 token)
        proposer.restart(n - max(1, min(proposer.limit // 2, proposer.limit - k + 1)))
    drafts, q = [], []
    for i in range(k):
        probs = distribution(proposer.read(text, n + i, 1)[-1])
        token = choose(probs)
        text[0, n + i] = token
        drafts.append(token)
        q.append(probs)
    return drafts, torch.stack(q)


def _verify(drafts: list[int], q: Tensor | None, p: Tensor, greedy: bool, choose, generator) -> tuple[int, list[int]]:
    """The modified rejection sampling rule over one round: how many ``drafts`` are accepted and
    the tokens the text gains (those, then one drawn from norm(max(0, p − q)) at the first
    rejection, or from p after them all). ``q``: (k, vocab), ``p``: (k + 1, vocab)."""
    for i, x in enumerate(drafts):
        if greedy:
            if x != choose(p[i]):
                return i, drafts[:i] + [choose(p[i])]
            continue
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * float(q[i, x]) >= float(p[i, x]):  # rejected: not u < p(x) / q(x) (q(x) > 0: x was drawn from q)
            residual = (p[i] - q[i]).clamp_min(0)
            # all zero only when p = q up to rounding, where a rejection is rounding too: draw from p
            return i, drafts[:i] + [choose(residual if float(residual.sum()) > 0 else p[i])]
    return len(drafts), drafts + [choose(p[len(drafts)])]
