"""Decoding: greedy and beam search with the length penalty (§6.1 of the paper)."""

from .search import Hypothesis, beam_search, greedy_search, length_penalty

__all__ = ["Hypothesis", "beam_search", "greedy_search", "length_penalty"]
