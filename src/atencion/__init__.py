"""atencion: the Transformer of "Attention Is All You Need" and its family (BERT, GPT, T5), to
train, decode, score, serve and inspect."""

from .config import ModelConfig
from .nn.transformer import Transformer

__all__ = ["ModelConfig", "Transformer", "load"]
__version__ = "0.1.0"


def load(directory, map_location="cpu") -> Transformer:
    """The model saved in ``directory`` (config.json + model.safetensors), whatever its ``arch``:
    an encoder-decoder, an encoder (BERT-style) or a decoder (GPT-style)."""
    return Transformer.load(directory, map_location)
