"""What each training task reads, how it batches, what its loss is and how it validates.

- ``translate``: parallel sentences, teacher forcing, label-smoothed cross-entropy (§5); BLEU.
- ``lm``: a causal language model (GPT) on the contiguous blocks of plain text; perplexity and
  bits per character.
- ``mlm``: BERT's masked language model on sentences (one line each); masked-token accuracy.
- ``classify``: a label per sentence (``label<TAB>text``); accuracy.

The trainer (trainer.py) owns the loop, the optimizer and the checkpoints; a task gives it index
batches (``batches``), turns one into tensors (``make_batch``), computes its summed loss
(``loss``) and validates (``validate``). Everything random in a batch (the epoch's order, MLM's
masking) is drawn from the seed, the epoch and the step, so a resumed run repeats it exactly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.batching import collate, token_batches
from ..data.corpus import read_parallel
from ..data.text import epoch_offset, lm_blocks, mask_tokens, read_labelled, read_text, split_tail
from ..data.tokenizer import BOS_ID, EOS_ID, MASK, PAD_ID, UNK_ID, Tokenizer
from ..errors import AtencionError, Diverged
from .config import TrainConfig
from .loss import generator_loss, label_smoothed_loss, sequence_loss

log = logging.getLogger(__name__)


@dataclass
class TaskBatch:
    """One micro-batch: the model's inputs, what the loss predicts, the number of units the loss
    is summed over (target tokens, masked tokens or sentences) and the tokens it holds."""

    inputs: Tensor
    targets: Tensor
    units: int
    tokens: int
    decoder_inputs: Tensor | None = None

    def to(self, device) -> "TaskBatch":
        decoder_inputs = None if self.decoder_inputs is None else self.decoder_inputs.to(device)
        return TaskBatch(self.inputs.to(device), self.targets.to(device), self.units, self.tokens, decoder_inputs)


class Task:
    name = ""
    symbols: tuple[str, ...] = ()  # tokens a new vocabulary must hold (mlm: <mask>)

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def tokenizer_texts(self) -> list[str]:
        """The text a new tokenizer is trained on."""
        raise NotImplementedError

    def train_tokenizer(self) -> Tokenizer:
        d = self.cfg.data
        return Tokenizer.train_text(self.tokenizer_texts(), d.tokenizer, d.vocab_size, d.model_type,
                                    d.character_coverage, self.symbols)

    def encode(self, tokenizer: Tokenizer) -> None:
        """Turn the text into token ids (after the tokenizer is trained or loaded)."""
        raise NotImplementedError

    def model_values(self) -> dict:
        """What the data decides about the model (a classifier's labels)."""
        return {}

    def lengths(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    def batches(self, epoch: int) -> list[list[int]]:
        """This epoch's micro-batches as lists of example indices, in training order."""
        t = self.cfg.train
        return token_batches(self.lengths(), t.max_tokens, seed=t.seed + epoch)

    def make_batch(self, indices: list[int], step: int, part: int) -> TaskBatch:
        raise NotImplementedError

    def loss(self, forward, model, batch: TaskBatch) -> tuple[Tensor, Tensor]:
        """(loss, negative log-likelihood), each summed over the batch's units."""
        return sequence_loss(forward, model, batch.inputs, batch.targets, self.cfg.label_smoothing)

    @torch.no_grad()
    def validate(self, model, device, step: int) -> dict[str, float]:
        raise NotImplementedError

    def has_validation(self) -> bool:
        return True


def _sums_to_result(loss: float, nll: float, units: float, step: int) -> dict[str, float]:
    if not math.isfinite(loss):
        raise Diverged(step, "validation loss", loss / max(units, 1))
    return {"valid_loss": loss / units, "valid_nll": nll / units, "valid_ppl": math.exp(min(nll / units, 50))}


# translate --------------------------------------------------------------------------------------


def read_pairs(cfg: TrainConfig, split: str) -> list[tuple[str, str]] | None:
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

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.train_pairs, self.valid_pairs = read_pairs(cfg, "train"), read_pairs(cfg, "valid")

    def train_tokenizer(self) -> Tokenizer:
        d = self.cfg.data
        return Tokenizer.train(self.train_pairs, d.vocab_size, d.model_type, d.joint, d.character_coverage)

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
        b = collate([self.examples[i] for i in indices], PAD_ID, BOS_ID, EOS_ID)
        return TaskBatch(b.src, b.tgt_out, b.n_tokens, b.n_tokens, b.tgt_in)

    def loss(self, forward, model, batch):
        hidden = forward(batch.inputs, batch.decoder_inputs, select=batch.targets != PAD_ID, project=False)
        generator = model.generator
        return generator_loss(hidden, generator.weight, generator.bias, batch.targets, PAD_ID,
                              self.cfg.label_smoothing)

    @torch.no_grad()
    def validate(self, model, device, step):
        from ..decode.translate import translate_lines
        from ..evaluate import score

        loss_sum = nll_sum = tokens = 0.0
        lengths = [(len(s), len(tg)) for s, tg in self.valid_examples]
        for group in token_batches(lengths, self.cfg.train.max_tokens, seed=None):
            batch = collate([self.valid_examples[i] for i in group], PAD_ID, BOS_ID, EOS_ID).to(device)
            loss, nll = label_smoothed_loss(model(batch.src, batch.tgt_in), batch.tgt_out, PAD_ID,
                                            self.cfg.label_smoothing)
            loss_sum, nll_sum, tokens = loss_sum + loss.item(), nll_sum + nll.item(), tokens + batch.n_tokens
        result = _sums_to_result(loss_sum, nll_sum, tokens, step)
        t = self.cfg.train
        if t.valid_bleu:
            pairs = self.valid_pairs[: t.valid_bleu_sentences or None]
            out = translate_lines(model, self.tokenizer, [s for s, _ in pairs], self.cfg.decode)
            scores = score([o[0].text for o in out], [r for _, r in pairs])
            result.update({f"valid_{k}": v for k, v in scores.items()})
        return result


# lm ---------------------------------------------------------------------------------------------


def _text_splits(cfg: TrainConfig) -> tuple[list[str], list[str] | None]:
    """Training and validation lines of the lm and mlm tasks: data.valid_text, or else the
    held-out tail (data.valid_fraction) of data.train_text."""
    d = cfg.data
    if d.train_text is None:
        raise AtencionError(f"data.train_text: task {cfg.task!r} reads plain text; set data.train_text to a file "
                            f"or a list of files")
    lines = read_text(d.train_text, "data.train_text")
    if d.valid_text is not None:
        return lines, read_text(d.valid_text, "data.valid_text")
    train, valid = split_tail(lines, d.valid_fraction)
    return train, valid


def text_stream(lines: list[str], tokenizer: Tokenizer) -> list[int]:
    """The token stream a language model reads: every character with its newlines (character
    vocabulary), or each line's pieces followed by ``</s>`` (SentencePiece, which has no newline)."""
    if tokenizer.kind == "char":
        return tokenizer.encode("".join(line + "\n" for line in lines))
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


class LMTask(Task):
    name = "lm"

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.train_lines, self.valid_lines = _text_splits(cfg)

    def tokenizer_texts(self) -> list[str]:
        if self.cfg.data.tokenizer == "char":  # the stream keeps its newlines: they are characters too
            return [line + "\n" for line in self.train_lines]
        return self.train_lines

    def encode(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        block = self.cfg.data.block_size
        self.stream = torch.tensor(text_stream(self.train_lines, tokenizer), dtype=torch.long)
        if self.stream.numel() < block + 1:
            raise AtencionError(f"data.train_text: the training text has {self.stream.numel()} tokens, fewer than "
                                f"one block of data.block_size={block} + 1")
        self.valid_stream = torch.tensor(text_stream(self.valid_lines, tokenizer), dtype=torch.long)
        if self.valid_stream.numel() < 2:
            raise AtencionError("data: the validation text has fewer than 2 tokens")
        # SentencePiece: the characters of the validation lines (with their newlines)
        self.valid_characters = None if tokenizer.kind == "char" else sum(len(x) + 1 for x in self.valid_lines)
        log.info("lm: %d training tokens, %d validation tokens", self.stream.numel(), self.valid_stream.numel())
        self._blocks: tuple[int, list] | None = None

    def blocks(self, epoch: int) -> list[tuple[int, int]]:
        if self._blocks is None or self._blocks[0] != epoch:
            block = self.cfg.data.block_size
            offset = epoch_offset(self.cfg.train.seed, epoch, block)
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


# mlm --------------------------------------------------------------------------------------------


def encode_sentences(lines: list[str], tokenizer: Tokenizer, max_len: int, name: str) -> list[list[int]]:
    """``<s> pieces </s>`` for each non-empty line (BERT's [CLS] … [SEP]); lines longer than
    ``max_len`` pieces are dropped and counted."""
    out, dropped = [], 0
    for line in lines:
        if not line.strip():
            continue
        ids = tokenizer.encode(line.strip())
        if len(ids) > max_len:
            dropped += 1
            continue
        out.append([BOS_ID, *ids, EOS_ID])
    if dropped:
        log.warning("%s: dropped %d sentences longer than data.max_len=%d tokens", name, dropped, max_len)
    if not out:
        raise AtencionError(f"{name}: no sentence of at most data.max_len={max_len} tokens")
    return out


def pad_rows(rows: list[list[int]]) -> Tensor:
    ids = torch.full((len(rows), max(len(r) for r in rows)), PAD_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return ids


class Masker:
    """BERT's masking of padded sentences (``mask_tokens``) for a tokenizer with ``<mask>``:
    regular tokens and ``<unk>`` can be chosen, the other special tokens never."""

    def __init__(self, tokenizer: Tokenizer, probability: float = 0.15):
        if tokenizer.mask_id is None:
            raise AtencionError("masked language modelling needs a vocabulary with <mask>; this tokenizer has none")
        self.mask_id, self.vocab_size, self.probability = tokenizer.mask_id, tokenizer.vocab_size, probability
        self.first_regular = max(EOS_ID, self.mask_id) + 1

    def __call__(self, rows: list[list[int]], generator: torch.Generator) -> tuple[Tensor, Tensor]:
        ids = pad_rows(rows)
        maskable = (ids >= self.first_regular) | (ids == UNK_ID)
        return mask_tokens(ids, maskable, self.mask_id, self.first_regular, self.vocab_size, self.probability,
                           generator)


class MLMTask(Task):
    name = "mlm"
    symbols = (MASK,)

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.train_lines, self.valid_lines = _text_splits(cfg)

    def tokenizer_texts(self) -> list[str]:
        return self.train_lines

    def encode(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.masker = Masker(tokenizer, self.cfg.data.mask_probability)
        max_len = self.cfg.data.max_len
        self.examples = encode_sentences(self.train_lines, tokenizer, max_len, "train text")
        self.valid_examples = encode_sentences(self.valid_lines, tokenizer, max_len, "valid text")
        self._lengths = [(len(e), 0) for e in self.examples]

    def lengths(self):
        return self._lengths

    def make_batch(self, indices, step, part) -> TaskBatch:
        generator = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + step * 1009 + part)
        inputs, targets = self.masker([self.examples[i] for i in indices], generator)
        return TaskBatch(inputs, targets, int((targets != PAD_ID).sum()), int((inputs != PAD_ID).sum()))

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


# classify ---------------------------------------------------------------------------------------


class ClassifyTask(Task):
    name = "classify"

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        d = cfg.data
        if d.train_tsv is None:
            raise AtencionError("data.train_tsv: task 'classify' reads label<TAB>text rows; set data.train_tsv")
        self.train_rows, self.labels, skipped = read_labelled(d.train_tsv, None, d.header, d.empty_lines)
        if len(self.labels) < 2:
            raise AtencionError(f"{d.train_tsv}: only one label ({self.labels[0]!r}); a classifier needs two or more")
        if skipped:
            log.warning("%s: skipped %d rows with an empty text", d.train_tsv, skipped)
        self.valid_rows = (read_labelled(d.valid_tsv, self.labels, d.header, d.empty_lines)[0]
                           if d.valid_tsv else None)

    def tokenizer_texts(self) -> list[str]:
        return [text for _, text in self.train_rows]

    def model_values(self) -> dict:
        return {"num_labels": len(self.labels), "labels": self.labels}

    def encode(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        max_len = self.cfg.data.max_len
        self.examples, self.targets = self._encode(self.train_rows, "train TSV", max_len)
        self.valid = self._encode(self.valid_rows, "valid TSV", max_len) if self.valid_rows else None
        self._lengths = [(len(e), 0) for e in self.examples]

    def _encode(self, rows, name, max_len):
        kept = [(label, [BOS_ID, *self.tokenizer.encode(text), EOS_ID]) for label, text in rows]
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
        ids = pad_rows([self.examples[i] for i in indices])
        labels = torch.tensor([self.targets[i] for i in indices])
        return TaskBatch(ids, labels, len(indices), int((ids != PAD_ID).sum()))

    def loss(self, forward, model, batch):
        logits = forward(batch.inputs, classify=True).float()
        loss = F.cross_entropy(logits, batch.targets, reduction="sum", label_smoothing=self.cfg.label_smoothing)
        return loss, F.cross_entropy(logits.detach(), batch.targets, reduction="sum")

    @torch.no_grad()
    def validate(self, model, device, step):
        examples, targets = self.valid
        scores = classify_scores(model, examples, targets, self.cfg.train.max_tokens, device)
        if not math.isfinite(scores["loss"]):
            raise Diverged(step, "validation loss", scores["loss"])
        return {"valid_loss": scores["loss"], "valid_accuracy": scores["accuracy"]}


@torch.no_grad()
def classify_logits(model, examples: list[list[int]], max_tokens: int, device) -> Tensor:
    """Logits (n, num_labels) of ``examples`` (token ids with ``<s>``/``</s>``), in their order."""
    out = torch.empty(len(examples), model.cfg.num_labels)
    for group in token_batches([(len(e), 0) for e in examples], max_tokens, seed=None):
        out[group] = model.classify(pad_rows([examples[i] for i in group]).to(device)).float().cpu()
    return out


def classify_scores(model, examples, targets: list[int], max_tokens: int, device) -> dict:
    """Loss, accuracy and the confusion matrix (rows: true label, columns: predicted)."""
    logits = classify_logits(model, examples, max_tokens, device)
    gold = torch.tensor(targets)
    predicted = logits.argmax(-1)
    n = model.cfg.num_labels
    confusion = torch.zeros(n, n, dtype=torch.long)
    confusion.index_put_((gold, predicted), torch.ones_like(gold), accumulate=True)
    return {"loss": float(F.cross_entropy(logits, gold)), "accuracy": float((predicted == gold).float().mean()),
            "confusion": confusion.tolist(), "sentences": len(targets)}


TASK_CLASSES = {"translate": TranslateTask, "lm": LMTask, "mlm": MLMTask, "classify": ClassifyTask}


def make_task(cfg: TrainConfig) -> Task:
    """The task ``cfg.task`` names, with its training (and validation) data read."""
    return TASK_CLASSES[cfg.task](cfg)
