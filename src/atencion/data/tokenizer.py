"""Subwords with SentencePiece (BPE or unigram) or with subword-nmt's BPE (``SubwordNmtVocab``, the
published translation setups'), characters (``CharVocab``, for nanoGPT-style language models) or
whitespace-separated symbols (``WhitespaceVocab``, for LRA's ListOps), trained on the training data,
stored beside the model; or the tokenizer of a Hugging Face model directory, run by the library that
wrote it (data/hf_tokenizer.py: ``foreign``).

In atencion's own vocabularies ids 0–3 are reserved to match ModelConfig: pad 0, unk 1, bos 2,
eos 3; a vocabulary for masked language modelling also holds ``<mask>``. A Hugging Face
tokenizer has its own (``Tokenizer.specials``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import AtencionError, MissingFileError
from ..fileio import atomic_write_bytes, json_line, read_json
from .hf_tokenizer import SpecialIds, read_foreign

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")
MASK = "<mask>"
JOINT_FILE, SRC_FILE, TGT_FILE, INFO_FILE = "spm.model", "spm.src.model", "spm.tgt.model", "tokenizer.json"


def _train_one(sentences: Iterable[str], vocab_size: int, model_type: str, character_coverage: float,
               seed_sentencepiece_size: int = 1_000_000, symbols: tuple[str, ...] = ()):
    import sentencepiece as spm

    def train() -> bytes:
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, user_defined_symbols=list(symbols),
            hard_vocab_limit=False, input_sentence_size=2_000_000, shuffle_input_sentence=True,
            seed_sentencepiece_size=seed_sentencepiece_size, minloglevel=2, num_threads=2,
        )
        return model.getvalue()

    return spm.SentencePieceProcessor(model_proto=_interruptible(train))


def _interruptible(work: Callable[[], bytes]) -> bytes:
    """``work()``, done by a forked child process while this process waits in short polls, so that
    Ctrl-C stops it at once; its bytes, or its error's message, come back through a pipe (nothing
    is pickled). SentencePiece trains in C++ and returns to Python only when done (minutes on a
    large corpus): called here, it would hold a Ctrl-C until then. A thread would not do either:
    the process could not exit cleanly while SentencePiece's threads run. The child ignores
    SIGINT (a terminal sends it to both) and is killed when this process stops waiting. Where
    there is no fork, or off the main thread (which alone receives signals), it is a plain call.
    The child holds its own copy of the pages it touches (the corpus' strings, whose reference
    counts it changes) until it is done."""
    if not hasattr(os, "fork") or threading.current_thread() is not threading.main_thread():
        return work()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code, never runs its exit handlers
        status = 1
        try:
            os.close(read)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:  # one byte says which: 1 and the bytes work() returned, or 0 and the error's message
                data = b"\x01" + work()
            except BaseException as err:  # noqa: BLE001 - the caller raises it
                data = b"\x00" + (str(err) or type(err).__name__).encode("utf-8", "replace")
            with os.fdopen(write, "wb") as pipe:
                pipe.write(data)
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    chunks, finished = [], False
    try:
        while True:
            ready, _, _ = select.select([read], [], [], 0.1)  # a Ctrl-C is taken between polls
            if ready:
                chunk = os.read(read, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        finished = True
    finally:
        os.close(read)
        if not finished:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    data = b"".join(chunks)
    if not data:
        raise RuntimeError("the SentencePiece trainer's process ended without an answer")
    if data[:1] != b"\x01":
        raise RuntimeError(data[1:].decode("utf-8"))
    return data[1:]


def check_text(text: str, what: str) -> str:
    """``text``, or an AtencionError naming ``what`` when it is not valid Unicode. A command-line
    argument whose bytes are not UTF-8 arrives with each bad byte as a lone surrogate (Python's
    surrogateescape: byte 0xff is U+DCFF), which no tokenizer reads and no UTF-8 file holds. Every
    text argument (``--prompt``, ``--text``, ``--src``, ``--tgt``) is refused so, before any work:
    unlike an input file, whose bad bytes are replaced so that one line still comes out per line in,
    a text argument is one the user can retype."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        where = f"at character {err.start + 1}"
        bad = (f"not valid UTF-8 (byte 0x{code - 0xDC00:02x} {where})" if 0xDC80 <= code <= 0xDCFF
               else f"not valid Unicode (a lone surrogate U+{code:04X} {where})")
        raise AtencionError(f"{what}: {bad}; give the text in UTF-8") from None
    return text


class CharVocab:
    """One token per character (nanoGPT's and char-rnn's Shakespeare models): the special tokens,
    then every character of the training text in code-point order. It answers the part of
    SentencePiece's interface the rest of atencion uses; a character never seen in training is
    ``<unk>``."""

    kind, unit, separator = "char", "character", ""  # the data.tokenizer name; a symbol in messages; decode's glue

    def __init__(self, pieces: list[str]):
        self.pieces = list(pieces)
        self.ids = {piece: i for i, piece in enumerate(self.pieces)}
        # what a text's symbols read as: the special tokens' names are <unk> there, as SentencePiece reads them
        self.lookup = {piece: i for piece, i in self.ids.items() if piece not in SPECIALS}

    @staticmethod
    def split(text: str) -> list[str]:
        """The symbols of ``text``, one token each."""
        return list(text)

    @classmethod
    def train(cls, texts: Iterable[str], symbols: tuple[str, ...] = ()) -> "CharVocab":
        seen: set[str] = set()
        for text in texts:
            seen.update(cls.split(text))
        return cls([*SPECIALS, *symbols, *sorted(seen.difference(SPECIALS, symbols))])

    def get_piece_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, out_type=int) -> list:
        symbols = self.split(text)
        if out_type is str:
            return symbols
        lookup, unk = self.lookup, UNK_ID
        return [lookup.get(symbol, unk) for symbol in symbols]

    def decode(self, ids: list[int]) -> str:
        """The symbols of ``ids``; special tokens are left out."""
        pieces, size = self.pieces, len(self.pieces)
        return self.separator.join(pieces[i] for i in ids if EOS_ID < i < size and pieces[i] != MASK)

    def id_to_piece(self, i: int) -> str:
        return self.pieces[i]

    def piece_to_id(self, piece: str) -> int:
        return self.ids.get(piece, UNK_ID)


class WhitespaceVocab(CharVocab):
    """One token per whitespace-separated symbol (LRA's ListOps: ``[MAX``, ``4``, ``]``, read by
    LRA's whitespace tokenizer): the special tokens, then every symbol of the training text in
    code-point order; a symbol never seen in training is ``<unk>``; ``decode`` joins by spaces."""

    kind, unit, separator = "whitespace", "symbol", " "

    @staticmethod
    def split(text: str) -> list[str]:
        return text.split()


class SubwordNmtVocab(WhitespaceVocab):
    """Byte-pair encoding as subword-nmt learns and applies it (Sennrich et al., 2016), the joint
    vocabulary of the published Transformer setups (``subword-nmt learn-bpe -s MERGES`` on both
    languages' training text, then ``apply-bpe``): each whitespace-separated word is split into
    characters with an end-of-word mark, and the most frequent adjacent pair (seen at least twice)
    is merged, ``merges`` times; text is segmented by replaying the merges in that order, a piece
    that a word continues after ending in ``@@``. The pieces are the special tokens, then every
    piece of the segmented training text in code-point order; a piece never seen (a new character)
    is ``<unk>``. ``decode`` joins the pieces and removes the ``@@ `` marks. Unlike SentencePiece it
    reads whitespace-tokenized text (Multi30k's tok/ files) and keeps no record of spacing."""

    kind, unit, MARK, VERSION = "subword-nmt", "piece", "@@", "#version: 0.2"

    def __init__(self, pieces: list[str], merges: list[str]):
        from subword_nmt.apply_bpe import BPE

        super().__init__(pieces)
        self.merges = list(merges)
        codes = "".join(f"{merge}\n" for merge in self.merges)  # in the format of subword-nmt 0.2's codes files
        self.bpe = BPE(io.StringIO(f"{self.VERSION}\n{codes}"), separator=self.MARK)

    def split(self, text: str) -> list[str]:
        return self.bpe.segment_tokens(text.split())

    @classmethod
    def train(cls, texts: Iterable[str], symbols: tuple[str, ...] = (), merges: int = 10000) -> "SubwordNmtVocab":
        from subword_nmt.learn_bpe import learn_bpe

        texts = list(texts)
        codes = io.StringIO()
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
            learn_bpe(io.StringIO("".join(f"{text}\n" for text in texts)), codes, merges)
        learned = [line for line in codes.getvalue().splitlines() if line != cls.VERSION]
        vocab = cls(list(SPECIALS), learned)
        seen: set[str] = set()
        for text in texts:
            seen.update(vocab.split(text))
        return cls([*SPECIALS, *symbols, *sorted(seen.difference(SPECIALS, symbols))], learned)

    def decode(self, ids: list[int]) -> str:
        text = super().decode(ids).replace(f"{self.MARK} ", "")
        return text[: -len(self.MARK)] if text.endswith(self.MARK) else text


VOCABS = {vocab.kind: vocab for vocab in (CharVocab, WhitespaceVocab, SubwordNmtVocab)}  # data.tokenizer → its class


class Tokenizer:
    """Source and target subword models (one shared model when the vocabulary is joint). A
    single-stack model (GPT, BERT) has one: ``encode``, ``decode``, ``vocab_size``."""

    def __init__(self, src_model, tgt_model=None):
        self.src = src_model
        self.tgt = tgt_model if tgt_model is not None else src_model

    @property
    def foreign(self) -> bool:
        """Whether it is a Hugging Face model directory's tokenizer (data/hf_tokenizer.py)."""
        return hasattr(self.src, "specials")

    @property
    def specials(self) -> SpecialIds:
        """The ids of its special tokens: atencion's 0–3, or those a Hugging Face tokenizer names."""
        return self.src.specials if self.foreign else SpecialIds(mask=self.mask_id)

    @property
    def chat_template(self) -> str | None:
        """A Hugging Face tokenizer's chat template (jinja), if it has one."""
        return self.src.chat_template if self.foreign else None

    @property
    def joint(self) -> bool:
        return self.src is self.tgt

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_piece_size()

    @property
    def kind(self) -> str:
        """The data.tokenizer that made it: "char", "whitespace", "subword-nmt" or "sentencepiece"; or, for a Hugging
        Face tokenizer, "huggingface" (tokenizer.json) or "marian" (SentencePiece and vocab.json)."""
        return getattr(self.src, "kind", "sentencepiece")

    @property
    def vocab_size(self) -> int:
        return self.src_vocab_size

    @property
    def mask_id(self) -> int | None:
        """The id of ``<mask>`` (a Hugging Face tokenizer's mask token: BERT's [MASK]), or None
        when the vocabulary has none."""
        if self.foreign:
            return self.src.specials.mask
        i = self.src.piece_to_id(MASK)
        return i if i != UNK_ID and self.src.id_to_piece(i) == MASK else None

    def encode(self, text: str) -> list[int]:
        return self.src.encode(text)

    @property
    def special_ids(self) -> set[int]:
        """The ids of every special token (never masked, never a random replacement)."""
        if self.foreign:
            return self.src.special_ids()
        return {PAD_ID, UNK_ID, BOS_ID, EOS_ID, *([self.mask_id] if self.mask_id is not None else [])}

    def sentence(self, text: str) -> list[int]:
        """``text`` as a model reads one sentence: ``<s> pieces </s>``, or what a Hugging Face
        tokenizer's post-processor makes of it (BERT's [CLS] … [SEP], GPT-2's pieces alone)."""
        return self.src.sentence(text) if self.foreign else [BOS_ID, *self.src.encode(text), EOS_ID]

    def chat(self, prompt: str) -> list[int]:
        """The ids of ``prompt`` as the user's turn of a chat, through the chat template (its
        text encoded without further special tokens, as ``apply_chat_template`` does)."""
        return self.src.encode(self.src.render_chat([{"role": "user", "content": prompt}]))

    def decode(self, ids: list[int]) -> str:
        return self.src.decode(ids)

    def piece(self, i: int) -> str:
        return self.src.id_to_piece(i)

    @classmethod
    def train_text(cls, texts: list[str], kind: str = "sentencepiece", vocab_size: int = 8000,
                   model_type: str = "bpe", character_coverage: float = 1.0,
                   symbols: tuple[str, ...] = ()) -> "Tokenizer":
        """One vocabulary for a single-stack model, from plain text: characters (``kind`` "char"),
        whitespace-separated symbols ("whitespace"), subword-nmt's BPE pieces ("subword-nmt",
        ``vocab_size`` merges) or SentencePiece pieces; ``symbols`` such as ``<mask>`` get ids of
        their own."""
        if kind == SubwordNmtVocab.kind:
            return cls(SubwordNmtVocab.train(texts, symbols, vocab_size))
        if kind in VOCABS:
            return cls(VOCABS[kind].train(texts, symbols))
        return cls(_train_one(texts, vocab_size, model_type, character_coverage, symbols=symbols))

    @classmethod
    def train(cls, pairs: list[tuple[str, str]], vocab_size: int = 8000, model_type: str = "bpe",
              joint: bool = True, character_coverage: float = 1.0, kind: str = "sentencepiece") -> "Tokenizer":
        """Source and target vocabularies for a translator: SentencePiece's (joint or one a side)
        or subword-nmt's joint BPE (``kind`` "subword-nmt", ``vocab_size`` merges)."""
        if kind == SubwordNmtVocab.kind:
            return cls.train_text([s for pair in pairs for s in pair], kind, vocab_size)
        if model_type not in ("bpe", "unigram"):
            raise AtencionError(f"data.model_type must be 'bpe' or 'unigram', got {model_type!r}")
        if joint:
            sentences = [s for pair in pairs for s in pair]
            return cls(_train_one(sentences, vocab_size, model_type, character_coverage))
        return cls(_train_one([s for s, _ in pairs], vocab_size, model_type, character_coverage),
                   _train_one([t for _, t in pairs], vocab_size, model_type, character_coverage))

    def encode_src(self, text: str) -> list[int]:
        return self.src.encode(text)

    def encode_tgt(self, text: str) -> list[int]:
        return self.tgt.encode(text)

    def decode_tgt(self, ids: list[int]) -> str:
        return self.tgt.decode(ids)

    def src_pieces(self, text: str) -> list[str]:
        return self.src.encode(text, out_type=str)

    def tgt_pieces(self, text: str) -> list[str]:
        return self.tgt.encode(text, out_type=str)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.foreign:  # the Hugging Face files, as they were read
            self.src.save(directory)
            if self.tgt is not self.src:
                self.tgt.save(directory)
            return
        if self.kind in VOCABS:
            info = {"kind": self.kind, "joint": True, "src_vocab_size": self.src_vocab_size,
                    "tgt_vocab_size": self.src_vocab_size, "pieces": self.src.pieces,
                    **({"merges": self.src.merges} if self.kind == SubwordNmtVocab.kind else {})}
            atomic_write_bytes(directory / INFO_FILE, (json.dumps(info, indent=1) + "\n").encode())
            return
        files = {JOINT_FILE: self.src} if self.joint else {SRC_FILE: self.src, TGT_FILE: self.tgt}
        for name, model in files.items():
            atomic_write_bytes(directory / name, model.serialized_model_proto())
        info = {"joint": self.joint, "src_vocab_size": self.src_vocab_size,
                "tgt_vocab_size": self.tgt_vocab_size, "files": sorted(files)}
        atomic_write_bytes(directory / INFO_FILE, (json.dumps(info, indent=2) + "\n").encode())

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        directory = Path(directory)
        foreign = read_foreign(directory)
        if foreign is not None:
            return cls(*foreign) if foreign[0] is not foreign[1] else cls(foreign[0])
        info = read_json(directory / INFO_FILE, "tokenizer description")
        vocab = VOCABS.get(info.get("kind")) if isinstance(info.get("kind"), str) else None
        if vocab is not None:
            return cls(_read_listed_vocab(directory, info, vocab))
        return cls(*_read_sentencepiece(directory, info))


def _read_listed_vocab(directory: Path, info: dict, vocab: type):
    """The ``vocab`` whose pieces (and subword-nmt's merges) tokenizer.json lists."""
    pieces = info.get("pieces")
    if (not isinstance(pieces, list) or list(pieces[: len(SPECIALS)]) != list(SPECIALS)
            or not all(isinstance(p, str) for p in pieces) or len(set(pieces)) != len(pieces)):
        raise AtencionError(f"{directory / INFO_FILE} line {json_line(directory / INFO_FILE, 'pieces')}: "
                            f"'pieces' must list {list(SPECIALS)} and then distinct {vocab.unit}s")
    if vocab is not SubwordNmtVocab:
        return vocab(pieces)
    merges = info.get("merges")
    if not isinstance(merges, list) or not all(isinstance(m, str) and len(m.split(" ")) == 2 for m in merges):
        raise AtencionError(f"{directory / INFO_FILE} line {json_line(directory / INFO_FILE, 'merges')}: "
                            f"'merges' must list subword-nmt's merges, each two pieces and one space")
    return vocab(pieces, merges)


def _read_sentencepiece(directory: Path, info: dict) -> list:
    """The joint SentencePiece model, or the source and target ones, checked against tokenizer.json's sizes."""
    import sentencepiece as spm

    names = [JOINT_FILE] if info.get("joint", True) else [SRC_FILE, TGT_FILE]
    models = []
    for name in names:
        path = directory / name
        if not path.is_file():
            raise MissingFileError(f"{path}: SentencePiece model not found")
        try:
            models.append(spm.SentencePieceProcessor(model_proto=path.read_bytes()))
        except Exception as err:  # sentencepiece raises RuntimeError/OSError on bad protos
            raise AtencionError(f"{path}: not a readable SentencePiece model ({err})") from None
    for name, model, key in zip(names, models, ("src_vocab_size", "tgt_vocab_size")):
        declared = info.get(key, info.get("src_vocab_size")) if len(models) == 1 else info.get(key)
        if declared is not None and declared != model.get_piece_size():
            raise AtencionError(f"{directory / name}: {model.get_piece_size()} pieces, but "
                                f"{directory / INFO_FILE} line {json_line(directory / INFO_FILE, key)} says "
                                f"{key} {declared}; the files come from different runs")
    return models

