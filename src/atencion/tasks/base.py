"""What every task shares: its spec (``TaskSpec``), the training side's interface (``Task``,
``TaskBatch``), the table of tasks (``TASKS``, filled by ``register_task``), and the questions
every command asks of a model: which task it was trained for (``model_task``), what it is in a
message (``describe``), and whether it can do what it is asked (``check_model``).

The trainer (train/trainer.py) owns the loop, the optimizer and the checkpoints; a task gives
it index batches (``batches``), turns one into tensors (``make_batch``), computes its summed
loss (``loss``) and validates (``validate``). A task whose model is not one model of the model
section builds it itself (``model``: contrastive's two towers), with a batch type of its own,
and may act after each update (``after_update``). Everything random in a batch (the epoch's order,
MLM's masking) is drawn from the seed, the epoch and the step, so a resumed run repeats it
exactly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..arguments import Command
from ..config import ModelConfig
from ..data.batching import token_batches
from ..data.tokenizer import PAD_ID, Tokenizer, check_text
from ..endpoint import TaskEndpoint
from ..errors import AtencionError, Diverged
from ..fileio import need_file
from ..nn.model_dir import load_model_dir
from ..nn.positional import position_limit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskSpec:
    """Everything the rest of atencion needs to know about one task, in one place."""

    name: str                      # the config's ``task:``, saved in the model's config.json
    kind: str                      # what a model of this task is, in messages
    preset: str                    # the model a config without model.preset trains
    archs: tuple[str, ...]         # the archs it can train
    metric: str                    # what early stopping watches by default (bleu, accuracy: higher is better)
    label_smoothing: float         # ε_ls when train.label_smoothing is not given
    training: type[Task]           # the training side
    use: str                       # what a model trained for it does: the command and the server's endpoint
    needs: str                     # what ``use`` needs of a model, in messages
    can: Callable[[Any, Tokenizer], bool]  # whether a model (with its tokenizer) can do ``use``
    evaluate: Callable[..., dict]  # `atencion evaluate` for a model of this task: (model_dir, options, warn)
    evaluate_options: tuple[str, ...]  # the options of `atencion evaluate` it reads (argument names)
    evaluate_required: tuple[str, ...]  # those it must be given
    metrics: tuple[str, ...] = ()  # what its validation measures beside the loss (train.early_stop_metric may name one)
    command: Command | None = None  # its command, `atencion USE`: arguments and runner (cli.py reads it)
    endpoint: TaskEndpoint | None = None  # its endpoint, POST /USE: schema and handler (serve/app.py reads it)
    # the training config (train/config.py)
    data_keys: tuple[str, ...] = ()  # the data section's keys it reads (one it does not read is refused when given)
    check_config: Callable[[Any, str], None] | None = None  # its own checks of a TrainConfig (source for messages)
    model_defaults: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False)  # arch → what it adds to
                                   # the model section unless given (classify: a decoder pools its last token)
    stand_in: dict[str, Any] = field(default_factory=dict, hash=False)  # what its data decides about the model,
                                   # stood in for before the data is read (classify: two labels)
    longest: Callable[[Any], tuple[int, str]] | None = None  # (length, key): the longest sequence its data
                                   # gives, for the positions check (None: its model reads no positions of text)
    check_model_section: Callable[[dict, str], None] | None = None  # a model section of its own (contrastive's
                                   # towers), checked in place of the ordinary one's keys and model

    @property
    def evaluate_needs(self) -> str:
        """The options ``evaluate`` must be given, as a message names them: "--src F --ref F"."""
        return " ".join(f"{flag(option)} F" for option in self.evaluate_required)


TASKS: dict[str, TaskSpec] = {}    # name → spec, in the order the task modules register
USES: dict[str, TaskSpec] = {}     # use (translate, generate, fill-mask, classify) → spec


def flag(option: str) -> str:
    """The command-line flag of an argument name: block_size → --block-size."""
    return "--" + option.replace("_", "-")


# the data keys of a new tokenizer (Task.train_tokenizer): read by every task that reads text
TOKENIZER_KEYS = ("tokenizer", "vocab_size", "model_type", "character_coverage")


def sentence_positions(cfg) -> tuple[int, str]:
    """The longest sequence of a task reading sentences of data.max_len tokens between <s> and </s>."""
    return cfg.data.max_len + 2, "data.max_len"


def target_positions(cfg) -> tuple[int, str]:
    """The longest sequence of a decoder writing targets of data.max_len tokens after <s>."""
    return cfg.data.max_len + 1, "data.max_len"


def register_task(spec: TaskSpec) -> TaskSpec:
    """Add a task to ``TASKS`` (tasks/__init__.py imports every task module)."""
    TASKS[spec.name] = spec
    USES[spec.use] = spec
    return spec


def model_task(cfg: ModelConfig) -> str:
    """The task a model was trained for: the one its config.json saves, or, for a directory
    written before the task was saved, what its config tells: "classify" (a classification
    head), "mlm" (an encoder), "lm" (a decoder) or "translate" (an encoder-decoder, an RNN)."""
    if cfg.task is not None:
        if cfg.task not in TASKS:
            raise AtencionError(f"config.json: task {cfg.task!r} is not a task of atencion; known: {list(TASKS)}")
        return cfg.task
    if cfg.num_labels:
        return "classify"
    return {"encoder": "mlm", "decoder": "lm"}.get(cfg.arch, "translate")


def describe(cfg: ModelConfig) -> str:
    """What a model is, for messages: the kind of its task, a translator named by its own arch."""
    task = model_task(cfg)
    return f"a translator (arch {cfg.arch})" if task == "translate" else TASKS[task].kind


def uses(model, tokenizer: Tokenizer) -> list[str]:
    """What ``model`` can do (USES), the use of its own task first."""
    own = TASKS[model_task(model.cfg)].use
    return sorted((use for use, spec in USES.items() if spec.can(model, tokenizer)), key=lambda use: use != own)


def check_model(model, tokenizer: Tokenizer, use: str) -> None:
    """Refuse, in one line, a model that cannot do ``use`` (generate, fill-mask, classify)."""
    if not USES[use].can(model, tokenizer):
        task = model_task(model.cfg)
        detail = " and its tokenizer has no <mask>" if use == "fill-mask" and model.cfg.arch == "encoder" else ""
        raise AtencionError(f"{use} needs {USES[use].needs}; this model is {describe(model.cfg)}{detail}: "
                            f"use {TASKS[task].use}")


# the training side ----------------------------------------------------------------------------


@dataclass
class TaskBatch:
    """One micro-batch: the model's inputs, what the loss predicts, the number of units the loss
    is summed over (target tokens, masked tokens or sentences) and the tokens it holds (an
    encoder of another kind of input: its positions). ``lengths``: the inputs' lengths, for an
    input kind whose examples differ in length (nn/inputs.py)."""

    inputs: Tensor
    targets: Tensor
    units: int
    tokens: int
    decoder_inputs: Tensor | None = None
    lengths: Tensor | None = None

    def to(self, device) -> TaskBatch:
        decoder_inputs = None if self.decoder_inputs is None else self.decoder_inputs.to(device)
        lengths = None if self.lengths is None else self.lengths.to(device)
        return TaskBatch(self.inputs.to(device), self.targets.to(device), self.units, self.tokens, decoder_inputs,
                         lengths)


class Task:
    """The training side of a task: what it reads, how it batches, its loss, how it validates."""

    name = ""
    symbols: tuple[str, ...] = ()  # tokens a new vocabulary must hold (mlm: <mask>)
    tokens = True                  # whether the model reads tokens (and so has a tokenizer)

    def __init__(self, cfg):
        self.cfg = cfg  # the run's TrainConfig (train/config.py, which reads TASKS: not imported here)

    def tokenizer_texts(self) -> list[str]:
        """The text a new tokenizer is trained on."""
        raise NotImplementedError

    def train_tokenizer(self) -> Tokenizer | None:
        """The tokenizer a new run trains (None: a model without a vocabulary, a ViT)."""
        d = self.cfg.data
        return Tokenizer.train_text(self.tokenizer_texts(), d.tokenizer, d.vocab_size, d.model_type,
                                    d.character_coverage, self.symbols)

    def encode(self, tokenizer: Tokenizer) -> None:
        """Turn the text into token ids (after the tokenizer is trained or loaded)."""
        raise NotImplementedError

    def model_values(self) -> dict:
        """What the task and its data decide about the model: the task itself (saved in
        config.json), a classifier's labels."""
        return {"task": self.name}

    def lengths(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    def batches(self, epoch: int) -> list[list[int]]:
        """This epoch's micro-batches as lists of example indices, in training order."""
        t = self.cfg.train
        return token_batches(self.lengths(), t.max_tokens, seed=t.seed + epoch)

    def make_batch(self, indices: list[int], step: int, part: int) -> TaskBatch:
        """The micro-batch of ``indices``: a TaskBatch, or a task's own type with what the trainer
        reads of one (``units``, ``tokens``, ``to(device)``: contrastive's PairBatch)."""
        raise NotImplementedError

    def loss(self, forward, model, batch: TaskBatch) -> tuple[Tensor, Tensor]:
        """(loss, negative log-likelihood), each summed over the batch's units."""
        from .loss import sequence_loss

        return sequence_loss(forward, model, batch.inputs, batch.targets, self.cfg.label_smoothing)

    @torch.no_grad()
    def validate(self, model, device, step: int) -> dict[str, float]:
        raise NotImplementedError

    def has_validation(self) -> bool:
        return True

    def model(self) -> torch.nn.Module | None:
        """The new model of a task that builds its own (contrastive: two towers, nn/towers.py),
        which the trainer trains, checkpoints and saves as it does one model (``save_model``
        writes its directory) and also leaves in OUT/last; None (the default): the trainer builds
        one model of the model section over the tokenizer's vocabularies."""
        return None

    def check_resumed(self, saved: torch.nn.Module, checkpoint) -> None:
        """--resume of a task with its own ``model``: refuse, in one line, the ``saved`` one of
        ``checkpoint`` if the config no longer builds it."""

    def after_update(self, model: torch.nn.Module) -> dict[str, float]:
        """After each update, on every process: what the task does to the weights (contrastive
        clips its temperature) and what it adds to the update's log line."""
        return {}


def valid_result(loss: float, nll: float, units: float, step: int) -> dict[str, float]:
    """Validation loss, NLL and perplexity per unit from sums; a non-finite loss is divergence."""
    if not math.isfinite(loss):
        raise Diverged(step, "validation loss", loss / max(units, 1))
    return {"valid_loss": loss / units, "valid_nll": nll / units, "valid_ppl": math.exp(min(nll / units, 50))}


# the use side's helpers -------------------------------------------------------------------------


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


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def pad_rows(rows: list[list[int]], pad_id: int = PAD_ID) -> Tensor:
    ids = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return ids


def sentence_ids(model, tokenizer: Tokenizer, texts: list[str], max_tokens: int = 0,
                 where: Callable[[int], str] = lambda i: f"--input line {i + 1}") -> list[list[int]]:
    """Each stripped text as a model reads a sentence (``Tokenizer.sentence``: ``<s> pieces </s>``,
    as the mlm and classify tasks read their data, or a Hugging Face tokenizer's own), refusing
    one that is not valid Unicode (``check_text``), of more than ``max_tokens`` pieces (0: no
    limit) or beyond a learned position table, named by ``where(index)``."""
    limit = position_limit(model.cfg)
    added = len(tokenizer.sentence(""))  # the special tokens around a sentence
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer.sentence(check_text(text, where(i)).strip())
        pieces = len(ids) - added
        if max_tokens and pieces > max_tokens:
            raise AtencionError(f"{where(i)}: {pieces} tokens, more than the limit of {max_tokens}")
        if limit is not None and len(ids) > limit:
            raise AtencionError(f"{where(i)}: {len(ids)} tokens with <s> and </s>, more than this model's "
                                f"learned positions (max_positions={limit})")
        out.append(ids)
    return out


def listing(items: list, limit: int = 10) -> str:
    """The first ``limit`` of ``items``, joined by commas, and how many more there are."""
    shown = ", ".join(str(item) for item in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def warn_unseen(tokenizer: Tokenizer, texts: str | list[str], what: str, warn=None,
                lines: list[int] | None = None) -> None:
    """Warn once, by ``warn(message)`` (default: a logging warning), of the symbols of ``texts``
    (characters, whitespace-separated symbols, subword-nmt's pieces) that a character, whitespace
    or subword-nmt vocabulary lacks and so reads as ``<unk>``: how many, which (in the order they
    first appear), named by ``what`` and, for a list of texts, the line of the first text holding
    one (``lines``: the texts' line numbers; default 1, 2, ...). Nothing for SentencePiece, whose pieces cover what
    its training text held, nor for a Hugging Face tokenizer."""
    if tokenizer.kind not in ("char", "whitespace", "subword-nmt"):
        return
    vocab = tokenizer.src
    many = not isinstance(texts, str)
    texts = [vocab.split(text) for text in (texts if many else [texts])]
    missing = set().union(*texts).difference(vocab.lookup)
    if not missing:
        return
    seen: dict[str, None] = {}
    first = None
    for k, symbols in enumerate(texts):
        for symbol in symbols:
            if symbol in missing and symbol not in seen:
                seen[symbol] = None
                first = k if first is None else first
        if len(seen) == len(missing):
            break
    n = len(seen)
    where = f" (first on line {lines[first] if lines is not None else first + 1})" if many else ""
    (warn or log.warning)(f"{what}: {n} {vocab.unit}{'' if n == 1 else 's'} not in the vocabulary, read as <unk>: "
                          f"{listing([repr(c) for c in seen])}{where}")


def evaluate_file(model: str, options: dict[str, Any], option: str,
                  score: Callable[[Any, Tokenizer, str], dict]) -> dict:
    """`atencion evaluate` on the file that ``option`` names: the model directory ``model``
    loaded as the options say (device, int8), ``score(model, tokenizer, path)``, and the
    settings beside the scores."""
    path = options[option]
    need_file(path, flag(option))
    loaded, tokenizer = load_model_dir(model, options.get("device", "cpu"), options.get("int8", False))
    return {**score(loaded, tokenizer, path), "model": model, "int8": options.get("int8", False),
            "batch_tokens": options.get("batch_tokens", 4096), option: path}
