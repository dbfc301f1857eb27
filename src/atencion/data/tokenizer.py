"""Subwords with SentencePiece (BPE or unigram), trained on the training data, stored beside the model.

Ids 0–3 are reserved to match ModelConfig: pad 0, unk 1, bos 2, eos 3.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Iterable

from ..errors import AtencionError, MissingFileError
from ..fileio import atomic_write_bytes, json_line, read_json

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
JOINT_FILE, SRC_FILE, TGT_FILE, INFO_FILE = "spm.model", "spm.src.model", "spm.tgt.model", "tokenizer.json"


def _train_one(sentences: Iterable[str], vocab_size: int, model_type: str, character_coverage: float,
               seed_sentencepiece_size: int = 1_000_000):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, character_coverage=character_coverage,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        hard_vocab_limit=False, input_sentence_size=2_000_000, shuffle_input_sentence=True,
        seed_sentencepiece_size=seed_sentencepiece_size, minloglevel=2, num_threads=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


class Tokenizer:
    """Source and target subword models (one shared model when the vocabulary is joint)."""

    def __init__(self, src_model, tgt_model=None):
        self.src = src_model
        self.tgt = tgt_model if tgt_model is not None else src_model

    @property
    def joint(self) -> bool:
        return self.src is self.tgt

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_piece_size()

    @classmethod
    def train(cls, pairs: list[tuple[str, str]], vocab_size: int = 8000, model_type: str = "bpe",
              joint: bool = True, character_coverage: float = 1.0) -> "Tokenizer":
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
        files = {JOINT_FILE: self.src} if self.joint else {SRC_FILE: self.src, TGT_FILE: self.tgt}
        for name, model in files.items():
            atomic_write_bytes(directory / name, model.serialized_model_proto())
        info = {"joint": self.joint, "src_vocab_size": self.src_vocab_size,
                "tgt_vocab_size": self.tgt_vocab_size, "files": sorted(files)}
        atomic_write_bytes(directory / INFO_FILE, (json.dumps(info, indent=2) + "\n").encode())

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        import sentencepiece as spm

        directory = Path(directory)
        info = read_json(directory / INFO_FILE, "tokenizer description")
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
        return cls(*models)

