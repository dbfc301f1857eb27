"""Text → subwords → batches: parallel corpora, SentencePiece, token-based batching."""
