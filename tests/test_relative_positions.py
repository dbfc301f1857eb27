"""Relative positions (RoPE, ALiBi, T5's bucketed bias) against Hugging Face's own functions, and
the properties the papers state. The model-level claims (KV cache, beams, packing, padding,
causality) run over every kind in test_model.py."""

import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.errors import AtencionError
from atencion.nn.attention import MultiHeadAttention, RelativeTerms, scaled_dot_product_attention
from atencion.nn.positional import AlibiPositions, RotaryPositions, T5Positions, alibi_slopes, t5_bucket
from conftest import random_batch, small_model


def test_rope_turns_queries_and_keys_as_gpt_neox_does():
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    d_k, base = 16, 5000.0
    config = GPTNeoXConfig(hidden_size=4 * d_k, num_attention_heads=4, max_position_embeddings=64,
                           rope_parameters={"rope_type": "default", "rope_theta": base, "partial_rotary_factor": 1.0})
    assert config.rope_parameters["rope_theta"] == base
    q, k = torch.randn(2, 4, 9, d_k), torch.randn(2, 4, 9, d_k)
    positions = torch.arange(3, 12)
    cos, sin = GPTNeoXRotaryEmbedding(config)(q, positions[None])
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    terms = RelativeTerms(rotary=RotaryPositions(d_k, base).angles(positions))
    torch.testing.assert_close(terms.rotate(q), expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms.rotate(k), expected_k, atol=1e-5, rtol=1e-5)


def test_rope_span_reads_the_angles_of_its_positions_from_a_table_grown_on_demand():
    rope = RotaryPositions(16, 500.0)
    for start, length in ((0, 5), (5, 1), (3, 4), (40, 7), (2, 100)):
        cos, sin = rope.span(start, length)
        expected_cos, expected_sin = rope.angles(torch.arange(start, start + length))
        torch.testing.assert_close(cos, expected_cos)
        torch.testing.assert_close(sin, expected_sin)
        if (start, length) == (5, 1):
            assert len(rope._table[0]) == 10  # twice the 5 positions the first span asked for
    assert len(rope._table[0]) == 102
    rope.to(torch.float64)  # a model moved to another dtype makes its table again
    assert rope.span(0, 3)[0].dtype == torch.float64


def test_a_rope_table_made_in_inference_mode_serves_training_after_it():
    rope = RotaryPositions(8)
    with torch.inference_mode():  # generation grows the table first
        rope.span(0, 6)
    x = torch.randn(6, 8, requires_grad=True)
    RelativeTerms(rotary=rope.span(0, 6)).rotate(x).sum().backward()  # saves cos and sin for backward
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_rope_score_depends_only_on_the_distance_between_query_and_key():
    rope = RotaryPositions(8)
    q, k = torch.randn(8), torch.randn(8)

    def score(m: int, n: int) -> float:
        turn = lambda x, p: RelativeTerms(rotary=rope.angles(torch.tensor([p]))).rotate(x[None])[0]  # noqa: E731
        return float(turn(q, m) @ turn(k, n))

    for distance in (0, 3, -5):
        scores = [score(m, m - distance) for m in (5, 17, 40)]
        assert max(scores) - min(scores) < 1e-4, scores
    assert abs(score(10, 7) - score(10, 2)) > 1e-3


def test_alibi_slopes_for_8_heads_are_the_powers_of_one_half():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)]))


@pytest.mark.parametrize("heads", [8, 12, 6])
def test_alibi_slopes_equal_blooms_including_head_counts_that_are_not_powers_of_two(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    mask = torch.ones(1, 10)
    bloom = build_alibi_tensor(mask, heads, torch.float32).view(heads, 10)  # slope_h * key position
    torch.testing.assert_close(bloom[:, 1], alibi_slopes(heads))
    # Bloom's bias is slope * j; ours is -slope * (i - j): the same up to a constant per query row
    ours = AlibiPositions(heads).bias(torch.arange(10), torch.arange(10), causal=True)
    difference = ours - bloom[:, None, :]
    torch.testing.assert_close(difference, difference[:, :, :1].expand_as(difference))


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("buckets, distance", [(32, 128), (16, 40)])
def test_t5_buckets_equal_hugging_faces(bidirectional, buckets, distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-300, 301)[None, :] + torch.zeros(3, 1, dtype=torch.long)
    expected = T5Attention._relative_position_bucket(relative, bidirectional, buckets, distance)
    assert torch.equal(t5_bucket(relative, bidirectional, buckets, distance), expected)


def test_t5_bias_in_an_encoder_sees_both_directions_and_in_a_decoder_looks_back():
    t5 = T5Positions(4)
    positions = torch.arange(6)
    both = t5.bias(positions, positions, causal=False)
    back = t5.bias(positions, positions, causal=True)
    assert not torch.equal(both[:, 2, 3], both[:, 3, 2])     # +1 and -1 are different buckets
    assert torch.equal(back[:, 2, 3], back[:, 2, 5])         # the future is one bucket (then masked)


@pytest.mark.parametrize("kind", ["rope", "alibi", "t5"])
def test_relative_kinds_add_nothing_to_the_embeddings(kind):
    model = small_model(positional=kind)
    assert model.encoder.positions is None and model.decoder.positions is None
    assert (model.encoder.relative is not None) and (model.decoder.relative is not model.encoder.relative)


def test_t5_uses_one_table_per_stack_shared_by_its_layers():
    model = small_model(positional="t5", n_layers=3)
    tables = [name for name, _ in model.named_parameters() if "relative" in name]
    assert tables == ["encoder.relative.weight", "decoder.relative.weight"]


@pytest.mark.parametrize("kind", ["sinusoidal", "learned", "rope", "alibi", "t5"])
def test_the_fused_path_equals_the_explicit_path_for_every_kind(kind):
    model = small_model(positional=kind)
    src, tgt = random_batch(model.cfg)
    explicit, _ = model(src, tgt, return_attention=True)
    torch.testing.assert_close(model(src, tgt), explicit, atol=1e-5, rtol=1e-5)


def test_a_float_bias_on_the_fused_kernel_equals_equation_one_with_the_bias():
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    bias = torch.randn(1, 3, 5, 7)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[0, 0, 1] = False  # a query with no visible key: zeros, not NaN
    fused, _ = scaled_dot_product_attention(q, k, v, mask, bias=bias)
    explicit, weights = scaled_dot_product_attention(q, k, v, mask, need_weights=True, bias=bias)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    scores = (q @ k.transpose(-2, -1) / 8 ** 0.5 + bias).masked_fill(~mask, float("-inf"))
    expected = torch.softmax(scores, -1).nan_to_num(0.0)
    torch.testing.assert_close(weights, expected)
    assert fused[0, :, 1].abs().max() == 0


@pytest.mark.parametrize("kind", ["rope", "alibi", "t5"])
def test_with_a_relative_kind_self_attention_is_not_permutation_equivariant(kind):
    """Without positions, permuting the inputs permutes the outputs (test_attention.py); a
    relative kind makes attention depend on where each token sits."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=20, d_model=16, n_heads=2, d_ff=32, n_layers=1, positional=kind)
    model = Transformer(cfg).eval()
    attention: MultiHeadAttention = model.encoder.layers[0].self_attn
    x = torch.randn(1, 6, 16)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    where = torch.arange(6)
    relative = model.encoder.relative
    terms = RelativeTerms(rotary=relative.angles(where)) if kind == "rope" else \
        RelativeTerms(relative=relative, q_pos=where, k_pos=where, causal=False)
    out, _ = attention(x, positions=terms)
    out_perm, _ = attention(x[:, perm], positions=terms)
    assert (out_perm - out[:, perm]).abs().max() > 1e-3
    plain, _ = attention(x)
    plain_perm, _ = attention(x[:, perm])
    torch.testing.assert_close(plain_perm, plain[:, perm], atol=1e-5, rtol=1e-5)


def test_a_model_directory_written_before_relative_kinds_loads_with_the_defaults(tmp_path):
    model = small_model()
    model.save(tmp_path)
    config = tmp_path / "config.json"
    import json

    values = json.loads(config.read_text())
    for key in ("rope_base", "relative_buckets", "relative_max_distance"):
        values.pop(key)
    config.write_text(json.dumps(values))
    loaded = Transformer.load(tmp_path).eval()
    src, tgt = random_batch(model.cfg)
    torch.testing.assert_close(loaded(src, tgt), model(src, tgt))


@pytest.mark.parametrize("values, message", [
    ({"positional": "relative"}, "positional must be one of"),
    ({"positional": "rope", "d_model": 15, "n_heads": 5}, "even d_k"),
    ({"positional": "t5", "relative_buckets": 2}, "relative_buckets"),
    ({"rope_base": 0.5}, "rope_base must be a number > 1"),
])
def test_impossible_relative_settings_are_refused_naming_the_key(values, message):
    with pytest.raises(AtencionError, match=message):
        ModelConfig(**{"vocab_size": 20, "d_model": 16, "n_heads": 2, **values})


@pytest.mark.parametrize("fmt", ["ctranslate2", "hf", "onnx"])
def test_exporting_relative_positions_is_refused_before_anything_is_written(fmt, tmp_path):
    from atencion.export import export

    with pytest.raises(AtencionError, match="relative positions|positional"):
        export(small_model(positional="rope"), tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()
