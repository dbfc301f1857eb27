"""Decoding: greedy and beam search with the length penalty (§6.1 of the paper)."""

from .search import Hypothesis, beam_search, greedy_search, length_penalty
from .settings import DecodeConfig

__all__ = ["DecodeConfig", "Hypothesis", "beam_search", "greedy_search", "length_penalty"]
