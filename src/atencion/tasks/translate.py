"""Task ``translate``: parallel sentences, teacher forcing, label-smoothed cross-entropy (§5),
validated by loss and BLEU; a trained model translates lines (``translate_file``; the search is
decode/) and is scored by BLEU and chrF (``evaluate_translator``, evaluate.py)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from ..arguments import COUNT, POSITIVE, Command, add_decoding_arguments, decode_config_of, warner
from ..config import TWO_STACKS
from ..data.batching import collate, token_batches
from ..data.corpus import read_lines, read_parallel
from ..data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from ..decode.settings import DecodeConfig
from ..decode.translate import Translation, translate_lines
from ..endpoint import Refused, RequestBody, TaskEndpoint
from ..errors import AtencionError
from ..evaluate import evaluate, score
from ..fileio import atomic_write, need_file, need_output_file
from ..nn.inputs import reads_tokens
from ..nn.model_dir import load_model_dir
from .base import (
    TOKENIZER_KEYS,
    Task,
    TaskBatch,
    TaskSpec,
    check_model,
    flag,
    register_task,
    target_positions,
    valid_result,
)

log = logging.getLogger(__name__)


# the training side ----------------------------------------------------------------------------


def read_pairs(cfg, split: str) -> list[tuple[str, str]] | None:
    d = cfg.data
    src, tgt, tsv = getattr(d, f"{split}_src"), getattr(d, f"{split}_tgt"), getattr(d, f"{split}_tsv")
    if tsv and (src or tgt):
        raise AtencionError(f"data: give either {split}_tsv or {split}_src + {split}_tgt, not both")
    if not tsv and not src and not tgt:
        if split == "train":
            raise AtencionError("data: no training data; set data.train_src and data.train_tgt, or data.train_tsv")
        return None
    if not tsv and not (src and tgt):
        raise AtencionError(f"data: {split}_src and {split}_tgt go together; one of them is missing")
    pairs, report = read_parallel(tsv or src, None if tsv else tgt, d.empty_lines)
    log.info(report.summary(f"{split} corpus"))
    return pairs


def encode_pairs(pairs, tokenizer: Tokenizer, max_len: int, name: str) -> list[tuple[list[int], list[int]]]:
    """Subword ids of each pair; pairs with a side longer than ``max_len`` are dropped and counted."""
    examples, dropped = [], 0
    for s, t in pairs:
        src, tgt = tokenizer.encode_src(s), tokenizer.encode_tgt(t)
        if len(src) > max_len or len(tgt) > max_len:
            dropped += 1
            continue
        examples.append((src, tgt))
    if dropped:
        log.warning("%s: dropped %d of %d pairs longer than data.max_len=%d subwords",
                    name, dropped, len(pairs), max_len)
    if not examples:
        raise AtencionError(f"{name}: every pair is longer than data.max_len={max_len}")
    return examples


class TranslateTask(Task):
    name = "translate"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.train_pairs, self.valid_pairs = read_pairs(cfg, "train"), read_pairs(cfg, "valid")

    def train_tokenizer(self) -> Tokenizer:
        d = self.cfg.data
        return Tokenizer.train(self.train_pairs, d.vocab_size, d.model_type, d.joint, d.character_coverage,
                               d.tokenizer)

    def encode(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        max_len = self.cfg.data.max_len
        self.examples = encode_pairs(self.train_pairs, tokenizer, max_len, "train corpus")
        self.valid_examples = (encode_pairs(self.valid_pairs, tokenizer, max_len, "valid corpus")
                               if self.valid_pairs else None)
        self._lengths = [(len(s), len(t)) for s, t in self.examples]

    def lengths(self) -> list[tuple[int, int]]:
        return self._lengths

    def has_validation(self) -> bool:
        return bool(self.valid_examples)

    def make_batch(self, indices, step, part) -> TaskBatch:
        return _batch([self.examples[i] for i in indices])

    def loss(self, forward, model, batch):
        return seq2seq_loss(forward, model, batch, self.cfg.label_smoothing)

    @torch.no_grad()
    def validate(self, model, device, step):
        lengths = [(len(s), len(tg)) for s, tg in self.valid_examples]
        batches = (_batch([self.valid_examples[i] for i in group])
                   for group in token_batches(lengths, self.cfg.train.max_tokens, seed=None))
        result = seq2seq_valid_loss(model, batches, self.cfg.label_smoothing, device, step)
        t = self.cfg.train
        if t.valid_bleu:
            pairs = self.valid_pairs[: t.valid_bleu_sentences or None]
            out = translate_lines(model, self.tokenizer, [s for s, _ in pairs], self.cfg.decode)
            scores = score([o[0].text for o in out], [r for _, r in pairs])
            result.update({f"valid_{k}": v for k, v in scores.items()})
        return result


def _batch(examples: list[tuple[list[int], list[int]]]) -> TaskBatch:
    b = collate(examples, PAD_ID, BOS_ID, EOS_ID)
    return TaskBatch(b.src, b.tgt_out, b.n_tokens, b.n_tokens, b.tgt_in)


def _lengths(batch: TaskBatch) -> dict[str, Tensor]:
    """The source lengths a batch of inputs other than token ids gives the model (none for text)."""
    return {} if batch.lengths is None else {"lengths": batch.lengths}


def seq2seq_loss(forward, model, batch: TaskBatch, label_smoothing: float) -> tuple[Tensor, Tensor]:
    """Teacher forcing's label-smoothed loss (§5.4) and NLL, summed over the target tokens, with
    the generator's projection applied inside the loss (tasks/loss.py: ``generator_loss``); the
    translator's, and the speech-to-text model's (tasks/transcribe.py)."""
    from .loss import generator_loss

    hidden = forward(batch.inputs, batch.decoder_inputs, select=batch.targets != PAD_ID, project=False,
                     **_lengths(batch))
    generator = model.generator
    return generator_loss(hidden, generator.weight, generator.bias, batch.targets, PAD_ID, label_smoothing)


def seq2seq_valid_loss(model, batches: Iterable[TaskBatch], label_smoothing: float, device,
                       step: int) -> dict[str, float]:
    """Validation loss, NLL and perplexity per target token over ``batches`` (teacher forcing)."""
    from .loss import label_smoothed_loss

    loss_sum = nll_sum = tokens = 0.0
    for batch in batches:
        batch = batch.to(device)
        loss, nll = label_smoothed_loss(model(batch.inputs, batch.decoder_inputs, **_lengths(batch)), batch.targets,
                                        PAD_ID, label_smoothing)
        loss_sum, nll_sum, tokens = loss_sum + loss.item(), nll_sum + nll.item(), tokens + batch.units
    return valid_result(loss_sum, nll_sum, tokens, step)


# the use side ---------------------------------------------------------------------------------


def can_translate(model, tokenizer: Tokenizer) -> bool:
    """An encoder-decoder (or an RNN) that reads tokens: not a speech-to-text model (task transcribe)."""
    return model.cfg.arch in TWO_STACKS and reads_tokens(model.cfg)


def translate_file(model: str, input: str | None = None, output: str | None = None,
                   decode: DecodeConfig | None = None, nbest: int = 1, max_input_tokens: int = 1024,
                   device: str = "cpu", int8: bool = False, threads: int = 0, warn=None) -> str | None:
    """`atencion translate`: translate the lines of ``input`` (None: stdin) with the model
    directory ``model``, one line out per line in; with ``nbest`` above 1 the N best as
    'LINE ||| TEXT ||| SCORE'. Written atomically to ``output``; without one, the text is returned.
    ``threads``: torch's threads (0: its choice). ``warn(message)`` hears of bytes that are not
    UTF-8 (replaced)."""
    decode = decode or DecodeConfig()
    if input:
        need_file(input, "--input")
    if output:
        need_output_file(output, "--output")
        if input and Path(output).resolve() == Path(input).resolve():
            raise AtencionError(f"--output {output} is the input file; choose another name")
    if nbest > decode.beam:
        raise AtencionError(f"--nbest {nbest}: at most --beam ({decode.beam}) translations per line")
    if threads:
        torch.set_num_threads(threads)
    loaded, tokenizer = load_model_dir(model, device, int8)
    check_model(loaded, tokenizer, "translate")
    source = input or getattr(sys.stdin, "buffer", sys.stdin)
    lines = read_lines(source, allow_empty=True, errors="replace", name=input or "stdin", warn=warn)
    results = translate_lines(loaded, tokenizer, lines, decode, nbest=nbest, max_src_tokens=max_input_tokens,
                              source=input or "stdin")
    text = format_translations(results, nbest)
    if output is None:
        return text
    atomic_write(output, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return None


def format_translations(results: list[list[Translation]], nbest: int) -> str:
    if nbest > 1:
        return "".join(f"{i} ||| {t.text} ||| {t.score:.4f}\n" for i, hyps in enumerate(results) for t in hyps)
    return "".join(hyps[0].text + "\n" for hyps in results)


def evaluate_translator(model: str, options: dict[str, Any], warn=None) -> dict:
    """`atencion evaluate` for a translator: translate ``src``, score against ``ref`` (evaluate.py)."""
    for option in ("src", "ref", "raw_ref", "recase_from"):
        if options.get(option):
            need_file(options[option], flag(option))
    if options.get("output"):
        need_output_file(options["output"], "--output")
    return evaluate(model, options["src"], options["ref"], options.get("decode"), output=options.get("output"),
                    device=options.get("device", "cpu"), raw_ref=options.get("raw_ref"),
                    recase_from=options.get("recase_from"), lang=options.get("lang"),
                    int8=options.get("int8", False), max_src_tokens=options.get("max_input_tokens", 0))


# the endpoint: POST /translate (`atencion serve`) -------------------------------------------------


class TranslateRequest(RequestBody):
    """POST /translate."""

    sentences: list[str] = Field(min_length=1)
    model: str | None = None
    beam: int = Field(4, ge=1, le=16)
    alpha: float = Field(0.6, ge=0.0, le=10.0)
    nbest: int = Field(1, ge=1, le=16)
    max_len_a: float = Field(1.0, ge=0.0, le=10.0)
    max_len_b: int = Field(50, ge=0, le=1024)
    attention: bool = False


def _source_pieces(i: int, sentence: str, m, settings) -> int:
    """The subword pieces of a request's ``i``-th sentence; 422 for an empty one or one over the limit."""
    if not sentence.strip():
        raise Refused(422, f"sentences.{i}: the sentence is empty")
    if len(sentence) > 40 * settings.max_tokens:  # surely too many pieces: don't even encode it
        raise Refused(422, f"sentences.{i}: {len(sentence)} characters, too long (at most "
                           f"{settings.max_tokens} subword pieces per sentence)")
    pieces = len(m.tokenizer.encode_src(sentence.strip()))
    if pieces > settings.max_tokens:
        raise Refused(422, f"sentences.{i}: {pieces} subword pieces, more than the limit of {settings.max_tokens}")
    return pieces


async def serve_translate(body: TranslateRequest, m, ctx) -> dict[str, Any]:
    """POST /translate: the sentences checked (count, length, nbest), translated by the server's batcher
    with the requests that arrive with them."""
    settings = ctx.settings
    if len(body.sentences) > settings.max_sentences:
        raise Refused(422, f"sentences: {len(body.sentences)} sentences, more than the limit of "
                           f"{settings.max_sentences} per request")
    if body.nbest > body.beam:
        raise Refused(422, f"nbest: {body.nbest} is more than beam ({body.beam})")
    tokens = sum(_source_pieces(i, sentence, m, settings) + 1 for i, sentence in enumerate(body.sentences))
    decode = DecodeConfig(beam=body.beam, alpha=body.alpha, max_len_a=body.max_len_a, max_len_b=body.max_len_b)
    results, attention = await ctx.translate(m, body.sentences, tokens, decode, body.nbest, body.attention)
    out = []
    for k, hyps in enumerate(results):
        item: dict[str, Any] = {"text": hyps[0].text, "score": round(hyps[0].score, 4),
                                "nbest": [{"text": h.text, "score": round(h.score, 4)} for h in hyps]}
        if attention is not None:
            item["attention"] = attention[k]
        out.append(item)
    return {"model": m.name, "translations": out}


ENDPOINT = TaskEndpoint(TranslateRequest, serve_translate,
                        defaults=("beam", "alpha", "nbest", "max_len_a", "max_len_b"))


# the command: `atencion translate` ----------------------------------------------------------------

def add_translate_arguments(p: argparse.ArgumentParser) -> None:
    add_decoding_arguments(p)
    p.add_argument("--input", help="input file (default: stdin)")
    p.add_argument("--output", help="output file (default: stdout); written atomically")
    p.add_argument("--nbest", type=POSITIVE, default=1,
                   help="print the N best translations as 'LINE ||| TEXT ||| SCORE' (default: 1)")
    p.add_argument("--threads", type=COUNT, default=0, help="torch threads (default: torch's choice)")


def cmd_translate(args: argparse.Namespace) -> None:
    """Translate lines from --input (default stdin) to --output (default stdout), one line out per line in."""
    text = translate_file(args.model, args.input, args.output, decode_config_of(args), args.nbest,
                          args.max_input_tokens, args.device, args.int8, args.threads, warn=warner("translate"))
    if text is not None:
        sys.stdout.write(text)


COMMAND = Command("translate", "translate text with a trained model", add_translate_arguments, cmd_translate)


def check_translate_config(cfg, source: str) -> None:
    """A translator's vocabularies are SentencePiece's or subword-nmt's (data.tokenizer)."""
    if cfg.data.tokenizer not in ("sentencepiece", "subword-nmt"):
        raise AtencionError(f"{source}: data.tokenizer: {cfg.data.tokenizer} is for the single-stack tasks (lm, mlm, "
                            f"classify)")


SPEC = register_task(TaskSpec(
    name="translate", kind="a translator (arch encoder-decoder or rnn)", preset="tiny",
    archs=("encoder-decoder", "rnn"), metric="bleu", label_smoothing=0.1, training=TranslateTask,
    use="translate", needs="a translator (arch encoder-decoder or rnn)", can=can_translate,
    evaluate=evaluate_translator, evaluate_options=("src", "ref", "output", "raw_ref", "recase_from", "lang"),
    evaluate_required=("src", "ref"), metrics=("bleu",),
    endpoint=ENDPOINT, command=COMMAND,
    data_keys=(*TOKENIZER_KEYS, "train_src", "train_tgt", "train_tsv", "valid_src", "valid_tgt", "valid_tsv",
               "empty_lines", "max_len", "joint"),
    check_config=check_translate_config, longest=target_positions))
