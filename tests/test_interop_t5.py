"""Hugging Face T5 (original v1.0) ↔ atencion: the same logits both ways, incremental decoding,
the t5-small parameter count, and refusals."""

import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.errors import AtencionError

transformers = pytest.importorskip("transformers")

from atencion.interop.t5 import config_from_t5, from_t5, to_t5  # noqa: E402


def _config(**overrides):
    # max distance 20: with 26 source and 24 target positions, both stacks meet exact buckets,
    # logarithmic ones and the last bucket (distances beyond 20)
    values = dict(vocab_size=99, d_model=64, num_heads=4, d_kv=16, d_ff=128, num_layers=2,
                  relative_attention_num_buckets=32, relative_attention_max_distance=20,
                  feed_forward_proj="relu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    values.update(overrides)
    return transformers.T5Config(**values)


@pytest.fixture(scope="module")
def t5():
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(_config()).eval()
    with torch.no_grad():  # move every parameter (RMSNorm gains start at 1) so the test sees them all
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


def _batch():
    g = torch.Generator().manual_seed(3)
    src = torch.randint(2, 99, (3, 26), generator=g)
    src[1, 20:] = 0  # right padding (T5's pad is 0)
    src[2, 9:] = 0
    tgt = torch.randint(2, 99, (3, 24), generator=g)
    tgt[:, 0] = 0  # T5 starts the decoder from the pad id
    return src, tgt


def _hf_logits(hf, src, tgt):
    with torch.no_grad():
        return hf(input_ids=src, attention_mask=src != 0, decoder_input_ids=tgt).logits


def test_config_matches_the_t5_preset_settings(t5):
    cfg = config_from_t5(t5.config)
    preset = ModelConfig.preset("t5-small", vocab_size=99)
    for key in ("arch", "positional", "norm", "norm_first", "bias", "scale_attention", "scale_embedding",
                "scale_output", "share_embeddings", "tie_output", "layer_norm_eps", "activation"):
        assert getattr(cfg, key) == getattr(preset, key), key
    assert (cfg.pad_id, cfg.bos_id, cfg.eos_id) == (0, 0, 1)
    assert (cfg.relative_buckets, cfg.relative_max_distance) == (32, 20)


def test_from_t5_gives_the_same_logits(t5):
    model = from_t5(t5)
    assert not model.training
    src, tgt = _batch()
    expected = _hf_logits(t5, src, tgt)
    with torch.no_grad():
        ours = model(src, tgt)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max() <= 1e-4


def test_the_relative_table_is_taken_from_block_0(t5):
    model = from_t5(t5)
    assert torch.equal(model.encoder.relative.weight,
                       t5.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight)
    assert torch.equal(model.decoder.relative.weight,
                       t5.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight)
    assert model.generator.weight is model.encoder.embed.weight is model.decoder.embed.weight


def test_to_t5_round_trip_gives_the_same_logits(t5):
    model = from_t5(t5)
    back = to_t5(model)
    assert not back.training
    src, tgt = _batch()
    with torch.no_grad():
        ours = model(src, tgt)
    assert (_hf_logits(back, src, tgt) - ours).abs().max() <= 1e-4
    assert (_hf_logits(back, src, tgt) - _hf_logits(t5, src, tgt)).abs().max() <= 1e-4
    theirs = t5.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_incremental_decoding_equals_the_full_pass(t5):
    model = from_t5(t5)
    src, tgt = _batch()
    with torch.no_grad():
        full = model(src, tgt)
        memory, mask = model.encode(src)
        state = model.init_state(memory, mask)
        steps = torch.cat([model.decode_step(tgt[:, t:t + 1], state) for t in range(tgt.size(1))], dim=1)
    assert (steps - full).abs().max() <= 1e-4
    assert (steps - _hf_logits(t5, src, tgt)).abs().max() <= 1e-4


def test_t5_small_preset_has_the_parameter_count_of_hugging_face_t5_small():
    with torch.device("meta"):
        hf = transformers.T5ForConditionalGeneration(transformers.T5Config())
        ours = Transformer(ModelConfig.preset("t5-small", vocab_size=32128))
    expected = sum(p.numel() for p in hf.parameters())
    assert ours.num_parameters() == expected == 60_506_624


def test_scale_decoder_outputs_false_is_imported_and_exported():
    torch.manual_seed(1)
    hf = transformers.T5ForConditionalGeneration(_config(tie_word_embeddings=False)).eval()
    assert hf.config.scale_decoder_outputs is False
    model = from_t5(hf)
    assert model.cfg.scale_output is False
    src, tgt = _batch()
    with torch.no_grad():
        ours = model(src, tgt)
    assert (ours - _hf_logits(hf, src, tgt)).abs().max() <= 1e-4
    assert to_t5(model).config.scale_decoder_outputs is False


@pytest.mark.parametrize("overrides, key", [
    (dict(feed_forward_proj="gated-gelu"), "feed_forward_proj"),
    (dict(d_kv=8), "d_kv"),
])
def test_config_from_t5_refuses_what_atencion_cannot_reproduce(overrides, key):
    with pytest.raises(AtencionError, match=key):
        config_from_t5(_config(**overrides))


@pytest.mark.parametrize("override, key", [
    (dict(bias=True), "bias"),
    (dict(norm="layernorm"), "norm"),
    (dict(norm_first=False), "norm_first"),
    (dict(scale_attention=True), "scale_attention"),
    (dict(scale_embedding=True), "scale_embedding"),
    (dict(tie_output=False), "tie_output"),
    (dict(output_bias=True), "output_bias"),
    (dict(positional="sinusoidal"), "positional"),
    (dict(share_embeddings=False, tgt_vocab_size=50), "share_embeddings"),
])
def test_to_t5_refuses_what_t5_cannot_express(override, key):
    cfg = ModelConfig.preset("t5-tiny", vocab_size=60, n_layers=1, d_model=32, d_ff=64, **override)
    with pytest.raises(AtencionError, match=key):
        to_t5(Transformer(cfg))


def test_to_t5_refuses_a_decoder_only_model():
    cfg = ModelConfig.preset("t5-tiny", vocab_size=60, n_layers=1, d_model=32, d_ff=64, arch="decoder")
    with pytest.raises(AtencionError, match="arch"):
        to_t5(Transformer(cfg))
