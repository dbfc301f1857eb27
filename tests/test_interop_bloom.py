import pytest
import torch

from atencion.errors import AtencionError
from atencion.interop.bloom import config_from_bloom, from_bloom, to_bloom
from atencion.nn.positional import alibi_slopes

transformers = pytest.importorskip("transformers")


def _bloom(n_head: int):
    config = transformers.BloomConfig(n_layer=2, hidden_size=96, n_head=n_head, vocab_size=99,
                                      apply_residual_connection_post_layernorm=False)
    torch.manual_seed(n_head)
    hf = transformers.BloomForCausalLM(config).eval()
    with torch.no_grad():  # LayerNorms start at 1 and 0, biases at 0: move them so the test sees them all
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module", params=[8, 12], ids=["8-heads", "12-heads"])
def bloom(request):
    return _bloom(request.param)


def _ids(batch=3, length=12, seed=3):
    return torch.randint(0, 99, (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_imported_bloom_matches_hugging_face_logits(bloom):
    model = from_bloom(bloom)
    cfg = model.cfg
    assert not model.training
    assert (cfg.positional, cfg.embedding_norm, cfg.norm_first, cfg.activation) == ("alibi", True, True, "gelu-tanh")
    assert model.decoder.positions is None and model.generator.weight is model.decoder.embed.weight
    ids = _ids()
    with torch.no_grad():
        ours = model(ids)
    expected = _hf_logits(bloom, ids)
    assert ours.shape == expected.shape == (3, 12, 99)
    assert (ours - expected).abs().max() <= 1e-4


def test_kv_cache_decoding_matches_hugging_face(bloom):
    model = from_bloom(bloom)
    ids = _ids(batch=2, length=9, seed=5)
    state = model.init_state()
    with torch.no_grad():
        steps = torch.cat([model.decode_step(ids[:, t:t + 1], state) for t in range(ids.size(1))], dim=1)
    assert (steps - _hf_logits(bloom, ids)).abs().max() <= 1e-4


def test_import_then_export_gives_back_the_same_model(bloom):
    back = to_bloom(from_bloom(bloom))
    assert isinstance(back, transformers.BloomForCausalLM) and not back.training
    theirs = bloom.state_dict()
    for name, value in back.state_dict().items():
        assert torch.equal(value, theirs[name]), name
    ids = _ids(seed=4)
    assert (_hf_logits(back, ids) - _hf_logits(bloom, ids)).abs().max() <= 1e-4


def test_the_qkv_reordering_matters():
    """Loading query_key_value without the per-head reordering gives other logits: the test can fail."""
    hf = _bloom(8)
    model = from_bloom(hf)
    with torch.no_grad():
        for i, layer in enumerate(model.decoder.layers):
            qkv = hf.transformer.h[i].self_attention.query_key_value
            layer.self_attn.in_proj.weight.copy_(qkv.weight)
            layer.self_attn.in_proj.bias.copy_(qkv.bias)
        ids = _ids()
        assert (model(ids) - _hf_logits(hf, ids)).abs().max() > 1e-2


@pytest.mark.parametrize("heads", [8, 12, 6])
def test_alibi_slopes_are_blooms(heads):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    assert torch.allclose(alibi_slopes(heads), _get_alibi_slopes(heads, torch.device("cpu")), rtol=1e-6, atol=0)


def test_post_layernorm_residual_is_refused():
    config = transformers.BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=10,
                                      apply_residual_connection_post_layernorm=True)
    with pytest.raises(AtencionError, match="apply_residual_connection_post_layernorm"):
        config_from_bloom(config)


def test_to_bloom_refuses_what_bloom_cannot_express():
    from atencion import ModelConfig, Transformer

    gpt = Transformer(ModelConfig.preset("gpt-tiny", vocab_size=20, n_layers=1))
    with pytest.raises(AtencionError, match="positional='learned'"):
        to_bloom(gpt)
