"""Task ``lm``: a causal language model (GPT) trained on the contiguous blocks of plain text,
validated by perplexity and bits per character; a trained model continues a prompt
(``generate_text``; the sampler is decode/sample.py) and is scored on a text (``evaluate_lm``).

A language model reads a token stream with a line break between lines (``text_stream``): a
character vocabulary keeps the newlines as characters, SentencePiece puts ``</s>`` between lines,
and a Hugging Face tokenizer reads the text whole, newlines and all, as its model was trained.
A Hugging Face model's generation ends at its end-of-sequence token (generation_config.json's
``eos_token_id``), as transformers' ``generate`` does; ``generate --chat`` writes the prompt as
the user's turn through the tokenizer's chat template.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from torch import Tensor

from ..arguments import DRAFT_TOKENS, Command, add_sampling_arguments, bounded, draft_tokens_of, warner
from ..data.corpus import read_lines
from ..data.text import epoch_offset, lm_blocks, read_text, split_tail
from ..data.tokenizer import EOS_ID, Tokenizer, check_text
from ..data.tokens import TokenStream, write_tokens
from ..decode.sample import generate_ids
from ..decode.settings import SamplingConfig, sampling_config
from ..decode.speculative import check_draft, speculative_ids
from ..endpoint import Refused, RequestBody, TaskEndpoint, cut, unprocessable
from ..errors import AtencionError, Diverged
from ..fileio import need_dir, need_file
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
    register_task,
    warn_unseen,
)

log = logging.getLogger(__name__)


# the training side ----------------------------------------------------------------------------


def text_splits(cfg) -> tuple[list[str], list[str], int | None]:
    """Training and validation lines of the lm and mlm tasks: data.valid_text, or else the
    held-out tail (data.valid_fraction) of data.train_text; and, for a tail, the number of lines
    it was cut from (None: data.valid_text)."""
    d = cfg.data
    if d.train_text is None:
        raise AtencionError(f"data.train_text: task {cfg.task!r} reads plain text; set data.train_text to a file "
                            f"or a list of files")
    lines = read_text(d.train_text, "data.train_text")
    if d.valid_text is not None:
        return lines, read_text(d.valid_text, "data.valid_text"), None
    train, valid = split_tail(lines, d.valid_fraction)
    return train, valid, len(lines)


def refuse_empty_tail(cfg, tail_of: int | None) -> None:
    """Called when the validation text is empty: if it is the held-out tail (cut from ``tail_of``
    lines), say that data.valid_fraction leaves nothing there and what to do (None, for
    data.valid_text: the caller's own refusal follows)."""
    if tail_of is not None:
        raise AtencionError(f"data.valid_fraction: the held-out tail ({cfg.data.valid_fraction:g} of {tail_of} "
                            f"lines of data.train_text) is empty; raise data.valid_fraction (e.g. 0.1) or give a "
                            f"validation text in data.valid_text")


def text_stream(lines: list[str], tokenizer: Tokenizer) -> list[int]:
    """The token stream a language model reads: every character with its newlines (character
    vocabulary), each line's pieces followed by ``</s>`` (SentencePiece, which has no newline), or
    the whole text as a Hugging Face tokenizer reads it (its own start token first, if it adds one)."""
    if tokenizer.kind == "char":
        return tokenizer.encode("".join(line + "\n" for line in lines))
    if tokenizer.foreign:
        return tokenizer.sentence("".join(line + "\n" for line in lines))
    stream: list[int] = []
    for line in lines:
        stream.extend(tokenizer.encode(line))
        stream.append(EOS_ID)
    return stream


@torch.no_grad()
def lm_scores(model, stream: Tensor, block_size: int, batch_blocks: int, device,
              characters: int | None = None) -> dict:
    """Loss (nats per token), perplexity and bits per character of ``model`` on a token
    ``stream``, cut into non-overlapping blocks of ``block_size`` (the last one shorter): every
    token but the first is predicted once, from the tokens before it in its block.
    ``characters``: how many characters the predicted tokens spell (None: one per token, a
    character vocabulary)."""
    blocks = lm_blocks(stream.numel(), block_size, partial=True)
    if not blocks:
        raise AtencionError(f"the text has {stream.numel()} tokens; at least 2 are needed")
    nll = 0.0
    tokens = 0
    for i in range(0, len(blocks), batch_blocks):
        group = blocks[i: i + batch_blocks]
        by_length: dict[int, list[int]] = {}
        for start, length in group:
            by_length.setdefault(length, []).append(start)
        for length, starts in by_length.items():
            rows = torch.stack([stream[s: s + length + 1] for s in starts]).to(device)
            logits = model(rows[:, :-1])
            nll += float(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1),
                                         reduction="sum"))
            tokens += rows[:, 1:].numel()
    return {"loss": nll / tokens, "ppl": math.exp(min(nll / tokens, 50)),
            "bpc": nll / math.log(2) / (characters or tokens),
            "tokens": tokens, "block_size": block_size}


def tokenize_files(tokenizer: str, texts: list[str], out: str) -> dict:
    """`atencion tokenize`: write the token stream of the text files ``texts`` (in order, each read
    whole) as ``task: lm`` reads them (``text_stream``: line breaks as the tokenizer keeps them) into
    the token file ``out`` (data/tokens.py), with the tokenizer of the directory ``tokenizer`` (a
    model or run directory, or a Hugging Face tokenizer's). Returns the file's header."""
    if not texts:
        raise AtencionError("tokenize: give at least one text file")
    loaded = Tokenizer.load(need_dir(tokenizer, "--tokenizer"))
    for path in texts:
        need_file(path, "TEXT")
    streams = (text_stream(read_lines(path), loaded) for path in texts)
    return {"out": str(out), **write_tokens(out, streams, loaded, [str(Path(p)) for p in texts])}


class LMTask(Task):
    name = "lm"

    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg.data
        if d.train_tokens is not None:  # token files: read when the tokenizer is known (encode)
            self.train_lines = self.valid_lines = None
        else:
            self.train_lines, self.valid_lines, self.tail_of = text_splits(cfg)

    def train_tokenizer(self) -> Tokenizer:
        """data.tokenizer_dir's tokenizer (token files must give one: theirs), or one trained on the text."""
        d = self.cfg.data
        if d.tokenizer_dir is not None:
            return Tokenizer.load(need_dir(d.tokenizer_dir, "data.tokenizer_dir"))
        if d.train_tokens is not None:
            raise AtencionError("data.train_tokens: token files are read with the tokenizer that wrote them; set "
                                "data.tokenizer_dir to its directory")
        return super().train_tokenizer()

    def _encode_token_files(self, tokenizer: Tokenizer) -> None:
        """data.train_tokens (and data.valid_tokens, or the held-out tail), memory-mapped."""
        d = self.cfg.data
        stream = TokenStream(d.train_tokens, "data.train_tokens", tokenizer)
        if d.valid_tokens is not None:
            self.stream, self.valid_stream = stream, TokenStream(d.valid_tokens, "data.valid_tokens", tokenizer)
        else:
            self.stream, self.valid_stream = stream.tail(d.valid_fraction)
        self.valid_characters = None  # bits per token: the characters are not in the file
        self.tail_of = None

    def tokenizer_texts(self) -> list[str]:
        if self.cfg.data.tokenizer == "char":  # the stream keeps its newlines: they are characters too
            return [line + "\n" for line in self.train_lines]
        return self.train_lines

    def encode(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        block = self.cfg.data.block_size
        if self.cfg.data.train_tokens is not None:
            self._encode_token_files(tokenizer)
        else:
            self.stream = torch.tensor(text_stream(self.train_lines, tokenizer), dtype=torch.long)
        if self.stream.numel() < block + 1:
            raise AtencionError(f"data.train_text: the training text has {self.stream.numel()} tokens, fewer than "
                                f"one block of data.block_size={block} + 1")
        if self.cfg.data.train_tokens is None:
            self.valid_stream = torch.tensor(text_stream(self.valid_lines, tokenizer), dtype=torch.long)
            # SentencePiece: the characters of the validation lines (with their newlines)
            self.valid_characters = None if tokenizer.kind == "char" else sum(len(x) + 1 for x in self.valid_lines)
        if self.valid_stream.numel() < 2:
            refuse_empty_tail(self.cfg, self.tail_of)
            raise AtencionError("data: the validation text has fewer than 2 tokens")
        log.info("lm: %d training tokens, %d validation tokens", self.stream.numel(), self.valid_stream.numel())
        self._blocks: tuple[int, list] | None = None

    def blocks(self, epoch: int) -> list[tuple[int, int]]:
        if self._blocks is None or self._blocks[0] != epoch:
            block = self.cfg.data.block_size
            offset = epoch_offset(self.cfg.train.seed, epoch, block, self.stream.numel())  # leaves a block
            self._blocks = (epoch, lm_blocks(self.stream.numel(), block, offset))
        return self._blocks[1]

    def batches(self, epoch: int) -> list[list[int]]:
        t, block = self.cfg.train, self.cfg.data.block_size
        order = list(range(len(self.blocks(epoch))))
        torch_rng = torch.Generator().manual_seed(t.seed + epoch)
        order = [order[i] for i in torch.randperm(len(order), generator=torch_rng).tolist()]
        per_batch = max(1, t.max_tokens // block)
        self._epoch = epoch  # make_batch reads this epoch's blocks
        return [order[k: k + per_batch] for k in range(0, len(order), per_batch)]

    def make_batch(self, indices, step, part) -> TaskBatch:
        blocks = self.blocks(self._epoch)
        rows = torch.stack([self.stream[s: s + n + 1] for s, n in (blocks[i] for i in indices)])
        return TaskBatch(rows[:, :-1], rows[:, 1:], rows[:, 1:].numel(), rows[:, 1:].numel())

    @torch.no_grad()
    def validate(self, model, device, step):
        block = self.cfg.data.block_size
        scores = lm_scores(model, self.valid_stream, block, max(1, self.cfg.train.max_tokens // block), device,
                           self.valid_characters)
        if not math.isfinite(scores["loss"]):
            raise Diverged(step, "validation loss", scores["loss"])
        return {"valid_loss": scores["loss"], "valid_ppl": scores["ppl"], "valid_bpc": scores["bpc"]}


# the use side: generate -----------------------------------------------------------------------


def can_generate(model, tokenizer: Tokenizer) -> bool:
    return model.cfg.arch == "decoder"


def prompt_ids(tokenizer: Tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """The ids a language model continues ``prompt`` from, as ``text_stream`` wrote its training
    text: characters with their line breaks, or (SentencePiece) each line's pieces with ``</s>``
    between lines. An empty prompt is the start of a line: a line break (``</s>``). A Hugging Face
    tokenizer reads the prompt as transformers' tokenizer does (its start token, if it adds one;
    an empty prompt is that token alone), or, with ``chat`` and a chat template, as the user's
    turn of a chat."""
    if tokenizer.foreign:
        if chat and tokenizer.chat_template is not None:
            return tokenizer.chat(prompt)
        start = tokenizer.specials.bos if tokenizer.specials.bos is not None else tokenizer.specials.eos
        return tokenizer.sentence(prompt) if prompt else [start]
    if tokenizer.kind == "char":
        return tokenizer.encode(prompt or "\n")
    if not prompt:
        return [EOS_ID]
    ids: list[int] = []
    for number, line in enumerate(prompt.split("\n")):
        ids.extend(([EOS_ID] if number else []) + tokenizer.encode(line))
    return ids


def render(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text of a language model's ``ids``: ``</s>`` of a SentencePiece model is a line break;
    a Hugging Face tokenizer decodes them, leaving its special tokens out."""
    if tokenizer.kind == "char" or tokenizer.foreign:
        return tokenizer.decode(ids)
    lines, line = [], []
    for i in ids:
        if i == EOS_ID:
            lines.append(line)
            line = []
        else:
            line.append(i)
    return "\n".join(tokenizer.decode(piece_ids) for piece_ids in [*lines, line])


def check_prompt(model, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, what: str = "--prompt",
                 chat: bool = False) -> list[int]:
    """The prompt's ids (``prompt_ids``), refused in one line naming ``what`` when the prompt is
    not valid Unicode (``check_text``), encodes to no token (the tokenizer drops each of its
    characters) or alone does not fit in a learned position table (past it, generation reads the
    last ``max_positions`` tokens)."""
    ids = prompt_ids(tokenizer, check_text(prompt, what), chat)
    if not ids:
        raise AtencionError(f"{what}: encodes to no token: this tokenizer drops each of its characters "
                            f"({listing([repr(c) for c in dict.fromkeys(prompt)])}); give text it reads (an empty "
                            f"prompt starts a new line)")
    limit = position_limit(model.cfg)
    if limit is not None and len(ids) > limit:
        raise AtencionError(f"{what}: {len(ids)} tokens, but this model's learned positions stop at "
                            f"max_positions={limit}; shorten the prompt")
    return ids


def generate_text(model, tokenizer: Tokenizer, prompt: str, sampling: SamplingConfig | None = None, *,
                  on_text: Callable[[int, str], None] | None = None, what: str = "--prompt", warn=None,
                  chat: bool = False, draft=None, **settings) -> list[str]:
    """``num_samples`` continuations of ``prompt`` by a decoder-only model, sampled together (one
    batch) as ``decode/sample.py`` says (``temperature`` 0, or 0 in float32, or ``top_k`` 1:
    greedy), each ``max_new_tokens`` tokens long; the text after the prompt, without it. The
    settings are ``sampling`` (a SamplingConfig) with the loose keyword ``settings`` put in
    (``max_new_tokens=100, seed=0``: ``sampling_config``). With a ``draft`` model (over the same
    token ids), each sample is drawn in turn by speculative decoding (``decode/speculative.py``,
    ``draft_tokens`` proposed per round): greedy gives the same text, sampling the same
    distribution with other random numbers.

    ``seed`` seeds the sampler's own generator: the same seed gives the same samples (None: a
    fresh seed). ``on_text(sample, text)``, if given, receives each sample's text as it grows: the
    growing ids are decoded whole and the new end of the text is handed on, so that SentencePiece's
    word boundaries come out as in the final text. Characters a character vocabulary lacks (read
    as ``<unk>``) are named once by ``warn(message)``, by default a logging warning. A Hugging
    Face model's samples end at its end-of-sequence token (``Tokenizer.specials.stop``); ``chat``:
    the prompt goes through the tokenizer's chat template, if it has one (``prompt_ids``)."""
    check_model(model, tokenizer, "generate")
    sampling = sampling_config(sampling, **settings)
    sampling.check()
    ids = check_prompt(model, tokenizer, prompt, sampling.max_new_tokens, what, chat)
    warn_unseen(tokenizer, prompt, what, warn)
    samples = _Samples(tokenizer, ids, sampling.num_samples, on_text)
    rows = torch.tensor([ids] * sampling.num_samples, dtype=torch.long, device=model_device(model))
    stop = (tokenizer.specials.stop if tokenizer.foreign else None) or None
    generator, s = _generator(model_device(model), sampling.seed), sampling
    if draft is None:
        generate_ids(model, rows, s.max_new_tokens, s.temperature, s.top_k, s.top_p, generator, stop,
                     on_step=samples.step)
        return samples.done()
    for k in range(s.num_samples):  # one text at a time: each accepts its own number of draft tokens per round
        speculative_ids(model, draft, rows[k:k + 1], s.max_new_tokens, s.draft_tokens, s.temperature, s.top_k,
                        s.top_p, generator, stop, on_step=lambda step, tokens, k=k: samples.step(step, tokens, k))
    return samples.done()


def _generator(device, seed: int | None) -> torch.Generator:
    """The sampler's own random numbers: from ``seed``, or a fresh seed when None."""
    generator = torch.Generator(device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class _Samples:
    """The samples' token ids as they grow, and their text: handed on as it grows to ``on_text(sample,
    text)``, if given, decoded whole each time so that SentencePiece's word boundaries come out as in
    the final text."""

    def __init__(self, tokenizer: Tokenizer, ids: list[int], count: int,
                 on_text: Callable[[int, str], None] | None):
        self.tokenizer, self.ids, self.on_text = tokenizer, ids, on_text
        self.head = render(tokenizer, ids)
        self.new: list[list[int]] = [[] for _ in range(count)]
        self.shown = [""] * count

    def continuation(self, new: list[int]) -> str:
        text = render(self.tokenizer, self.ids + new)
        return text[len(self.head):] if text.startswith(self.head) else render(self.tokenizer, new)

    def step(self, step: int, tokens: torch.Tensor, sample: int | None = None) -> None:
        """The step's new tokens: one per sample, or the one of ``sample`` alone (speculative decoding)."""
        rows = self.new if sample is None else [self.new[sample]]
        for row, token in zip(rows, tokens.tolist()):
            row.append(token)
        if self.on_text is not None:
            self.show()

    def show(self, final: bool = False) -> None:
        for k, row in enumerate(self.new):
            text = self.continuation(row)
            # a character whose bytes are split over tokens (byte-level BPE) decodes as U+FFFD
            # until its last byte comes: held back until then, or until the text is done
            text = text if final else text.rstrip("\ufffd")
            if text.startswith(self.shown[k]) and len(text) > len(self.shown[k]):
                self.on_text(k, text[len(self.shown[k]):])
                self.shown[k] = text

    def done(self) -> list[str]:
        if self.on_text is not None:
            self.show(final=True)
        return [self.continuation(row) for row in self.new]


def check_draft_vocabulary(model: str, tokenizer: Tokenizer, draft: str, draft_tokenizer: Tokenizer) -> None:
    """Refuse, in one line naming both directories, a draft whose tokenizer is not the target's:
    speculative decoding compares the two models' probabilities token id by token id."""
    def pieces(t: Tokenizer) -> list[str]:
        return [t.piece(i) for i in range(t.vocab_size)]

    if draft_tokenizer is None:  # a model of images or sounds
        raise AtencionError(f"--draft {draft} reads no tokens (it has no tokenizer): a draft must be a decoder-only "
                            f"model with the tokenizer of --model {model}")
    mine, theirs = (tokenizer.kind, pieces(tokenizer)), (draft_tokenizer.kind, pieces(draft_tokenizer))
    if mine == theirs:
        return
    if mine[0] != theirs[0] or len(mine[1]) != len(theirs[1]):
        detail = f"{theirs[0]}, {len(theirs[1])} pieces against {mine[0]}, {len(mine[1])}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(mine[1], theirs[1])) if a != b)
        detail = f"token {i} is {theirs[1][i]!r} against {mine[1][i]!r}"
    raise AtencionError(f"--draft {draft} has another vocabulary than --model {model} ({detail}): a draft must use "
                        f"the target's tokenizer")


def generate_to(out: TextIO, model: str, prompt: str = "", input: str | None = None,
                sampling: SamplingConfig | None = None, device: str = "cpu", warn=None, chat: bool = False,
                draft: str | None = None) -> None:
    """`atencion generate`: write to ``out`` the prompt, its continuation by the model directory
    ``model`` and a line break. One sample is written as it is generated (flushed when ``out``
    is a terminal); several are drawn together and written when done. With ``input`` each line of
    that file is a prompt, sampled with the same seed. When ``input`` or more than one sample is
    asked for (``sampling``, a SamplingConfig), each text starts with a header line: '--- sample K
    ---', '--- line N ---' or '--- line N, sample K ---'. With ``draft``, a model directory with
    the same tokenizer, the text comes by speculative decoding (``generate_text``). The settings
    and every prompt are checked before anything is written. ``warn(message)`` hears of bytes of
    ``input`` that are not UTF-8 (replaced) and, once, of characters a character vocabulary lacks
    (read as ``<unk>``). ``chat``: each prompt is the user's turn through the tokenizer's chat
    template (``warn`` hears when it has none: plain text)."""
    sampling = sampling or SamplingConfig()
    sampling.check()
    if input:
        need_file(input, "--input")
    loaded, tokenizer = load_model_dir(model, device)
    check_model(loaded, tokenizer, "generate")
    if chat and tokenizer.chat_template is None:
        (warn or log.warning)(f"--chat: {model} has no chat template (tokenizer_config.json or chat_template.jinja); "
                              f"the prompt is read as plain text")
    drafting = None if draft is None else _draft_model(model, tokenizer, loaded, draft, device, sampling)
    prompts = _prompts(prompt, input, warn)
    for text, what in prompts:
        check_prompt(loaded, tokenizer, text, sampling.max_new_tokens, what, chat)
    warn_unseen(tokenizer, [text for text, _ in prompts] if input else prompt, input or "--prompt", warn)
    live = out.isatty()

    def show(sample: int, text: str) -> None:
        out.write(text)
        if live:
            out.flush()

    for number, (text, what) in enumerate(prompts, start=1):
        settings = dict(what=what, warn=_told, chat=chat, draft=drafting)
        if sampling.num_samples == 1:
            out.write(f"--- line {number} ---\n{text}" if input else text)
            generate_text(loaded, tokenizer, text, sampling, on_text=show, **settings)
            show(0, "\n")
            continue
        for k, sample in enumerate(generate_text(loaded, tokenizer, text, sampling, **settings), start=1):
            header = f"--- line {number}, sample {k} ---" if input else f"--- sample {k} ---"
            show(k, f"{header}\n{text}{sample}\n")


def _draft_model(model: str, tokenizer: Tokenizer, loaded, draft: str, device: str, sampling: SamplingConfig):
    """The draft model directory ``draft``, loaded and checked against ``model`` (vocabulary, shape)."""
    drafting, draft_tokenizer = load_model_dir(draft, device, what="--draft")
    check_draft_vocabulary(model, tokenizer, draft, draft_tokenizer)
    check_draft(loaded, drafting, sampling.draft_tokens)
    return drafting


def _prompts(prompt: str, input: str | None, warn) -> list[tuple[str, str]]:
    """The prompts and how messages name each: ``prompt``, or each line of the file ``input``."""
    if not input:
        return [(prompt, "--prompt")]
    lines = read_lines(input, allow_empty=True, errors="replace", warn=warn)
    return [(line, f"--input line {number}") for number, line in enumerate(lines, start=1)]


def _told(message: str) -> None:
    """The ``warn`` of a prompt whose warnings ``generate_to`` gave already, once for all prompts."""


# the use side: evaluate -----------------------------------------------------------------------


def evaluate_lm(model, tokenizer: Tokenizer, lines: list[str], block_size: int | None = None,
                batch_tokens: int = 4096, what: str = "--text", warn=None) -> dict:
    """Loss (nats per token), perplexity and bits per character of a language model on ``lines``
    (``lm_scores`` on their ``text_stream``), in non-overlapping blocks of ``block_size`` tokens
    (default: the model's ``max_positions``). A line that is not valid Unicode is refused, naming
    it as line N of ``what``; characters a character vocabulary lacks (read as ``<unk>``) are named
    once by ``warn(message)``, by default a logging warning."""
    check_model(model, tokenizer, "generate")
    for number, line in enumerate(lines, start=1):
        check_text(line, f"{what} line {number}")
    warn_unseen(tokenizer, lines, what, warn)
    limit = position_limit(model.cfg)
    block_size = block_size or model.cfg.max_positions
    if limit is not None and block_size > limit:
        raise AtencionError(f"--block-size {block_size}: more than this model's learned positions "
                            f"(max_positions={limit})")
    stream = torch.tensor(text_stream(lines, tokenizer), dtype=torch.long)
    characters = None if tokenizer.kind == "char" else sum(len(line) + 1 for line in lines)  # as LMTask counts
    with evaluating(model):
        return lm_scores(model, stream, block_size, max(1, batch_tokens // block_size), model_device(model),
                         characters)


def evaluate_lm_dir(model: str, options: dict[str, Any], warn=None) -> dict:
    """`atencion evaluate` for a language model: ``evaluate_lm`` on the file ``text``."""
    return evaluate_file(model, options, "text", lambda loaded, tokenizer, path: evaluate_lm(
        loaded, tokenizer, read_lines(path), options.get("block_size"), options.get("batch_tokens", 4096), path,
        warn))


# the endpoint: POST /generate (`atencion serve`) --------------------------------------------------


SMALLEST = 1e-30  # the least positive temperature and top_p of /generate (float32's smallest normal: 1.2e-38)
NEW_TOKENS = 100  # /generate's max_new_tokens when a request gives none (at most the server's limit)


class GenerateRequest(RequestBody):
    """POST /generate: see ``tasks.lm.generate_text``; max_new_tokens None is NEW_TOKENS (at most the limit).

    temperature is 0 (greedy) or from SMALLEST (1e-30) to 100, top_p from SMALLEST to 1: sampling
    runs in float32, where a smaller positive number is 0 (below 1.4e-45) or subnormal, and
    dividing the logits by it or cutting the nucleus at it makes no distribution to draw from. A
    value that small is refused (422 naming the field) rather than guessed at; any temperature or
    top_p near SMALLEST already samples the greedy text."""

    prompt: str = ""
    model: str | None = None
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    num_samples: int = Field(1, ge=1)

    @field_validator("temperature", "top_p")
    @classmethod
    def _not_too_small(cls, value: float, info: ValidationInfo) -> float:
        if 0 < value < SMALLEST:
            greedy = "0 for greedy decoding or " if info.field_name == "temperature" else ""
            raise PydanticCustomError("too_small_for_float32", f"{value!r} is too small for float32, where "
                                                               f"sampling runs; give {greedy}at least {SMALLEST:g}")
        return value


def default_new_tokens(settings) -> int:
    """/generate's max_new_tokens when a request gives none."""
    return min(NEW_TOKENS, settings.max_new_tokens)


async def serve_generate(body: GenerateRequest, m, ctx) -> dict[str, Any]:
    """POST /generate: the prompt and the settings checked against the server's limits, then sampled
    (``generate_text``) on the model's worker."""
    settings = ctx.settings
    new_tokens = body.max_new_tokens or default_new_tokens(settings)
    if new_tokens > settings.max_new_tokens:
        raise Refused(422, f"max_new_tokens: {cut(str(new_tokens))} is more than the limit of "
                           f"{settings.max_new_tokens}")
    if body.num_samples > settings.max_samples:
        raise Refused(422, f"num_samples: {cut(str(body.num_samples))} is more than the limit of "
                           f"{settings.max_samples}")
    ctx.check_length("prompt", body.prompt)
    with unprocessable():
        ids = check_prompt(m.model, m.tokenizer, body.prompt, new_tokens, "prompt")
    ctx.check_length("prompt", body.prompt, len(ids))
    sampling = SamplingConfig(new_tokens, body.temperature, body.top_k, body.top_p, body.seed, body.num_samples,
                              SamplingConfig.draft_tokens if m.draft is None else m.draft.tokens)
    draft = None if m.draft is None else m.draft.model
    texts = await ctx.run(m, lambda: generate_text(m.model, m.tokenizer, body.prompt, sampling, what="prompt",
                                                   draft=draft))
    return {"model": m.name, "prompt": body.prompt, "texts": texts}


def draft_info(m) -> dict[str, Any]:
    """/info's "draft" of a model that generates: the draft model /generate speculates with, or None."""
    if m.draft is None:
        return {"draft": None}
    return {"draft": {"path": m.draft.path, "draft_tokens": m.draft.tokens,
                      "parameters": m.draft.model.num_parameters()}}


ENDPOINT = TaskEndpoint(GenerateRequest, serve_generate, defaults=("temperature", "top_k", "top_p", "num_samples"),
                        server_defaults=lambda settings: {"max_new_tokens": default_new_tokens(settings)},
                        info=draft_info)


# the command: `atencion generate` -----------------------------------------------------------------

def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory of a decoder-only language model (arch decoder), "
                                                   "atencion's or a Hugging Face one")
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default="", help="text to continue (default: none; the model starts a new line)")
    prompts.add_argument("--input", help="a file of prompts, one a line: one generation per line")
    p.add_argument("--max-new-tokens", type=bounded(int, 1, highest=1_000_000), default=200,
                   help="tokens generated per sample (default: 200)")
    add_sampling_arguments(p, 1.0, "the same text")
    p.add_argument("--num-samples", type=bounded(int, 1, highest=1000), default=1,
                   help="samples per prompt, drawn together as one batch (default: 1)")
    p.add_argument("--chat", action="store_true",
                   help="an instruct model: the prompt is the user's turn, written through the chat template of "
                        "its Hugging Face tokenizer (plain text when it has none)")
    p.add_argument("--draft", metavar="DIR",
                   help="speculative decoding: a small model directory with the same tokenizer proposes tokens "
                        "that --model verifies, several per pass; the text comes from --model's own distribution "
                        "(greedy: the same text), faster when the draft often agrees (default: off)")
    p.add_argument("--draft-tokens", type=bounded(int, 1, highest=64),
                   help=f"with --draft: tokens the draft proposes per round (default: {DRAFT_TOKENS})")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")


def cmd_generate(args: argparse.Namespace) -> None:
    """Continue a prompt with a decoder-only language model (a GPT) and print the prompt, its
    continuation and a line break. One sample is printed token by token as it is generated (flushed
    at once on a terminal); several (--num-samples) are drawn together and printed when done. With
    --input each line of the file is a prompt, sampled with the same --seed. When --input or
    --num-samples above 1 is given, each text starts with a header line: '--- sample K ---',
    '--- line N ---' or '--- line N, sample K ---'. Every prompt is checked (length against the
    model's learned positions) before anything is generated. With --draft, speculative decoding
    (Leviathan et al. 2023): --verbose logs its acceptance rate and tokens/s on stderr."""
    draft_tokens = draft_tokens_of(args)  # before the model is read
    sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                              args.num_samples, draft_tokens or DRAFT_TOKENS)
    generate_to(sys.stdout, args.model, args.prompt, args.input, sampling, args.device, warn=warner("generate"),
                chat=args.chat, draft=args.draft)


COMMAND = Command("generate", "continue a prompt with a language model (GPT), streamed",
                  add_generate_arguments, cmd_generate)


def check_lm_config(cfg, source: str) -> None:
    """Text or token files (data.train_text or data.train_tokens), each validated by its own kind."""
    d = cfg.data
    if d.train_tokens is not None and d.train_text is not None:
        raise AtencionError(f"{source}: give data.train_text or data.train_tokens, not both")
    if d.valid_tokens is not None and d.train_tokens is None:
        raise AtencionError(f"{source}: data.valid_tokens goes with data.train_tokens (text validates with "
                            f"data.valid_text)")


def block_positions(cfg) -> tuple[int, str]:
    """A language model's longest sequence: one block."""
    return cfg.data.block_size, "data.block_size"


SPEC = register_task(TaskSpec(
    name="lm", kind="a language model (arch decoder)", preset="gpt-tiny", archs=("decoder",), metric="loss",
    label_smoothing=0.0, training=LMTask, use="generate", needs="a decoder-only model (arch decoder)",
    can=can_generate, evaluate=evaluate_lm_dir, evaluate_options=("text", "block_size"),
    evaluate_required=("text",),
    endpoint=ENDPOINT, command=COMMAND,
    data_keys=(*TOKENIZER_KEYS, "train_text", "valid_text", "valid_fraction", "train_tokens", "valid_tokens",
               "tokenizer_dir", "block_size"),
    check_config=check_lm_config, longest=block_positions))
