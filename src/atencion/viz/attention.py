"""Attention weights (eq. 1, §3.2.3) of a trained Transformer: capture, words, alignment, AER.

Caution: attention weights help to inspect a model; they are not a causal explanation of its
decisions (a head can attend to a word that changes nothing downstream, and the residual
stream carries information the weights do not show).

Positions. The encoder reads the source pieces and </s>. The decoder reads <s> + the target
pieces (teacher forcing); its output at position j predicts target piece j, and </s> after the
last. Encoder self-attention is (S+1) × (S+1), decoder masked self-attention (T+1) × (T+1),
labelled on both axes by the decoder's inputs <s> p_0 … p_{T-1}, and cross-attention
(T+1) × (S+1).

Row shift: which cross-attention row stands for target piece j.
  "predict" (default): row j, the row whose output predicts p_j (its input is p_{j-1}, or <s>).
  "input":             row j+1, the row where p_j is the decoder's input.
A cross-attention map is labelled by the piece each row stands for: "predict" gives the rows
the labels p_0 … p_{T-1} </s>, "input" gives <s> p_0 … p_{T-1}. The matrix is the same; word
alignment and the plots read the labels, so they follow the shift.

Words. Pieces group into words at SentencePiece's "▁" (a piece that starts with it starts a
word); <s> and </s> stay words of their own. ``aggregate_words`` reduces a word's rows and its
columns with "mean" or "sum". The default, rows="mean", cols="sum" (Clark et al. 2019, "What
does BERT look at?"), keeps every row a distribution: a word's attention *to* a word is the sum
over that word's key pieces, averaged over the word's query pieces, so a row still sums to 1.
The issue's wording, "sum over a word's target pieces (rows), mean over its source pieces
(columns)", is rows="sum", cols="mean": a row then sums to Σ over the word's pieces of the
mean weight per key word, which is no longer 1 (with one-piece words everywhere both agree).
Word alignment always uses the default; the argmax over source words does not depend on the
row reduction, only on the column one.

AER (Och and Ney 2003): AER = 1 − (|A∩S| + |A∩P|) / (|A| + |S|) for predicted links A, sure
links S and possible links P ⊇ S; with one gold set, P = S and AER = 1 − F1.

An RNN encoder-decoder (arch rnn, nn/rnn.py) has one attention, its decoder's over the encoder
states: α_{t,i} is its cross-attention, one layer of one head, read, aligned and scored as the
Transformer's; it has no self-attention maps. With ``attention: none`` it has no map at all.

Single-stack models have self-attention only (``capture_self_attention``), and so neither
alignment nor AER. A GPT (arch decoder) reads the tokens of a text as they are, as its language
model's stream has them, and what it generates greedily after them; its maps are causal. A BERT
(arch encoder) reads <s> + the pieces of a sentence + </s>, as its masked-LM task does; its maps
are bidirectional. A character tokenizer's whitespace is labelled ␣ (space), ⏎ (newline) and
⇥ (tab); in words, a character model's word starts at a whitespace character, as a SentencePiece
word starts at "▁".

A model that reads images (a ViT) or recordings (a speech classifier, a speech-to-text model)
is captured by ``capture_input_attention``: its encoder's self-attention, its attention rollout
(Abnar and Zuidema 2020, ``attention_rollout``), what its head pools ([CLS], or the mean of the
rows), and a speech-to-text model's cross-attention over the encoder positions for each
character of its own (greedy) transcript.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Iterable

import numpy as np
import torch

from ..config import ATTENTION_KINDS, TWO_STACKS
from ..decode.sample import generate_ids
from ..decode.settings import DecodeConfig
from ..errors import AtencionError
from ..nn.positional import position_limit
from ..nn.prefix import places

log = logging.getLogger(__name__)

def kind_note(kind: str) -> str:
    """What the self-attention maps of attention kind ``kind`` show, beside eq. (1)'s legend (its
    KindSpec's ``note``, nn/kinds/): "" for eq. (1) itself; a kind the registry does not know (a
    model saved by another version) gets a line that says so instead of failing."""
    spec = ATTENTION_KINDS.get(kind)
    if spec is None:
        return f"attention kind {kind!r}: these are the weights it computed, whatever they mean for that kind"
    return spec.note


CAUTION = ("attention weights help to inspect a model; they are not a causal explanation "
           "of its decisions")
BOS, EOS = "<s>", "</s>"
SPECIALS = (BOS, EOS)
OTHER_SPECIALS = re.compile(r"\[[A-Z]+\]|<\|[^|]+\|>")  # Hugging Face's: BERT's [CLS], GPT-2's <|endoftext|>
KINDS = ("encoder", "decoder", "cross")
SHIFTS = ("predict", "input")
REDUCTIONS = {"sum": np.sum, "mean": np.mean}
WORD_START = "▁"
VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}   # a character tokenizer's whitespace, made visible
ARCH_NAMES = {"encoder-decoder": "an encoder-decoder (a translator)", "rnn": "an RNN encoder-decoder (a translator)",
              "decoder": "a decoder-only model (GPT)",
              "encoder": "an encoder-only model (BERT)"}

Link = tuple[int, int]   # (source word, target word), 0-based, as in Pharaoh "i-j"


@dataclass(frozen=True)
class AttentionMap:
    """One kind of attention at every layer and head: ``weights`` (layers, h, queries, keys);
    ``rows`` and ``cols`` label the queries and keys (pieces, or words when ``words``)."""

    kind: str
    weights: np.ndarray
    rows: list[str]
    cols: list[str]
    words: bool = False

    def mean(self, layer: int | None = None) -> np.ndarray:
        """The head average of one layer (0-based), or of every layer when ``layer`` is None."""
        heads = self.weights.mean(axis=1)
        return heads.mean(axis=0) if layer is None else heads[layer]

    def to_words(self, rows: str = "mean", cols: str = "sum") -> "AttentionMap":
        """Pieces → words (see the module docstring); a word-level map is returned as it is."""
        if self.words:
            return self
        weights = aggregate_words(self.weights, word_spans(self.rows), word_spans(self.cols), rows, cols)
        return AttentionMap(self.kind, weights, word_labels(self.rows), word_labels(self.cols), True)


@dataclass(frozen=True)
class Attention:
    """Every attention map of one (source, target) pair, as one teacher-forced pass computed it
    (an RNN encoder-decoder has the cross-attention map only: ``encoder`` and ``decoder`` None)."""

    src: str
    tgt: str
    shift: str
    encoder: AttentionMap | None
    decoder: AttentionMap | None
    cross: AttentionMap
    attention_kind: str = "full"  # the self-attention's kind (model.attention): what its maps show, kind_note

    def maps(self) -> dict[str, AttentionMap]:
        return {kind: getattr(self, kind) for kind in KINDS if getattr(self, kind) is not None}

    def to_words(self, rows: str = "mean", cols: str = "sum") -> "Attention":
        return replace(self, **{kind: amap.to_words(rows, cols) for kind, amap in self.maps().items()})


@dataclass(frozen=True)
class SelfAttention:
    """The self-attention of a single-stack model over one sequence, as one forward pass computed
    it: ``text`` as given, ``generated`` the text of the ``new_tokens`` a GPT appended (none for a
    BERT), and the map of kind "decoder" (GPT, causal) or "encoder" (BERT, bidirectional)."""

    text: str
    generated: str
    new_tokens: int
    self_attention: AttentionMap
    attention_kind: str = "full"  # the self-attention's kind (model.attention): what its maps show, kind_note

    def maps(self) -> dict[str, AttentionMap]:
        return {self.self_attention.kind: self.self_attention}

    def to_words(self, rows: str = "mean", cols: str = "sum") -> "SelfAttention":
        return replace(self, self_attention=self.self_attention.to_words(rows, cols))


def require_cross_attention(model, what: str) -> None:
    """Refuse a single-stack model where cross-attention is needed; ``what`` starts the message."""
    arch = model.cfg.arch
    if arch not in TWO_STACKS:
        raise AtencionError(f"{what} needs the cross-attention of an encoder-decoder (a translator); this model is "
                            f"{ARCH_NAMES.get(arch, repr(arch))}, which has self-attention only")
    if arch == "rnn" and model.cfg.rnn["attention"] == "none":
        raise AtencionError(f"{what} needs attention weights; this RNN encoder-decoder has rnn.attention 'none': its "
                            f"decoder reads one summary vector of the source, and attends to nothing")


def capture_attention(model, tokenizer, src: str, tgt: str | list[int], shift: str = "predict") -> Attention:
    """Run ``model`` (in eval mode, without gradients) on one pair and keep every attention weight.

    ``tgt`` is the target text or its piece ids (e.g. the tokens a beam search returned, which
    need not be the segmentation that encoding the decoded text would give).
    """
    require_cross_attention(model, "a sentence pair's attention")
    if shift not in SHIFTS:
        raise AtencionError(f"shift must be one of {SHIFTS}, got {shift!r}")
    src = src.strip()
    if not src:
        raise AtencionError("the source sentence is empty")
    cfg = model.cfg
    src_ids = tokenizer.encode_src(src)
    tgt_ids = tokenizer.encode_tgt(tgt.strip()) if isinstance(tgt, str) else list(tgt)
    tgt_text = tgt.strip() if isinstance(tgt, str) else tokenizer.decode_tgt(tgt_ids)
    device = next(model.parameters()).device
    src_tensor = torch.tensor([src_ids + [cfg.eos_id]], device=device)
    tgt_tensor = torch.tensor([[cfg.bos_id] + tgt_ids], device=device)
    model.eval()
    with torch.no_grad():
        _, attn = model(src_tensor, tgt_tensor, return_attention=True)
    weights = {kind: torch.stack(attn[kind])[:, 0].float().cpu().numpy() for kind in KINDS if attn[kind]}

    src_tokens = [tokenizer.src.id_to_piece(i) for i in src_ids] + [EOS]
    tgt_pieces = [tokenizer.tgt.id_to_piece(i) for i in tgt_ids]
    tgt_inputs = [BOS] + tgt_pieces
    cross_rows = tgt_pieces + [EOS] if shift == "predict" else tgt_inputs
    encoder = AttentionMap("encoder", weights["encoder"], src_tokens, src_tokens) if "encoder" in weights else None
    decoder = AttentionMap("decoder", weights["decoder"], tgt_inputs, tgt_inputs) if "decoder" in weights else None
    return Attention(src, tgt_text, shift, encoder, decoder, AttentionMap("cross", weights["cross"], cross_rows,
                                                                          src_tokens), attention_kind(cfg))


def token_label(tokenizer, i: int) -> str:
    """The label of token ``i``: its piece, with a character tokenizer's whitespace made visible
    (VISIBLE) and any other unprintable character escaped; a Hugging Face tokenizer's piece spelt
    with "▁" where a word starts (its vocabulary's ``label``)."""
    if tokenizer.foreign:
        return tokenizer.src.label(i)
    piece = tokenizer.piece(i)
    if tokenizer.kind != "char":
        return piece
    return VISIBLE.get(piece) or (piece if piece.isprintable() else piece.encode("unicode_escape").decode())


def self_attention_ids(model, tokenizer, text: str) -> list[int]:
    """What a single-stack model reads for ``text``: a GPT its tokens (and a Hugging Face
    tokenizer's start token, if it adds one), a BERT the sentence (``Tokenizer.sentence``: <s> +
    its pieces + </s>, or [CLS] … [SEP]). An empty sequence is refused, naming --text."""
    cfg = model.cfg
    if cfg.arch == "encoder":
        if not text.strip():
            raise AtencionError("--text: the sentence is empty")
        return tokenizer.sentence(text.strip())
    ids = tokenizer.sentence(text) if tokenizer.foreign else tokenizer.encode(text)
    if not ids:
        raise AtencionError(f"--text {text!r} has no tokens: a GPT needs at least one to attend from")
    return ids


def capture_self_attention(model, tokenizer, text: str, max_new_tokens: int = 0) -> SelfAttention:
    """Run a single-stack ``model`` (in eval mode, without gradients) on ``text`` and keep its
    self-attention at every layer and head: ``model(ids, return_attention=True)`` over the ids of
    ``self_attention_ids``, and for a GPT the ``max_new_tokens`` it generates greedily after them.
    Refused before any work: an encoder-decoder model, new tokens from a model that does not
    generate, and a sequence longer than a learned position table."""
    cfg = model.cfg
    if cfg.arch not in ("decoder", "encoder"):
        raise AtencionError(f"self-attention over one text needs a single-stack model (GPT or BERT); this model is "
                            f"{ARCH_NAMES.get(cfg.arch, repr(cfg.arch))}: give it --src (and --tgt)")
    if max_new_tokens and cfg.arch != "decoder":
        raise AtencionError(f"--max-new-tokens: only a decoder-only model (GPT) generates; this model is "
                            f"{ARCH_NAMES[cfg.arch]}")
    prompt = self_attention_ids(model, tokenizer, text)
    # the places of virtual tokens (nn/prefix.py) come first: a prompt's queries and keys, a prefix's keys
    prompt_places, prefix_places = places(model.encoder if cfg.arch == "encoder" else model.decoder)
    limit = position_limit(cfg)
    if limit is not None and prompt_places + prefix_places + len(prompt) + max_new_tokens > limit:
        raise AtencionError(f"--text: {len(prompt)} tokens + --max-new-tokens {max_new_tokens} pass this model's "
                            f"learned positions, which stop at max_positions={limit}")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    if max_new_tokens:
        ids = torch.cat([ids, generate_ids(model, ids, max_new_tokens, temperature=0)], dim=1)
    model.eval()
    with torch.no_grad():
        _, attn = model(ids, return_attention=True)
    kind = cfg.arch
    weights = torch.stack(attn[kind])[:, 0].float().cpu().numpy()
    rows = [f"<prompt {i + 1}>" for i in range(prompt_places)] + [token_label(tokenizer, i) for i in ids[0].tolist()]
    cols = [f"<prefix {i + 1}>" for i in range(prefix_places)] + rows
    generated = tokenizer.decode(ids[0, len(prompt):].tolist())
    return SelfAttention(text, generated, ids.size(1) - len(prompt), AttentionMap(kind, weights, rows, cols),
                         attention_kind(cfg))


def attention_kind(cfg) -> str:
    """The kind of a model's self-attention (model.attention), "full" for eq. (1)."""
    return "full" if getattr(cfg, "attention", None) is None else cfg.attention["kind"]


# words -----------------------------------------------------------------------------------------

def word_spans(labels: list[str]) -> list[list[int]]:
    """Positions grouped into words: a piece starting with "▁" starts a word, and so do a
    character model's whitespace (␣, ⏎, ...), <s>, </s> (or [CLS], [SEP], <|endoftext|>) and
    whatever follows them."""
    spans: list[list[int]] = []
    starts = tuple(VISIBLE.values())

    def special(label: str) -> bool:
        return label in SPECIALS or OTHER_SPECIALS.fullmatch(label) is not None

    for i, label in enumerate(labels):
        if (not spans or special(label) or label.startswith(WORD_START) or label in starts
                or special(labels[i - 1])):
            spans.append([i])
        else:
            spans[-1].append(i)
    return spans


def word_labels(labels: list[str]) -> list[str]:
    """The words of ``word_spans``, without "▁" (<s> and </s> as they are)."""
    return ["".join(labels[i] for i in span).replace(WORD_START, "") or WORD_START
            for span in word_spans(labels)]


def aggregate_words(weights: np.ndarray, row_spans: list[list[int]], col_spans: list[list[int]],
                    rows: str = "mean", cols: str = "sum") -> np.ndarray:
    """(…, queries, keys) → (…, query words, key words): each word's columns reduced by ``cols``,
    then each word's rows by ``rows`` ("sum" or "mean"). The default keeps rows summing to 1."""
    if rows not in REDUCTIONS or cols not in REDUCTIONS:
        raise AtencionError(f"rows and cols must each be 'sum' or 'mean', got {rows!r} and {cols!r}")
    weights = np.asarray(weights)
    by_col = np.stack([REDUCTIONS[cols](weights[..., span], axis=-1) for span in col_spans], axis=-1)
    return np.stack([REDUCTIONS[rows](by_col[..., span, :], axis=-2) for span in row_spans], axis=-2)


# alignment -------------------------------------------------------------------------------------

def _real(labels: list[str]) -> list[int]:
    return [i for i, label in enumerate(labels) if label not in SPECIALS]


def word_alignment(cross: AttentionMap, layer: int | None = None, head: int | None = None) -> set[Link]:
    """Each target word linked to the source word its cross-attention weighs most.

    Heads averaged (or ``head`` alone), of one layer (0-based) or of every layer averaged
    (``layer`` None). Rows follow the map's row shift; <s> and </s> take no part, neither as
    rows nor as columns. Words come from ``AttentionMap.to_words`` with its default reduction.
    """
    words = cross.to_words()
    per_head = words.weights if head is None else words.weights[:, head:head + 1]
    matrix = per_head.mean(axis=1)
    matrix = matrix.mean(axis=0) if layer is None else matrix[layer]
    rows, cols = _real(words.rows), _real(words.cols)
    if not rows or not cols:
        return set()
    best = matrix[np.ix_(rows, cols)].argmax(axis=1)
    return {(int(i), j) for j, i in enumerate(best)}


def parse_pharaoh(line: str, where: str = "alignment") -> tuple[set[Link], set[Link]]:
    """Sure and possible links of one line: "i-j" is sure, "i?j" possible only (0-based). ``where``
    (e.g. "FILE line N") starts the message of an AtencionError for a malformed link."""
    sure, possible = set(), set()
    for item in line.split():
        sep = "-" if "-" in item else "?"
        left, _, right = item.partition(sep)
        # ASCII digits only: str.isdigit() also accepts "²" (which int() refuses) and "١".
        if not (left.isascii() and left.isdigit() and right.isascii() and right.isdigit()):
            raise AtencionError(f"{where}: {item!r} is not an alignment link 'i-j' or 'i?j' "
                                f"(i, j: 0-based source and target word positions)")
        (sure if sep == "-" else possible).add((int(left), int(right)))
    return sure, possible | sure


def format_pharaoh(links: Iterable[Link]) -> str:
    return " ".join(f"{i}-{j}" for i, j in sorted(links, key=lambda link: (link[1], link[0])))


def alignment_error_rate(predicted: Iterable[Link], sure: Iterable[Link],
                         possible: Iterable[Link] | None = None) -> float:
    """AER = 1 − (|A∩S| + |A∩P|) / (|A| + |S|) of one sentence (Och and Ney 2003).

    ``possible`` defaults to ``sure``; it is taken as P ∪ S, so that P ⊇ S. With nothing
    predicted and nothing sure, AER is 0.
    """
    return corpus_alignment_error_rate([predicted], [sure], None if possible is None else [possible])


def corpus_alignment_error_rate(predicted: list[Iterable[Link]], sure: list[Iterable[Link]],
                                possible: list[Iterable[Link]] | None = None) -> float:
    """AER of a corpus: the counts of every sentence summed before the division."""
    if len(predicted) != len(sure) or (possible is not None and len(possible) != len(sure)):
        raise AtencionError(f"{len(predicted)} predicted alignments for {len(sure)} gold ones")
    hits = size = 0
    for k, (a, s) in enumerate(zip(predicted, sure)):
        a, s = set(a), set(s)
        p = s if possible is None else set(possible[k]) | s
        hits += len(a & s) + len(a & p)
        size += len(a) + len(s)
    return 1.0 - hits / size if size else 0.0


def evaluate_alignment(model, tokenizer, sources: list[str], targets: list[str], gold: list[str],
                       shift: str = "predict", max_sentences: int = 0,
                       names: tuple[str, str, str] = ("source", "target", "alignments"),
                       max_tokens: int = 0) -> dict:
    """AER of cross-attention alignments against gold Pharaoh lines, teacher-forcing each gold
    target (no decoding): per layer (heads averaged), every layer averaged, and per head.
    ``names`` (the three files) start the messages about a line. Every line is checked before
    any work: a sentence of more than ``max_tokens`` subword pieces (0: no limit), or a link that
    points past its sentence's words, is refused naming the file and the line."""
    require_cross_attention(model, "--model: AER")
    if not len(sources) == len(targets) == len(gold):
        raise AtencionError(f"{len(sources)} lines in {names[0]}, {len(targets)} in {names[1]} and {len(gold)} "
                            f"in {names[2]}: the files must be aligned line by line")
    n = len(sources) if max_sentences <= 0 else min(max_sentences, len(sources))
    links = [_gold_links(tokenizer, sources[k], targets[k], gold[k], k + 1, names, max_tokens) for k in range(n)]
    n_layers, n_heads = (1, 1) if model.cfg.arch == "rnn" else (model.cfg.decoder_layers, model.cfg.n_heads)
    layer_links: list[list[set[Link]]] = [[] for _ in range(n_layers)]
    head_links = [[[] for _ in range(n_heads)] for _ in range(n_layers)]
    mean_links, sure, possible = [], [], []
    for k in range(n):
        attention = capture_attention(model, tokenizer, sources[k], targets[k], shift)
        cross = attention.cross.to_words()
        shape = (len(_real(cross.cols)), len(_real(cross.rows)))
        expected = (len(sources[k].split()), len(targets[k].split()))
        if shape != expected:
            raise AtencionError(f"{names[0]} line {k + 1}: the pieces make {shape[0]} source and {shape[1]} "
                                f"target words, the text has {expected[0]} and {expected[1]}")
        s, p = links[k]
        sure.append(s)
        possible.append(p)
        mean_links.append(word_alignment(cross))
        for layer in range(n_layers):
            layer_links[layer].append(word_alignment(cross, layer))
            for head in range(n_heads):
                head_links[layer][head].append(word_alignment(cross, layer, head))
    log.info("aligned %d sentences", n)

    def aer(links):
        return round(corpus_alignment_error_rate(links, sure, possible), 4)

    layers = [aer(links) for links in layer_links]
    return {"sentences": n, "shift": shift, "layers": layers, "layers_mean": aer(mean_links),
            "best_layer": int(np.argmin(layers)) + 1,
            "heads": [[aer(links) for links in per_layer] for per_layer in head_links]}


def _gold_links(tokenizer, source: str, target: str, gold: str, line: int, names: tuple[str, str, str],
                max_tokens: int) -> tuple[set[Link], set[Link]]:
    """The sure and possible links of one gold line, its sentence pair checked first: a source that
    is not empty, no more than ``max_tokens`` pieces a side (0: no limit), links within its words."""
    if not source.strip():
        raise AtencionError(f"{names[0]} line {line}: the source sentence is empty")
    for name, text, pieces in ((names[0], source, tokenizer.src_pieces), (names[1], target, tokenizer.tgt_pieces)):
        if max_tokens and len(pieces(text)) > max_tokens:
            raise AtencionError(f"{name} line {line}: {len(pieces(text))} subword pieces, more than the "
                                f"limit of {max_tokens} (--max-tokens)")
    s, p = parse_pharaoh(gold, f"{names[2]} line {line}")
    words = (len(source.split()), len(target.split()))
    outside = sorted(link for link in p if link[0] >= words[0] or link[1] >= words[1])
    if outside:
        i, j = outside[0]
        raise AtencionError(f"{names[2]} line {line}: link {i}-{j} points past the sentence pair, which has "
                            f"{words[0]} source and {words[1]} target words (positions from 0)")
    return s, p


def format_aer_table(result: dict) -> str:
    """A markdown table of ``evaluate_alignment``'s result: one row per layer, then the mean."""
    lines = [f"AER of cross-attention alignments ({result['sentences']} sentences, row shift "
             f"'{result['shift']}'; lower is better)", "",
             "| layer | AER (heads averaged) | best head | its AER |", "|---|---|---|---|"]
    for layer, (value, heads) in enumerate(zip(result["layers"], result["heads"]), start=1):
        best = int(np.argmin(heads))
        lines.append(f"| {layer} | {value:.4f} | {best + 1} | {heads[best]:.4f} |")
    lines.append(f"| all layers averaged | {result['layers_mean']:.4f} | | |")
    return "\n".join(lines)


# attention over inputs: images and recordings ----------------------------------------------------

def attention_rollout(weights: np.ndarray) -> np.ndarray:
    """Attention rollout (Abnar and Zuidema 2020, "Quantifying Attention Flow in Transformers",
    §3): the attention of an encoder's output positions to its inputs through every layer. Per
    layer the head average A of ``weights`` (layers, heads, n, n), plus the identity for the
    residual connection, rows renormalised, A' = (A + I) / rowsum (= 0.5 A + 0.5 I when A's rows
    sum to 1); then Ã(l) = A'(l) · Ã(l−1) from the first layer, Ã(1) = A'(1). Returns (n, n):
    row i, how much output position i draws on each input position (one example: no padding)."""
    if weights.ndim != 4 or weights.shape[2] != weights.shape[3]:
        raise AtencionError(f"attention rollout takes self-attention weights (layers, heads, n, n), got shape "
                            f"{weights.shape}")
    identity = np.eye(weights.shape[-1])
    rollout = identity
    for layer in weights.astype(np.float64):
        mixed = layer.mean(axis=0) + identity
        mixed = mixed / np.maximum(mixed.sum(axis=-1, keepdims=True), 1e-30)
        rollout = mixed @ rollout
    return rollout


@dataclass(frozen=True)
class InputAttention:
    """The attention of a model that reads an image or a recording, as one forward pass computed it.

    ``kind``: "patches" (a ViT), "spectrogram" (a speech classifier) or "transcribe" (speech to
    text). ``features``: what was read, (channels, height, width) or (n_mels, frames). ``encoder``:
    the encoder's self-attention (layers, heads, n, n), its positions labelled [CLS] and p1 … pN
    (patches, row-major over ``grid``) or e1 … eN (encoder positions, each two log-mel frames
    after the stride-2 convolution). ``rollout``: ``attention_rollout`` of it. ``cross``: a
    speech-to-text model's cross-attention map, rows the transcript's characters and </s>
    ("predict" shift: row j predicts character j), columns the encoder positions; ``text`` the
    transcript (greedy)."""

    kind: str
    features: np.ndarray
    encoder: AttentionMap
    rollout: np.ndarray
    grid: tuple[int, int] | None = None
    cross: AttentionMap | None = None
    text: str = ""
    pooling: str = "first"

    def pooled(self, weights: np.ndarray) -> np.ndarray:
        """What the classification head reads, as a distribution over the positions: the [CLS]
        row of ``weights`` (n, n) for "first" pooling, the last row for "last", the mean of its rows
        for "mean" pooling."""
        return weights.mean(axis=0) if self.pooling == "mean" else weights[0 if self.pooling == "first" else -1]

    def last_layer(self) -> np.ndarray:
        """The pooled last-layer attention per head, (heads, n)."""
        return np.stack([self.pooled(head) for head in self.encoder.weights[-1]])

    def to_json(self) -> dict:
        """The numbers: the positions' labels, the pooled last-layer attention per head and its
        mean, the pooled rollout, the patch grid (a ViT); a speech-to-text model's transcript and
        cross-attention (every layer and head, and the last layer's head mean). Rounded to 5 places."""
        def listed(array: np.ndarray) -> list:
            return np.round(array, 5).tolist()

        heads = self.last_layer()
        data = {"kind": self.kind, "pooling": self.pooling, "positions": self.encoder.cols,
                "last_layer": listed(heads), "last_layer_mean": listed(heads.mean(axis=0)),
                "rollout": listed(self.pooled(self.rollout))}
        if self.grid is not None:
            data["grid"] = list(self.grid)
        if self.cross is not None:
            data.update(text=self.text, cross={"rows": self.cross.rows, "cols": self.cross.cols,
                                               "weights": listed(self.cross.weights)},
                        cross_last_layer_mean=listed(self.cross.mean(self.cross.weights.shape[0] - 1)))
        return data


def capture_input_attention(model, tokenizer, example: torch.Tensor) -> InputAttention:
    """Run ``model`` (eval mode, no gradients) on one ``example`` its input kind read (an image,
    or a recording's log-mel frames) and keep its encoder's attention and rollout; a speech-to-text
    model first transcribes it (greedy), then is teacher-forced on its own transcript for the
    cross-attention. A model that reads tokens is refused."""
    from ..nn.inputs import input_kind

    cfg = model.cfg
    kind = input_kind(cfg)
    if kind.tokens:
        raise AtencionError("--image and --audio are for a model that reads images (inputs kind patches) or "
                            "recordings (inputs kind spectrogram); this model reads tokens: give it --text")
    device = next(model.parameters()).device
    batch, lengths = kind.collate([example])
    batch = batch.to(device)
    lengths = None if lengths is None else lengths.to(device)
    model.eval()
    cross = None
    text = ""
    with torch.no_grad():
        if cfg.arch in TWO_STACKS:
            from ..tasks.transcribe import transcribe_inputs

            best = transcribe_inputs(model, tokenizer, [example], DecodeConfig(beam=1))[0][0]
            text = best.text
            tgt = torch.tensor([[cfg.bos_id] + list(best.tokens)], device=device)
            _, attn = model(batch, tgt, return_attention=True, lengths=lengths)
            rows = [tokenizer.tgt.id_to_piece(i) for i in best.tokens] + [EOS]
        else:
            _, attn = model(batch, return_attention=True, lengths=lengths)
    weights = torch.stack(attn["encoder"])[:, 0].float().cpu().numpy()
    n = weights.shape[-1]
    grid = None
    if kind.name == "patches":
        patch, (height, width) = cfg.inputs["patch"], cfg.inputs["size"]
        grid = (height // patch, width // patch)
        labels = ["[CLS]"] + [f"p{i + 1}" for i in range(n - 1)]
    else:
        labels = [f"e{i + 1}" for i in range(n)]
    if cfg.arch in TWO_STACKS:
        cross = AttentionMap("cross", torch.stack(attn["cross"])[:, 0].float().cpu().numpy(), rows, labels)
        mode = "transcribe"
    else:
        mode = kind.name
    return InputAttention(mode, example.float().cpu().numpy(), AttentionMap("encoder", weights, labels, labels),
                          attention_rollout(weights), grid, cross, text, getattr(cfg, "pooling", "first") or "first")
