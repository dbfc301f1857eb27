"""The Transformer's building blocks, one paper section per file."""

from .attention import KVCache, MultiHeadAttention, scaled_dot_product_attention
from .layers import DecoderLayer, EncoderLayer, FeedForward, Residual
from .positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, TokenEmbedding, sinusoidal_table
from .transformer import Decoder, DecoderState, Encoder, Generator, Transformer, causal_mask

__all__ = [
    "KVCache", "MultiHeadAttention", "scaled_dot_product_attention",
    "DecoderLayer", "EncoderLayer", "FeedForward", "Residual",
    "LearnedPositionalEmbedding", "SinusoidalPositionalEncoding", "TokenEmbedding", "sinusoidal_table",
    "Decoder", "DecoderState", "Encoder", "Generator", "Transformer", "causal_mask",
]
