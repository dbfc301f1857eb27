"""Sampling from decoder-only models (decode/sample.py): greedy and cached generation agree with
the full forward pass, top-k and top-p never leave their sets and draw with the right
frequencies, seeds reproduce, stop_id ends rows, and bad requests are refused before any work."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from atencion import ModelConfig, Transformer
from atencion.decode.sample import check_sampling, choose_next, filter_logits, generate_ids
from atencion.errors import AtencionError
from conftest import small_model


def gpt(seed=0, **overrides):
    """A tiny random GPT-style decoder with learned positions (dropout on when in training mode)."""
    values = dict(arch="decoder", positional="learned", norm_first=True, scale_embedding=False, max_positions=32)
    return small_model(seed, **{**values, **overrides})


class Recording(nn.Module):
    """``model``, recording the next-token logits that each decode_step hands to the sampler."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg, self.seen = model, model.cfg, []
        self.train(model.training)

    def init_state(self):
        return self.model.init_state()

    def decode_step(self, ids, state, last=None):
        logits = self.model.decode_step(ids, state, last=last)
        self.seen.append(logits[:, -1].clone())
        return logits


class FixedLogits(nn.Module):
    """A stand-in decoder whose next-token logits are given: ``logits`` (steps, batch or 1, vocab),
    step s of the generation getting logits[s] (the last one once the steps run out)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits
        self.cfg = SimpleNamespace(arch="decoder", vocab_size=logits.size(-1), positional="rope", max_positions=0)

    def init_state(self):
        return SimpleNamespace(step=0)

    def decode_step(self, ids, state, last=None):
        logits = self.logits[min(state.step, len(self.logits) - 1)].expand(ids.size(0), -1)
        state.step += 1
        return logits[:, None, :].expand(-1, min(ids.size(1), last or ids.size(1)), -1)


def prompt_ids(batch=3, length=5, vocab=40, seed=1):
    return torch.randint(4, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def kept(logits):
    """The set of token ids a filtered row of logits still allows."""
    return set(torch.isfinite(logits).nonzero().squeeze(1).tolist())


# greedy and the cache ---------------------------------------------------------------------------

def test_cached_generation_equals_the_full_forward_pass_at_every_step():
    model = gpt()
    recording = Recording(model)
    prompt = prompt_ids()
    out = generate_ids(recording, prompt, 12, temperature=0)
    assert out.shape == (3, 12)
    with torch.no_grad():
        full = model(torch.cat([prompt, out], dim=1))  # no cache: every position recomputed
    for step, logits in enumerate(recording.seen):
        expected = full[:, prompt.size(1) - 1 + step]
        assert (logits - expected).abs().max() < 1e-5, step
        assert torch.equal(out[:, step], expected.argmax(dim=-1)), step


def test_greedy_generation_equals_argmax_of_the_forward_pass_token_by_token():
    model = gpt(seed=2)
    ids = prompt_ids(seed=3)
    with torch.no_grad():
        for _ in range(10):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    assert torch.equal(generate_ids(model, prompt_ids(seed=3), 10, temperature=0), ids[:, 5:])


def test_a_tiny_temperature_and_top_k_1_are_greedy():
    model = gpt(seed=4)
    prompt = prompt_ids(seed=5)
    greedy = generate_ids(model, prompt, 15, temperature=0)
    cold = generate_ids(model, prompt, 15, temperature=1e-6, generator=torch.Generator().manual_seed(0))
    top1 = generate_ids(model, prompt, 15, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cold, greedy) and torch.equal(top1, greedy)


def test_greedy_draws_no_random_numbers():
    generator = torch.Generator().manual_seed(7)
    before = generator.get_state()
    generate_ids(gpt(), prompt_ids(), 6, temperature=0, generator=generator)
    generate_ids(gpt(), prompt_ids(), 6, temperature=0.8, top_k=1, generator=generator)
    assert torch.equal(generator.get_state(), before)


def test_generation_runs_without_dropout_and_gives_the_model_its_mode_back():
    model = gpt(seed=6)
    expected = generate_ids(model, prompt_ids(), 8, temperature=0)
    model.train()
    assert torch.equal(generate_ids(model, prompt_ids(), 8, temperature=0), expected)
    assert model.training


# top-k and top-p ---------------------------------------------------------------------------------

def test_top_k_keeps_exactly_the_k_largest_logits_unchanged():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    filtered = filter_logits(logits, top_k=3)
    assert torch.equal(logits, before)  # the input is left as is
    for row in range(4):
        top = set(logits[row].topk(3).indices.tolist())
        assert kept(filtered[row]) == top
        assert torch.equal(filtered[row, list(top)], logits[row, list(top)])


@pytest.mark.parametrize("top_p, expected", [(0.05, {0}), (0.3, {0}), (0.65, {0, 1}), (0.75, {0, 1, 2}),
                                              (0.95, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_nucleus_reaching_p_and_always_the_most_likely_token(top_p, expected):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    order = [2, 0, 3, 1]  # token i has probability probs[order[i]], so its rank is order[i]
    filtered = filter_logits(probs[order].log()[None], top_p=top_p)[0]
    assert {order[t] for t in kept(filtered)} == expected


@pytest.mark.parametrize("top_p, size", [(0.25, 1), (0.5, 2), (0.75, 3), (0.76, 4)])
def test_a_nucleus_whose_probability_equals_p_exactly_is_enough(top_p, size):
    assert len(kept(filter_logits(torch.zeros(1, 4), top_p=top_p)[0])) == size  # four tokens of 1/4 each


def test_top_p_applies_to_the_distribution_top_k_renormalised():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    assert kept(filter_logits(logits, top_p=0.5)[0]) == {0, 1}               # 0.4 < 0.5
    assert kept(filter_logits(logits, top_k=2, top_p=0.5)[0]) == {0}         # 0.4 / 0.7 > 0.5


def truncated(probs: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The distribution sampling should draw from, computed by hand: p^(1/T) renormalised, the
    top_k most likely kept, renormalised, the nucleus reaching top_p kept, renormalised."""
    q = [p ** (1 / temperature) for p in probs]
    q = [x / sum(q) for x in q]
    ranked = sorted(range(len(q)), key=lambda i: -q[i])
    keep = ranked[:top_k] if top_k else ranked
    mass = sum(q[i] for i in keep)
    nucleus, before = [], 0.0
    for i in keep:
        if before < top_p:
            nucleus.append(i)
        before += q[i] / mass
    total = sum(q[i] for i in nucleus)
    return [q[i] / total if i in nucleus else 0.0 for i in range(len(q))]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8),
                                                       (2.0, 4, 0.9), (0.5, 5, 0.7)])
def test_sampled_frequencies_match_the_truncated_renormalised_distribution(temperature, top_k, top_p):
    """20,000 draws from a fixed 6-token distribution: tokens outside the set never appear, and
    each frequency is within 4 standard errors of its probability."""
    probs = [0.05, 0.3, 0.12, 0.25, 0.08, 0.2]
    n = 20_000
    logits = torch.tensor(probs).log()[None].expand(n, -1)
    tokens = choose_next(logits, temperature, top_k, top_p, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=6).tolist()
    for token, q in enumerate(truncated(probs, temperature, top_k, top_p)):
        if q == 0:
            assert counts[token] == 0, token
        else:
            assert abs(counts[token] / n - q) <= 4 * math.sqrt(q * (1 - q) / n), (token, counts[token] / n, q)


def test_generated_tokens_stay_in_each_steps_top_k_and_top_p_set():
    """A stand-in model gives every row and step its own logits; each token must lie in the set
    filter_logits leaves for that row and step."""
    steps, batch, vocab = 6, 400, 12
    logits = torch.randn(steps, batch, vocab, generator=torch.Generator().manual_seed(1)) * 2
    prompt = torch.zeros(batch, 1, dtype=torch.long)
    for top_k, top_p in ((3, 1.0), (0, 0.6), (4, 0.5)):
        out = generate_ids(FixedLogits(logits), prompt, steps, top_k=top_k, top_p=top_p,
                           generator=torch.Generator().manual_seed(2))
        allowed = torch.isfinite(filter_logits(logits.view(-1, vocab), top_k, top_p)).view(steps, batch, vocab)
        assert bool(allowed.transpose(0, 1).gather(2, out[:, :, None]).all())
        assert len(set(out.flatten().tolist())) > 1  # it did sample


# seeds, stop_id, on_step -------------------------------------------------------------------------

def test_a_seed_reproduces_a_sample_and_different_seeds_differ():
    model = gpt(seed=8)
    prompt = prompt_ids(batch=4, seed=9)

    def sample(seed):
        generator = torch.Generator().manual_seed(seed)
        return generate_ids(model, prompt, 16, temperature=1.0, top_p=0.95, generator=generator)
    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))


def script(rows: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """Logits (steps, batch, vocab) under which greedy decoding emits ``rows`` token by token."""
    ids = torch.tensor(rows).t()
    return nn.functional.one_hot(ids, vocab).float() * 10


def test_a_row_that_emits_stop_id_keeps_emitting_it_and_generation_ends_when_all_rows_stop():
    stop = 9
    model = FixedLogits(script([[5, stop, 7, 7, 7, 7], [6, 6, 6, stop, 8, 8], [4, 4, 4, 4, stop, 4]]))
    seen = []
    out = generate_ids(model, torch.ones(3, 2, dtype=torch.long), 8, temperature=0, stop_id=stop,
                       on_step=lambda step, tokens: seen.append((step, tokens.clone())))
    assert out.tolist() == [[5, stop, stop, stop, stop], [6, 6, 6, stop, stop], [4, 4, 4, 4, stop]]
    assert [step for step, _ in seen] == [0, 1, 2, 3, 4]
    assert all(torch.equal(tokens, out[:, step]) for step, tokens in seen)


def test_without_a_stop_every_row_gets_max_new_tokens():
    model = FixedLogits(script([[5, 9, 7], [6, 6, 6]]))
    assert generate_ids(model, torch.ones(2, 1, dtype=torch.long), 5, temperature=0).tolist() == \
        [[5, 9, 7, 7, 7], [6, 6, 6, 6, 6]]
    assert generate_ids(model, torch.ones(2, 1, dtype=torch.long), 5, temperature=0, stop_id=8).shape == (2, 5)


# refusals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature, top_k, top_p, message", [
    (-1.0, 0, 1.0, "--temperature must be >= 0 and finite"),
    (float("nan"), 0, 1.0, "--temperature must be >= 0 and finite"),
    (float("inf"), 0, 1.0, "--temperature must be >= 0 and finite"),
    (1.0, -1, 1.0, "--top-k must be an integer >= 0"),
    (1.0, 1.5, 1.0, "--top-k must be an integer >= 0"),
    (1.0, float("nan"), 1.0, "--top-k must be an integer >= 0"),
    (1.0, 0, 0.0, r"--top-p must be in \(0, 1\], got 0.0"),
    (1.0, 0, 1.5, r"--top-p must be in \(0, 1\], got 1.5"),
    (1.0, 0, -1.0, r"--top-p must be in \(0, 1\], got -1.0"),
    (1.0, 0, float("nan"), r"--top-p must be in \(0, 1\], got nan"),
    (1.0, 0, 1e-50, r"--top-p must be in \(0, 1\], got 1e-50, which is 0 in float32"),
])
def test_bad_sampling_settings_are_refused_naming_the_option(temperature, top_k, top_p, message):
    with pytest.raises(AtencionError, match=message):
        check_sampling(temperature, top_k, top_p)
    recording = Recording(gpt())
    with pytest.raises(AtencionError, match=message):
        generate_ids(recording, prompt_ids(), 3, temperature, top_k, top_p)
    assert recording.seen == []


def test_settings_at_their_limits_are_accepted():
    for settings in ((0.0, 0, 1.0), (1.5, 1, 1e-9), (100.0, 1000, 0.5)):
        check_sampling(*settings)


@pytest.mark.parametrize("arch, preset, what", [("encoder", "bert-tiny", "encoder-only"),
                                                ("encoder-decoder", "tiny", "an encoder-decoder")])
def test_models_that_are_not_decoder_only_are_refused(arch, preset, what):
    model = Transformer(ModelConfig.preset(preset, vocab_size=40, n_layers=1))
    assert model.cfg.arch == arch
    with pytest.raises(AtencionError, match=rf"generate needs a decoder-only model \(arch decoder\); "
                                            rf"this model is {what}"):
        generate_ids(model, prompt_ids(), 3)


def test_a_prompt_too_long_for_learned_positions_is_refused_before_generating():
    recording = Recording(gpt(max_positions=16))
    assert generate_ids(recording, prompt_ids(length=16), 1, temperature=0).shape == (3, 1)
    recording.seen.clear()
    with pytest.raises(AtencionError, match=r"--prompt of 17 tokens is longer than this model's learned positions "
                                            r"\(max_positions=16\)"):
        generate_ids(recording, prompt_ids(length=17), 8)
    assert recording.seen == []


def test_past_learned_positions_each_step_reads_the_last_window_as_nanogpt_crops_it():
    torch.manual_seed(0)
    model = gpt(max_positions=16).eval()
    prompt = prompt_ids(length=10)
    new = generate_ids(model, prompt, 20, temperature=0)
    text = prompt
    with torch.no_grad():
        for _ in range(20):  # the reference: full forward passes over at most the last 16 tokens
            text = torch.cat([text, model(text[:, -16:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(new, text[:, 10:])


@pytest.mark.parametrize("prompt, max_new_tokens, message", [
    (torch.zeros(2, 0, dtype=torch.long), 3, r"--prompt is empty \(2, 0\)"),
    (torch.zeros(0, 4, dtype=torch.long), 3, r"--prompt is empty \(0, 4\)"),
    (torch.zeros(4, dtype=torch.long), 3, "--prompt must be integer token ids shaped"),
    (torch.zeros(1, 4), 3, "--prompt must be integer token ids shaped"),
    (torch.full((1, 4), 40), 3, r"--prompt holds token id 40, outside the vocabulary \[0, 40\)"),
    (torch.ones(1, 4, dtype=torch.long), 0, "--max-new-tokens must be a positive integer, got 0"),
])
def test_bad_prompts_and_lengths_are_refused(prompt, max_new_tokens, message):
    with pytest.raises(AtencionError, match=message):
        generate_ids(gpt(), prompt, max_new_tokens)
