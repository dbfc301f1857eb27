"""Task ``classify``: a label per sentence (``label<TAB>text``) from a classification head over
an encoder (BERT's first token) or a decoder (GPT's last), validated by accuracy; a trained
model labels lines (``classify_lines``, ``classify_probabilities``) and is scored with a
confusion matrix (``evaluate_classifier``).

An encoder of another kind of input (``model.inputs``: a ViT's images) reads ``label<TAB>path``
rows instead, each path relative to the TSV's folder, each file read by its input kind
(nn/inputs.py: ``read``, ``collate``); it has no tokenizer. Such a model labels files
(``classify_paths``)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from ..arguments import POSITIVE, TTA_SHIFT_HELP, Command, bounded, warner
from ..data.batching import token_batches
from ..data.corpus import read_lines
from ..data.images import rotate_images, shift_images, shifted_views
from ..data.text import read_labelled_lines
from ..data.tokenizer import PAD_ID, Tokenizer
from ..endpoint import Refused, RequestBody, TaskEndpoint, Upload, unprocessable, uploaded
from ..errors import AtencionError, Diverged
from ..fileio import need_file
from ..nn.inputs import INPUTS, input_kind, read_inputs
from ..nn.model_dir import load_model_dir
from .base import (
    TOKENIZER_KEYS,
    Task,
    TaskBatch,
    TaskSpec,
    check_model,
    evaluate_file,
    evaluating,
    model_device,
    pad_rows,
    register_task,
    sentence_ids,
    sentence_positions,
    warn_unseen,
)

log = logging.getLogger(__name__)


# the training side ----------------------------------------------------------------------------


def _header(message: str) -> None:
    """A first line taken as a header (data.header: auto), said with the key that decides it."""
    log.warning("%s (data.header: auto; set data.header: yes or no to decide)", message)


class ClassifyTask(Task):
    name = "classify"

    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg.data
        self.inputs = cfg.model_inputs()  # None: tokens; else the files are read now, before anything is written
        self.tokens = self.inputs is None
        what = "text" if self.tokens else "path"
        for key, does in (("shift", "moves"), ("rotate", "turns")):
            if getattr(d, key) and (self.inputs is None or self.inputs["kind"] != "patches"):
                reads = self.inputs["kind"] if self.inputs else "tokens"
                raise AtencionError(f"data.{key} {does} images; this model reads {reads} (model.inputs): "
                                    f"set data.{key}: 0")
        if d.train_tsv is None:
            raise AtencionError(f"data.train_tsv: task 'classify' reads label<TAB>{what} rows; set data.train_tsv")
        self.train_rows, self.labels, skipped, lines = read_labelled_lines(d.train_tsv, None, d.header,
                                                                          d.empty_lines, _header)
        if len(self.labels) < 2:
            raise AtencionError(f"{d.train_tsv}: only one label ({self.labels[0]!r}); a classifier needs two or more")
        if skipped:
            log.warning("%s: skipped %d rows with an empty %s", d.train_tsv, skipped, what)
        valid = read_labelled_lines(d.valid_tsv, self.labels, d.header, d.empty_lines, _header) if d.valid_tsv \
            else None
        self.valid_rows = valid[0] if valid else None
        if not self.tokens:
            self.images = read_rows(self.inputs, d.train_tsv, self.train_rows, lines)
            self.valid_images = read_rows(self.inputs, d.valid_tsv, valid[0], valid[3]) if valid else None

    def tokenizer_texts(self) -> list[str]:
        return [text for _, text in self.train_rows]

    def train_tokenizer(self) -> Tokenizer | None:
        return super().train_tokenizer() if self.tokens else None  # a ViT reads no text

    def model_values(self) -> dict:
        return {**super().model_values(), "num_labels": len(self.labels), "labels": self.labels}

    def encode(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        if not self.tokens:
            self.examples, self.targets = self.images, [label for label, _ in self.train_rows]
            self.valid = (self.valid_images, [label for label, _ in self.valid_rows]) if self.valid_rows else None
            kind = INPUTS[self.inputs["kind"]]
            self._lengths = [(kind.positions(e, self.inputs) - 1, 0) for e in self.examples]
            return
        max_len = self.cfg.data.max_len
        self.examples, self.targets = self._encode(self.train_rows, "train TSV", max_len)
        self.valid = self._encode(self.valid_rows, "valid TSV", max_len) if self.valid_rows else None
        self._lengths = [(len(e), 0) for e in self.examples]

    def _encode(self, rows, name, max_len):
        kept = [(label, self.tokenizer.sentence(text)) for label, text in rows]
        dropped = sum(1 for _, ids in kept if len(ids) > max_len + 2)
        if dropped:
            log.warning("%s: dropped %d of %d sentences longer than data.max_len=%d tokens", name, dropped,
                        len(kept), max_len)
        kept = [(label, ids) for label, ids in kept if len(ids) <= max_len + 2]
        if not kept:
            raise AtencionError(f"{name}: no sentence of at most data.max_len={max_len} tokens")
        return [ids for _, ids in kept], [label for label, _ in kept]

    def lengths(self):
        return self._lengths

    def has_validation(self) -> bool:
        return self.valid is not None

    def make_batch(self, indices, step, part) -> TaskBatch:
        labels = torch.tensor([self.targets[i] for i in indices])
        if not self.tokens:
            inputs, lengths = INPUTS[self.inputs["kind"]].collate([self.examples[i] for i in indices])
            if self.cfg.data.shift or self.cfg.data.rotate:  # drawn from the seed, the step and the part:
                seed = self.cfg.train.seed * 1_000_003 + step * 1009 + part  # a resumed run draws them again
                generator = torch.Generator().manual_seed(seed)
                inputs = rotate_images(shift_images(inputs, self.cfg.data.shift, generator), self.cfg.data.rotate,
                                       generator)
            positions = sum(self._lengths[i][0] + 1 for i in indices)
            return TaskBatch(inputs, labels, len(indices), positions, lengths=lengths)
        pad = self.tokenizer.specials.pad
        pad = PAD_ID if pad is None else pad
        ids = pad_rows([self.examples[i] for i in indices], pad)
        labels = torch.tensor([self.targets[i] for i in indices])
        return TaskBatch(ids, labels, len(indices), int((ids != pad).sum()))

    def loss(self, forward, model, batch):
        logits = forward(batch.inputs, classify=True, lengths=batch.lengths).float()
        loss = F.cross_entropy(logits, batch.targets, reduction="sum", label_smoothing=self.cfg.label_smoothing)
        return loss, F.cross_entropy(logits.detach(), batch.targets, reduction="sum")

    @torch.no_grad()
    def validate(self, model, device, step):
        examples, targets = self.valid
        scores = classify_scores(model, examples, targets, self.cfg.train.max_tokens, device)
        if not math.isfinite(scores["loss"]):
            raise Diverged(step, "validation loss", scores["loss"])
        return {"valid_loss": scores["loss"], "valid_accuracy": scores["accuracy"]}


def read_rows(inputs: dict, tsv: str, rows: list[tuple[int, str]], lines: list[int],
              name: str | None = None) -> list[Tensor]:
    """The files the ``(label, path)`` rows of ``tsv`` name (relative to its folder), read as the
    model's ``inputs`` say; a bad one is refused naming the TSV's line (the TSV called ``name``)."""
    folder = Path(tsv).parent
    return read_inputs(inputs, [folder / path for _, path in rows], lambda i: f"{name or tsv} line {lines[i]}")


def check_tta_shift(model, tta_shift: int) -> None:
    """Test-time shifts are for image classifiers (inputs kind patches) only."""
    kind = input_kind(model.cfg).name
    if tta_shift and kind != "patches":
        raise AtencionError(f"--tta-shift {tta_shift}: test-time shifts are for image classifiers (model.inputs kind "
                            f"patches); this model reads {kind}")


@torch.no_grad()
def classify_logits(model, examples: list[list[int]] | list[Tensor], max_tokens: int, device,
                    tta_shift: int = 0) -> Tensor:
    """Logits (n, num_labels) of ``examples`` (token ids with ``<s>``/``</s>``, or the raw inputs
    of the model's input kind), in their order. With ``tta_shift`` N > 0 (images only:
    ``check_tta_shift``), test-time augmentation: the log of the mean of the probabilities the
    model gives each image moved by every whole offset in [-N, N]² pixels (``shifted_views``)."""
    out = torch.empty(len(examples), model.cfg.num_labels)
    kind = input_kind(model.cfg)
    check_tta_shift(model, tta_shift)
    if not kind.tokens:
        lengths = [(kind.positions(e, model.cfg.inputs) - 1, 0) for e in examples]
        for group in token_batches(lengths, max_tokens, seed=None):
            inputs, sizes = kind.collate([examples[i] for i in group])
            sizes = None if sizes is None else sizes.to(device)
            if not tta_shift:
                out[group] = model.classify(inputs.to(device), lengths=sizes).float().cpu()
                continue
            views = shifted_views(inputs.to(device), tta_shift)
            log_probs = torch.stack([model.classify(view).float().log_softmax(-1) for view in views])
            out[group] = (log_probs.logsumexp(0) - math.log(len(views))).cpu()
        return out
    for group in token_batches([(len(e), 0) for e in examples], max_tokens, seed=None):
        rows = pad_rows([examples[i] for i in group], model.cfg.pad_id)
        out[group] = model.classify(rows.to(device)).float().cpu()
    return out


def classify_scores(model, examples, targets: list[int], max_tokens: int, device, tta_shift: int = 0) -> dict:
    """Loss, accuracy and the confusion matrix (rows: true label, columns: predicted); ``tta_shift``
    as for ``classify_logits``."""
    logits = classify_logits(model, examples, max_tokens, device, tta_shift)
    gold = torch.tensor(targets)
    predicted = logits.argmax(-1)
    n = model.cfg.num_labels
    confusion = torch.zeros(n, n, dtype=torch.long)
    confusion.index_put_((gold, predicted), torch.ones_like(gold), accumulate=True)
    count = "sentences" if input_kind(model.cfg).tokens else "examples"
    return {"loss": float(F.cross_entropy(logits, gold)), "accuracy": float((predicted == gold).float().mean()),
            "confusion": confusion.tolist(), count: len(targets)}


# the use side: classify -----------------------------------------------------------------------


def can_classify(model, tokenizer: Tokenizer) -> bool:
    return bool(model.cfg.num_labels)


def label_names(model) -> list[str]:
    return model.cfg.labels or [str(i) for i in range(model.cfg.num_labels)]


def classify_probabilities(model, tokenizer: Tokenizer, texts: list[str], batch_tokens: int = 4096,
                           max_tokens: int = 0, where: Callable[[int], str] = lambda i: f"--input line {i + 1}",
                           warn=None, what: str = "--input") -> torch.Tensor:
    """The probability of every label for each text, (len(texts), num_labels), batched by
    ``batch_tokens``. An empty text is classified as the empty sentence ``<s> </s>``. Characters
    a character vocabulary lacks (read as ``<unk>``) are named once by ``warn(message)`` (by
    default a logging warning), with ``what`` and the line of the first (text i is line i + 1)."""
    check_model(model, tokenizer, "classify")
    examples = sentence_ids(model, tokenizer, texts, max_tokens, where)
    warn_unseen(tokenizer, [text.strip() for text in texts], what, warn)
    with evaluating(model):
        return classify_logits(model, examples, batch_tokens, model_device(model)).softmax(-1)


def classify_lines(model, tokenizer: Tokenizer, lines: list[str], batch_tokens: int = 4096, max_tokens: int = 0,
                   where: Callable[[int], str] = lambda i: f"--input line {i + 1}", warn=None,
                   what: str = "--input") -> list[tuple[str, float]]:
    """The most likely label of each line and its probability (see ``classify_probabilities``)."""
    probabilities, index = classify_probabilities(model, tokenizer, lines, batch_tokens, max_tokens, where, warn,
                                                  what).max(-1)
    names = label_names(model)
    return [(names[i], p) for i, p in zip(index.tolist(), probabilities.tolist())]


def classify_paths(model, paths: list[Path], batch_tokens: int = 4096,
                   where: Callable[[int], str] = lambda i: f"--input line {i + 1}", tta_shift: int = 0) -> torch.Tensor:
    """The probability of every label for each file of ``paths`` (an image for a ViT), read by
    the model's input kind, (len(paths), num_labels); a bad file is refused naming ``where(i)``.
    ``tta_shift`` as for ``classify_logits``."""
    check_model(model, None, "classify")
    examples = read_inputs(model.cfg.inputs, paths, where)
    with evaluating(model):
        return classify_logits(model, examples, batch_tokens, model_device(model), tta_shift).softmax(-1)


def prediction(names: list[str], row: list[float]) -> dict[str, Any]:
    """One text's answer: the most likely label, its probability and every label's."""
    best = max(range(len(row)), key=row.__getitem__)
    return {"label": names[best], "probability": row[best], "probabilities": dict(zip(names, row))}


def classify_file(model: str, input: str | None = None, as_json: bool = False, batch_tokens: int = 4096,
                  max_input_tokens: int = 1024, device: str = "cpu", warn=None, tta_shift: int = 0) -> str:
    """`atencion classify`: label each line of ``input`` (None: stdin) with the model directory
    ``model``, one line out per line in: 'LABEL<TAB>PROBABILITY', or (``as_json``) one JSON
    object per line with every label's probability. An empty line gets the model's answer on the
    empty sentence, so that the lines stay aligned; bytes that are not UTF-8 are replaced, and
    ``warn(message)`` hears of it, as it does (once) of characters a character vocabulary lacks.
    A model of another input kind (a ViT) reads a file's path on each line instead, relative to
    the folder of ``input`` (stdin: the current directory); an empty line, or a bad file, is
    refused naming the line. ``tta_shift``: an image classifier's test-time shifts
    (``classify_logits``)."""
    if input:
        need_file(input, "--input")
    loaded, tokenizer = load_model_dir(model, device)
    check_model(loaded, tokenizer, "classify")
    check_tta_shift(loaded, tta_shift)
    name = input or "stdin"
    source = input or getattr(sys.stdin, "buffer", sys.stdin)
    lines = read_lines(source, allow_empty=True, errors="replace", name=name, warn=warn)

    def where(index: int) -> str:
        return f"{name} line {index + 1}"

    if not input_kind(loaded.cfg).tokens:
        empty = [i for i, line in enumerate(lines) if not line.strip()]
        if empty:
            raise AtencionError(f"{where(empty[0])}: empty; expected the path of a file to classify")
        folder = Path(input).parent if input else Path()
        probabilities = classify_paths(loaded, [folder / line.strip() for line in lines], batch_tokens, where,
                                       tta_shift)
        best, index = probabilities.max(-1)
        names = label_names(loaded)
        if not as_json:
            return "".join(f"{names[i]}\t{p:.4f}\n" for i, p in zip(index.tolist(), best.tolist()))
        return "".join(json.dumps(prediction(names, row), ensure_ascii=False) + "\n" for row in probabilities.tolist())
    if not as_json:
        return "".join(f"{label}\t{p:.4f}\n" for label, p in
                       classify_lines(loaded, tokenizer, lines, batch_tokens, max_input_tokens, where, warn, name))
    names = label_names(loaded)
    rows = classify_probabilities(loaded, tokenizer, lines, batch_tokens, max_input_tokens, where, warn,
                                  name).tolist()
    return "".join(json.dumps(prediction(names, row), ensure_ascii=False) + "\n" for row in rows)


# the use side: evaluate -----------------------------------------------------------------------


def evaluate_classifier(model, tokenizer: Tokenizer, rows: list[tuple[int, str]], batch_tokens: int = 4096,
                        max_tokens: int = 0, what: str = "--tsv", lines: list[int] | None = None,
                        warn=None) -> dict:
    """Accuracy, loss and the confusion matrix (rows: true label, columns: predicted) of a
    classifier on ``rows`` of (label index, text); a text of more than ``max_tokens`` pieces (0:
    no limit) is refused, naming its row: line ``lines[i]`` of ``what`` (the file line numbers
    ``read_labelled_lines`` gives), or else row i + 1. Characters a character vocabulary lacks
    (read as ``<unk>``) are named once by ``warn(message)``, by default a logging warning."""
    check_model(model, tokenizer, "classify")

    def where(i: int) -> str:
        return f"{what} line {lines[i]}" if lines is not None else f"{what} row {i + 1}"

    examples = sentence_ids(model, tokenizer, [text for _, text in rows], max_tokens, where)
    warn_unseen(tokenizer, [text for _, text in rows], what, warn, lines)
    with evaluating(model):
        scores = classify_scores(model, examples, [label for label, _ in rows], batch_tokens, model_device(model))
    return {**scores, "labels": label_names(model)}


def evaluate_classifier_dir(model: str, options: dict[str, Any], warn=None) -> dict:
    """`atencion evaluate` for a classifier: ``evaluate_classifier`` on the rows of the file
    ``tsv`` (a first line whose label is no label of the model is a header, as in training)."""
    def score(loaded, tokenizer: Tokenizer | None, path: str) -> dict:
        tta_shift = options.get("tta_shift") or 0
        check_tta_shift(loaded, tta_shift)
        rows, _, skipped, lines = read_labelled_lines(path, label_names(loaded))
        if skipped and warn is not None:
            warn(f"{path}: left out {skipped} rows with an empty text")
        if not input_kind(loaded.cfg).tokens:  # label<TAB>path rows: the files, read by the model's input kind
            check_model(loaded, tokenizer, "classify")
            examples = read_rows(loaded.cfg.inputs, path, rows, lines, f"--tsv {path}")
            with evaluating(loaded):
                scores = classify_scores(loaded, examples, [label for label, _ in rows],
                                         options.get("batch_tokens", 4096), model_device(loaded), tta_shift)
            return {**scores, "labels": label_names(loaded), **({"tta_shift": tta_shift} if tta_shift else {})}
        return evaluate_classifier(loaded, tokenizer, rows, options.get("batch_tokens", 4096),
                                   options.get("max_input_tokens", 1024), f"--tsv {path}", lines, warn)

    return evaluate_file(model, options, "tsv", score)


# the endpoint: POST /classify (`atencion serve`) --------------------------------------------------


class ClassifyRequest(RequestBody):
    """POST /classify: see ``tasks.classify.classify_probabilities``."""

    texts: list[str] = Field(min_length=1)
    model: str | None = None


async def serve_classify(body: ClassifyRequest, m, ctx) -> dict[str, Any]:
    """POST /classify with JSON texts: each checked against the server's limits, then labelled."""
    settings = ctx.settings
    if len(body.texts) > settings.max_sentences:
        raise Refused(422, f"texts: {len(body.texts)} texts, more than the limit of {settings.max_sentences} "
                           f"per request")
    for i, text in enumerate(body.texts):
        ctx.check_length(f"texts.{i}", text)
    with unprocessable():
        sentence_ids(m.model, m.tokenizer, body.texts, settings.max_tokens, lambda i: f"texts.{i}")
    probabilities = await ctx.run(m, lambda: classify_probabilities(
        m.model, m.tokenizer, body.texts, settings.batch_tokens, settings.max_tokens, lambda i: f"texts.{i}",
        what="texts"))
    names = label_names(m.model)
    return {"model": m.name, "predictions": [prediction(names, row) for row in probabilities.tolist()]}


async def serve_classify_upload(form: Upload, m, ctx) -> dict[str, Any]:
    """An image's or a recording's label; with ``attention``, the [CLS] (or pooled) attention and
    its rollout (``InputAttention.to_json``)."""
    def work():
        with uploaded(form) as path:
            row = classify_paths(m.model, [path], ctx.settings.batch_tokens, lambda i: "file")[0].tolist()
            return prediction(label_names(m.model), row), ctx.input_attention(m, path) if form.attention else None

    answer, attention = await ctx.run(m, work)
    return {"model": m.name, "predictions": [answer]} | ({"attention": attention} if form.attention else {})


ENDPOINT = TaskEndpoint(ClassifyRequest, serve_classify, info=lambda m: {"labels": label_names(m.model)},
                        upload=serve_classify_upload)


# the command: `atencion classify` -----------------------------------------------------------------

def add_classify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory of a classifier (trained with task classify)")
    p.add_argument("--input", help="sentences, one a line (default: stdin)")
    p.add_argument("--json", action="store_true",
                   help='one JSON object per line: {"label", "probability", "probabilities": {LABEL: P, ...}}')
    p.add_argument("--batch-tokens", type=POSITIVE, default=4096, help="tokens per batch (default: 4096)")
    p.add_argument("--max-input-tokens", type=POSITIVE, default=1024,
                   help="a line of more pieces is refused, naming it, before any work (default: 1024)")
    p.add_argument("--tta-shift", type=bounded(int, 0, highest=4), default=0, metavar="N", help=TTA_SHIFT_HELP)
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")


def cmd_classify(args: argparse.Namespace) -> None:
    """Label each line of --input (default stdin) with a classifier: one line out per line in,
    'LABEL<TAB>PROBABILITY', the most likely label and its probability (--json: every label's).
    An empty line gets the model's answer on the empty sentence, so that the lines stay aligned;
    bytes that are not UTF-8 are replaced (with one warning)."""
    sys.stdout.write(classify_file(args.model, args.input, args.json, args.batch_tokens, args.max_input_tokens,
                                   args.device, warn=warner("classify"), tta_shift=args.tta_shift))


COMMAND = Command("classify", "label each line with a classifier", add_classify_arguments, cmd_classify)


SPEC = register_task(TaskSpec(
    name="classify", kind="a classifier (a classification head)", preset="bert-tiny", archs=("encoder", "decoder"),
    metric="accuracy", label_smoothing=0.0, training=ClassifyTask, use="classify",
    needs="a model with a classification head (task classify)", can=can_classify,
    evaluate=evaluate_classifier_dir, evaluate_options=("tsv", "tta_shift"), evaluate_required=("tsv",),
    metrics=("accuracy",),
    endpoint=ENDPOINT, command=COMMAND,
    data_keys=(*TOKENIZER_KEYS, "train_tsv", "valid_tsv", "header", "empty_lines", "max_len", "shift", "rotate"),
    model_defaults={"decoder": {"pooling": "last"}}, stand_in={"num_labels": 2}, longest=sentence_positions))
