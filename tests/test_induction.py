"""The induction-head detector (viz/induction.py) finds the heads of a two-layer attention-only
model whose weights are set by hand to be a previous-token head and an induction head, scores
the others low, and scores a random model low; the in-context learning score is the loss of
token 500 minus that of token 50."""

import math

import numpy as np
import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.errors import AtencionError
from atencion.viz.induction import icl_score, induction_scores, loss_by_position, repeated_tokens

V, L, H = 20, 32, 2             # vocabulary, positions, heads per layer
D = 2 * V + L                   # the residual stream: [token | previous token | position]
TOKEN, PREVIOUS, POSITION = 0, V, 2 * V
D_K = D // H


def hand_built(copy: bool = True) -> Transformer:
    """Layer 0, head 0 attends from each position to the one before it and writes that token into
    the "previous token" part of the residual; layer 1, head 0 matches the current token against
    that part (so it attends to the token after an earlier occurrence) and copies the attended
    token into the "token" part, which the tied unembedding reads. The other two heads are random
    and small. RMSNorm without gains keeps each part as it is, up to one scale per position."""
    cfg = ModelConfig(vocab_size=V, arch="decoder", n_layers=2, d_model=D, n_heads=H, d_ff=0, dropout=0.0,
                      norm="rmsnorm", norm_first=True, positional="learned", max_positions=L,
                      scale_embedding=False, bias=False)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.05)
        for norm in [model.decoder.final_norm, *(b.res_self.norm for b in model.decoder.layers)]:
            norm.weight.fill_(1.0)
        model.decoder.embed.weight.copy_(torch.eye(V, D))                          # token t → e_t
        model.decoder.positions.weight.copy_(torch.eye(D)[POSITION:POSITION + L])  # position p → e_{2V+p}
        q_rows, k_rows, v_rows = slice(0, D_K), slice(D, D + D_K), slice(2 * D, 2 * D + D_K)   # head 0's
        first, second = model.decoder.layers
        w, w_o = first.self_attn.in_proj.weight, first.self_attn.out_proj.weight
        w[q_rows] = w[k_rows] = w[v_rows] = 0
        w_o[:, :D_K] = 0
        for p in range(L):
            w[q_rows][p, POSITION + p] = 3.0              # query of position p: direction p
            if p + 1 < L:
                w[k_rows][p + 1, POSITION + p] = 3.0      # key of position p: direction p + 1
        for t in range(V):
            w[v_rows][t, TOKEN + t] = 1.0                 # value: the token
            w_o[PREVIOUS + t, t] = 1.0                    # written as "previous token"
        w, w_o = second.self_attn.in_proj.weight, second.self_attn.out_proj.weight
        w[q_rows] = w[k_rows] = w[v_rows] = 0
        w_o[:, :D_K] = 0
        for t in range(V):
            w[q_rows][t, TOKEN + t] = 3.0                 # query: the current token
            w[k_rows][t, PREVIOUS + t] = 3.0              # key: the token before
            w[v_rows][t, TOKEN + t] = 1.0                 # value: the token itself
            w_o[(TOKEN if copy else PREVIOUS) + t, t] = 3.0   # written where the unembedding reads it
    return model


def test_the_hand_built_model_completes_repeated_sequences():
    model = hand_built()
    ids = repeated_tokens(V, 12, rows=4)
    with torch.no_grad():
        predicted = model(ids).argmax(-1)
    # the second copy from its second token on (the first one matches position 0 too: see below)
    assert torch.equal(predicted[:, 13:-1], ids[:, 14:])


def test_the_detector_finds_the_induction_head_and_the_previous_token_head_is_not_one():
    scores = induction_scores(hand_built(), length=12, rows=6)
    assert scores.prefix_matching.shape == scores.copying.shape == (2, H)
    # (position 0 has no token before it: its "previous token" is its own, which the head of the second
    # copy's first query matches as well as the right one, halving that query's share: 11.5 / 12)
    assert scores.prefix_matching[1, 0] > 0.9 and scores.copying[1, 0] > 0.9
    others = [(0, 0), (0, 1), (1, 1)]
    assert all(scores.prefix_matching[h] < 0.2 for h in others)
    assert all(scores.copying[h] < 0.3 for h in others)
    assert scores.induction_heads() == [(1, 0)]
    assert scores.previous_token[0, 0] > 0.99      # the first layer's half of the circuit
    assert all(scores.previous_token[h] < 0.2 for h in [(0, 1), (1, 0), (1, 1)])


def test_a_head_that_matches_prefixes_but_writes_elsewhere_does_not_copy():
    scores = induction_scores(hand_built(copy=False), length=12, rows=6)
    assert scores.prefix_matching[1, 0] > 0.9
    assert scores.copying[1, 0] < 0.1
    assert scores.induction_heads() == []


@pytest.mark.parametrize("seed", [0, 1])
def test_a_random_model_scores_low(seed):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=200, arch="decoder", n_layers=2, d_model=64, n_heads=4, d_ff=0, dropout=0.0,
                      norm_first=True, positional="learned", max_positions=128)
    scores = induction_scores(Transformer(cfg).eval(), length=50, rows=4)
    assert scores.prefix_matching.max() < 0.15 and scores.previous_token.max() < 0.15
    assert scores.copying.max() < 0.2
    assert scores.induction_heads() == []


def test_repeated_tokens_repeat_distinct_regular_tokens():
    ids = repeated_tokens(30, 10, rows=3, seed=5)
    assert ids.shape == (3, 20) and torch.equal(ids[:, :10], ids[:, 10:])
    assert all(len(set(row[:10].tolist())) == 10 for row in ids) and ids.min() >= 4
    with pytest.raises(AtencionError, match="length 27 must be between 1 and the 26 regular tokens"):
        repeated_tokens(30, 27, rows=1)


def test_the_icl_score_is_the_loss_of_token_500_minus_that_of_token_50():
    """A model that has learnt in context (the hand-built one on repeated rows) scores below 0; the
    score is the difference of the two per-position losses, which a plain cross-entropy gives too."""
    model = hand_built()
    ids = repeated_tokens(V, 12, rows=5)
    losses = loss_by_position(model, ids)
    with torch.no_grad():
        logits = model(ids)
    for i in (3, 15):
        expected = torch.nn.functional.cross_entropy(logits[:, i - 1], ids[:, i])
        assert math.isclose(losses[i].item(), expected.item(), rel_tol=1e-5)
    assert torch.isnan(losses[0])
    score = icl_score(model, ids, early=5, late=20)
    assert math.isclose(score, (losses[20] - losses[5]).item(), rel_tol=1e-6)
    assert score < -1.0
    with pytest.raises(AtencionError, match="it needs 0 < 50 < 500 < the text's length"):
        icl_score(model, ids)


def test_the_detector_takes_decoders_only():
    cfg = ModelConfig(vocab_size=40, arch="encoder", n_layers=1, d_model=16, n_heads=2, d_ff=0)
    with pytest.raises(AtencionError, match="decoder-only model"):
        induction_scores(Transformer(cfg), length=5, rows=1)
    assert np.isfinite(induction_scores(hand_built(), length=5, rows=1).copying).all()


def test_the_induction_command_prints_the_scores_of_a_model_directory(tmp_path, capsys):
    import json

    from atencion.data.tokenizer import Tokenizer
    from atencion.nn.model_dir import save_model_dir
    from conftest import run_cli

    tokenizer = Tokenizer.train_text(["abcdefghijklmno\n"], kind="char")   # 4 special ids + 16 characters
    save_model_dir(tmp_path / "model", hand_built(), tokenizer)
    status, out, _ = run_cli(["induction", "--model", str(tmp_path / "model"), "--length", "12", "--rows", "6"],
                             capsys)
    report = json.loads(out)
    assert status == 0 and report["induction_heads"] == [[1, 0]] and report["prefix_matching"][1][0] > 0.9
    (tmp_path / "text.txt").write_text("abc\n" * 200)
    status, _, err = run_cli(["induction", "--model", str(tmp_path / "model"), "--length", "12",
                              "--text", str(tmp_path / "text.txt")],
                             capsys)
    assert status == 2 and "max_positions=32" in err and len(err.strip().splitlines()) == 1


def test_the_attention_endpoint_scores_a_gpts_heads_when_asked():
    from fastapi.testclient import TestClient

    from atencion.data.tokenizer import Tokenizer
    from atencion.serve.app import LoadedModel, create_app

    tokenizer = Tokenizer.train_text(["abcdefghijklmno\n"], kind="char")
    encoder = Transformer(ModelConfig(vocab_size=V, arch="encoder", n_layers=1, d_model=16, n_heads=2, d_ff=0))
    served = [LoadedModel("gpt", "", hand_built(), tokenizer), LoadedModel("bert", "", encoder, tokenizer)]
    with TestClient(create_app(served)) as client:
        plain = client.post("/attention", json={"text": "abcab"}).json()
        scored = client.post("/attention", json={"text": "abcab", "induction": True}).json()
        refused = client.post("/attention", json={"text": "abcab", "model": "bert", "induction": True})
    assert "induction" not in plain and scored["attention"] == plain["attention"]
    # 16 repeated tokens: as many as the vocabulary's regular ones, half the 32 learned positions
    assert scored["induction"]["length"] == 16 and scored["induction"]["induction_heads"] == [[1, 0]]
    assert refused.status_code == 422 and "arch 'encoder'" in refused.json()["error"]
