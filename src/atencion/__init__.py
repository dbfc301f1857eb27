"""atencion: the Transformer of "Attention Is All You Need", to train, decode, score and inspect."""

from .config import ModelConfig
from .nn.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]
__version__ = "0.1.0"
