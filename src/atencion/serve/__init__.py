"""`atencion serve`: an HTTP API with dynamic batching and limits, and the attention explorer page."""
