"""Language models at work: a GPT continues a prompt (``generate_text``), a BERT fills in masked
tokens (``fill_mask``), a classifier labels sentences (``classify_lines``), and each is scored on
a test text (``evaluate_lm``, ``evaluate_mlm``, ``evaluate_classifier``). The command line
(generate, fill-mask, classify, evaluate) and the server share these functions.

Every function reads its input the way the model's training task read its data (train/tasks.py):
a language model a token stream with a line break between lines (``text_stream``), a masked LM
and a classifier one sentence as ``<s> pieces </s>``.

``what`` arguments name where the input came from (``--prompt``, ``--input line 3``, ``text``)
in error messages, which are one line (AtencionError).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager

import torch

from .config import ModelConfig
from .data.batching import token_batches
from .data.tokenizer import BOS_ID, EOS_ID, MASK, PAD_ID, UNK_ID, Tokenizer
from .decode.sample import check_sampling, generate_ids
from .errors import AtencionError
from .train.tasks import Masker, classify_logits, classify_scores, lm_scores, mlm_scores, text_stream

# what a model is, and what it can do ------------------------------------------------------------

KINDS = {"translate": "a translator (arch encoder-decoder or rnn)", "lm": "a language model (arch decoder)",
         "mlm": "a masked language model (arch encoder)", "classify": "a classifier (a classification head)"}
USES = {"translate": "translate", "lm": "generate", "mlm": "fill-mask", "classify": "classify"}


def model_task(cfg: ModelConfig) -> str:
    """The task a model was trained for, as its config tells: "classify" (a classification head),
    "mlm" (an encoder), "lm" (a decoder) or "translate" (an encoder-decoder)."""
    if cfg.num_labels:
        return "classify"
    return {"encoder": "mlm", "decoder": "lm"}.get(cfg.arch, "translate")


def describe(cfg: ModelConfig) -> str:
    """What a model is, for messages: KINDS of its task, a translator named by its own arch."""
    task = model_task(cfg)
    return f"a translator (arch {cfg.arch})" if task == "translate" else KINDS[task]


def can_generate(model, tokenizer: Tokenizer) -> bool:
    return model.cfg.arch == "decoder"


def can_fill_mask(model, tokenizer: Tokenizer) -> bool:
    return model.cfg.arch == "encoder" and tokenizer.mask_id is not None


def can_classify(model, tokenizer: Tokenizer) -> bool:
    return bool(model.cfg.num_labels)


CAN = {"generate": can_generate, "fill-mask": can_fill_mask, "classify": can_classify}
NEEDS = {"translate": "a translator (arch encoder-decoder or rnn)", "generate": "a decoder-only model (arch decoder)",
         "fill-mask": "an encoder (arch encoder) whose vocabulary has <mask> (task mlm)",
         "classify": "a model with a classification head (task classify)"}


def check_model(model, tokenizer: Tokenizer, command: str) -> None:
    """Refuse, in one line, a model that cannot do ``command`` (generate, fill-mask, classify)."""
    if not CAN[command](model, tokenizer):
        task = model_task(model.cfg)
        detail = " and its tokenizer has no <mask>" if command == "fill-mask" and model.cfg.arch == "encoder" else ""
        raise AtencionError(f"{command} needs {NEEDS[command]}; this model is {describe(model.cfg)}{detail}: "
                            f"use {USES[task]}")


def position_limit(model) -> int | None:
    """How many positions the model can read: its learned position table's rows, or None (sinusoids
    and relative positions extend without limit)."""
    return model.cfg.max_positions if model.cfg.positional == "learned" else None


@contextmanager
def evaluating(model):
    """The model in eval mode (no dropout) under inference mode; its own mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def _device(model) -> torch.device:
    return next(model.parameters()).device


# generate ---------------------------------------------------------------------------------------


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The ids a language model continues ``prompt`` from, as ``text_stream`` wrote its training
    text: characters with their line breaks, or (SentencePiece) each line's pieces with ``</s>``
    between lines. An empty prompt is the start of a line: a line break (``</s>``)."""
    if tokenizer.kind == "char":
        return tokenizer.encode(prompt or "\n")
    if not prompt:
        return [EOS_ID]
    ids: list[int] = []
    for number, line in enumerate(prompt.split("\n")):
        ids.extend(([EOS_ID] if number else []) + tokenizer.encode(line))
    return ids


def render(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text of a language model's ``ids``: ``</s>`` of a SentencePiece model is a line break."""
    if tokenizer.kind == "char":
        return tokenizer.decode(ids)
    lines, line = [], []
    for i in ids:
        if i == EOS_ID:
            lines.append(line)
            line = []
        else:
            line.append(i)
    return "\n".join(tokenizer.decode(piece_ids) for piece_ids in [*lines, line])


def check_prompt(model, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, what: str = "--prompt") -> list[int]:
    """The prompt's ids, refused in one line naming ``what`` when the prompt alone does not fit in
    a learned position table (past it, generation reads the last ``max_positions`` tokens)."""
    ids = prompt_ids(tokenizer, prompt)
    limit = position_limit(model)
    if limit is not None and len(ids) > limit:
        raise AtencionError(f"{what}: {len(ids)} tokens, but this model's learned positions stop at "
                            f"max_positions={limit}; shorten the prompt")
    return ids


def generate_text(model, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 200, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int | None = None, num_samples: int = 1,
                  on_text: Callable[[int, str], None] | None = None, what: str = "--prompt") -> list[str]:
    """``num_samples`` continuations of ``prompt`` by a decoder-only model, sampled together (one
    batch) as ``decode/sample.py`` says (``temperature`` 0 or ``top_k`` 1: greedy), each
    ``max_new_tokens`` tokens long; the text after the prompt, without it.

    ``seed`` seeds the sampler's own generator: the same seed gives the same samples (None: a
    fresh seed). ``on_text(sample, text)``, if given, receives each sample's text as it grows: the
    growing ids are decoded whole and the new end of the text is handed on, so that SentencePiece's
    word boundaries come out as in the final text."""
    check_model(model, tokenizer, "generate")
    check_sampling(temperature, top_k, top_p)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise AtencionError(f"--num-samples must be a positive integer, got {num_samples!r}")
    ids = check_prompt(model, tokenizer, prompt, max_new_tokens, what)
    device = _device(model)
    generator = torch.Generator(device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    head = render(tokenizer, ids)

    def continuation(new: list[int]) -> str:
        text = render(tokenizer, ids + new)
        return text[len(head):] if text.startswith(head) else render(tokenizer, new)

    new: list[list[int]] = [[] for _ in range(num_samples)]
    shown = [""] * num_samples

    def show() -> None:
        for k, row in enumerate(new):
            text = continuation(row)
            if text.startswith(shown[k]) and len(text) > len(shown[k]):
                on_text(k, text[len(shown[k]):])
                shown[k] = text

    def on_step(step: int, tokens: torch.Tensor) -> None:
        for row, token in zip(new, tokens.tolist()):
            row.append(token)
        if on_text is not None:
            show()

    rows = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    generate_ids(model, rows, max_new_tokens, temperature, top_k, top_p, generator, on_step=on_step)
    return [continuation(row) for row in new]


# fill-mask --------------------------------------------------------------------------------------


def token_text(tokenizer: Tokenizer, i: int) -> str:
    """Token ``i`` as text: a character, or a SentencePiece piece with its word-start mark ``▁``
    shown as a leading space (" cat" starts a word, "ing" goes on with one); special tokens by name."""
    piece = tokenizer.piece(i)
    return piece.replace("▁", " ") if tokenizer.kind == "sentencepiece" else piece


def masked_ids(tokenizer: Tokenizer, text: str, what: str = "--text") -> list[int]:
    """``<s> pieces </s>`` of ``text`` with ``<mask>`` where the text says ``<mask>``: the pieces
    between the masks are encoded on their own."""
    if MASK not in text:
        raise AtencionError(f"{what}: no {MASK} in the text; write {MASK} where a token should be predicted")
    ids = [BOS_ID]
    for number, part in enumerate(text.strip().split(MASK)):
        ids.extend(([tokenizer.mask_id] if number else []) + tokenizer.encode(part))
    return ids + [EOS_ID]


def fill_mask(model, tokenizer: Tokenizer, text: str, top_k: int = 5,
              what: str = "--text") -> list[list[tuple[str, float]]]:
    """For each ``<mask>`` in ``text``, in order, the ``top_k`` most likely tokens (see
    ``token_text``) and their probabilities under an encoder's masked-LM head, most likely first.
    All masks are predicted at once, each seeing the others as ``<mask>``."""
    check_model(model, tokenizer, "fill-mask")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise AtencionError(f"--top-k must be a positive integer, got {top_k!r}")
    ids = masked_ids(tokenizer, text, what)
    limit = position_limit(model)
    if limit is not None and len(ids) > limit:
        raise AtencionError(f"{what}: {len(ids)} tokens with <s> and </s>, more than this model's learned "
                            f"positions (max_positions={limit})")
    inputs = torch.tensor([ids], device=_device(model))
    with evaluating(model):
        logits = model(inputs, select=inputs == tokenizer.mask_id)
    probabilities, index = logits.float().softmax(-1).topk(min(top_k, logits.size(-1)), dim=-1)
    return [[(token_text(tokenizer, i), p) for i, p in zip(row_index, row_p)]
            for row_index, row_p in zip(index.tolist(), probabilities.tolist())]


# classify ---------------------------------------------------------------------------------------


def label_names(model) -> list[str]:
    return model.cfg.labels or [str(i) for i in range(model.cfg.num_labels)]


def sentence_ids(model, tokenizer: Tokenizer, texts: list[str], max_tokens: int = 0,
                 where: Callable[[int], str] = lambda i: f"--input line {i + 1}") -> list[list[int]]:
    """``<s> pieces </s>`` of each stripped text (as the classify task read its data), refusing
    one of more than ``max_tokens`` pieces (0: no limit) or beyond a learned position table,
    named by ``where(index)``."""
    limit = position_limit(model)
    out = []
    for i, text in enumerate(texts):
        ids = [BOS_ID, *tokenizer.encode(text.strip()), EOS_ID]
        if max_tokens and len(ids) - 2 > max_tokens:
            raise AtencionError(f"{where(i)}: {len(ids) - 2} tokens, more than the limit of {max_tokens}")
        if limit is not None and len(ids) > limit:
            raise AtencionError(f"{where(i)}: {len(ids)} tokens with <s> and </s>, more than this model's "
                                f"learned positions (max_positions={limit})")
        out.append(ids)
    return out


def classify_probabilities(model, tokenizer: Tokenizer, texts: list[str], batch_tokens: int = 4096,
                           max_tokens: int = 0, where: Callable[[int], str] = lambda i: f"--input line {i + 1}"
                           ) -> torch.Tensor:
    """The probability of every label for each text, (len(texts), num_labels), batched by
    ``batch_tokens``. An empty text is classified as the empty sentence ``<s> </s>``."""
    check_model(model, tokenizer, "classify")
    examples = sentence_ids(model, tokenizer, texts, max_tokens, where)
    with evaluating(model):
        return classify_logits(model, examples, batch_tokens, _device(model)).softmax(-1)


def classify_lines(model, tokenizer: Tokenizer, lines: list[str], batch_tokens: int = 4096, max_tokens: int = 0,
                   where: Callable[[int], str] = lambda i: f"--input line {i + 1}") -> list[tuple[str, float]]:
    """The most likely label of each line and its probability (see ``classify_probabilities``)."""
    probabilities, index = classify_probabilities(model, tokenizer, lines, batch_tokens, max_tokens, where).max(-1)
    names = label_names(model)
    return [(names[i], p) for i, p in zip(index.tolist(), probabilities.tolist())]


# evaluate ---------------------------------------------------------------------------------------


def evaluate_lm(model, tokenizer: Tokenizer, lines: list[str], block_size: int | None = None,
                batch_tokens: int = 4096) -> dict:
    """Loss (nats per token), perplexity and bits per character of a language model on ``lines``
    (``lm_scores`` on their ``text_stream``), in non-overlapping blocks of ``block_size`` tokens
    (default: the model's ``max_positions``)."""
    check_model(model, tokenizer, "generate")
    limit = position_limit(model)
    block_size = block_size or model.cfg.max_positions
    if limit is not None and block_size > limit:
        raise AtencionError(f"--block-size {block_size}: more than this model's learned positions "
                            f"(max_positions={limit})")
    stream = torch.tensor(text_stream(lines, tokenizer), dtype=torch.long)
    characters = None if tokenizer.kind == "char" else sum(len(line) + 1 for line in lines)  # as LMTask counts
    with evaluating(model):
        return lm_scores(model, stream, block_size, max(1, batch_tokens // block_size), _device(model), characters)


def evaluate_mlm(model, tokenizer: Tokenizer, lines: list[str], batch_tokens: int = 4096, max_tokens: int = 1024,
                 seed: int = 0, probability: float = 0.15, what: str = "--text",
                 count_from: list[str] | None = None) -> dict:
    """Masked-token loss, perplexity and accuracy of a masked language model on the non-empty
    ``lines`` (``mlm_scores``: ``probability`` of the tokens masked as in training, drawn from
    ``seed``, so the same positions every time), beside the accuracy on the same positions of
    always guessing the most frequent token of ``count_from`` (the training text, when known),
    or else of these lines themselves: a baseline that has peeked at the test text's token
    counts. A line of more than ``max_tokens`` pieces (or beyond a learned position table) is
    refused, naming it."""
    check_model(model, tokenizer, "fill-mask")
    numbers = [number for number, line in enumerate(lines, start=1) if line.strip()]
    if not numbers:
        raise AtencionError(f"{what}: no sentence; the text has only empty lines")
    examples = sentence_ids(model, tokenizer, [lines[n - 1] for n in numbers], max_tokens,
                            lambda i: f"{what} line {numbers[i]}")
    masker = Masker(tokenizer, probability)
    device = _device(model)
    with evaluating(model):
        scores = mlm_scores(model, masker, examples, batch_tokens, device, seed)
    counted = examples if count_from is None else [tokenizer.encode(line) for line in count_from]
    counts = Counter(i for e in counted for i in e if i >= masker.first_regular or i == UNK_ID)  # the maskable
    guess = counts.most_common(1)[0][0]
    generator = torch.Generator().manual_seed(seed)  # the draws of mlm_scores again: the same positions
    right = 0
    for group in token_batches([(len(e), 0) for e in examples], batch_tokens, seed=None):
        _, targets = masker([examples[i] for i in group], generator)
        right += int((targets[targets != PAD_ID] == guess).sum())
    return {**scores, "sentences": len(examples), "mask_probability": probability, "seed": seed,
            "most_frequent_token": token_text(tokenizer, guess),
            "most_frequent_token_accuracy": right / scores["masked"]}


def evaluate_classifier(model, tokenizer: Tokenizer, rows: list[tuple[int, str]], batch_tokens: int = 4096,
                        max_tokens: int = 0, what: str = "--tsv") -> dict:
    """Accuracy, loss and the confusion matrix (rows: true label, columns: predicted) of a
    classifier on ``rows`` of (label index, text); a text of more than ``max_tokens`` pieces (0:
    no limit) is refused, naming its row."""
    check_model(model, tokenizer, "classify")
    examples = sentence_ids(model, tokenizer, [text for _, text in rows], max_tokens,
                            lambda i: f"{what} row {i + 1}")
    with evaluating(model):
        scores = classify_scores(model, examples, [label for label, _ in rows], batch_tokens, _device(model))
    return {**scores, "labels": label_names(model)}
