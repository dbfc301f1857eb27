import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.errors import AtencionError
from atencion.interop.bert import config_from_bert, from_bert, to_bert
from conftest import small_model

transformers = pytest.importorskip("transformers")

PAD = 0


def _bert(hidden_act="gelu", seed=0, **overrides):
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                     vocab_size=99, max_position_embeddings=40, type_vocab_size=2,
                                     hidden_act=hidden_act, pad_token_id=PAD, **overrides)
    torch.manual_seed(seed)
    hf = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():  # LayerNorms start at 1 and 0, biases at 0: move them so the test sees them all
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module")
def bert():
    return _bert()


def _batch(batch=3, length=12, seed=3, vocab=99):
    """Rows right-padded by 0, 3 and 7 pads; token type 1 on the second half of each row's real tokens."""
    ids = torch.randint(PAD + 1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
    types = torch.zeros_like(ids)
    for row, pads in enumerate((0, 3, 7)[:batch]):
        real = length - pads
        ids[row, real:] = PAD
        types[row, real // 2:real] = 1
    return ids, types


def _hf_logits(hf, ids, types=None):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=(ids != PAD).long(), token_type_ids=types).logits


def _ours(model, ids, types=None):
    with torch.no_grad():
        return model(ids, token_type_ids=types)


def _assert_close_at_real_positions(ours, expected, ids):
    assert ours.shape == expected.shape
    real = ids != PAD
    assert 0 < real.sum() < real.numel()  # padding is there, and real tokens
    assert (ours[real] - expected[real]).abs().max() <= 1e-4


def test_imported_bert_matches_hugging_face_logits(bert):
    model = from_bert(bert)
    assert not model.training
    cfg = model.cfg
    assert (cfg.arch, cfg.positional, cfg.norm_first, cfg.embedding_norm, cfg.scale_embedding) == \
        ("encoder", "learned", False, True, False)
    assert (cfg.type_vocab_size, cfg.pad_id, cfg.layer_norm_eps, cfg.activation) == (2, PAD, 1e-12, "gelu")
    assert model.mlm_head.weight is model.encoder.embed.weight  # the tied head
    ids, types = _batch()
    ours, expected = _ours(model, ids, types), _hf_logits(bert, ids, types)
    assert expected.shape == (3, 12, 99)
    _assert_close_at_real_positions(ours, expected, ids)
    # the token types matter: without them both sides change, and still agree
    assert (_hf_logits(bert, ids) - expected)[ids != PAD].abs().max() > 1e-3
    _assert_close_at_real_positions(_ours(model, ids), _hf_logits(bert, ids), ids)


@pytest.mark.parametrize("hidden_act", ["relu", "gelu_new", "gelu_pytorch_tanh"])
def test_imported_activations_match(hidden_act):
    hf = _bert(hidden_act, seed=1)
    model = from_bert(hf)
    assert model.cfg.activation == {"relu": "relu"}.get(hidden_act, "gelu-tanh")
    ids, types = _batch(seed=5)
    _assert_close_at_real_positions(_ours(model, ids, types), _hf_logits(hf, ids, types), ids)


def test_import_then_export_gives_back_the_same_model(bert):
    model = from_bert(bert)
    back = to_bert(model)
    assert isinstance(back, transformers.BertForMaskedLM) and not back.training
    assert back.cls.predictions.decoder.weight is back.bert.embeddings.word_embeddings.weight
    theirs = bert.state_dict()
    assert set(back.state_dict()) == set(theirs)
    for name, value in back.state_dict().items():
        assert torch.equal(value, theirs[name]), name
    ids, types = _batch(seed=4)
    expected = _hf_logits(back, ids, types)
    _assert_close_at_real_positions(_ours(model, ids, types), expected, ids)
    _assert_close_at_real_positions(expected, _hf_logits(bert, ids, types), ids)
    assert from_bert(back).cfg == model.cfg


@pytest.mark.parametrize("activation", ["gelu", "gelu-tanh"])
def test_exported_atencion_model_matches(activation):
    """An atencion model (not imported) exported to BERT; without token types, BERT gets one zero type row."""
    model = small_model(seed=5, arch="encoder", positional="learned", scale_embedding=False, embedding_norm=True,
                        activation=activation, max_positions=16, type_vocab_size=0, layer_norm_eps=1e-12)
    hf = to_bert(model)
    assert hf.config.type_vocab_size == 1 and not hf.bert.embeddings.token_type_embeddings.weight.any()
    ids, _ = _batch(batch=3, length=10, seed=6, vocab=model.cfg.vocab_size)
    _assert_close_at_real_positions(_hf_logits(hf, ids), _ours(model, ids), ids)


@pytest.mark.parametrize("key, value", [("arch", "decoder"), ("norm_first", True), ("positional", "sinusoidal"),
                                        ("norm", "rmsnorm"), ("scale_embedding", True), ("embedding_norm", False),
                                        ("bias", False), ("scale_attention", False), ("num_labels", 2)])
def test_to_bert_refuses_what_bert_cannot_express(key, value):
    bert_like = dict(arch="encoder", positional="learned", scale_embedding=False, embedding_norm=True,
                     activation="gelu", type_vocab_size=2)
    bert_like[key] = value
    if key == "arch":
        del bert_like["type_vocab_size"]  # token types are an encoder's
    model = Transformer(ModelConfig(vocab_size=20, n_layers=1, d_model=16, d_ff=32, n_heads=2, **bert_like))
    with pytest.raises(AtencionError, match=f"{key}={value!r}") as err:
        to_bert(model)
    assert "\n" not in str(err.value)


def test_from_bert_refuses_a_model_that_is_not_bert():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=10,
                                                                n_positions=8))
    with pytest.raises(AtencionError, match="GPT2LMHeadModel.*'gpt2'"):
        from_bert(gpt2)
    with pytest.raises(AtencionError, match="model_type 'gpt2'"):
        config_from_bert(gpt2.config)
    with pytest.raises(AtencionError, match="BertModel"):  # BERT without its MLM head
        from_bert(transformers.BertModel(transformers.BertConfig(num_hidden_layers=1, hidden_size=16,
                                                                 num_attention_heads=2, intermediate_size=32,
                                                                 vocab_size=10)))


@pytest.mark.parametrize("overrides, key", [(dict(is_decoder=True), "is_decoder"),
                                            (dict(hidden_act="silu"), "hidden_act"),
                                            (dict(position_embedding_type="relative_key"), "position_embedding_type"),
                                            (dict(pad_token_id=None), "pad_token_id")])
def test_config_from_bert_refuses_what_atencion_cannot_compute(overrides, key):
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                     vocab_size=10, **overrides)
    with pytest.raises(AtencionError, match=key):
        config_from_bert(config)


def test_from_bert_refuses_an_untied_head():
    hf = _bert(tie_word_embeddings=False)
    with torch.no_grad():
        hf.cls.predictions.decoder.weight.add_(1.0)
    with pytest.raises(AtencionError, match="cls.predictions.decoder.weight"):
        from_bert(hf)


def test_bert_base_preset_has_the_parameter_count_of_bert_base():
    with torch.device("meta"):
        hf = transformers.BertForMaskedLM(transformers.BertConfig())
        ours = Transformer(ModelConfig.preset("bert-base", vocab_size=30522))
    expected = sum(p.numel() for p in hf.parameters())  # the tied head counted once
    assert ours.num_parameters() == expected == 109_514_298
