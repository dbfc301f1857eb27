"""Speculative decoding (decode/speculative.py, `atencion generate --draft`): a draft's proposals,
verified by the target in one pass and kept by the modified rejection sampling rule, give the
target's own greedy text and, sampled, the target's exact distribution; a cache rolled back
continues as a fresh pass; what cannot roll back, or reads other token ids, is refused in one line."""

from __future__ import annotations

import itertools

import pytest
import torch

from atencion.data.tokenizer import Tokenizer
from atencion.decode.sample import generate_ids, next_probs
from atencion.decode.speculative import speculative_ids
from atencion.errors import AtencionError
from atencion.train.checkpoint import save_checkpoint
from conftest import run_cli as run
from conftest import small_model

PROMPTS = [[5, 9, 13, 7], [21], [30, 4, 4, 17, 8, 11, 2, 39, 16]]


def decoder(seed: int, **overrides):
    """A small random GPT whose greedy text varies (an untied output: a tied one repeats its input)."""
    return small_model(seed, arch="decoder", dropout=0.0, tie_output=False, **overrides)


def near_copy(model, seed: int, noise: float):
    """``model`` with Gaussian noise of scale ``noise`` on every weight: a draft that often agrees."""
    copy = decoder(seed, **{k: getattr(model.cfg, k) for k in ("positional", "max_positions", "n_layers")})
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(noise * torch.randn(p.shape, generator=generator))
    return copy


# greedy: the target's own text ------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("positions", [
    dict(positional="rope"),
    # learned tables shorter than the text: the target alone past its 24 positions, the draft rereads past its 10
    dict(positional="learned", max_positions=24),
])
def test_greedy_speculative_text_is_the_targets_own_greedy_text(k, positions):
    target = decoder(0, **positions)
    drafts = {"another model": decoder(1, n_layers=1, **{**positions, "max_positions": 10}),
              "a near copy": near_copy(target, 2, 0.02)}
    accepted = {}
    for (name, draft), prompt in itertools.product(drafts.items(), PROMPTS):
        ids = torch.tensor([prompt])
        alone = generate_ids(target, ids, 30, temperature=0)
        tokens, stats = speculative_ids(target, draft, ids, 30, k, temperature=0)
        assert torch.equal(tokens, alone), (name, prompt)
        accepted[name] = accepted.get(name, 0) + stats.accepted
        assert stats.accepted < stats.drafted or name == "a near copy"  # rejections happen
    assert accepted["a near copy"] > accepted["another model"]  # and acceptances


def test_a_draft_equal_to_the_target_has_every_greedy_proposal_accepted():
    target = decoder(0, positional="rope")
    seen = []
    tokens, stats = speculative_ids(target, target, torch.tensor([PROMPTS[0]]), 21, 4, temperature=0,
                                    on_step=lambda step, token: seen.append((step, int(token))))
    assert stats.drafted == stats.accepted == 16 and stats.rounds == 5  # 4 rounds of 4 + 1 bonus each, then 1
    assert seen == list(enumerate(tokens[0].tolist()))


def test_speculative_text_ends_at_a_stop_token_as_generate_ids_does():
    """A Hugging Face model's text ends at its end-of-sequence token: with ``stop_id`` the
    speculative text is the target's greedy text up to and including it, whether the stop comes
    among the accepted draft tokens or as the target's own."""
    target = decoder(0, positional="rope")
    ids = torch.tensor([PROMPTS[0]])
    full = generate_ids(target, ids, 30, temperature=0)[0].tolist()
    for at in (3, 9):
        stop = full[at]
        end = next(i for i, token in enumerate(full) if token in (stop, 0)) + 1
        alone = generate_ids(target, ids, 30, temperature=0, stop_id=[stop, 0])
        for draft in (target, near_copy(target, 2, 0.02)):
            tokens, stats = speculative_ids(target, draft, ids, 30, 4, temperature=0, stop_id=[stop, 0])
            assert tokens[0].tolist() == alone[0].tolist() == full[:end] and stats.new_tokens == end


# sampled: the target's exact distribution -------------------------------------------------------

def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square test of ``counts`` against ``probs`` (cells expecting
    fewer than 5 pooled into one), from the upper regularised incomplete gamma function."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].sum().double()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))


def exact_first_tokens(model, prompt: list[int], sampling: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact distribution of the first two new tokens, (vocab, vocab), and of the third, (vocab,),
    from full forward passes: P(a, b) = p(a | prompt) p(b | prompt a), P(c) = Σ P(a, b) p(c | prompt a b)."""
    vocab = model.cfg.vocab_size
    with torch.no_grad():
        first = next_probs(model(torch.tensor([prompt]))[0, -1], *sampling)
        pairs = torch.tensor([prompt + [a] for a in range(vocab)])
        joint = first[:, None] * next_probs(model(pairs)[:, -1], *sampling)
        triples = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        third = (joint.reshape(-1, 1) * next_probs(model(triples)[:, -1], *sampling)).sum(0)
    return joint, third


def test_sampled_speculative_text_follows_the_targets_exact_distribution():
    # a vocabulary of 8, peaked distributions, a draft that disagrees often; temperature, top-k and
    # top-p alike on both; 3 new tokens with 2 proposed: the first two come from one round (accepted or
    # redrawn from max(0, p − q)), the third also from the bonus draw after two acceptances
    sampling = (0.9, 6, 0.95)
    target, draft = (decoder(seed, vocab_size=8, n_layers=1, positional="rope") for seed in (0, 1))
    with torch.no_grad():
        for model in (target, draft):
            model.generator.weight.mul_(4)
    prompt, samples = [5, 1, 6], 2000
    generator = torch.Generator().manual_seed(0)
    pairs, thirds = torch.zeros(8, 8), torch.zeros(8)
    drafted = accepted = 0
    for _ in range(samples):
        tokens, stats = speculative_ids(target, draft, torch.tensor([prompt]), 3, 2, *sampling, generator=generator)
        a, b, c = tokens[0].tolist()
        pairs[a, b] += 1
        thirds[c] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0.2 < accepted / drafted < 0.8  # both branches of the rule are taken often
    joint, third = exact_first_tokens(target, prompt, sampling)
    assert not pairs[joint == 0].any() and not thirds[third == 0].any()  # never a token top-k/top-p removed
    assert chi_square_p(pairs.flatten(), joint.flatten()) > 1e-3
    assert chi_square_p(thirds, third) > 1e-3
    # the test can fail: the same samples are far from the draft's own distribution
    draft_joint, draft_third = exact_first_tokens(draft, prompt, sampling)
    assert chi_square_p(pairs.flatten(), draft_joint.flatten()) < 1e-9
    assert chi_square_p(thirds, draft_third) < 1e-9


# the cache rolled back ---------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [
    dict(positional="learned", max_positions=32),
    dict(positional="rope"),
    dict(positional="alibi", attention={"kind": "flash", "q_tile": 4, "k_tile": 4}),
    dict(positional="rope", attention={"kind": "longformer", "window": 3, "global_tokens": 1}),
])
def test_a_cache_rolled_back_continues_as_a_fresh_pass(overrides):
    model = decoder(0, **overrides)
    ids = torch.randint(4, model.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        state = model.init_state()
        model.decode_step(ids[:, :14], state)  # 14 cached, then 6 forgotten
        state.truncate(8)
        assert state.offset == 8 and all(len(cache) == 8 for cache in state.self_caches)
        rolled = model.decode_step(ids[:, 14:], state)  # positions 8 … 13, read after the rollback
        fresh = model(torch.cat([ids[:, :8], ids[:, 14:]], 1))[:, 8:]
    assert torch.allclose(rolled, fresh, atol=1e-5), (rolled - fresh).abs().max()


@pytest.mark.parametrize("attention", [{"kind": "window", "window": 4}, {"kind": "performer", "features": 16}])
def test_a_cache_that_cannot_roll_back_is_refused_in_one_line(attention):
    plain, windowed = decoder(0, positional="rope"), decoder(0, positional="rope", attention=attention)
    for target, draft, option in ((windowed, plain, "--model"), (plain, windowed, "--draft")):
        with pytest.raises(AtencionError, match=f"^{option}: speculative decoding .* kind '{attention['kind']}'") \
                as refused:
            speculative_ids(target, draft, torch.tensor([PROMPTS[0]]), 5)
        assert "\n" not in str(refused.value)


# the command line ----------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    """A character GPT (the target), a smaller one with the same tokenizer (the draft), and two with
    other vocabularies: more characters ("larger"), and as many but one other ("renamed")."""
    root = tmp_path_factory.mktemp("speculative")
    lines = ["the cat sat on the mat\n", "a dog ate the bone\n"]
    tokenizers = {"target": Tokenizer.train_text(lines, "char"),
                  "larger": Tokenizer.train_text([*lines, "xyz\n"], "char"),
                  "renamed": Tokenizer.train_text([line.replace("b", "x") for line in lines], "char")}
    tokenizers["draft"] = tokenizers["target"]
    for name, tokenizer in tokenizers.items():
        layers = 2 if name == "target" else 1
        save_checkpoint(root / name, decoder(layers, vocab_size=tokenizer.vocab_size, n_layers=layers,
                                             positional="learned", max_positions=32), tokenizer)
    vocab_size = tokenizers["target"].vocab_size
    save_checkpoint(root / "windowed", decoder(3, vocab_size=vocab_size, positional="rope",
                                               attention={"kind": "window", "window": 4}), tokenizers["target"])
    save_checkpoint(root / "encoder", small_model(4, arch="encoder", vocab_size=vocab_size), tokenizers["target"])
    return {name: str(root / name) for name in [*tokenizers, "windowed", "encoder"]}


def test_generate_with_a_draft_prints_the_targets_greedy_text_and_logs_its_acceptance(directories, capsys, caplog):
    argv = ["generate", "--model", directories["target"], "--prompt", "the ", "--max-new-tokens", "40",
            "--temperature", "0"]
    status, alone, _ = run(argv, capsys)
    assert status == 0
    with caplog.at_level("INFO", logger="atencion.decode.speculative"):
        status, drafted, _ = run(argv + ["--draft", directories["draft"], "--draft-tokens", "3"], capsys)
    assert status == 0 and drafted == alone
    assert any("tokens/s" in r.message and "draft tokens accepted" in r.message for r in caplog.records)
    status, samples, _ = run(argv + ["--draft", directories["draft"], "--num-samples", "2"], capsys)
    assert status == 0 and samples == "".join(f"--- sample {k} ---\n{alone}" for k in (1, 2))


@pytest.mark.parametrize("other, detail", [("larger", "pieces against char"),
                                           ("renamed", "token 7 is 'c' against 'b'")])
def test_a_draft_with_another_vocabulary_is_refused_in_one_line_naming_both(directories, capsys, other, detail):
    status, out, err = run(["generate", "--model", directories["target"], "--prompt", "the",
                            "--draft", directories[other]], capsys)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and directories[other] in err and directories["target"] in err
    assert "another vocabulary" in err and detail in err
    status, _, err = run(["generate", "--model", directories["target"], "--draft", directories["draft"],
                          "--draft-tokens", "0"], capsys)
    assert status == 2 and "argument --draft-tokens" in err


# the server --------------------------------------------------------------------------------------


def served(directories, *names: str):
    """LoadedModels of the ``directories`` named, each under its own name, as `atencion serve` loads them."""
    from atencion.serve.run import load_models

    return load_models([f"{name}={directories[name]}" for name in names])


def test_serve_with_a_draft_generates_the_targets_greedy_text_speculatively_and_info_names_it(directories, caplog):
    """/generate with `serve --draft` gives the text of the same server without it, each sample
    decoded by speculative decoding (one log line each), for every decoder served, each with a copy of
    the draft of its own; an encoder beside them is served as it is, and /info says which uses the draft."""
    from fastapi.testclient import TestClient

    from atencion.serve.app import ServeSettings, create_app
    from atencion.serve.run import attach_draft

    plain = served(directories, "target")
    directories = {**directories, "again": directories["target"]}
    drafted = served(directories, "target", "again", "encoder")
    attach_draft(drafted, directories["draft"], 3)
    assert drafted[0].draft.model is not drafted[1].draft.model and drafted[2].draft is None
    requests = [{"prompt": "the ", "temperature": 0, "max_new_tokens": 40, "num_samples": 2},
                {"prompt": "a dog", "top_k": 1, "max_new_tokens": 25}]
    with TestClient(create_app(plain, ServeSettings())) as client:
        alone = [client.post("/generate", json=r).json() for r in requests]
        assert client.get("/info").json()["models"][0]["draft"] is None
    with TestClient(create_app(drafted, ServeSettings())) as client:
        with caplog.at_level("INFO", logger="atencion.decode.speculative"):
            for name in ("target", "again"):
                answers = [client.post("/generate", json={**r, "model": name}).json() for r in requests]
                assert [a["texts"] for a in answers] == [a["texts"] for a in alone], answers
            sampled = client.post("/generate", json={"prompt": "the ", "seed": 1, "max_new_tokens": 30})
        assert sampled.status_code == 200 and len(sampled.json()["texts"]) == 1, sampled.text
        rounds = [r for r in caplog.records if "draft tokens accepted" in r.message]
        assert len(rounds) == 2 * 3 + 1  # each sample, speculatively: 3 of each model's requests, and the sampled one
        info = {m["name"]: m for m in client.get("/info").json()["models"]}
    parameters = drafted[0].draft.model.num_parameters()
    for name in ("target", "again"):
        assert info[name]["draft"] == {"path": directories["draft"], "draft_tokens": 3, "parameters": parameters}
    assert "draft" not in info["encoder"] and info["encoder"]["endpoints"] == ["/attention"]


@pytest.mark.parametrize("models, draft, said, named", [
    (["target"], "larger", "has a vocabulary of", ["larger", "target"]),
    (["target"], "renamed", "another vocabulary", ["renamed", "target"]),
    (["encoder", "target"], "renamed", "another vocabulary", ["renamed", "target"]),  # the encoder needs no draft
    (["target", "windowed"], "draft", "cannot", ["windowed"]),  # a window's cache cannot roll back
    (["encoder"], "draft", "no served model generates text", ["draft"]),
    (["target"], "encoder", "must be a decoder-only model", ["encoder"]),
])
def test_serve_refuses_a_draft_it_cannot_use_at_start_up_in_one_line_naming_it_and_the_model(
        directories, capsys, monkeypatch, models, draft, said, named):
    from atencion.serve import run as serving

    monkeypatch.setattr(serving, "serve", lambda *args: pytest.fail("served despite the draft"))
    argv = ["serve", *(a for m in models for a in ("--model", directories[m])), "--draft", directories[draft]]
    status, out, err = run(argv, capsys)
    assert status == 2 and out == "" and err.count("\n") == 1 and said in err, err
    assert all(directories[name] in err for name in named), err


def test_serve_s_draft_options_reach_the_models_it_serves(directories, capsys, monkeypatch):
    from atencion.serve import run as serving

    seen = []
    monkeypatch.setattr(serving, "serve", lambda models, *args: seen.extend(models))
    status, _, err = run(["serve", "--model", directories["target"], "--model", directories["encoder"],
                          "--draft", directories["draft"], "--draft-tokens", "5"], capsys)
    assert status == 0, err
    assert [(m.draft.path, m.draft.tokens) if m.draft else None for m in seen] == [(directories["draft"], 5), None]


def test_a_draft_that_reads_no_tokens_is_refused_in_one_line_naming_it(directories, tmp_path, capsys):
    from atencion.config import ModelConfig
    from atencion.nn.model_dir import save_model
    from atencion.nn.transformer import Transformer

    images = ModelConfig.preset("vit-tiny", n_layers=1, d_model=16, d_ff=32, n_heads=2, num_labels=2,
                                inputs={"kind": "patches", "patch": 4, "size": [8, 8], "channels": 1})
    save_model(Transformer(images), tmp_path / "vit")
    for draft in (str(tmp_path / "vit"), str(tmp_path)):  # an image model; a directory that holds no model
        status, out, err = run(["generate", "--model", directories["target"], "--prompt", "the", "--draft", draft],
                               capsys)
        assert status == 2 and out == "" and err.count("\n") == 1 and draft in err and "Traceback" not in err, err
