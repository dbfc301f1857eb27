"""Local and sparse attention (nn/kinds/sparse.py): the sliding window, Longformer and BigBird,
computed in blocks, equal eq. (1) masked by their explicit patterns in values and gradients; keys
outside the pattern have no influence; BigBird's random blocks follow their seed; the memory grows
linearly with the length."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from atencion.errors import AtencionError
from atencion.nn.attention import _explicit_attention
from atencion.nn.kinds.sparse import (
    bigbird_attention,
    bigbird_pattern,
    bigbird_random_blocks,
    longformer_attention,
    longformer_pattern,
    window_attention,
    window_pattern,
)
from atencion.nn.positional import AlibiPositions, T5Positions

torch.set_num_threads(1)


def qkv(batch, heads, q_len, k_len, d_k=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads, q_len, d_k), (batch, heads, k_len, d_k), (batch, heads, k_len, d_k))
    return [torch.randn(shape, generator=g, dtype=dtype).requires_grad_() for shape in shapes]


def key_padding(batch, k_len, padded):
    """Row b hides its last b * padded keys."""
    mask = torch.ones(batch, 1, 1, k_len, dtype=torch.bool)
    for row in range(batch):
        mask[row, ..., k_len - row * padded:] = False
    return mask


def global_tokens(k_len):
    return torch.tensor([p for p in (0, 9, 30) if p < k_len])


# a kind: its blocked attention and its explicit pattern, on one setting each
KINDS = {
    "window": (lambda q, k, v, causal, **kw: window_attention(q, k, v, 5, causal, block=4, **kw),
               lambda q_len, k_len, heads, causal: window_pattern(q_len, k_len, 5, causal)),
    "window-default-block": (lambda q, k, v, causal, **kw: window_attention(q, k, v, 7, causal, **kw),
                             lambda q_len, k_len, heads, causal: window_pattern(q_len, k_len, 7, causal)),
    "longformer": (lambda q, k, v, causal, **kw: longformer_attention(q, k, v, 4, global_tokens(k.size(-2)), causal,
                                                                      block=3, **kw),
                   lambda q_len, k_len, heads, causal: longformer_pattern(q_len, k_len, 4, global_tokens(k_len),
                                                                          causal)),
    "bigbird": (lambda q, k, v, causal, **kw: bigbird_attention(q, k, v, 4, 2, 1, 7, causal, **kw),
                lambda q_len, k_len, heads, causal: bigbird_pattern(q_len, k_len, 4, 2, 1, 7, heads, causal)),
}


def compare(kind, q, k, v, causal, mask=None, bias_fn=None, bias_params=()):
    """The blocked kind and the explicit eq. (1) over its pattern: outputs, weights, gradients."""
    attention, pattern = KINDS[kind]
    q_len, k_len, heads = q.size(-2), k.size(-2), q.size(1)
    out, weights = attention(q, k, v, causal, mask=mask, bias=bias_fn, need_weights=True)
    allowed = pattern(q_len, k_len, heads, causal)
    allowed = allowed if mask is None else allowed & mask
    bias = None if bias_fn is None else bias_fn(torch.arange(q_len), torch.arange(k_len))
    ref_out, ref_weights = _explicit_attention(q, k, v, allowed, 0.0, bias)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    inputs = (q, k, v, *bias_params)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref_out, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_a_window_as_long_as_the_sequence_is_full_attention(causal):
    q, k, v = qkv(2, 3, 23, 23)
    for window in (23, 100):
        out, _ = window_attention(q, k, v, window, causal)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch, heads, q_len, k_len, padded", [
    (2, 3, 31, 31, 0),   # lengths that are not multiples of the block
    (3, 2, 33, 33, 4),   # key padding
    (2, 2, 1, 1, 0),     # a single position
    (1, 4, 64, 64, 0),   # lengths that are multiples of the block
])
def test_each_kind_equals_eq_1_over_its_pattern(kind, causal, batch, heads, q_len, k_len, padded):
    q, k, v = qkv(batch, heads, q_len, k_len, seed=q_len)
    compare(kind, q, k, v, causal, key_padding(batch, k_len, padded) if padded else None)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("q_len", [1, 6, 13])
def test_decoding_queries_at_the_end_of_a_cache_equal_eq_1_over_the_pattern(kind, q_len):
    q, k, v = qkv(2, 3, q_len, 37, seed=q_len)
    compare(kind, q, k, v, True, key_padding(2, 37, 3))


@pytest.mark.parametrize("kind", list(KINDS))
def test_decoding_one_query_gives_the_last_row_of_the_full_pass(kind):
    attention, _ = KINDS[kind]
    q, k, v = qkv(1, 2, 35, 35)
    full, _ = attention(q, k, v, True)
    last, _ = attention(q[:, :, -1:], k, v, True)
    torch.testing.assert_close(last, full[:, :, -1:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("positions", ["alibi", "t5"])
def test_each_kind_adds_alibi_and_t5_biases_as_eq_1_does(kind, causal, positions):
    heads, q_len, k_len = 3, 29, 33
    offset = k_len - q_len if causal else 0
    q, k, v = qkv(2, heads, q_len if causal else k_len, k_len, seed=5)
    table = AlibiPositions(heads) if positions == "alibi" else T5Positions(heads, num_buckets=8, max_distance=16)
    params = tuple(table.parameters())

    def bias(q_index, k_index):
        return table.bias(q_index + offset, k_index, causal)

    compare(kind, q, k, v, causal, key_padding(2, k_len, 5), bias, params)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("causal", [False, True])
def test_a_key_outside_a_querys_pattern_has_no_influence(kind, causal):
    attention, pattern = KINDS[kind]
    q, k, v = qkv(1, 2, 40, 40, seed=3)
    allowed = pattern(40, 40, 2, causal).expand(2, 40, 40)
    row = 20
    out, _ = attention(q, k, v, causal)
    k_grad, v_grad = torch.autograd.grad(out[:, :, row].sum(), (k, v))
    outside = ~allowed[:, row]  # (heads, keys)
    assert outside.any() and (~outside).any()
    for grad in (k_grad, v_grad):
        assert torch.all(grad[0][outside] == 0)
        assert torch.all(grad[0][~outside].abs().sum(-1) > 0)
    with torch.no_grad():  # a perturbed key and value outside the pattern leave the row bit for bit
        k2, v2 = k.clone(), v.clone()
        k2[0][outside] += 100.0
        v2[0][outside] -= 100.0
        out2, _ = attention(q, k2, v2, causal)
        assert torch.equal(out2[:, :, row], out[:, :, row])


def test_a_query_that_sees_no_key_gives_zero_output_and_no_nan():
    q, k, v = qkv(2, 2, 20, 20)
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    mask[1] = False
    for kind, (attention, _) in KINDS.items():
        out, weights = attention(q, k, v, True, mask=mask, need_weights=True)
        assert torch.all(out[1] == 0) and torch.all(weights[1] == 0), kind
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads), kind
        assert torch.all(grads[0][1] == 0), kind


@pytest.mark.parametrize("kind", list(KINDS))
def test_dropout_zeroes_weights_and_rescales_the_rest_like_f_dropout(kind):
    attention, _ = KINDS[kind]
    k_len, p = 36, 0.25
    q = torch.randn(1, 2, k_len, 4)
    k = torch.randn(1, 2, k_len, 4)
    v = torch.eye(k_len).expand(1, 2, k_len, k_len)  # the output row is the row of dropped weights
    out, weights = attention(q, k, v, False, dropout_p=p, need_weights=True)
    kept = out != 0
    torch.testing.assert_close(out[kept], weights[kept] / (1 - p))
    dropped = (weights > 0) & ~kept
    assert 0.1 < dropped.sum() / (weights > 0).sum() < 0.4


# the explicit patterns, checked by hand ---------------------------------------------------------

def test_the_causal_window_sees_itself_and_the_w_minus_1_keys_before_it():
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [1, 1, 1, 0, 0],
                             [0, 1, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(window_pattern(5, 5, 3, True), expected)
    assert torch.equal(window_pattern(2, 5, 3, True), expected[3:])  # the last two positions
    bidirectional = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(window_pattern(4, 4, 2, False), bidirectional)


def test_longformer_global_positions_see_and_are_seen_by_all_and_causal_keeps_the_past():
    pattern = longformer_pattern(6, 6, 1, torch.tensor([2]), False)
    expected = torch.eye(6, dtype=torch.bool)
    expected[2, :] = expected[:, 2] = True
    assert torch.equal(pattern, expected)
    assert torch.equal(longformer_pattern(6, 6, 1, [2], True), expected.tril())


def test_bigbird_blocks_see_neighbours_globals_and_their_random_blocks():
    block, n_blocks = 2, 8
    pattern = bigbird_pattern(16, 16, block, 1, 1, 3, 2, False)
    chosen = bigbird_random_blocks(n_blocks, 1, 1, 3, 2, False)
    for head in range(2):
        blocks = pattern[head, ::block, ::block]  # one token per block: the block pattern
        for a in range(n_blocks):
            expected = {c for c in range(n_blocks) if abs(a - c) <= 1 or c == 0 or a == 0}
            expected |= {int(c) for c in chosen[head, a] if c >= 0}
            assert set(blocks[a].nonzero().flatten().tolist()) == expected
        assert torch.equal(pattern[head], blocks.repeat_interleave(block, 0).repeat_interleave(block, 1))


# BigBird's random blocks ---------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_bigbird_random_blocks_follow_the_seed_and_differ_per_head_and_seed(causal):
    blocks = bigbird_random_blocks(40, 3, 2, 11, 4, causal)
    assert torch.equal(blocks, bigbird_random_blocks(40, 3, 2, 11, 4, causal))
    assert not torch.equal(blocks, bigbird_random_blocks(40, 3, 2, 12, 4, causal))
    for head in range(1, 4):
        assert not torch.equal(blocks[head], blocks[0])


@pytest.mark.parametrize("causal", [False, True])
def test_bigbird_random_blocks_are_distinct_and_never_a_neighbour_or_global(causal):
    n_blocks, random_blocks, global_blocks = 30, 3, 2
    blocks = bigbird_random_blocks(n_blocks, random_blocks, global_blocks, 5, 3, causal)
    for head in range(3):
        for a in range(n_blocks):
            chosen = [int(c) for c in blocks[head, a] if c >= 0]
            candidates = [c for c in range(global_blocks, n_blocks) if abs(a - c) > 1 and (not causal or c < a)]
            if a < global_blocks:
                candidates = []
            assert len(chosen) == len(set(chosen)) == min(random_blocks, len(candidates))
            assert set(chosen) <= set(candidates)


def test_bigbird_random_blocks_are_drawn_uniformly():
    blocks = bigbird_random_blocks(12, 2, 1, 0, 3000, False)[:, 6]  # block 6: candidates 1-4 and 8-11
    counts = torch.bincount(blocks.flatten(), minlength=12).float()
    assert torch.all(counts[[0, 5, 6, 7]] == 0)
    frequencies = counts[[1, 2, 3, 4, 8, 9, 10, 11]] / counts.sum()
    assert torch.all((frequencies - 1 / 8).abs() < 0.02)


def test_causal_bigbird_keeps_its_random_blocks_as_the_sequence_grows():
    short = bigbird_random_blocks(20, 3, 1, 9, 2, True)
    long = bigbird_random_blocks(50, 3, 1, 9, 2, True)
    assert torch.equal(long[:, :20], short)


# settings ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda q, k, v: window_attention(q, k, v, 0), "model.attention.window must be an integer >= 1, got 0"),
    (lambda q, k, v: window_attention(q, k, v, 4, block=0), "model.attention.block must be an integer >= 1, got 0"),
    (lambda q, k, v: longformer_attention(q, k, v, 4, torch.tensor([0, 40])),
     "model.attention.global_tokens: position 40 is beyond the length 32"),
    (lambda q, k, v: bigbird_attention(q, k, v, 0, 1, 1, 0), "model.attention.block_size must be an integer >= 1"),
    (lambda q, k, v: bigbird_attention(q, k, v, 4, -1, 1, 0),
     "model.attention.random_blocks must be an integer >= 0, got -1"),
    (lambda q, k, v: bigbird_attention(q, k, v, 4, 1, -1, 0),
     "model.attention.global_blocks must be an integer >= 0, got -1"),
    (lambda q, k, v: window_attention(q, k, v, 4, mask=torch.ones(1, 1, 32, 32, dtype=torch.bool)),
     r"key-padding mask \(batch, 1, 1, k_len=32\)"),
    (lambda q, k, v: window_attention(torch.cat([q, q], 2), k, v, 4), "got 64 queries and 32 keys"),
])
def test_bad_settings_are_refused_in_one_line_naming_the_setting(call, message):
    q, k, v = qkv(1, 2, 32, 32)
    with pytest.raises(AtencionError, match=message):
        call(q, k, v)


# the work grows linearly ------------------------------------------------------------------------

MEMORY_PROGRAM = """
import json, torch
from atencion.nn.kinds.sparse import bigbird_attention, longformer_attention, window_attention
from atencion.viz.table1 import measure_peak_memory
torch.set_num_threads(1)
kinds = {
    "window": lambda q, k, v: window_attention(q, k, v, 64, True),
    "longformer": lambda q, k, v: longformer_attention(q, k, v, 64, torch.tensor([0, 1]), False),
    "bigbird": lambda q, k, v: bigbird_attention(q, k, v, 32, 1, 1, 0, False),
}
def step(kind, q, k, v):
    kinds[kind](q, k, v)[0].sum().backward()
peaks = {}
for kind in kinds:
    for n in (1024, 4096, 8192):  # the first one warms up
        q, k, v = (torch.randn(1, 2, n, 32, requires_grad=True) for _ in range(3))
        peaks[f"{kind} {n}"] = measure_peak_memory(lambda: step(kind, q, k, v))
print(json.dumps(peaks))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak memory is read from /proc (Linux)")
def test_the_memory_of_each_kind_grows_linearly_with_the_length():
    result = subprocess.run([sys.executable, "-c", MEMORY_PROGRAM], capture_output=True, text=True, check=True,
                            env={"OMP_NUM_THREADS": "1", "PYTHONPATH": ":".join(sys.path)})
    peaks = json.loads(result.stdout)
    for kind in ("window", "longformer", "bigbird"):
        small, large = peaks[f"{kind} 4096"], peaks[f"{kind} 8192"]
        assert 1.5 < large / small < 2.6, (kind, small, large)  # n² would give 4
        assert large < 8192**2 * 2 * 4 / 4  # far below one n × n float32 matrix per head
