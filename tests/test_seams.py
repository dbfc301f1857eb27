"""The seams where new work plugs in: an attention kind is one AttentionKind subclass and one
KindSpec in ATTENTION_KINDS, a position kind one module and one PositionKind in POSITIONS, whose
flags (``rotary``, ``bias``) say what it does. Each toy here is registered from this file alone
and removed afterwards; that config, the stacks and the attention explorer take it proves that
nothing else names the kinds."""

import re

import numpy as np
import pytest
import torch

from atencion import ModelConfig
from atencion.errors import AtencionError
from atencion.nn.kinds import ATTENTION_KINDS, AttentionKind, KindSpec
from atencion.nn.positional import POSITIONS, AlibiPositions, PositionKind, RotaryPositions
from atencion.viz.attention import AttentionMap, SelfAttention, kind_note
from atencion.viz.html import attention_html
from conftest import small_model

TOY_NOTE = "toy: eq. (1) computed plainly, its scores divided by the temperature"


class Toy(AttentionKind):
    """Eq. (1) written out, the scores divided by an integer ``temperature`` (1: eq. (1) itself)."""

    name = "toy"
    general_masks = True

    def forward(self, q, k, v, mask, positions, dropout_p, scale, need_weights):
        scale = q.size(-1) ** -0.5 if scale is None else scale
        scores = q @ k.transpose(-2, -1) * scale / self.settings["temperature"]
        if positions is not None and positions.bias is not None:
            scores = scores + positions.bias
        if self.causal:  # the queries are the last q_len positions
            scores = scores.masked_fill(~torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device)
                                        .tril(k.size(2) - q.size(2)), float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1)
        return weights @ v, weights if need_weights else None


def _toy_check(cfg, settings):
    if settings["temperature"] > 8:
        raise AtencionError(f"attention.temperature ({settings['temperature']}) is more than the toy's 8")


@pytest.fixture
def toy_kind():
    spec = KindSpec("toy", TOY_NOTE, {"temperature": 1}, {"temperature": 1}, check=_toy_check,
                    build=lambda cfg, causal, layer, shared: Toy(cfg.attention, causal))
    ATTENTION_KINDS["toy"] = spec
    try:
        yield spec
    finally:
        ATTENTION_KINDS.pop("toy", None)


@pytest.fixture
def toy_positions():
    kinds = (PositionKind("toy-rope", "relative", lambda cfg: RotaryPositions(cfg.d_k, 500.0), rotary=True),
             PositionKind("toy-alibi", "relative", lambda cfg: AlibiPositions(cfg.n_heads), bias=True))
    POSITIONS.update({kind.name: kind for kind in kinds})
    try:
        yield kinds
    finally:
        for kind in kinds:
            POSITIONS.pop(kind.name, None)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_a_kind_registered_from_outside_builds_and_equals_eq1(toy_kind, arch):
    toy = small_model(arch=arch, dropout=0.0, attention={"kind": "toy"})
    full = small_model(arch=arch, dropout=0.0)
    assert toy.cfg.attention == {"kind": "toy", "temperature": 1}  # completed with the spec's default
    stack = toy.encoder if arch == "encoder" else toy.decoder
    assert all(isinstance(layer.self_attn.kind, Toy) for layer in stack.layers) and not stack.full
    ids = torch.randint(4, toy.cfg.vocab_size, (2, 9))
    ids[1, 6:] = toy.cfg.pad_id
    torch.testing.assert_close(_logits(toy, ids), _logits(full, ids), atol=1e-5, rtol=1e-5)
    warm = small_model(arch=arch, dropout=0.0, attention={"kind": "toy", "temperature": 3})  # the setting is read
    assert not torch.allclose(_logits(warm, ids), _logits(full, ids), atol=1e-3)


def test_a_kind_registered_from_outside_decodes_step_by_step(toy_kind):
    model = small_model(arch="decoder", dropout=0.0, attention={"kind": "toy", "temperature": 2})
    ids = torch.randint(4, model.cfg.vocab_size, (1, 7))
    state = model.init_state()
    steps = torch.cat([model.decode_step(ids[:, t:t + 1], state) for t in range(7)], 1)
    torch.testing.assert_close(steps, _logits(model, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention,message", [
    ({"kind": "toy", "temperature": 0}, "attention.temperature must be an integer >= 1, got 0"),  # its lower bound
    ({"kind": "toy", "temperature": 9}, "attention.temperature (9) is more than the toy's 8"),  # its check
    ({"kind": "toy", "window": 3}, "attention.window is not a setting of attention kind 'toy'; its keys are "
                                   "['kind', 'temperature']"),
    ({"kind": "toys"}, "attention.kind must be one of ['full', 'flash', 'window', 'longformer', 'bigbird', "
                       "'linformer', 'performer', 'toy'], got 'toys'"),
])
def test_a_registered_kinds_settings_and_check_are_the_configs(toy_kind, attention, message):
    with pytest.raises(AtencionError, match=re.escape(message)):
        ModelConfig(vocab_size=20, attention=attention)


def test_a_kind_is_refused_once_it_is_removed(toy_kind):
    ModelConfig(vocab_size=20, attention={"kind": "toy"})
    ATTENTION_KINDS.pop("toy")
    with pytest.raises(AtencionError, match=re.escape("attention.kind must be one of")):
        ModelConfig(vocab_size=20, attention={"kind": "toy"})


def test_the_explorer_shows_a_registered_kinds_note_and_survives_an_unknown_kind(toy_kind):
    amap = AttentionMap("encoder", np.full((1, 1, 2, 2), 0.5), ["a", "b"], ["a", "b"])
    assert kind_note("toy") == TOY_NOTE and kind_note("full") == ""
    assert TOY_NOTE in attention_html(SelfAttention("a b", "", 0, amap, "toy"))
    assert TOY_NOTE not in attention_html(SelfAttention("a b", "", 0, amap))
    ATTENTION_KINDS.pop("toy")  # a model saved with a kind this version does not know: a line, not a KeyError
    page = attention_html(SelfAttention("a b", "", 0, amap, "toy"))
    assert TOY_NOTE not in page and "attention kind 'toy'" in page


def test_a_position_kinds_rotary_flag_makes_the_stacks_turn_queries_and_keys(toy_positions):
    ids = torch.randint(4, 40, (2, 9))
    for arch in ("encoder", "decoder"):
        toy = small_model(arch=arch, dropout=0.0, positional="toy-rope")
        rope = small_model(arch=arch, dropout=0.0, positional="rope", rope_base=500.0)
        torch.testing.assert_close(_logits(toy, ids), _logits(rope, ids), atol=1e-5, rtol=1e-5)
    model = small_model(arch="decoder", dropout=0.0, positional="toy-rope")
    state = model.init_state()
    steps = torch.cat([model.decode_step(ids[:1, t:t + 1], state) for t in range(9)], 1)
    torch.testing.assert_close(steps, _logits(model, ids[:1]), atol=1e-5, rtol=1e-5)


def test_a_position_kinds_bias_flag_is_what_kinds_without_scores_refuse(toy_positions):
    toy = small_model(arch="decoder", dropout=0.0, positional="toy-alibi")
    alibi = small_model(arch="decoder", dropout=0.0, positional="alibi")
    ids = torch.randint(4, 40, (2, 9))
    torch.testing.assert_close(_logits(toy, ids), _logits(alibi, ids), atol=1e-5, rtol=1e-5)
    for kind in ("performer", "linformer"):
        with pytest.raises(AtencionError, match=re.escape(f"attention.kind {kind} computes no score matrix to add "
                                                          f"positional 'toy-alibi'")):
            ModelConfig(vocab_size=20, arch="encoder", positional="toy-alibi", attention={"kind": kind})
    ModelConfig(vocab_size=20, arch="encoder", positional="toy-rope", attention={"kind": "performer"})


def test_a_relative_kind_with_flags_is_refused_for_an_absolute_role():
    with pytest.raises(ValueError, match="rotary and bias are flags of a relative kind"):
        PositionKind("wrong", "absolute", lambda cfg: None, rotary=True)
