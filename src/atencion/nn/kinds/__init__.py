"""Attention kinds beside eq. (1) (``model.attention: {kind: ...}``): exact attention computed in
tiles (FlashAttention), local and sparse patterns (a sliding window, Longformer, BigBird), and
low-rank and kernel approximations (Linformer, Performer)."""
