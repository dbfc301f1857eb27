"""The seam of what an encoder reads (``model.inputs``, nn/inputs.py): tokens stay today's model
bit for bit, other kinds are checked in one line naming the key, and only the archs a kind
allows take it."""

import json

import pytest
import torch

from atencion import ModelConfig, Transformer
from atencion.errors import AtencionError
from atencion.nn.inputs import INPUTS, input_kind

PATCHES = {"kind": "patches", "patch": 2, "size": [4, 6], "channels": 1}


def tiny(**values) -> ModelConfig:
    base = dict(vocab_size=50, arch="encoder", n_layers=2, d_model=16, d_ff=32, n_heads=2, num_labels=3, dropout=0.0)
    return ModelConfig(**{**base, **values})


@pytest.mark.parametrize("tokens", [None, "tokens", {"kind": "tokens"}])
@pytest.mark.parametrize("arch", ["encoder", "encoder-decoder", "decoder"])
def test_inputs_of_tokens_is_todays_model_bit_for_bit(tokens, arch):
    torch.manual_seed(0)
    before = Transformer(tiny(arch=arch, num_labels=0))
    torch.manual_seed(0)
    after = Transformer(tiny(arch=arch, num_labels=0, inputs=tokens))
    assert after.cfg.inputs is None and after.cfg.to_dict() == before.cfg.to_dict()
    for (name, a), (_, b) in zip(before.state_dict().items(), after.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(4, 50, (2, 5))
    args = (ids, ids) if arch == "encoder-decoder" else (ids,)
    assert torch.equal(before.eval()(*args), after.eval()(*args))


def test_a_config_json_without_inputs_loads_as_tokens(tmp_path):
    values = tiny().to_dict()
    del values["inputs"]
    (tmp_path / "config.json").write_text(json.dumps(values))
    cfg = ModelConfig.load(tmp_path / "config.json")
    assert cfg.inputs is None and input_kind(cfg).tokens


def test_patches_settings_are_completed_with_the_defaults_in_the_config():
    cfg = tiny(vocab_size=0, inputs={"kind": "patches", "patch": 2, "size": [4, 6]})
    assert cfg.inputs == {"kind": "patches", "patch": 2, "size": [4, 6], "channels": 3, "shifted": False}
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("inputs, message", [
    ({"kind": "pixels"}, r"inputs.kind must be one of \['tokens', 'patches', 'spectrogram'\], got 'pixels'"),
    (7, "inputs must be a mapping such as"),
    ("patches", "inputs.patch is missing"),
    ({**PATCHES, "stride": 2}, "inputs.stride is not a setting of inputs kind 'patches'"),
    ({**PATCHES, "patch": 0}, "inputs.patch must be a positive integer, got 0"),
    ({**PATCHES, "channels": "rgb"}, "inputs.channels must be a positive integer, got 'rgb'"),
    ({**PATCHES, "shifted": "yes"}, "inputs.shifted must be true or false, got 'yes'"),
    ({**PATCHES, "size": [4]}, r"inputs.size must be \[height, width\], two positive integers, got \[4\]"),
    ({**PATCHES, "patch": 4}, r"inputs.patch \(4\) must divide both sides of inputs.size \[4, 6\]"),
])
def test_a_bad_inputs_setting_is_one_line_naming_its_key(inputs, message):
    with pytest.raises(AtencionError, match=message) as err:
        tiny(vocab_size=0, inputs=inputs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder", "rnn"])
def test_only_an_encoder_reads_patches(arch):
    with pytest.raises(AtencionError, match=f"inputs kind 'patches' .* is read by the encoder of arch encoder, "
                                            f"not '{arch}'"):
        tiny(arch=arch, vocab_size=0, num_labels=0, inputs=PATCHES)


def test_an_encoder_of_patches_has_no_vocabulary_and_positions_for_every_patch():
    with pytest.raises(AtencionError, match="vocab_size must be 0 with inputs kind 'patches'"):
        tiny(inputs=PATCHES)
    with pytest.raises(AtencionError, match=r"max_positions \(6\) must be at least 7: inputs gives 6 patches and "
                                            r"the \[CLS\] token"):
        tiny(vocab_size=0, inputs=PATCHES, positional="learned", max_positions=6)
    with pytest.raises(AtencionError, match="type_vocab_size .token types. needs inputs of tokens"):
        tiny(vocab_size=0, inputs=PATCHES, type_vocab_size=2)


def test_an_encoder_of_patches_takes_a_float_batch_of_the_configured_shape():
    model = Transformer(tiny(vocab_size=0, inputs=PATCHES)).eval()
    assert model.classify(torch.randn(2, 1, 4, 6)).shape == (2, 3)
    assert model(torch.randn(2, 1, 4, 6)).shape == (2, 1 + 6, 16)  # no vocabulary: the encoder's output
    for bad in (torch.randn(2, 3, 4, 6), torch.randn(1, 4, 6), torch.zeros(2, 1, 4, 6, dtype=torch.long)):
        with pytest.raises(AtencionError, match=r"images must be a float tensor .* = \(batch, 1, 4, 6\)"):
            model.classify(bad)
    with pytest.raises(AtencionError, match="makes its own mask"):
        model.encode(torch.randn(2, 1, 4, 6), torch.ones(2, 1, 1, 7, dtype=torch.bool))


def test_a_training_config_reads_a_bare_kind_and_sets_one_key_of_it(tmp_path):
    from atencion.train.config import load_config

    config = tmp_path / "c.yaml"
    config.write_text("task: classify\nmodel: {inputs: patches, n_layers: 1}\ndata: {train_tsv: t.tsv}\n")
    cfg = load_config(config, ["model.inputs.patch=2", "model.inputs.size=[4, 6]", "model.inputs.channels=1"])
    assert cfg.model["inputs"] == PATCHES
    built = cfg.model_config(8000, None, {"task": "classify", "num_labels": 2})
    assert (built.vocab_size, built.n_layers, built.d_model) == (0, 1, 192)  # vit-tiny's
    assert built.inputs == {**PATCHES, "shifted": False}


def test_every_input_kind_names_what_it_takes_and_archs_that_exist():
    from atencion.config import ARCHS

    for name, kind in INPUTS.items():
        assert kind.name == name and kind.takes and set(kind.archs) <= set(ARCHS)
        assert kind.tokens or (kind.collate is not None and kind.preset is not None)
