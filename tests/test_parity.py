"""Parity with independent implementations: torch.nn.Transformer and Hugging Face Marian."""

import pytest
import torch
from torch import nn

from atencion.interop.marian import from_marian
from conftest import random_batch, small_model


def _copy_attention(theirs: nn.MultiheadAttention, ours) -> None:
    theirs.in_proj_weight.copy_(ours.in_proj.weight)
    theirs.in_proj_bias.copy_(ours.in_proj.bias)
    theirs.out_proj.weight.copy_(ours.out_proj.weight)
    theirs.out_proj.bias.copy_(ours.out_proj.bias)


def _copy_ffn(theirs, ours) -> None:
    theirs.linear1.load_state_dict(ours.ffn.linear1.state_dict())
    theirs.linear2.load_state_dict(ours.ffn.linear2.state_dict())


def _torch_transformer_from(model) -> nn.Transformer:
    """torch.nn.Transformer with this model's weights (its final norms only for pre-LN)."""
    cfg = model.cfg
    kw = dict(d_model=cfg.d_model, nhead=cfg.n_heads, dim_feedforward=cfg.d_ff, dropout=0.0,
              batch_first=True, norm_first=cfg.norm_first, layer_norm_eps=cfg.layer_norm_eps)
    final = (lambda: nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)) if cfg.norm_first else (lambda: None)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**kw), cfg.n_layers, norm=final(),
                                    enable_nested_tensor=False)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**kw), cfg.n_layers, norm=final())
    # nn.Transformer re-initialises its parameters when built: build it first, then copy.
    reference = nn.Transformer(d_model=cfg.d_model, nhead=cfg.n_heads, custom_encoder=encoder,
                               custom_decoder=decoder, batch_first=True).eval()
    with torch.no_grad():
        for theirs, ours in zip(encoder.layers, model.encoder.layers):
            _copy_attention(theirs.self_attn, ours.self_attn)
            _copy_ffn(theirs, ours)
            theirs.norm1.load_state_dict(ours.res_self.norm.state_dict())
            theirs.norm2.load_state_dict(ours.res_ffn.norm.state_dict())
        for theirs, ours in zip(decoder.layers, model.decoder.layers):
            _copy_attention(theirs.self_attn, ours.self_attn)
            _copy_attention(theirs.multihead_attn, ours.cross_attn)
            _copy_ffn(theirs, ours)
            theirs.norm1.load_state_dict(ours.res_self.norm.state_dict())
            theirs.norm2.load_state_dict(ours.res_cross.norm.state_dict())
            theirs.norm3.load_state_dict(ours.res_ffn.norm.state_dict())
        if cfg.norm_first:
            encoder.norm.load_state_dict(model.encoder.final_norm.state_dict())
            decoder.norm.load_state_dict(model.decoder.final_norm.state_dict())
    return reference


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_matches_torch_nn_transformer_with_padding(norm_first):
    model = small_model(norm_first=norm_first)
    reference = _torch_transformer_from(model)
    src, tgt = random_batch(model.cfg, batch=4, src_len=9, tgt_len=7)
    pad = src == model.cfg.pad_id
    assert pad.any()
    with torch.no_grad():
        src_x = model.encoder.embed(src) + model.encoder.positions(src.size(1))
        tgt_x = model.decoder.embed(tgt) + model.decoder.positions(tgt.size(1))
        future = nn.Transformer.generate_square_subsequent_mask(tgt.size(1)) < 0  # True = hidden
        hidden = reference(src_x, tgt_x, tgt_mask=future, src_key_padding_mask=pad,
                           memory_key_padding_mask=pad)
        expected = model.generator(hidden)
        ours = model(src, tgt)
    assert (ours - expected).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def marian():
    transformers = pytest.importorskip("transformers")
    config = transformers.MarianConfig(
        vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        activation_function="relu", scale_embedding=True, max_position_embeddings=128,
        pad_token_id=59, decoder_start_token_id=59, eos_token_id=0, dropout=0.1,
    )
    torch.manual_seed(0)
    hf = transformers.MarianMTModel(config).eval()
    with torch.no_grad():  # move every parameter away from its default so the test sees them all
        for name, p in hf.named_parameters():
            if "embed_positions" not in name:  # the fixed sinusoids stay as they are
                p.add_(0.1 * torch.randn_like(p))
        hf.final_logits_bias.normal_()
    return hf


def _marian_batch(hf):
    g = torch.Generator().manual_seed(3)
    pad = hf.config.pad_token_id
    src = torch.randint(1, pad, (3, 10), generator=g)
    src[1, 7:] = pad
    src[2, 4:] = pad
    tgt = torch.randint(1, pad, (3, 8), generator=g)
    tgt[:, 0] = hf.config.decoder_start_token_id
    return src, tgt


def test_matches_hugging_face_marian_logits(marian):
    model = from_marian(marian).eval()
    src, tgt = _marian_batch(marian)
    with torch.no_grad():
        expected = marian(input_ids=src, attention_mask=src != marian.config.pad_token_id,
                          decoder_input_ids=tgt).logits
        ours = model(src, tgt)
    assert (ours - expected).abs().max() <= 1e-4


def test_marian_import_needs_the_feature_permutation(marian):
    """Without handling Marian's sines-then-cosines table the logits differ: the test can fail."""
    from atencion.interop import marian as importer

    identity = lambda d: torch.arange(d)  # noqa: E731
    original = importer.marian_to_paper_permutation
    importer.marian_to_paper_permutation = identity
    try:
        model = from_marian(marian).eval()
    finally:
        importer.marian_to_paper_permutation = original
    src, tgt = _marian_batch(marian)
    with torch.no_grad():
        expected = marian(input_ids=src, attention_mask=src != marian.config.pad_token_id,
                          decoder_input_ids=tgt).logits
        assert (model(src, tgt) - expected).abs().max() > 1e-2


def test_marian_with_unsupported_activation_is_refused():
    transformers = pytest.importorskip("transformers")
    from atencion.interop.marian import config_from_marian

    config = transformers.MarianConfig(vocab_size=10, d_model=8, encoder_attention_heads=2,
                                       decoder_attention_heads=2, activation_function="swish")
    with pytest.raises(ValueError, match="activation_function='swish'"):
        config_from_marian(config)
