"""Generation past any length: a decoding step of a kind whose cache keeps a bounded number of keys
(a sliding window, the causal Performer) builds positions for those keys only, not for the whole
text, and still gives the logits of the full pass far past the first window."""

from __future__ import annotations

import pytest
import torch

import atencion.nn.transformer as transformer
from conftest import small_model


@pytest.mark.parametrize("attention, positional, most_keys", [
    ({"kind": "window", "window": 4}, "rope", 4),       # the last window − 1 keys and the new one
    ({"kind": "window", "window": 4}, "alibi", 4),      # ALiBi's bias reads the key positions themselves
    ({"kind": "performer", "features": 64}, "rope", 1),  # running sums: no key kept
    ({"kind": "full"}, "alibi", 60),                     # eq. (1) keeps every key: positions for all of them
    ({"kind": "full"}, "rope", 0),                       # RoPE turns the new token only: no positions built
])
def test_a_decoding_step_builds_positions_for_the_keys_its_cache_holds_and_gives_the_full_pass(
        monkeypatch, attention, positional, most_keys):
    model = small_model(arch="decoder", n_layers=1, dropout=0.0, attention=attention, positional=positional)
    ids = torch.randint(4, model.cfg.vocab_size, (1, 60), generator=torch.Generator().manual_seed(0))
    key_positions = []

    def recording(relative, offset, length, q_pos, k_pos, causal):
        key_positions.append([] if k_pos is None else k_pos.tolist())
        return relative_terms(relative, offset, length, q_pos, k_pos, causal)

    relative_terms = transformer._relative_terms
    monkeypatch.setattr(transformer, "_relative_terms", recording)
    state = model.init_state()
    steps = torch.cat([model.decode_step(ids[:, t:t + 1], state) for t in range(60)], 1)
    assert max(len(k) for k in key_positions) == most_keys
    assert key_positions[-1] == list(range(60 - most_keys, 60))  # the positions of the last keys, in order
    monkeypatch.setattr(transformer, "_relative_terms", relative_terms)
    full = model(ids)
    assert torch.allclose(steps, full, atol=1e-5), (steps - full).abs().max()
