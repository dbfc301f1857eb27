"""The family from one set of blocks: encoder-only (BERT) and decoder-only (GPT) models, T5's
settings, their heads and presets. Parity with Hugging Face is in test_interop_*.py."""

import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.errors import AtencionError

KINDS = ["sinusoidal", "learned", "rope", "alibi", "t5"]


def tiny(arch: str, **overrides) -> Transformer:
    torch.manual_seed(0)
    values = dict(vocab_size=50, n_layers=2, d_model=32, d_ff=64, n_heads=4, dropout=0.0, arch=arch)
    values.update(overrides)
    model = Transformer(ModelConfig(**values)).eval()
    with torch.no_grad():  # LayerNorm gains and biases start at 1 and 0: randomise them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def ids(batch=3, length=8, seed=1, pad_rows=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(4, 50, (batch, length), generator=g)
    if pad_rows:
        for row in range(1, batch):
            x[row, length - 2 * row:] = 0
    return x


@pytest.mark.parametrize("positional", KINDS)
def test_a_decoder_never_sees_the_future(positional):
    model = tiny("decoder", positional=positional)
    x = ids(pad_rows=False)
    logits = model(x)
    changed = x.clone()
    changed[:, 5:] = torch.randint(4, 50, changed[:, 5:].shape)
    after = model(changed)
    torch.testing.assert_close(after[:, :5], logits[:, :5])
    assert (after[:, 5:] - logits[:, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("positional", KINDS)
def test_an_encoder_sees_both_ways_and_padding_changes_nothing(positional):
    model = tiny("encoder", positional=positional)
    x = ids()
    logits = model(x)
    changed = x.clone()
    changed[0, 6] = (changed[0, 6] + 1 - 4) % 46 + 4
    assert (model(changed)[0, :6] - logits[0, :6]).abs().max() > 1e-4  # earlier positions see a later one
    padded = torch.cat([x, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded)[:, :8][x != 0], logits[x != 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positional", KINDS)
@pytest.mark.parametrize("group", [1, 3])
def test_decoder_only_kv_cache_equals_the_full_forward_pass(positional, group):
    model = tiny("decoder", positional=positional)
    x = ids(batch=2, pad_rows=False).repeat_interleave(group, dim=0)
    full = model(x)
    state = model.init_state(group=group)
    steps = [model.decode_step(x[:, :3], state)]
    steps += [model.decode_step(x[:, t: t + 1], state) for t in range(3, x.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_a_decoding_step_asked_for_its_last_positions_gives_those_of_the_full_pass():
    model = tiny("decoder")
    x = ids(batch=2, pad_rows=False)
    full = model(x)
    state = model.init_state()
    first = model.decode_step(x[:, :5], state, last=1)
    assert first.shape == (2, 1, full.size(-1))
    torch.testing.assert_close(first, full[:, 4:5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.decode_step(x[:, 5:8], state, last=2), full[:, 6:8], atol=1e-5, rtol=1e-5)
    assert state.offset == 8  # every new token is cached, whatever the logits kept


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
@pytest.mark.parametrize("positional", KINDS)
def test_the_fused_path_equals_the_explicit_path(arch, positional):
    model = tiny(arch, positional=positional)
    x = ids(pad_rows=arch == "encoder")
    explicit, attention = model(x, return_attention=True)
    real = x != 0  # an encoder's output at padding is never read (the fused path skips it)
    torch.testing.assert_close(model(x)[real], explicit[real], atol=1e-5, rtol=1e-5)
    assert len(next(iter(attention.values()))) == 2


def test_bert_settings_token_types_and_the_mlm_head_change_the_logits():
    model = tiny("encoder", type_vocab_size=2, embedding_norm=True, activation="gelu", positional="learned",
                 max_positions=16)
    x = ids()
    types = torch.zeros_like(x)
    types[:, 4:] = 1
    assert (model(x, token_type_ids=types) - model(x)).abs().max() > 1e-4
    assert model(x).shape == (3, 8, 50)
    with pytest.raises(AtencionError, match="token_type_ids"):
        model(x, token_type_ids=torch.full_like(x, 2))


def test_t5_settings_rmsnorm_no_scaling_and_the_scaled_tied_output():
    model = tiny("encoder-decoder", positional="t5", norm="rmsnorm", norm_first=True, bias=False,
                 scale_attention=False, scale_output=True, scale_embedding=False)
    assert isinstance(model.encoder.layers[0].res_self.norm, torch.nn.RMSNorm)
    assert all("bias" not in name for name, _ in model.named_parameters() if "layers" in name)
    x = ids()
    hidden = model(x, x, project=False)
    torch.testing.assert_close(model(x, x), model.generator(hidden))
    unscaled = Transformer(ModelConfig(**{**model.cfg.to_dict(), "scale_output": False})).eval()
    unscaled.load_state_dict(model.state_dict())
    torch.testing.assert_close(unscaled(x, x) * 32 ** -0.5, model(x, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch, pooling", [("encoder", "first"), ("encoder", "mean"), ("decoder", "mean")])
def test_the_classification_head_pools_as_configured_and_ignores_padding(arch, pooling):
    model = tiny(arch, num_labels=3, pooling=pooling)
    x = ids()
    logits = model.classify(x)
    assert logits.shape == (3, 3)
    padded = torch.cat([x, torch.zeros(3, 2, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model.classify(padded), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, vocab, millions", [("bert-base", 30522, 110), ("gpt2", 50257, 124),
                                                   ("t5-small", 32128, 60)])
def test_presets_have_their_published_parameter_counts(name, vocab, millions):
    cfg = ModelConfig.preset(name, vocab_size=vocab)
    with torch.device("meta"):
        n = Transformer(cfg).num_parameters()
    assert abs(n / 1e6 - millions) < 0.6, n


def test_bert_tiny_is_turc_et_al():
    cfg = ModelConfig.preset("bert-tiny", vocab_size=30522)
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_ff) == ("encoder", 2, 128, 2, 512)


def test_a_saved_decoder_loads_as_a_decoder(tmp_path):
    model = tiny("decoder", positional="rope")
    model.save(tmp_path)
    loaded = Transformer.load(tmp_path).eval()
    assert loaded.cfg.arch == "decoder"
    torch.testing.assert_close(loaded(ids(pad_rows=False)), model(ids(pad_rows=False)))


@pytest.mark.parametrize("values, message", [
    ({"arch": "bidirectional"}, "arch must be one of"),
    ({"arch": "decoder", "tgt_vocab_size": 60}, "one stack and one vocabulary"),
    ({"arch": "decoder", "type_vocab_size": 2}, "type_vocab_size"),
    ({"norm": "batchnorm"}, "norm must be one of"),
    ({"activation": "swish"}, "activation must be one of"),
])
def test_impossible_family_settings_are_refused_naming_the_key(values, message):
    with pytest.raises(AtencionError, match=message):
        ModelConfig(**{"vocab_size": 50, "d_model": 32, "n_heads": 4, **values})


def test_the_wrong_call_for_an_arch_is_one_clear_error():
    with pytest.raises(AtencionError, match="takes one sequence"):
        tiny("decoder")(ids(), ids())
    with pytest.raises(AtencionError, match="model\\(src_ids, tgt_in_ids\\)"):
        tiny("encoder-decoder")(ids())
    with pytest.raises(AtencionError, match="cannot decode"):
        model = tiny("encoder")
        model.decode_step(ids(), model.init_state())


@pytest.mark.parametrize("values, fmt", [({"arch": "decoder"}, "onnx"), ({"arch": "encoder"}, "ctranslate2"),
                                         ({"norm": "rmsnorm"}, "ctranslate2")])
def test_exporting_a_member_the_exporters_do_not_know_is_refused(values, fmt, tmp_path):
    """(CTranslate2 takes decoders: tests/test_ctranslate2_decoder.py.)"""
    from atencion.export import export

    with pytest.raises(AtencionError, match="cannot be exported yet"):
        export(tiny(values.pop("arch", "encoder-decoder"), **values), tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


def test_the_searches_depend_on_the_decoding_protocol_only():
    from atencion.decode.protocol import Decodable, DecodingState
    from atencion.decode.search import beam_search, greedy_search

    model = tiny("encoder-decoder")
    assert isinstance(model, Decodable)
    memory, mask = model.encode(ids())
    assert isinstance(model.init_state(memory, mask), DecodingState)
    with pytest.raises(AtencionError, match="decoding protocol"):
        greedy_search(torch.nn.Linear(2, 2), ids())
    with pytest.raises(AtencionError, match="encoder-only model has no decoder"):
        beam_search(tiny("encoder"), ids(), 2)


def test_the_presets_command_prints_every_preset_beside_its_published_count(capsys):
    from atencion.cli import main

    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for row in ("63.1M  65M", "214.2M  213M", "109.5M  110M", "124.4M  124M", "60.5M  60M", "37.0M  39M"):
        assert row in out, out
    for name in ("bert-tiny", "gpt-tiny", "t5-tiny"):
        assert name in out
