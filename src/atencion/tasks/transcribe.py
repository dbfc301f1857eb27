"""Task ``transcribe``: speech to text, as Whisper frames it (Radford et al. 2022, §2.2): an
encoder-decoder whose encoder reads a recording's log-mel frames (``model.inputs: spectrogram``,
nn/inputs.py) and whose decoder writes its text, trained as the translator is (teacher forcing,
label-smoothed cross-entropy, §5; tasks/translate.py's ``seq2seq_loss``) on ``text<TAB>path.wav``
rows, the paths relative to the TSV's folder; validated by loss and, decoding the validation
recordings, exact match, BLEU and chrF. A trained model transcribes WAV files
(``transcribe_file``) with the translator's search (decode/translate.py's ``decode_sources``:
greedy or beam search) and is scored the same way (``evaluate_transcriber``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..arguments import COUNT, POSITIVE, Command, add_decoding_arguments, decode_config_of, warner
from ..config import TWO_STACKS
from ..data.batching import shift_targets, token_batches
from ..data.corpus import CorpusError, read_lines
from ..data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from ..decode.settings import DecodeConfig
from ..decode.translate import Translation, decode_sources
from ..endpoint import TaskEndpoint, Upload, uploaded
from ..errors import AtencionError
from ..evaluate import score
from ..fileio import atomic_write, need_file, need_output_file
from ..nn.inputs import INPUTS, input_kind, read_inputs
from ..nn.model_dir import load_model_dir
from .base import TOKENIZER_KEYS, Task, TaskBatch, TaskSpec, check_model, evaluate_file, register_task, target_positions
from .translate import format_translations, seq2seq_loss, seq2seq_valid_loss

log = logging.getLogger(__name__)


# reading recordings ---------------------------------------------------------------------------


def read_text_rows(path: str | Path) -> list[tuple[str, Path, int]]:
    """The rows of a ``text<TAB>path.wav`` TSV file: each row's text, its file (a path relative to
    the TSV's folder, or absolute) and its line number. A line without a tab, an empty text or an
    empty path is refused, naming the line."""
    rows = []
    for number, line in enumerate(read_lines(path), start=1):
        text, sep, name = line.partition("\t")
        if not sep:
            raise CorpusError(f"{path} line {number}: expected text<TAB>path, found no tab")
        text, name = text.strip(), name.strip()
        if not text or not name:
            raise CorpusError(f"{path} line {number}: the {'path' if text else 'text'} is empty; expected "
                              f"text<TAB>path")
        rows.append((text, Path(path).parent / name, number))
    return rows


# the training side ----------------------------------------------------------------------------


class TranscribeTask(Task):
    name = "transcribe"

    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg.data
        if d.train_tsv is None:
            raise AtencionError("data.train_tsv: task 'transcribe' reads text<TAB>path.wav rows; set data.train_tsv")
        self.inputs = cfg.model_inputs()
        if self.inputs is None:
            raise AtencionError("model.inputs: task 'transcribe' reads recordings; set model.inputs: spectrogram "
                                "(the default preset, whisper-tiny, has it)")
        self.train_rows = self._read(d.train_tsv)
        self.valid_rows = self._read(d.valid_tsv) if d.valid_tsv else None

    def _read(self, tsv: str) -> list[tuple[str, Tensor]]:
        rows = read_text_rows(tsv)
        features = read_inputs(self.inputs, [p for _, p, _ in rows], lambda i: f"{tsv} line {rows[i][2]}")
        log.info("%s: %d recordings", tsv, len(rows))
        return [(text, x) for (text, _, _), x in zip(rows, features)]

    def tokenizer_texts(self) -> list[str]:
        return [text for text, _ in self.train_rows]

    def encode(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.examples = self._encode(self.train_rows, "train TSV")
        self.valid = self._encode(self.valid_rows, "valid TSV") if self.valid_rows else None

    def _encode(self, rows, name: str) -> list[tuple[Tensor, list[int]]]:
        """(frames, target ids) of each row; targets longer than data.max_len are dropped, counted."""
        max_len = self.cfg.data.max_len
        encoded = [(x, self.tokenizer.encode_tgt(text)) for text, x in rows]
        kept = [(x, ids) for x, ids in encoded if len(ids) <= max_len]
        if len(kept) < len(rows):
            log.warning("%s: dropped %d of %d texts longer than data.max_len=%d tokens", name, len(rows) - len(kept),
                        len(rows), max_len)
        if not kept:
            raise AtencionError(f"{name}: every text is longer than data.max_len={max_len} tokens")
        return kept

    def lengths(self) -> list[tuple[int, int]]:
        """(source positions, target tokens) without EOS: train.max_tokens counts the encoder's
        positions (a recording's frames / 2) on the source side."""
        return _lengths(self.examples, self.inputs)

    def has_validation(self) -> bool:
        return self.valid is not None

    def make_batch(self, indices, step, part) -> TaskBatch:
        return _batch([self.examples[i] for i in indices], self.inputs)

    def loss(self, forward, model, batch):
        return seq2seq_loss(forward, model, batch, self.cfg.label_smoothing)

    @torch.no_grad()
    def validate(self, model, device, step):
        lengths = _lengths(self.valid, self.inputs)
        batches = (_batch([self.valid[i] for i in group], self.inputs)
                   for group in token_batches(lengths, self.cfg.train.max_tokens, seed=None))
        result = seq2seq_valid_loss(model, batches, self.cfg.label_smoothing, device, step)
        t = self.cfg.train
        if t.valid_bleu:
            rows = self.valid_rows[: t.valid_bleu_sentences or None]
            out = transcribe_inputs(model, self.tokenizer, [x for _, x in rows], self.cfg.decode)
            scores = transcript_scores([o[0].text for o in out], [text for text, _ in rows])
            result.update({f"valid_{k}": v for k, v in scores.items()})
        return result


def _lengths(examples: list[tuple[Tensor, list[int]]], inputs: dict[str, Any]) -> list[tuple[int, int]]:
    kind = INPUTS[inputs["kind"]]
    return [(kind.positions(x, inputs) - 1, len(ids)) for x, ids in examples]  # token_batches adds the EOS


def _batch(examples: list[tuple[Tensor, list[int]]], inputs: dict[str, Any]) -> TaskBatch:
    frames, lengths = INPUTS[inputs["kind"]].collate([x for x, _ in examples])
    tgt_in, tgt_out, n_tokens = shift_targets([ids for _, ids in examples], PAD_ID, BOS_ID, EOS_ID)
    return TaskBatch(frames, tgt_out, n_tokens, n_tokens, tgt_in, lengths)


def transcript_scores(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """``exact_match`` (the share of transcripts equal to their reference) beside the
    translator's scores (evaluate.py: sacreBLEU's BLEU, tokenized BLEU and chrF). BLEU counts
    up to 4-grams, so on one-word transcripts (spoken digits) it is 0; exact match and chrF
    (characters) are the measures there."""
    exact = sum(h == r for h, r in zip(hypotheses, references)) / max(len(references), 1)
    return {"exact_match": round(exact, 4), **score(hypotheses, references)}


# the use side ---------------------------------------------------------------------------------


def can_transcribe(model, tokenizer: Tokenizer) -> bool:
    """An encoder-decoder whose encoder reads files (recordings): a model of task transcribe."""
    return model.cfg.arch in TWO_STACKS and input_kind(model.cfg).read is not None


def transcribe_inputs(model, tokenizer: Tokenizer, inputs: list[Tensor], decode: DecodeConfig | None = None,
                      nbest: int = 1, where: Callable[[int], str] = lambda i: f"recording {i + 1}"
                      ) -> list[list[Translation]]:
    """The ``nbest`` best transcripts of each example (a recording's frames, as the model's input
    kind reads it), decoded by the translator's search (greedy for beam 1, else beam search)."""
    kind = input_kind(model.cfg)
    return decode_sources(model, tokenizer, [kind.positions(x, model.cfg.inputs) - 1 for x in inputs],
                          lambda group: kind.collate([inputs[i] for i in group]), decode or DecodeConfig(), nbest,
                          where)


def transcribe_paths(model, tokenizer: Tokenizer, paths: list[Path], decode: DecodeConfig | None = None,
                     nbest: int = 1, where: Callable[[int], str] = lambda i: f"--input line {i + 1}"
                     ) -> list[list[Translation]]:
    """``transcribe_inputs`` of WAV files; every file is read (and a bad one refused, naming
    ``where(index)`` and the file) before anything is decoded."""
    check_model(model, tokenizer, "transcribe")
    return transcribe_inputs(model, tokenizer, read_inputs(model.cfg.inputs, paths, where), decode, nbest, where)


def transcribe_file(model: str, input: str | None = None, output: str | None = None,
                    decode: DecodeConfig | None = None, nbest: int = 1, device: str = "cpu", int8: bool = False,
                    threads: int = 0, warn=None) -> str | None:
    """`atencion transcribe`: the text of each WAV file named in ``input`` (None: stdin), one
    path a line, relative to the folder of ``input`` (stdin: the current directory), as
    `atencion classify` reads files; one line out per line in, or with ``nbest`` above 1 the N
    best as 'LINE ||| TEXT ||| SCORE'. Every file is read before any is decoded, so an empty
    line or a bad file stops the command, naming the line, with nothing written. Written
    atomically to ``output``; without one, the text is returned."""
    decode = decode or DecodeConfig()
    if input:
        need_file(input, "--input")
    if output:
        need_output_file(output, "--output")
    if nbest > decode.beam:
        raise AtencionError(f"--nbest {nbest}: at most --beam ({decode.beam}) transcripts per recording")
    if threads:
        torch.set_num_threads(threads)
    loaded, tokenizer = load_model_dir(model, device, int8)
    check_model(loaded, tokenizer, "transcribe")
    name = input or "stdin"
    lines = read_lines(input or getattr(sys.stdin, "buffer", sys.stdin), allow_empty=True, name=name, warn=warn)
    empty = [i for i, line in enumerate(lines) if not line.strip()]
    if empty:
        raise AtencionError(f"{name} line {empty[0] + 1}: empty; expected the path of a WAV file to transcribe")
    folder = Path(input).parent if input else Path()
    results = transcribe_paths(loaded, tokenizer, [folder / line.strip() for line in lines], decode, nbest,
                               lambda i: f"{name} line {i + 1}")
    text = format_translations(results, nbest)
    if output is None:
        return text
    atomic_write(output, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return None


def evaluate_transcriber(model: str, options: dict[str, Any], warn=None) -> dict:
    """`atencion evaluate` for a speech-to-text model: transcribe the recordings of ``tsv``
    (``text<TAB>path.wav``), score against the texts (``transcript_scores``)."""
    decode = options.get("decode") or DecodeConfig()

    def score_file(loaded, tokenizer: Tokenizer, path: str) -> dict:
        rows = read_text_rows(path)
        out = transcribe_paths(loaded, tokenizer, [p for _, p, _ in rows], decode,
                               where=lambda i: f"--tsv {path} line {rows[i][2]}")
        return {**transcript_scores([o[0].text for o in out], [text for text, _, _ in rows]),
                "sentences": len(rows), "beam": decode.beam, "alpha": decode.alpha}

    return evaluate_file(model, options, "tsv", score_file)


# the endpoint: POST /transcribe (`atencion serve`) ------------------------------------------------


async def serve_transcribe(form: Upload, m, ctx) -> dict[str, Any]:
    """A recording's transcript, decoded greedily (beam 1, as the speech configs decode); with
    ``attention``, the decoder's cross-attention over the encoder's positions for each character."""
    def work():
        with uploaded(form) as path:
            if form.attention:
                attention = ctx.input_attention(m, path)
                return attention["text"], attention
            return transcribe_paths(m.model, m.tokenizer, [path], DecodeConfig(beam=1), where=lambda i: "file")[0][0]\
                .text, None

    text, attention = await ctx.run(m, work)
    return {"model": m.name, "text": text} | ({"attention": attention} if form.attention else {})


ENDPOINT = TaskEndpoint(None, None, upload=serve_transcribe)  # recordings only: a multipart form


# the command: `atencion transcribe` ---------------------------------------------------------------

def add_transcribe_arguments(p: argparse.ArgumentParser) -> None:
    add_decoding_arguments(p, text=False)
    p.add_argument("--input", help="WAV files, one path a line, relative to this file's folder (default: stdin, "
                                   "paths relative to the current directory)")
    p.add_argument("--output", help="output file (default: stdout); written atomically")
    p.add_argument("--nbest", type=POSITIVE, default=1,
                   help="print the N best transcripts as 'LINE ||| TEXT ||| SCORE' (default: 1)")
    p.add_argument("--threads", type=COUNT, default=0, help="torch threads (default: torch's choice)")


def cmd_transcribe(args: argparse.Namespace) -> None:
    """Write the text of each WAV file named on --input (default stdin), one path a line, one line
    out per line in, with a speech-to-text model (task transcribe). A WAV file is PCM (8, 16, 24 or
    32 bits, mono or more channels, averaged), at any rate: it is resampled to 16 kHz. Every file is
    read before any is decoded: an empty line, or a missing, empty, corrupt or non-WAV file, stops
    the command, naming its line and the file, with nothing written."""
    text = transcribe_file(args.model, args.input, args.output, decode_config_of(args), args.nbest, args.device,
                           args.int8, args.threads, warn=warner("transcribe"))
    if text is not None:
        sys.stdout.write(text)


COMMAND = Command("transcribe", "write the text of WAV files with a speech-to-text model",
                  add_transcribe_arguments, cmd_transcribe)


SPEC = register_task(TaskSpec(
    name="transcribe", kind="a speech-to-text model (an encoder-decoder reading recordings)", preset="whisper-tiny",
    archs=("encoder-decoder",), metric="exact_match", label_smoothing=0.1, training=TranscribeTask,
    use="transcribe", needs="a speech-to-text model (task transcribe)", can=can_transcribe,
    evaluate=evaluate_transcriber, evaluate_options=("tsv",), evaluate_required=("tsv",),
    metrics=("exact_match", "bleu", "chrf"),
    endpoint=ENDPOINT, command=COMMAND,
    data_keys=(*TOKENIZER_KEYS, "train_tsv", "valid_tsv", "max_len"), longest=target_positions))
