"""The Transformer's building blocks, one paper section per file. Every architecture module
is imported here, so that model_dir.ARCHS (filled by @register_arch) knows them all."""

from ..interrupt import remembering_ctrl_c

with remembering_ctrl_c(defer=True):  # torch loads here: a Ctrl-C is raised once it has (interrupt.py)
    from .attention import MultiHeadAttention, causal_mask, scaled_dot_product_attention
    from .cache import BeamKVCache, DecoderState, KVCache, Packing
    from .dropout import Dropout, fast_dropout
    from .layers import Block, FeedForward, Residual
    from .positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, TokenEmbedding, sinusoidal_table
    from .rnn import RNNSeq2Seq
    from .transformer import ClassificationHead, Decoder, Encoder, Generator, MaskedLMHead, Transformer

__all__ = [
    "BeamKVCache", "KVCache", "MultiHeadAttention", "Packing", "scaled_dot_product_attention",
    "Dropout", "fast_dropout",
    "Block", "FeedForward", "Residual",
    "LearnedPositionalEmbedding", "SinusoidalPositionalEncoding", "TokenEmbedding", "sinusoidal_table",
    "ClassificationHead", "Decoder", "DecoderState", "Encoder", "Generator", "MaskedLMHead", "Transformer",
    "causal_mask", "RNNSeq2Seq",
]
