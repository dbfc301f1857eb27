"""Induction heads and in-context learning (Olsson et al. 2022, "In-context Learning and
Induction Heads"), measured on a decoder-only model (arch decoder).

An induction head completes ``[A][B] … [A] → [B]``: from the second ``[A]`` it attends to the
token that followed the first one (prefix matching) and raises that token's logit (copying). In
a two-layer attention-only model (``model.d_ff: 0``) it needs a previous-token head in the first
layer, whose output tells each position which token came before it, to find ``[B]``.

The scores, per head, on repeated random tokens (:func:`repeated_tokens`: T distinct random
tokens, then the same T again, a batch of such rows):

* prefix matching: the attention weight from each position i of the second copy to position
  i − T + 1, the token right after the earlier occurrence of the token at i, averaged over the
  positions and the rows. 1: the head attends there alone; a head that spreads its weight
  evenly gets about ln 2 / T. The previous-token score, the weight on position i − 1 alike, finds
  the first layer's half of the circuit.
* copying: the head's own output at a position, o = Σ_k A_ik v_k W_O (its slice of W^O, no
  bias), read through the unembedding as a direct logit contribution: W_U · g ⊙ (o − mean(o))
  with the gain g of the final LayerNorm of a pre-LN model (g ⊙ o for RMSNorm, o itself without a
  final norm, as in a post-LN model, whose norms after each block are left out; the final norm's
  division by the residual's scale is left out too, as it scales every logit of a position alike
  and changes no rank). The score is the share of the positions of the
  second copy at which the token the head attends to most gets the highest of these logits,
  strictly (a tie counts against it): 1 for a head that copies what it reads, about 1/V for one
  that writes something else. The query's own attention decides which token is "attended", so
  the score says what the head's OV circuit does with what it reads (Olsson et al. measure the
  same property by the eigenvalues of W_U W_O W_V W_E; this is the version on the model's own
  computation, its norms and its first layer included).

The in-context learning score (Olsson et al.'s): the mean loss (nats) of the token at index 500
of a text (counting from 0) minus that of the token at index 50, on held-out text; negative when
later tokens are predicted better because the model uses its context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from ..errors import AtencionError
from ..nn.attention import repeat_kv
from ..nn.positional import position_limit
from ..nn.prefix import places


@dataclass
class InductionScores:
    """Per-head scores, arrays of shape (layers, heads), on ``rows`` sequences of ``length``
    random tokens repeated twice: prefix matching, copying and previous token (module docstring)."""

    prefix_matching: np.ndarray
    copying: np.ndarray
    previous_token: np.ndarray
    length: int
    rows: int

    def induction_heads(self, prefix: float = 0.4, copying: float = 0.5) -> list[tuple[int, int]]:
        """The (layer, head) pairs whose prefix-matching and copying scores both reach the
        thresholds, the project's line for "an induction head" (Olsson et al. draw none)."""
        found = (self.prefix_matching >= prefix) & (self.copying >= copying)
        return [(int(layer), int(head)) for layer, head in zip(*np.nonzero(found))]

    def to_dict(self) -> dict:
        scores = {key: np.round(getattr(self, key).astype(float), 4).tolist()
                  for key in ("prefix_matching", "copying", "previous_token")}
        return {"length": self.length, "rows": self.rows, **scores}


def repeated_tokens(vocab_size: int, length: int, rows: int, first: int = 4, seed: int = 0) -> Tensor:
    """(rows, 2·length): in each row ``length`` distinct token ids drawn at random from ``first`` …
    vocab_size − 1 (the ids below ``first`` are special), then the same ``length`` ids again."""
    if not 1 <= length <= vocab_size - first:
        raise AtencionError(f"repeated tokens: length {length} must be between 1 and the {vocab_size - first} "
                            f"regular tokens (ids {first} … {vocab_size - 1}), as each row's tokens are distinct")
    generator = torch.Generator().manual_seed(seed)
    half = torch.stack([torch.randperm(vocab_size - first, generator=generator)[:length] + first
                        for _ in range(rows)])
    return torch.cat([half, half], dim=1)


def _require_decoder(model) -> None:
    if getattr(model.cfg, "arch", None) != "decoder":
        raise AtencionError(f"induction heads are measured on a decoder-only model (arch decoder), got arch "
                            f"{getattr(model.cfg, 'arch', None)!r}")


def _head_outputs(model, ids: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """Each layer's attention weights (batch, h, queries, keys) and each head's output through W^O
    (batch, h, queries, d_model), from one forward pass (the inputs of every self-attention
    captured, and the prefix keys and values a prefix-tuned model gives it: they come before the
    tokens' keys, and their values are part of each head's output)."""
    inputs: list[tuple[Tensor, tuple[Tensor, Tensor] | None]] = []
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda _, args, kwargs: inputs.append((args[0], kwargs.get("prefix"))), with_kwargs=True)
        for layer in model.decoder.layers]
    try:
        _, attentions = model.hidden(ids, return_attention=True)
    finally:
        for hook in hooks:
            hook.remove()
    weights = attentions["decoder"]
    if any(w is None for w in weights):
        raise AtencionError(f"attention.kind {model.cfg.attention['kind']} returns no attention weights to "
                            f"score heads by; use kind full")
    outputs = []
    for layer, (x, prefix), w in zip(model.decoder.layers, inputs, weights):
        attn = layer.self_attn
        _, _, v = attn._split(attn.in_proj(x))
        v = repeat_kv(v, attn.h)
        if prefix is not None:  # the prefix's values, (1, h, length, d_k), before the tokens'
            v = torch.cat([prefix[1].to(v.dtype).expand(v.size(0), -1, -1, -1), v], dim=2)
        heads = w @ v                                                        # (batch, h, queries, d_k)
        w_o = attn.out_proj.weight.view(attn.d_model, attn.h, attn.d_k)      # W^O, one slice per head
        outputs.append(torch.einsum("bhtk,dhk->bhtd", heads, w_o))
    return weights, outputs


def _direct_logits(model, contribution: Tensor) -> Tensor:
    """A head's output read through the final norm's gain and the unembedding (module docstring)."""
    norm = model.decoder.final_norm
    if isinstance(norm, nn.LayerNorm):
        contribution = (contribution - contribution.mean(-1, keepdim=True)) * norm.weight
    elif isinstance(norm, nn.RMSNorm):
        contribution = contribution * norm.weight
    return contribution @ model.generator.weight.T


@torch.no_grad()
def induction_scores(model, length: int = 100, rows: int = 8, seed: int = 0) -> InductionScores:
    """The prefix-matching and copying score of every head (module docstring) on ``rows``
    sequences of ``length`` random tokens repeated twice. A model adapted by virtual tokens
    (nn/prefix.py) is scored on its tokens: a prompt's places (queries and keys) and a prefix's
    keys come first and are left out of the scores, and a head that attends most to one of them
    attends to no token (its copying is judged on the token it attends to most)."""
    _require_decoder(model)
    was_training = model.training
    model.eval()
    try:
        ids = repeated_tokens(model.cfg.vocab_size, length, rows, seed=seed)
        ids = ids.to(next(model.parameters()).device)
        weights, outputs = _head_outputs(model, ids)
    finally:
        model.train(was_training)
    prompt, prefix_keys = places(model.decoder)
    second = torch.arange(length, 2 * length, device=ids.device)              # the second copy's tokens
    prefix, copying, previous = [], [], []
    for w, out in zip(weights, outputs):
        w, out = w[:, :, prompt:, prompt + prefix_keys:], out[:, :, prompt:]   # the tokens' queries and keys
        prefix.append(w[:, :, second, second - length + 1].mean(dim=(0, 2)))
        previous.append(w[:, :, second, second - 1].mean(dim=(0, 2)))
        layer_copying = []
        for head in range(w.size(1)):
            attended = ids.gather(1, w[:, head, second].argmax(-1))            # (rows, length)
            logits = _direct_logits(model, out[:, head, second])               # (rows, length, V)
            own = logits.gather(-1, attended[..., None])
            layer_copying.append(((logits >= own).sum(-1) == 1).float().mean())
        copying.append(torch.stack(layer_copying))
    arrays = [torch.stack(scores).cpu().numpy() for scores in (prefix, copying, previous)]
    return InductionScores(*arrays, length, rows)


@torch.no_grad()
def loss_by_position(model, ids: Tensor, positions: list[int] | None = None, rows_per_pass: int = 32) -> Tensor:
    """The mean loss (nats) over the rows of ``ids`` (batch, L) of the token at each index of
    ``positions`` (default: 1 … L−1; index 0, which nothing comes before, is NaN), each predicted
    from the tokens before it. Only those positions go through the unembedding, ``rows_per_pass``
    rows at a time."""
    _require_decoder(model)
    length = ids.size(1)
    positions = list(range(length)) if positions is None else positions
    if not all(0 <= i < length for i in positions):
        raise AtencionError(f"positions must be token indices below the text's length ({length}), got {positions}")
    wanted = [i for i in positions if i > 0]
    select = torch.zeros(length, dtype=torch.bool, device=ids.device)
    select[[i - 1 for i in wanted]] = True       # the output at i − 1 predicts the token at i
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros(len(wanted))
        for chunk in ids.split(rows_per_pass):
            logits = model(chunk, select=select.expand(chunk.shape)).view(chunk.size(0), len(wanted), -1)
            losses = nn.functional.cross_entropy(logits.transpose(1, 2), chunk[:, wanted], reduction="none")
            total += losses.sum(0).cpu()
    finally:
        model.train(was_training)
    means = dict(zip(wanted, (total / ids.size(0)).tolist()))
    return torch.tensor([means.get(i, float("nan")) for i in positions])


def icl_score(model, ids: Tensor, early: int = 50, late: int = 500) -> float:
    """Olsson et al.'s in-context learning score: the mean loss of the token at index ``late``
    minus that at index ``early``, over the rows of ``ids`` (batch, L > late), held-out text."""
    if not 0 < early < late < ids.size(1):
        raise AtencionError(f"the in-context learning score compares tokens {early} and {late}: it needs "
                            f"0 < {early} < {late} < the text's length ({ids.size(1)} tokens)")
    at_early, at_late = loss_by_position(model, ids, [early, late]).tolist()
    return at_late - at_early


def text_rows(ids: Tensor, length: int = 512, stride: int = 256) -> Tensor:
    """Rows of ``length`` tokens of the token stream ``ids``, one starting every ``stride`` tokens:
    the held-out text the in-context learning score reads."""
    if ids.numel() < length:
        raise AtencionError(f"the text has {ids.numel()} tokens; the in-context learning score reads rows of "
                            f"{length}")
    return torch.stack([ids[start:start + length] for start in range(0, ids.numel() - length + 1, stride)])


DEFAULT_LENGTH = 100  # the random tokens before they repeat, when the model reads that many twice


def fitting_length(model, length: int | None) -> int:
    """The random tokens before they repeat (``--length``): ``length`` if the model can read it, or,
    given None, DEFAULT_LENGTH or the longest it can read. Each row is 2 · length tokens after the
    model's virtual places (nn/prefix.py), within its learned positions, and repeats ``length``
    distinct regular tokens of its vocabulary; a length past either is refused naming --length."""
    virtual = sum(places(model.decoder))
    limit = position_limit(model.cfg)
    by_positions = DEFAULT_LENGTH if limit is None else (limit - virtual) // 2
    by_vocabulary = model.cfg.vocab_size - 4  # the ids below 4 are special (repeated_tokens)
    longest = min(by_positions, by_vocabulary)
    if length is None:
        length = min(DEFAULT_LENGTH, longest)
        if length < 1:
            raise AtencionError(f"induction: the model reads {limit} positions ({virtual} of them virtual tokens) and "
                                f"{by_vocabulary} regular tokens: too few for a row of tokens and their repetition")
        return length
    if length > by_positions:
        after = f" after its {virtual} virtual tokens" if virtual else ""
        raise AtencionError(f"--length {length}: each row is 2 × --length = {2 * length} tokens{after}, but the "
                            f"model's learned positions stop at max_positions={limit}; use --length {by_positions} "
                            f"or less")
    if length > by_vocabulary:
        raise AtencionError(f"--length {length}: each row repeats --length distinct tokens, and the model's "
                            f"vocabulary has {by_vocabulary} regular ones; use --length {by_vocabulary} or less")
    return length


def check_context(model, context: int, late: int = 500) -> None:
    """``--context``, the tokens per row of --text, must reach past token ``late`` (the in-context
    learning score compares it with token 50) and fit in the model's learned positions."""
    limit, virtual = position_limit(model.cfg), sum(places(model.decoder))
    if context <= late:
        raise AtencionError(f"--context {context}: the in-context learning score compares tokens 50 and {late} of "
                            f"each row of --text, so --context must be above {late}")
    if limit is not None and context + virtual > limit:
        after = f" after its {virtual} virtual tokens" if virtual else ""
        raise AtencionError(f"--context {context}: rows of --text of {context} tokens{after} pass the model's learned "
                            f"positions, which stop at max_positions={limit}"
                            + (f"; use --context {limit - virtual} or less" if limit - virtual > late else
                               f", too few for the in-context learning score (token {late}): leave out --text"))


def induction_report(model_dir, length: int | None = None, rows: int = 8, seed: int = 0, text: str | None = None,
                     context: int = 512, device: str = "cpu") -> dict:
    """The scores of the model directory ``model_dir`` (a decoder): every head's prefix-matching
    and copying score, the heads that pass both thresholds, and, with a held-out ``text`` file,
    the in-context learning score on its rows of ``context`` tokens (tasks/lm.py's stream).
    ``length``: the random tokens before they repeat (None: ``fitting_length``'s). Both are
    checked against the model before any work."""
    from ..data.text import read_text
    from ..nn.model_dir import load_model_dir
    from ..tasks.lm import text_stream

    model, tokenizer = load_model_dir(model_dir, device=device)
    _require_decoder(model)
    length = fitting_length(model, length)
    if text is not None:
        check_context(model, context)
    scores = induction_scores(model, length, rows, seed)
    report = {**scores.to_dict(), "induction_heads": scores.induction_heads()}
    if text is not None:
        stream = torch.tensor(text_stream(read_text(text, "--text"), tokenizer), dtype=torch.long, device=device)
        held_out = text_rows(stream, context)
        report.update(icl=round(icl_score(model, held_out), 4), icl_rows=len(held_out))
    return report
