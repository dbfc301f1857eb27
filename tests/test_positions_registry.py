"""The position registry: POSITIONS names each kind once, and what it says of a kind (its role,
its module, its length limit) is what a model built with that kind does; a kind added to
POSITIONS alone is taken by the config, the stacks, generation and the exporters."""

import re

import pytest
import torch

from atencion import ModelConfig
from atencion.decode.sample import generate_ids
from atencion.errors import AtencionError
from atencion.nn.attention import RelativeTerms
from atencion.nn.positional import (
    POSITIONS,
    AlibiPositions,
    LearnedPositionalEmbedding,
    PositionKind,
    kinds,
    position_kind,
    position_limit,
)
from conftest import small_model


def _first_layer_input(model, ids):
    """What the stack hands its first layer: the summed input x and the relative terms."""
    seen = {}

    def hook(module, args, kwargs):
        seen["x"], seen["positions"] = args[0], kwargs.get("positions")

    handle = model.encoder.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return seen["x"], seen["positions"]


@pytest.mark.parametrize("name", kinds("absolute") + kinds("relative"))  # a grid's kind: test_vit.py
def test_each_kind_acts_where_its_role_says(name):
    model = small_model(arch="encoder", positional=name, dropout=0.0)
    kind = position_kind(model.cfg)
    assert kind.name == name and kind.role in ("absolute", "relative")
    ids = torch.randint(4, model.cfg.vocab_size, (2, 9))
    x, terms = _first_layer_input(model, ids)
    with torch.no_grad():
        tokens = model.encoder.embed(ids)
    if kind.role == "absolute":  # added to the embeddings, nothing inside attention
        assert model.encoder.relative is None and terms is None
        with torch.no_grad():
            added = model.encoder.positions(ids.size(1))
        assert added.abs().sum() > 0
        torch.testing.assert_close(x, tokens + added)
    else:  # the embeddings alone, and a bias or a rotation inside self-attention
        assert model.encoder.positions is None
        torch.testing.assert_close(x, tokens, rtol=0, atol=0)
        assert isinstance(terms, RelativeTerms) and (terms.bias is not None or terms.rotary is not None)
    assert name in kinds(kind.role)


@pytest.mark.parametrize("name", kinds("absolute") + kinds("relative"))  # a grid's kind: test_vit.py
def test_position_limit_is_how_many_positions_a_model_can_read(name):
    model = small_model(arch="decoder", positional=name, max_positions=8, dropout=0.0)
    limit = position_limit(model.cfg)
    if limit is None:  # extends without limit: far past max_positions
        with torch.no_grad():
            assert torch.isfinite(model(torch.randint(4, 40, (1, 24)))).all()
        return
    assert limit == model.decoder.positions.weight.size(0) == 8
    with torch.no_grad():
        model(torch.randint(4, 40, (1, limit)))
        with pytest.raises(AtencionError, match="max_positions=8"):
            model(torch.randint(4, 40, (1, limit + 1)))


def test_an_rnn_has_no_position_limit_whatever_positional_says():
    cfg = ModelConfig(vocab_size=20, arch="rnn", positional="learned", max_positions=4)
    assert position_limit(cfg) is None


def test_the_config_takes_exactly_the_kinds_of_positions():
    with pytest.raises(AtencionError, match=re.escape(f"positional must be one of {list(POSITIONS)}, got 'relative'")):
        ModelConfig(vocab_size=20, positional="relative")


def test_a_kind_with_an_unknown_role_cannot_be_declared():
    with pytest.raises(ValueError, match="role must be one of"):
        PositionKind("inside", "inside-out", lambda cfg: None)


def test_a_kind_added_to_positions_alone_is_taken_by_config_stacks_generation_and_export(monkeypatch, tmp_path):
    from atencion.export import export

    monkeypatch.setitem(POSITIONS, "table", PositionKind(
        "table", "absolute", lambda cfg: LearnedPositionalEmbedding(cfg.d_model, cfg.max_positions),
        limit=lambda cfg: cfg.max_positions))
    monkeypatch.setitem(POSITIONS, "slopes", PositionKind(
        "slopes", "relative", lambda cfg: AlibiPositions(cfg.n_heads)))

    gpt = small_model(arch="decoder", positional="table", max_positions=6, dropout=0.0)
    assert isinstance(gpt.decoder.positions, LearnedPositionalEmbedding) and gpt.decoder.relative is None
    with pytest.raises(AtencionError, match="longer than this model's learned positions"):
        generate_ids(gpt, torch.randint(4, 40, (1, 7)), 2)
    assert generate_ids(gpt, torch.randint(4, 40, (1, 5)), 4, temperature=0).shape == (1, 4)  # past 6: a window

    translator = small_model(positional="slopes", dropout=0.0)
    assert translator.encoder.positions is None and isinstance(translator.encoder.relative, AlibiPositions)
    assert position_limit(translator.cfg) is None
    with pytest.raises(AtencionError, match="positional='slopes' \\(relative positions\\) cannot be exported"):
        export(translator, tmp_path / "out", "onnx")
    assert not (tmp_path / "out").exists()
