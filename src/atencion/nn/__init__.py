"""The Transformer's building blocks, one paper section per file."""

from .attention import BeamKVCache, KVCache, MultiHeadAttention, Packing, scaled_dot_product_attention
from .dropout import Dropout, fast_dropout
from .layers import DecoderLayer, EncoderLayer, FeedForward, Residual
from .positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, TokenEmbedding, sinusoidal_table
from .transformer import Decoder, DecoderState, Encoder, Generator, Transformer, causal_mask

__all__ = [
    "BeamKVCache", "KVCache", "MultiHeadAttention", "Packing", "scaled_dot_product_attention", "Dropout", "fast_dropout",
    "DecoderLayer", "EncoderLayer", "FeedForward", "Residual",
    "LearnedPositionalEmbedding", "SinusoidalPositionalEncoding", "TokenEmbedding", "sinusoidal_table",
    "Decoder", "DecoderState", "Encoder", "Generator", "Transformer", "causal_mask",
]
