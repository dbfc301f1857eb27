"""Inspecting attention: capture every weight, aggregate pieces into words, align, plot, write HTML."""

from .attention import (
    CAUTION,
    Attention,
    AttentionMap,
    SelfAttention,
    alignment_error_rate,
    capture_attention,
    capture_self_attention,
    corpus_alignment_error_rate,
    word_alignment,
)

__all__ = ["CAUTION", "Attention", "AttentionMap", "SelfAttention", "alignment_error_rate", "capture_attention",
           "capture_self_attention", "corpus_alignment_error_rate", "word_alignment"]
