"""Task ``mlm``: BERT's masked language model on sentences (one line each), validated by
masked-token accuracy; a trained model fills in ``<mask>`` (``fill_mask``) and is scored on
sentences beside a most-frequent-token baseline (``evaluate_mlm``)."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from ..arguments import Command, bounded, warner
from ..data.batching import token_batches
from ..data.corpus import read_lines
from ..data.text import mask_tokens
from ..data.tokenizer import BOS_ID, EOS_ID, MASK, PAD_ID, Tokenizer, check_text
from ..endpoint import RequestBody, TaskEndpoint, unprocessable
from ..errors import AtencionError, Diverged
from ..nn.model_dir import load_model_dir
from ..nn.positional import position_limit
from .base import (
    TOKENIZER_KEYS,
    Task,
    TaskBatch,
    TaskSpec,
    check_model,
    evaluate_file,
    evaluating,
    listing,
    model_device,
    pad_rows,
    register_task,
    sentence_ids,
    sentence_positions,
    warn_unseen,
)
from .lm import refuse_empty_tail, text_splits

log = logging.getLogger(__name__)


# the training side ----------------------------------------------------------------------------


def encode_sentences(lines: list[str], tokenizer: Tokenizer, max_len: int, name: str,
                     masker: Masker | None = None) -> list[list[int]]:
    """``<s> pieces </s>`` for each non-empty line (BERT's [CLS] … [SEP]); lines longer than
    ``max_len`` pieces are dropped and counted, and so are lines with no piece to mask (no piece
    at all: only characters the tokenizer drops, such as U+FEFF or U+200B; or, given the
    ``masker``, none it may choose)."""
    out, dropped, nothing, lines_in = [], 0, 0, 0
    for line in lines:
        if not line.strip():
            continue
        lines_in += 1
        ids = tokenizer.encode(line.strip())
        if not (masker.can_mask(ids) if masker is not None else ids):
            nothing += 1
            continue
        if len(ids) > max_len:
            dropped += 1
            continue
        out.append(tokenizer.sentence(line.strip()))
    if dropped:
        log.warning("%s: dropped %d sentences longer than data.max_len=%d tokens", name, dropped, max_len)
    if nothing:
        log.warning("%s: dropped %d sentences with no token to mask (only characters the tokenizer drops, such as "
                    "U+FEFF or U+200B)", name, nothing)
    if not out and not nothing:
        raise AtencionError(f"{name}: no sentence of at most data.max_len={max_len} tokens")
    if not out:
        counts = [f"{dropped} longer than data.max_len={max_len} tokens"] if dropped else []
        counts.append(f"{nothing} with no token to mask")
        raise AtencionError(f"{name}: no sentence left: {' and '.join(counts)} (of {lines_in} non-empty lines)")
    return out


class Masker:
    """BERT's masking of padded sentences (``mask_tokens``) for a tokenizer with ``<mask>``:
    regular tokens (those after the last special one) and ``<unk>`` can be chosen, the other
    special tokens never."""

    def __init__(self, tokenizer: Tokenizer, probability: float = 0.15):
        if tokenizer.mask_id is None:
            raise AtencionError("masked language modelling needs a vocabulary with <mask>; this tokenizer has none")
        self.mask_id, self.vocab_size, self.probability = tokenizer.mask_id, tokenizer.vocab_size, probability
        self.first_regular = max(tokenizer.special_ids) + 1
        specials = tokenizer.specials
        self.unk = specials.unk if specials.unk is not None else -1
        self.pad = specials.pad if specials.pad is not None else PAD_ID

    def maskable(self, i: int) -> bool:
        return i >= self.first_regular or i == self.unk

    def can_mask(self, ids: list[int]) -> bool:
        """Whether a sentence's pieces hold one that masking may choose."""
        return any(self.maskable(i) for i in ids)

    def __call__(self, rows: list[list[int]], generator: torch.Generator) -> tuple[Tensor, Tensor]:
        ids = pad_rows(rows, self.pad)
        maskable = (ids >= self.first_regular) | (ids == self.unk)
        return mask_tokens(ids, maskable, self.mask_id, self.first_regular, self.vocab_size, self.probability,
                           generator)


class MLMTask(Task):
    name = "mlm"
    symbols = (MASK,)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.train_lines, self.valid_lines, self.tail_of = text_splits(cfg)

    def tokenizer_texts(self) -> list[str]:
        return self.train_lines

    def encode(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.masker = Masker(tokenizer, self.cfg.data.mask_probability)
        max_len = self.cfg.data.max_len
        self.examples = encode_sentences(self.train_lines, tokenizer, max_len, "train text", self.masker)
        if not any(line.strip() for line in self.valid_lines):
            refuse_empty_tail(self.cfg, self.tail_of)
        self.valid_examples = encode_sentences(self.valid_lines, tokenizer, max_len, "valid text", self.masker)
        self._lengths = [(len(e), 0) for e in self.examples]

    def lengths(self):
        return self._lengths

    def make_batch(self, indices, step, part) -> TaskBatch:
        generator = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + step * 1009 + part)
        inputs, targets = self.masker([self.examples[i] for i in indices], generator)
        return TaskBatch(inputs, targets, int((targets != PAD_ID).sum()), int((inputs != self.masker.pad).sum()))

    @torch.no_grad()
    def validate(self, model, device, step):
        scores = mlm_scores(model, self.masker, self.valid_examples, self.cfg.train.max_tokens, device)
        if not math.isfinite(scores["loss"]):
            raise Diverged(step, "validation loss", scores["loss"])
        return {"valid_loss": scores["loss"], "valid_ppl": scores["ppl"], "valid_accuracy": scores["accuracy"]}


@torch.no_grad()
def mlm_scores(model, masker: Masker, examples: list[list[int]], max_tokens: int, device, seed: int = 0) -> dict:
    """Masked-token loss and accuracy on ``examples`` (``<s>`` ids ``</s>``), masked as in
    training from a fixed seed (the same positions every time)."""
    generator = torch.Generator().manual_seed(seed)
    nll = correct = units = 0.0
    for group in token_batches([(len(e), 0) for e in examples], max_tokens, seed=None):
        inputs, targets = masker([examples[i] for i in group], generator)
        inputs, targets = inputs.to(device), targets.to(device)
        select = targets != PAD_ID
        logits = model(inputs, select=select).float()
        gold = targets[select]
        nll += float(F.cross_entropy(logits, gold, reduction="sum"))
        correct += float((logits.argmax(-1) == gold).sum())
        units += gold.numel()
    return {"loss": nll / units, "ppl": math.exp(min(nll / units, 50)), "accuracy": correct / units,
            "masked": int(units)}


# the use side: fill-mask ----------------------------------------------------------------------


def can_fill_mask(model, tokenizer: Tokenizer) -> bool:
    return model.cfg.arch == "encoder" and tokenizer is not None and tokenizer.mask_id is not None


def token_text(tokenizer: Tokenizer, i: int) -> str:
    """Token ``i`` as text: a character, or a SentencePiece piece with its word-start mark ``▁``
    shown as a leading space (" cat" starts a word, "ing" goes on with one), or what a Hugging
    Face tokenizer decodes it to (its fill-mask pipeline's ``token_str``); special tokens by name."""
    piece = tokenizer.piece(i)
    if tokenizer.foreign:
        return tokenizer.decode([i]) or piece
    return piece.replace("▁", " ") if tokenizer.kind == "sentencepiece" else piece


def masked_ids(tokenizer: Tokenizer, text: str, what: str = "--text") -> list[int]:
    """``<s> pieces </s>`` of ``text`` with ``<mask>`` where the text says ``<mask>``: the pieces
    between the masks are encoded on their own. A Hugging Face tokenizer reads the text whole,
    each ``<mask>`` written as its own mask token (BERT's [MASK], which the text may use too).
    Text that is not valid Unicode is refused (``check_text``), naming ``what``."""
    own = tokenizer.piece(tokenizer.mask_id) if tokenizer.foreign else MASK
    if MASK not in check_text(text, what) and own not in text:
        raise AtencionError(f"{what}: no {MASK} in the text; write {MASK} where a token should be predicted")
    if tokenizer.foreign:
        return tokenizer.sentence(text.strip().replace(MASK, own))
    ids = [BOS_ID]
    for number, part in enumerate(text.strip().split(MASK)):
        ids.extend(([tokenizer.mask_id] if number else []) + tokenizer.encode(part))
    return ids + [EOS_ID]


def fill_mask(model, tokenizer: Tokenizer, text: str, top_k: int = 5, what: str = "--text",
              warn=None) -> list[list[tuple[str, float]]]:
    """For each ``<mask>`` in ``text``, in order, the ``top_k`` most likely tokens (see
    ``token_text``) and their probabilities under an encoder's masked-LM head, most likely first.
    All masks are predicted at once, each seeing the others as ``<mask>``. Characters a
    character vocabulary lacks (read as ``<unk>``) are named once by ``warn(message)``, by
    default a logging warning."""
    check_model(model, tokenizer, "fill-mask")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise AtencionError(f"--top-k must be a positive integer, got {top_k!r}")
    ids = masked_ids(tokenizer, text, what)
    warn_unseen(tokenizer, "".join(text.strip().split(MASK)), what, warn)
    limit = position_limit(model.cfg)
    if limit is not None and len(ids) > limit:
        raise AtencionError(f"{what}: {len(ids)} tokens with <s> and </s>, more than this model's learned "
                            f"positions (max_positions={limit})")
    inputs = torch.tensor([ids], device=model_device(model))
    with evaluating(model):
        logits = model(inputs, select=inputs == tokenizer.mask_id)
    probabilities, index = logits.float().softmax(-1).topk(min(top_k, logits.size(-1)), dim=-1)
    return [[(token_text(tokenizer, i), p) for i, p in zip(row_index, row_p)]
            for row_index, row_p in zip(index.tolist(), probabilities.tolist())]


def fill_mask_text(model: str, text: str, top_k: int = 5, as_json: bool = False, device: str = "cpu",
                   warn=None) -> str:
    """`atencion fill-mask`: ``fill_mask`` with the model directory ``model``, as text: for each
    mask its tokens (JSON strings) and probabilities, or one JSON object (``as_json``).
    ``warn(message)`` hears of characters a character vocabulary lacks."""
    import json

    loaded, tokenizer = load_model_dir(model, device)
    masks = fill_mask(loaded, tokenizer, text, top_k, warn=warn)
    if as_json:
        return json.dumps({"text": text, "masks": [[{"token": token, "probability": p} for token, p in mask]
                                                   for mask in masks]}, ensure_ascii=False) + "\n"
    out = []
    for number, mask in enumerate(masks, start=1):
        out.append(f"<mask> {number}:\n")
        out.extend(f"  {p:.4f}  {json.dumps(token, ensure_ascii=False)}\n" for token, p in mask)
    return "".join(out)


# the use side: evaluate -----------------------------------------------------------------------


def evaluate_mlm(model, tokenizer: Tokenizer, lines: list[str], batch_tokens: int = 4096, max_tokens: int = 1024,
                 seed: int = 0, probability: float = 0.15, what: str = "--text",
                 count_from: list[str] | None = None, warn=None) -> dict:
    """Masked-token loss, perplexity and accuracy of a masked language model on the non-empty
    ``lines`` (``mlm_scores``: ``probability`` of the tokens masked as in training, drawn from
    ``seed``, so the same positions every time), beside the accuracy on the same positions of
    always guessing the most frequent token of ``count_from`` (the training text, when known),
    or else of these lines themselves: a baseline that has peeked at the test text's token
    counts. A line of more than ``max_tokens`` pieces (or beyond a learned position table) is
    refused, naming it. A line with no token to mask (only characters the tokenizer drops, such
    as U+FEFF or U+200B) is left out, as an empty line is, and counted (``no_token_lines``).
    ``warn(message)``, by default a logging warning, names those lines, and once the characters a
    character vocabulary lacks (read as ``<unk>``)."""
    check_model(model, tokenizer, "fill-mask")
    numbers = [number for number, line in enumerate(lines, start=1) if line.strip()]
    if not numbers:
        raise AtencionError(f"{what}: no sentence; the text has only empty lines")
    encoded = sentence_ids(model, tokenizer, [lines[n - 1] for n in numbers], max_tokens,
                           lambda i: f"{what} line {numbers[i]}")
    warn_unseen(tokenizer, [line.strip() for line in lines], what, warn)
    masker = Masker(tokenizer, probability)
    has_token = [masker.can_mask(e) for e in encoded]
    examples = [e for e, keep in zip(encoded, has_token) if keep]
    left_out = [n for n, keep in zip(numbers, has_token) if not keep]
    if not examples:
        raise AtencionError(f"{what}: no sentence; every line is empty or has no token to mask")
    if left_out:
        noun = "line" if len(left_out) == 1 else "lines"
        (warn or log.warning)(f"{what}: left out {len(left_out)} {noun} with no token to mask: {noun} "
                              f"{listing(left_out)}")
    device = model_device(model)
    with evaluating(model):
        scores = mlm_scores(model, masker, examples, batch_tokens, device, seed)
    counted = examples if count_from is None else [tokenizer.encode(line) for line in count_from]
    counts = Counter(i for e in counted for i in e if masker.maskable(i))
    guess = counts.most_common(1)[0][0]
    generator = torch.Generator().manual_seed(seed)  # the draws of mlm_scores again: the same positions
    right = 0
    for group in token_batches([(len(e), 0) for e in examples], batch_tokens, seed=None):
        _, targets = masker([examples[i] for i in group], generator)
        right += int((targets[targets != PAD_ID] == guess).sum())
    return {**scores, "sentences": len(examples), "no_token_lines": len(left_out), "mask_probability": probability,
            "seed": seed, "most_frequent_token": token_text(tokenizer, guess),
            "most_frequent_token_accuracy": right / scores["masked"]}


def evaluate_mlm_dir(model: str, options: dict[str, Any], warn=None) -> dict:
    """`atencion evaluate` for a masked language model: ``evaluate_mlm`` on the file ``text``."""
    return evaluate_file(model, options, "text", lambda loaded, tokenizer, path: evaluate_mlm(
        loaded, tokenizer, read_lines(path), options.get("batch_tokens", 4096), options.get("max_input_tokens", 1024),
        what=path, warn=warn))


# the endpoint: POST /fill-mask (`atencion serve`) -------------------------------------------------


class FillMaskRequest(RequestBody):
    """POST /fill-mask: see ``tasks.mlm.fill_mask``."""

    text: str
    model: str | None = None
    top_k: int = Field(5, ge=1, le=100)


async def serve_fill_mask(body: FillMaskRequest, m, ctx) -> dict[str, Any]:
    """POST /fill-mask: the text checked against the server's limit, its masks filled on the model's worker."""
    ctx.check_length("text", body.text)
    with unprocessable():
        pieces = len(masked_ids(m.tokenizer, body.text, "text")) - 2
    ctx.check_length("text", body.text, pieces)
    masks = await ctx.run(m, lambda: fill_mask(m.model, m.tokenizer, body.text, body.top_k, "text"))
    return {"model": m.name, "masks": [[{"token": token, "probability": p} for token, p in mask] for mask in masks]}


ENDPOINT = TaskEndpoint(FillMaskRequest, serve_fill_mask, defaults=("top_k",))


# the command: `atencion fill-mask` ----------------------------------------------------------------

def add_fill_mask_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory of a masked language model (arch encoder, "
                                                   "a vocabulary with <mask>)")
    p.add_argument("--text", required=True, help='text with one or more <mask>, e.g. "the <mask> sat on the mat"')
    p.add_argument("--top-k", type=bounded(int, 1, highest=1000), default=5, help="tokens shown per mask (default: 5)")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object: {"text", "masks": [[{"token", "probability"}, ...], ...]}')
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")


def cmd_fill_mask(args: argparse.Namespace) -> None:
    """Predict the token at each <mask> of --text with a masked language model (a BERT): for each
    mask, in order, the --top-k most likely tokens with their probabilities, most likely first. The
    masks are predicted at once, each seeing the others as <mask>. A SentencePiece token is shown in
    quotes with its word-start mark as a leading space: " cat" starts a word, "ing" goes on with the
    word before it."""
    sys.stdout.write(fill_mask_text(args.model, args.text, args.top_k, args.json, args.device,
                                    warn=warner("fill-mask")))


COMMAND = Command("fill-mask", "predict the tokens at <mask> with a masked language model (BERT)",
                  add_fill_mask_arguments, cmd_fill_mask)


SPEC = register_task(TaskSpec(
    name="mlm", kind="a masked language model (arch encoder)", preset="bert-tiny", archs=("encoder",),
    metric="loss", label_smoothing=0.0, training=MLMTask, use="fill-mask",
    needs="an encoder (arch encoder) whose vocabulary has <mask> (task mlm)", can=can_fill_mask,
    evaluate=evaluate_mlm_dir, evaluate_options=("text",), evaluate_required=("text",),
    endpoint=ENDPOINT, command=COMMAND,
    data_keys=(*TOKENIZER_KEYS, "train_text", "valid_text", "valid_fraction", "mask_probability", "max_len"),
    longest=sentence_positions))
