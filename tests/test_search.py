import itertools

import pytest
import torch

from atencion.decode import Hypothesis, beam_search, greedy_search, length_penalty
from conftest import random_batch, small_model

PAD, BOS, EOS = 0, 2, 3


def eos_model(seed=1, eos_bias=2.0, **overrides):
    """A small model whose translations end after a few steps: an untied generator with a bias
    on EOS (seed 1 and bias 2 give greedy outputs of varied lengths, most below the maximum)."""
    model = small_model(seed, output_bias=True, tie_output=False, **overrides)
    with torch.no_grad():
        model.generator.bias[EOS] = eos_bias
    return model


def varied_batch(model, batch=5, src_len=8, seed=1):
    """Right-padded sources whose real lengths all differ (8, 7, 6, …)."""
    src, _ = random_batch(model.cfg, batch=batch, src_len=src_len, seed=seed)
    return src


def lp_formula(length, alpha):
    return ((5 + length) / 6) ** alpha


def scored_length(hyp, max_len):
    """|Y|: tokens plus the EOS, except for a hypothesis cut at the maximum length (no EOS)."""
    return len(hyp.tokens) if len(hyp.tokens) == max_len else len(hyp.tokens) + 1


def teacher_forced_log_prob(model, src_row, tokens, with_eos):
    """Sum of log-softmax scores of tokens (+ EOS) from one full forward pass over BOS + tokens,
    PAD and BOS excluded from the distribution (they can never be generated)."""
    tgt_in = torch.tensor([[BOS] + tokens])
    with torch.no_grad():
        logits = model(src_row, tgt_in).float()
        logits[..., [PAD, BOS]] = float("-inf")
        log_probs = torch.log_softmax(logits, dim=-1)[0]
    targets = tokens + [EOS] if with_eos else tokens
    return sum(log_probs[i, t].item() for i, t in enumerate(targets))


def real_length(src_row):
    return int((src_row != PAD).sum())


# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_beam_size_one_equals_greedy_on_a_batch(alpha):
    model = eos_model()
    src = varied_batch(model)
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    beam = beam_search(model, src, beam_size=1, alpha=alpha, max_len_a=1.0, max_len_b=5)
    assert [hyps[0].tokens for hyps in beam] == greedy
    lengths = [len(out) for out in greedy]
    assert len(set(lengths)) > 1 and min(lengths) > 0  # EOS at different steps: a real check


def test_greedy_output_is_the_argmax_path_of_the_full_forward_pass():
    model = eos_model()
    src = varied_batch(model, batch=3)
    for row, out in zip(src, greedy_search(model, src, max_len_a=1.0, max_len_b=5)):
        row = row[None, :real_length(row)]
        prefix = [BOS]
        while len(prefix) - 1 < real_length(row) + 5:
            with torch.no_grad():
                logits = model(row, torch.tensor([prefix]))[0, -1]
            logits[[PAD, BOS]] = float("-inf")
            token = int(logits.argmax())
            if token == EOS:
                break
            prefix.append(token)
        assert out == prefix[1:]


# exhaustive search on a tiny vocabulary: ids 0 PAD, 2 BOS, 3 EOS; 1, 4, 5 are ordinary tokens

ORDINARY = [1, 4, 5]
MAX_LEN = 3
ALL_SEQUENCES = [list(s) for n in range(MAX_LEN + 1) for s in itertools.product(ORDINARY, repeat=n)]


def brute_force_ranking(model, src_row, alpha):
    """Every possible output of at most MAX_LEN tokens, scored independently, best first."""
    ranked = []
    for tokens in ALL_SEQUENCES:
        with_eos = len(tokens) < MAX_LEN
        log_prob = teacher_forced_log_prob(model, src_row, tokens, with_eos)
        ranked.append((log_prob / lp_formula(len(tokens) + with_eos, alpha), tokens, log_prob))
    ranked.sort(key=lambda item: -item[0])
    return ranked


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_exhaustive_beam_finds_the_exact_best_sequence(alpha):
    model = eos_model(seed=3, eos_bias=0.0, vocab_size=6)
    src = varied_batch(model, batch=2, src_len=5, seed=3)
    beam = len(ALL_SEQUENCES)  # 40: room for every sequence at every step
    results = beam_search(model, src, beam_size=beam, alpha=alpha, max_len_a=0, max_len_b=MAX_LEN,
                          nbest=beam)
    for row, hyps in zip(src, results):
        ranked = brute_force_ranking(model, row[None, :real_length(row)], alpha)
        assert hyps[0].tokens == ranked[0][1]
        assert hyps[0].score == pytest.approx(ranked[0][0], abs=1e-4)
        assert [h.tokens for h in hyps] == [tokens for _, tokens, _ in ranked]


def test_log_prob_equals_the_teacher_forced_sum():
    model = eos_model()
    src = varied_batch(model)
    results = beam_search(model, src, beam_size=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=4)
    for row, hyps in zip(src, results):
        row = row[None, :real_length(row)]
        max_len = real_length(row) + 5
        for hyp in hyps:
            length = scored_length(hyp, max_len)
            expected = teacher_forced_log_prob(model, row, hyp.tokens, with_eos=length > len(hyp.tokens))
            assert hyp.log_prob == pytest.approx(expected, abs=1e-4)
            assert hyp.score == pytest.approx(hyp.log_prob / lp_formula(length, 0.6), rel=1e-6)


def test_length_penalty_matches_the_formula_of_wu_et_al():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)
    assert length_penalty(7, 0.6) == pytest.approx(2.0 ** 0.6)
    assert length_penalty(13, 1.0) == pytest.approx(3.0)
    assert length_penalty(25, 2.0) == pytest.approx(25.0)
    assert length_penalty(40, 0.0) == 1.0


def test_length_penalty_lets_a_longer_hypothesis_overtake_a_shorter_one():
    model = eos_model(seed=6, eos_bias=0.0, vocab_size=6)  # a seed where the two rankings differ
    src = varied_batch(model, batch=1, src_len=5, seed=3)
    beam = len(ALL_SEQUENCES)
    plain = beam_search(model, src, beam_size=beam, alpha=0.0, max_len_a=0, max_len_b=MAX_LEN, nbest=beam)[0]
    penalized = beam_search(model, src, beam_size=beam, alpha=1.0, max_len_a=0, max_len_b=MAX_LEN,
                            nbest=beam)[0]
    short, long = plain[0], penalized[0]
    assert len(short.tokens) < len(long.tokens)
    assert short.log_prob > long.log_prob  # the shorter one is more probable, yet loses at alpha=1
    for alpha, hyps in ((0.0, plain), (1.0, penalized)):
        by_formula = sorted(hyps, key=lambda h: -h.log_prob / lp_formula(scored_length(h, MAX_LEN), alpha))
        assert [h.tokens for h in hyps] == [h.tokens for h in by_formula]


def test_batched_search_equals_decoding_each_sentence_alone():
    model = eos_model()
    src = varied_batch(model)
    kwargs = dict(beam_size=3, alpha=0.6, max_len_a=1.0, max_len_b=3, nbest=3)
    batched = beam_search(model, src, **kwargs)
    kept_in_batch = beam_search(model, src, _drop_finished=False, **kwargs)
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=3)
    for i, row in enumerate(src):
        alone = row[None, :real_length(row)]
        single = beam_search(model, alone, **kwargs)[0]
        for results in (batched, kept_in_batch):
            assert [h.tokens for h in results[i]] == [h.tokens for h in single]
            assert [h.score for h in results[i]] == pytest.approx([h.score for h in single], abs=1e-4)
        assert greedy[i] == greedy_search(model, alone, max_len_a=1.0, max_len_b=3)[0]


def test_done_sentences_leave_the_batch(monkeypatch):
    model = eos_model()
    src = varied_batch(model)
    rows = []
    decode_step = model.decode_step

    def counting_decode_step(tgt_ids, state):
        rows.append(tgt_ids.size(0))
        return decode_step(tgt_ids, state)

    monkeypatch.setattr(model, "decode_step", counting_decode_step)
    beam_search(model, src, beam_size=3, max_len_a=1.0, max_len_b=3)
    dropping = list(rows)
    rows.clear()
    beam_search(model, src, beam_size=3, max_len_a=1.0, max_len_b=3, _drop_finished=False)
    assert dropping[0] == rows[0] == 3 * len(src)
    assert sum(dropping) < sum(rows)
    assert dropping == sorted(dropping, reverse=True)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_a_sentence_stops_once_it_holds_beam_size_finished_hypotheses(alpha, monkeypatch):
    """Early stopping (fairseq's rule) saves decoder work; searching on to the maximum length
    can only find a best hypothesis that scores at least as well."""
    model = eos_model()
    src = varied_batch(model, batch=6, src_len=8, seed=2)
    rows = []
    decode_step = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda t, s: rows.append(t.size(0)) or decode_step(t, s))
    kwargs = dict(beam_size=3, alpha=alpha, max_len_a=1.0, max_len_b=4, nbest=3)
    early = beam_search(model, src, **kwargs)
    early_rows = sum(rows)
    full = beam_search(model, src, _early_stop=False, **kwargs)
    assert early_rows < sum(rows) - early_rows  # decoder rows saved
    for a, b in zip(early, full):  # the same hypothesis may score a float32 rounding apart: its rows
        assert len(a) == 3          # went through products of other batch sizes (dot products, panels, MKL)
        assert b[0].score >= a[0].score - 1e-6 * abs(a[0].score)


def test_outputs_respect_the_max_length_and_never_contain_pad_or_bos():
    model = small_model(0, output_bias=True)
    with torch.no_grad():  # make PAD and BOS the most likely tokens: only the mask stops them
        model.generator.bias[PAD] = 10.0
        model.generator.bias[BOS] = 10.0
    src = varied_batch(model)
    max_lens = [int(0.5 * real_length(row) + 2) for row in src]
    greedy = greedy_search(model, src, max_len_a=0.5, max_len_b=2)
    beams = beam_search(model, src, beam_size=3, max_len_a=0.5, max_len_b=2, nbest=3)
    outputs = greedy + [h.tokens for hyps in beams for h in hyps]
    limits = max_lens + [m for m, hyps in zip(max_lens, beams) for _ in hyps]
    assert all(len(out) <= limit for out, limit in zip(outputs, limits))
    assert any(len(out) == limit for out, limit in zip(outputs, limits))  # forced ends happen
    assert all(PAD not in out and BOS not in out and EOS not in out for out in outputs)


def test_nbest_returns_sorted_distinct_hypotheses():
    model = eos_model()
    src = varied_batch(model)
    for hyps in beam_search(model, src, beam_size=5, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=5):
        assert len(hyps) == 5 and all(isinstance(h, Hypothesis) for h in hyps)
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == len(hyps)


@pytest.mark.parametrize("kwargs, words", [
    (dict(beam_size=2, nbest=3), ["nbest", "beam_size"]),
    (dict(beam_size=2, nbest=0), ["nbest"]),
    (dict(beam_size=0, nbest=1), ["beam_size"]),
    (dict(alpha=-0.1), ["alpha"]),
    (dict(max_len_a=0, max_len_b=0), ["max_len"]),
])
def test_bad_arguments_raise_value_error(kwargs, words):
    model = eos_model()
    src = varied_batch(model, batch=2)
    with pytest.raises(ValueError) as err:
        beam_search(model, src, **kwargs)
    assert all(word in str(err.value) for word in words)


def test_a_model_in_training_mode_is_refused():
    model = eos_model().train()
    src = varied_batch(model, batch=2)
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        beam_search(model, src)
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        greedy_search(model, src)


@pytest.mark.parametrize("vocab", [10_000, 10_007, 37_000, 200])
def test_topk_rows_through_chunk_maxima_equals_torch_topk(vocab):
    from atencion.decode.search import topk_rows

    g = torch.Generator().manual_seed(vocab)
    x = torch.log_softmax(torch.randn(50, vocab, generator=g) * 3, dim=-1)
    x[:, [0, 2]] = float("-inf")                       # PAD and BOS, as the search bans them
    x[7, 64 * 3: 64 * 4] += 40                         # one row's best entries all in one chunk
    x[9, -5:] += 40                                    # and another's in the last, partial chunk
    for n in (1, 10):
        values, index = topk_rows(x, n)
        want_values, want_index = x.topk(n, dim=1)
        assert torch.equal(values, want_values)
        assert torch.equal(index, want_index)          # no ties among random floats
