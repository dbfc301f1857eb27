import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.errors import AtencionError
from atencion.interop.gpt2 import config_from_gpt2, from_gpt2, to_gpt2
from conftest import small_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=99, n_positions=32,
                                     bos_token_id=98, eos_token_id=98)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # LayerNorms start at 1 and 0, biases at 0: move them so the test sees them all
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


def _ids(batch=3, length=12, seed=3):
    return torch.randint(0, 99, (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_imported_gpt2_matches_hugging_face_logits(gpt2):
    model = from_gpt2(gpt2)
    assert not model.training
    assert model.cfg.arch == "decoder" and model.cfg.positional == "learned" and model.cfg.norm_first
    assert model.generator.weight is model.decoder.embed.weight  # the tied head
    ids = _ids()
    with torch.no_grad():
        ours = model(ids)
    expected = _hf_logits(gpt2, ids)
    assert ours.shape == expected.shape == (3, 12, 99)
    assert (ours - expected).abs().max() <= 1e-4


def test_import_then_export_gives_back_the_same_logits(gpt2):
    back = to_gpt2(from_gpt2(gpt2))
    assert isinstance(back, transformers.GPT2LMHeadModel) and not back.training
    ids = _ids(seed=4)
    assert (_hf_logits(back, ids) - _hf_logits(gpt2, ids)).abs().max() <= 1e-4
    theirs = gpt2.state_dict()
    for name, value in back.state_dict().items():
        assert torch.equal(value, theirs[name]), name


def test_exported_atencion_model_matches(gpt2):
    """An atencion model (not imported) exported to GPT-2, untied head and no biases included."""
    model = small_model(seed=5, arch="decoder", positional="learned", norm_first=True, scale_embedding=False,
                        activation="gelu-tanh", max_positions=16, tie_output=False, bias=False)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model(ids)
    assert (_hf_logits(to_gpt2(model), ids) - expected).abs().max() <= 1e-4


def test_kv_cache_decoding_matches_hugging_face(gpt2):
    model = from_gpt2(gpt2)
    ids = _ids(batch=2, length=10, seed=5)
    expected = _hf_logits(gpt2, ids)
    state = model.init_state()
    with torch.no_grad():
        steps = [model.decode_step(ids[:, t:t + 1], state) for t in range(ids.size(1))]
    assert (torch.cat(steps, dim=1) - expected).abs().max() <= 1e-4


def test_to_gpt2_refuses_what_gpt2_cannot_express():
    encoder = Transformer(ModelConfig(vocab_size=20, arch="encoder", n_layers=1, d_model=16, d_ff=32, n_heads=2))
    with pytest.raises(AtencionError, match="arch='encoder'"):
        to_gpt2(encoder)
    rope = Transformer(ModelConfig(vocab_size=20, arch="decoder", n_layers=1, d_model=16, d_ff=32, n_heads=2,
                                   positional="rope", norm_first=True, scale_embedding=False))
    with pytest.raises(AtencionError, match="positional='rope'"):
        to_gpt2(rope)


def test_config_from_gpt2_refuses_layer_scaled_attention():
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=10, n_positions=8,
                                     scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(AtencionError, match="scale_attn_by_inverse_layer_idx"):
        config_from_gpt2(config)


def test_gpt2_preset_has_the_parameter_count_of_gpt2_small():
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config())
        ours = Transformer(ModelConfig.preset("gpt2", vocab_size=50257))
    expected = sum(p.numel() for p in hf.parameters())  # the tied head counted once
    assert ours.num_parameters() == expected == 124_439_808
