"""The tokenizers of Hugging Face model directories, run by the libraries that wrote them, so that
the ids are the ones the model was trained on:

- ``tokenizer.json`` through the `tokenizers` library, the code transformers' fast tokenizers
  run (``TokenizersVocab``);
- Marian's ``source.spm`` / ``target.spm`` through SentencePiece, their pieces numbered by
  ``vocab.json`` (and ``target_vocab.json`` when the vocabularies are separate), as
  transformers' MarianTokenizer does (``MarianVocab``).

Each answers the part of SentencePiece's interface that data/tokenizer.py's ``Tokenizer`` uses,
and also ``sentence`` (a sentence as the model reads it: the post-processor's [CLS] … [SEP],
Llama's <s> …, Marian's … </s>) and ``specials``: the special ids, read from
tokenizer_config.json, special_tokens_map.json, generation_config.json and config.json, in that
order. The files are kept as read and written back unchanged (``save``), so that a converted
directory (`atencion import`) tokenizes exactly as the original.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AtencionError, MissingFileError
from ..fileio import atomic_write_bytes, read_json
from ..fileio import shown_json as _shown

HF_TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, GENERATION_CONFIG = ("tokenizer_config.json", "special_tokens_map.json",
                                                           "generation_config.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MARIAN_FILES = ("source.spm", "target.spm", "vocab.json")
TARGET_VOCAB = "target_vocab.json"
# copied with the tokenizer when present: what its special ids and chat template are read from
SIDE_FILES = (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, GENERATION_CONFIG, CHAT_TEMPLATE_FILE)
ROLES = ("pad", "unk", "bos", "eos", "mask", "cls", "sep")


@dataclass(frozen=True)
class SpecialIds:
    """The ids of a vocabulary's special tokens (None: it has none) and those that end a
    generation (``stop``: Hugging Face's ``eos_token_id``, one or several)."""

    pad: int | None = 0
    unk: int | None = 1
    bos: int | None = 2
    eos: int | None = 3
    mask: int | None = None
    stop: tuple[int, ...] = field(default=())


def is_hf_tokenizer(info: dict) -> bool:
    """Whether a parsed tokenizer.json is the `tokenizers` library's (not atencion's description)."""
    return isinstance(info, dict) and "model" in info and "added_tokens" in info


def _object(path: Path, what: str) -> dict:
    """The JSON object in ``path``; anything else is refused naming the file."""
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise AtencionError(f"{path}: holds {type(data).__name__}; expected a JSON object ({what})")
    return data


def _token(path: Path, key: str, value) -> str | None:
    """A special token as a tokenizer config writes it: a string, an AddedToken's {"content":
    ...}, or null."""
    content = value.get("content") if isinstance(value, dict) else value
    if value is not None and not isinstance(content, str):
        raise AtencionError(f"{path}: {key} is {_shown(value)}; expected a token (a string or "
                            f'{{"content": "…"}}), or null')
    return content


def _ids(path: Path, key: str, value) -> tuple[int, ...]:
    """The token ids of ``key``: a whole number ≥ 0, a list of them, or null (none)."""
    values = value if isinstance(value, list) else [value]
    if value is None:
        return ()
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise AtencionError(f"{path}: {key} is {_shown(value)}; expected a token id (a whole number ≥ 0), a list "
                            f"of them, or null")
    return tuple(values)


def _special_tokens(directory: Path) -> dict[str, str]:
    """Each role's special token as tokenizer_config.json, else special_tokens_map.json, names it."""
    tokens: dict[str, str] = {}
    for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
        if (directory / name).is_file():
            config = _object(directory / name, "tokenizer configuration")
            for role in ROLES:
                token = _token(directory / name, f"{role}_token", config.get(f"{role}_token"))
                if token is not None:
                    tokens.setdefault(role, token)
    return tokens


def _special_token_ids(directory: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The pad/bos/eos ids generation_config.json, else config.json, gives, and the "file: key" of each."""
    ids: dict[str, tuple[int, ...]] = {}
    source: dict[str, str] = {}  # role → "file: key" its ids came from
    for name in (GENERATION_CONFIG, "config.json"):
        if (directory / name).is_file():
            config = _object(directory / name, "configuration")
            for role in ("pad", "bos", "eos"):
                key = f"{role}_token_id"
                found = _ids(directory / name, key, config.get(key))
                if found and role not in ids:
                    ids[role], source[role] = found, f"{directory / name}: {key}"
    return ids, source


def read_specials(directory: Path, token_to_id, vocab_size: int) -> SpecialIds:
    """The special ids of the tokenizer in ``directory``: each role's token named by
    tokenizer_config.json or special_tokens_map.json (then its id by ``token_to_id``), else the
    id generation_config.json or config.json gives; BERT's [CLS]/[SEP] stand for <s>/</s>. A
    value of the wrong kind, or an id taken as a special token outside the vocabulary
    (``vocab_size``), is refused naming the file and key; EOS ids past it may stay among the ids
    that end a text (``stop``), which the model never produces (as transformers takes them)."""
    tokens = _special_tokens(directory)
    ids, source = _special_token_ids(directory)

    def find(role: str) -> int | None:
        token = tokens.get(role)
        if token is not None and token_to_id(token) is not None:
            return token_to_id(token)
        if role in ids and ids[role][0] >= vocab_size:
            raise AtencionError(f"{source[role]} is {ids[role][0]}, outside the vocabulary of {vocab_size} tokens "
                                f"(and no {role}_token names a token of it)")
        return ids[role][0] if role in ids else None

    bos, eos, pad = find("bos"), find("eos"), find("pad")
    bos = find("cls") if bos is None else bos
    eos = find("sep") if eos is None else eos
    stop = ids.get("eos") or ((eos,) if eos is not None else ())
    pad = eos if pad is None else pad  # GPT-2 has none: pad with </s>, as interop's configs do
    return SpecialIds(pad=pad, unk=find("unk"), bos=bos, eos=eos, mask=find("mask"), stop=stop)


def read_chat_template(directory: Path) -> tuple[str, Path] | None:
    """The chat template of the tokenizer in ``directory`` and the file it is in
    (chat_template.jinja, or the "chat_template" of tokenizer_config.json: a string, or named
    templates of which "default"), or None."""
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        path = directory / CHAT_TEMPLATE_FILE
        try:
            return path.read_text(encoding="utf-8"), path
        except UnicodeDecodeError:
            raise AtencionError(f"{path}: not UTF-8 text; expected a jinja2 chat template") from None
    path = directory / TOKENIZER_CONFIG
    if not path.is_file():
        return None
    template = _object(path, "tokenizer configuration").get("chat_template")
    if isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str) and
                                          isinstance(t.get("template"), str) for t in template):
        template = {t["name"]: t["template"] for t in template}.get("default")
    elif template is not None and not isinstance(template, str):
        raise AtencionError(f"{path}: chat_template is {_shown(template)}; expected a jinja2 template (a string), "
                            f'a list of {{"name": …, "template": …}}, or null')
    return (template, path) if template is not None else None


def _side_files(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in SIDE_FILES if (directory / name).is_file()}


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class ForeignVocab:
    """What the two vocabularies of this module share: their files, kept to be written back,
    their special ids and their chat template."""

    kind = ""

    def __init__(self, directory: Path, files: dict[str, bytes], specials: SpecialIds):
        self.directory, self.files, self.specials = directory, files, specials
        path = directory / TOKENIZER_CONFIG
        clean_up = _object(path, "tokenizer configuration").get("clean_up_tokenization_spaces") \
            if TOKENIZER_CONFIG in files else None
        if clean_up is not None and not isinstance(clean_up, bool):
            raise AtencionError(f"{path}: clean_up_tokenization_spaces is {_shown(clean_up)}; expected true, false "
                                f"or null")
        self.clean_up = bool(clean_up)
        self.chat_template, self.chat_template_file = read_chat_template(directory) or (None, None)

    def save(self, directory: Path) -> None:
        for name, data in self.files.items():
            atomic_write_bytes(directory / name, data)

    def special_tokens(self) -> dict[str, str]:
        """Each role's token as text (bos_token, eos_token, ...), as a chat template reads them."""
        roles = {"pad": self.specials.pad, "unk": self.specials.unk, "bos": self.specials.bos,
                 "eos": self.specials.eos, "mask": self.specials.mask}
        return {f"{role}_token": self.id_to_piece(i) for role, i in roles.items() if i is not None}

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """``messages`` through the chat template with the prompt of the assistant's turn, by
        transformers' own renderer (sandboxed jinja2, as ``apply_chat_template``). A template
        that does not render (a syntax error, an unknown filter, its own ``raise_exception``) is
        refused in one line naming its file and jinja's message."""
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.chat_template,
                                                add_generation_prompt=True, **self.special_tokens())
        except Exception as err:  # the template is the directory's own code: whatever it raises is its fault
            lines = str(err).strip().splitlines()
            reason = f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__
            line = getattr(err, "lineno", None)
            where = f"{self.chat_template_file}" + (f" (template line {line})" if line else "")
            raise AtencionError(f"{where}: the chat template does not render ({reason})") from None
        return rendered[0]

    def id_to_piece(self, i: int) -> str:
        raise NotImplementedError

    def special_ids(self) -> set[int]:
        s = self.specials
        return {i for i in (s.pad, s.unk, s.bos, s.eos, s.mask, *s.stop) if i is not None}


class TokenizersVocab(ForeignVocab):
    """A ``tokenizer.json`` run by the `tokenizers` library."""

    kind = "huggingface"

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer as Backend

        path = directory / HF_TOKENIZER_FILE
        try:
            self.backend = Backend.from_file(str(path))
        except Exception as err:  # tokenizers raises its own Exception for a file it cannot read
            raise AtencionError(f"{path}: not a readable tokenizers file ({err})") from None
        files = {HF_TOKENIZER_FILE: path.read_bytes(), **_side_files(directory)}
        super().__init__(directory, files, read_specials(directory, self.backend.token_to_id,
                                                         self.backend.get_vocab_size(with_added_tokens=True)))
        model = json.loads(files[HF_TOKENIZER_FILE]).get("model", {})
        # WordPiece's mark of a piece that goes on with a word ("##"); None for other models
        self.continues = (model.get("continuing_subword_prefix") or "##") if model.get("type") == "WordPiece" else None

    def get_piece_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def special_ids(self) -> set[int]:
        added = self.backend.get_added_tokens_decoder()
        return super().special_ids() | {i for i, token in added.items() if token.special}

    def encode(self, text: str, out_type=int) -> list:
        """The pieces of ``text`` without special tokens."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        return encoding.tokens if out_type is str else encoding.ids

    def sentence(self, text: str) -> list[int]:
        """``text`` as the model reads it: with the special tokens the post-processor adds."""
        return self.backend.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        text = self.backend.decode(ids, skip_special_tokens=True)
        return _clean_up(text) if self.clean_up else text

    def id_to_piece(self, i: int) -> str:
        return self.backend.id_to_token(i) or ""

    def label(self, i: int) -> str:
        """Token ``i`` spelt as SentencePiece spells its pieces, with "▁" where a word starts (viz
        groups pieces into words by it): WordPiece's "##" goes on with a word and its other pieces
        start one, byte-level BPE's "Ġ" is the space before a word. Special tokens as they are."""
        piece = self.id_to_piece(i)
        if i in self.special_ids():
            return piece
        if self.continues is not None:
            return piece[len(self.continues):] if piece.startswith(self.continues) else "▁" + piece
        return "▁" + piece[1:] if piece.startswith("Ġ") else piece

    def piece_to_id(self, piece: str) -> int:
        i = self.backend.token_to_id(piece)
        return i if i is not None else (self.specials.unk if self.specials.unk is not None else 0)


class MarianVocab(ForeignVocab):
    """One side of a Marian directory: a SentencePiece model cutting text into pieces, numbered
    by the directory's vocabulary; a language code ``>>xx<<`` at the start is a piece of its own
    (MarianTokenizer's ``_tokenize``). Text is decoded by the source model unless the
    vocabularies are separate (MarianTokenizer's ``_decode``)."""

    kind = "marian"

    def __init__(self, directory: Path, spm_file: str, vocab_file: str, decode_file: str):
        import sentencepiece as spm

        self.spm = self._load(spm, directory / spm_file)
        self.decoder = self._load(spm, directory / decode_file)
        vocab = read_json(directory / vocab_file, "Marian vocabulary")
        if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
            raise AtencionError(f"{directory / vocab_file}: must map each piece to its id")
        self.ids, self.pieces = vocab, {i: piece for piece, i in vocab.items()}
        names = [*MARIAN_FILES, *([TARGET_VOCAB] if (directory / TARGET_VOCAB).is_file() else [])]
        files = {name: (directory / name).read_bytes() for name in names}
        super().__init__(directory, {**files, **_side_files(directory)},
                         read_specials(directory, vocab.get, max(vocab.values(), default=-1) + 1))
        if self.specials.unk is None:
            raise AtencionError(f"{directory / vocab_file}: has no <unk>, which MarianTokenizer requires")

    @staticmethod
    def _load(spm, path: Path):
        if not path.is_file():
            raise MissingFileError(f"{path}: SentencePiece model not found")
        try:
            return spm.SentencePieceProcessor(model_proto=path.read_bytes())
        except Exception as err:  # sentencepiece raises RuntimeError/OSError on bad protos
            raise AtencionError(f"{path}: not a readable SentencePiece model ({err})") from None

    def get_piece_size(self) -> int:
        return len(self.ids)

    def encode(self, text: str, out_type=int) -> list:
        code: list[str] = []
        end = text.find("<<")
        if text.startswith(">>") and end != -1:
            code, text = [text[: end + 2]], text[end + 2:]
        pieces = code + self.spm.encode(text, out_type=str)
        return pieces if out_type is str else [self.ids.get(p, self.specials.unk) for p in pieces]

    def sentence(self, text: str) -> list[int]:
        return [*self.encode(text), self.specials.eos]

    def decode(self, ids: list[int]) -> str:
        special = {i for i in (self.specials.pad, self.specials.eos, self.specials.unk) if i is not None}
        pieces = [self.pieces[i] for i in ids if i in self.pieces and i not in special]
        text = self.decoder.decode_pieces(pieces).replace("▁", " ").strip()
        return _clean_up(text) if self.clean_up else text

    def id_to_piece(self, i: int) -> str:
        return self.pieces.get(i, "")

    def label(self, i: int) -> str:
        """Token ``i`` as viz shows it: its SentencePiece piece ("▁" starts a word)."""
        return self.id_to_piece(i)

    def piece_to_id(self, piece: str) -> int:
        return self.ids.get(piece, self.specials.unk)


def read_foreign(directory: Path) -> tuple[ForeignVocab, ForeignVocab] | None:
    """The (source, target) vocabularies of a Hugging Face tokenizer in ``directory`` (the same
    object twice when there is one), or None when the directory holds atencion's own
    tokenizer. A Marian directory is told by its SentencePiece models or vocab.json."""
    if any((directory / name).is_file() for name in MARIAN_FILES):
        for name in MARIAN_FILES:
            if not (directory / name).is_file():
                raise MissingFileError(f"{directory / name}: not found (a Marian tokenizer needs "
                                       f"{', '.join(MARIAN_FILES)})")
        separate = (directory / TARGET_VOCAB).is_file()
        source = MarianVocab(directory, "source.spm", "vocab.json", "target.spm" if separate else "source.spm")
        target = MarianVocab(directory, "target.spm", TARGET_VOCAB if separate else "vocab.json",
                             "target.spm" if separate else "source.spm")
        return source, target
    path = directory / HF_TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None  # atencion's reader names what is wrong with it
    if not is_hf_tokenizer(info):
        return None
    vocab = TokenizersVocab(directory)
    return vocab, vocab
