"""The whole model: masks, padding, KV cache, presets, files and bad input."""

import json

import pytest
import torch

from atencion import ModelConfig, Transformer
from conftest import random_batch, small_config, small_model

KINDS = ["sinusoidal", "learned", "rope", "alibi", "t5"]


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("positional", KINDS)
def test_causal_mask_hides_the_future(norm_first, positional):
    model = small_model(norm_first=norm_first, positional=positional)
    src, tgt = random_batch(model.cfg)
    logits = model(src, tgt)
    t = 2
    changed = tgt.clone()
    changed[:, t + 1:] = torch.randint(4, model.cfg.vocab_size, changed[:, t + 1:].shape)
    logits_changed = model(src, changed)
    torch.testing.assert_close(logits_changed[:, : t + 1], logits[:, : t + 1])
    assert (logits_changed[:, t + 1:] - logits[:, t + 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("positional", KINDS)
def test_extra_padding_changes_nothing(norm_first, positional):
    model = small_model(norm_first=norm_first, positional=positional)
    src, tgt = random_batch(model.cfg)
    logits = model(src, tgt)
    pad = model.cfg.pad_id
    src_padded = torch.cat([src, torch.full((src.size(0), 4), pad)], dim=1)
    tgt_padded = torch.cat([tgt, torch.full((tgt.size(0), 3), pad)], dim=1)
    logits_padded = model(src_padded, tgt_padded)
    torch.testing.assert_close(logits_padded[:, : tgt.size(1)], logits, atol=1e-5, rtol=1e-5)


def test_source_padding_is_not_attended_to():
    """Changing what sits under the pad mask (passed explicitly) changes nothing."""
    model = small_model()
    src, tgt = random_batch(model.cfg)
    mask = model.padding_mask(src)
    garbage = src.clone()
    garbage[~mask[:, 0, 0]] = 7
    torch.testing.assert_close(model(garbage, tgt, src_mask=mask), model(src, tgt))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("positional", KINDS)
def test_encoder_on_real_positions_only_equals_the_padded_encoder(norm_first, positional):
    """With ``pack`` the encoder computes on the real positions only: the same output there, and
    zeros at the padding (so the packed path did run); the same gradients for a loss that reads
    the real positions; and the same logits from the whole model, which packs, as from its
    unpacked path (``return_attention`` turns packing off)."""
    model = small_model(norm_first=norm_first, positional=positional)
    src, tgt = random_batch(model.cfg, batch=4, src_len=9)
    mask = model.padding_mask(src)
    real = mask[:, 0, 0]
    outputs, grads = {}, {}
    for pack in (False, True):
        model.zero_grad()
        memory, _ = model.encoder(src, mask, pack=pack)
        (memory[real] ** 2).sum().backward()
        outputs[pack] = memory.detach()
        grads[pack] = {name: p.grad.clone() for name, p in model.encoder.named_parameters() if p.grad is not None}
    torch.testing.assert_close(outputs[True][real], outputs[False][real], atol=1e-5, rtol=1e-5)
    assert (~real).any() and outputs[True][~real].abs().max() == 0
    assert outputs[False][~real].abs().max() > 0.1
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 0
    for name in grads[True]:
        torch.testing.assert_close(grads[True][name], grads[False][name], atol=1e-4, rtol=1e-4)
    unpacked, _ = model(src, tgt, return_attention=True)
    torch.testing.assert_close(model(src, tgt), unpacked, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [
    {}, {"norm_first": True}, {"positional": "learned"}, {"share_embeddings": False, "tie_output": False,
                                                          "tgt_vocab_size": 30, "output_bias": True},
    {"positional": "rope"}, {"positional": "alibi"}, {"positional": "t5"}, {"positional": "t5", "norm_first": True},
])
def test_incremental_decoding_with_kv_cache_equals_full_forward(overrides):
    model = small_model(**overrides)
    src, tgt = random_batch(model.cfg)
    full = model(src, tgt)
    memory, src_mask = model.encode(src)
    state = model.init_state(memory, src_mask)
    steps = [model.decode_step(tgt[:, :2], state)]  # a two-token prefix, then one token at a time
    steps += [model.decode_step(tgt[:, t: t + 1], state) for t in range(2, tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_the_kv_cache_writes_steps_into_room_and_keeps_what_cat_would():
    from atencion.nn.cache import KVCache

    generator = torch.Generator().manual_seed(0)
    steps = [torch.randn(2, 3, n, 4, generator=generator) for n in (5, 1, 1, 2, 1)]
    cache, expected = KVCache(), None
    with torch.no_grad():
        for i, step in enumerate(steps):
            k, v = cache.append(step, -step)
            expected = step if expected is None else torch.cat([expected, step], dim=2)
            assert torch.equal(k, expected) and torch.equal(v, -expected) and len(cache) == expected.size(2)
            if i == 2:  # from the third step on, the keys live in one buffer with room for more
                room = k.data_ptr()
        assert k.data_ptr() == room  # no copy since
        cache.truncate(6)  # speculative decoding forgets the last keys: the next step writes over them
        k, _ = cache.append(steps[1], steps[1])
        assert torch.equal(k, torch.cat([expected[:, :, :6], steps[1]], dim=2)) and k.data_ptr() == room
        cache.reorder(torch.tensor([1]))  # a sentence leaves the batch: a new buffer from the next step
        k, _ = cache.append(steps[2][1:], steps[2][1:])
        assert torch.equal(k, torch.cat([expected[1:, :, :6], steps[1][1:], steps[2][1:]], dim=2))
        outside = torch.zeros(2, 3, 8, 4)
        cache.k, cache.v = outside[:, :, :5], outside[:, :, :5]  # set from outside (the ONNX export does it)
        k, _ = cache.append(steps[1], steps[1])  # copied into room of its own, not written into the tensor given
        assert torch.equal(k, torch.cat([outside[:, :, :5], steps[1]], dim=2)) and not outside.any()
    leaf = torch.randn(2, 3, 1, 4, requires_grad=True)  # under autograd: concatenated, the gradient flows
    cache = KVCache()
    cache.append(steps[0], steps[0])
    k, _ = cache.append(leaf, leaf)
    k.sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(leaf))


def test_a_cache_written_by_the_whole_step_kernel_shows_what_it_wrote_when_read():
    """nn/fused.py writes each layer's new key and value into ``KVCache.room`` and says ``written``:
    k and v are views made when first read, showing every step written, with or without reads between."""
    from atencion.nn.cache import KVCache

    generator = torch.Generator().manual_seed(1)
    expected = torch.randn(2, 3, 4, 8, generator=generator)
    cache = KVCache()
    cache.append(expected, -expected)
    for step in range(70):  # past the first buffers' room for 64 keys: they grow once
        new = torch.randn(2, 3, 1, 8, generator=generator)
        end = len(cache) + 1
        keys, values = cache.room(end)
        keys[:, :, end - 1:end], values[:, :, end - 1:end] = new, -new  # as the kernel writes them
        cache.written(end)
        expected = torch.cat([expected, new], dim=2)
        assert len(cache) == end == expected.size(2) and cache.rows == 2
        if step % 9 == 0:
            assert torch.equal(cache.k, expected) and torch.equal(cache.v, -expected)
    new = torch.randn(2, 3, 1, 8, generator=generator)
    k, v = cache.append(new, -new)  # the layer-by-layer path goes on from there
    expected = torch.cat([expected, new], dim=2)
    assert torch.equal(k, expected) and torch.equal(v, -expected)
    cache.written(len(cache))
    cache.k = torch.zeros(2, 3, 5, 8)  # one of the two set from outside: the other stays what was written
    assert torch.equal(cache.v, -expected) and len(cache) == 5


def test_decoder_state_reorder_selects_batch_rows():
    model = small_model()
    src, tgt = random_batch(model.cfg)
    memory, src_mask = model.encode(src)
    state = model.init_state(memory, src_mask)
    model.decode_step(tgt[:, :3], state)
    index = torch.tensor([2, 2, 0])
    state.reorder(index)
    last = model.decode_step(tgt[index, 3:4], state)
    expected = model(src[index], tgt[index, :4])[:, 3:4]
    torch.testing.assert_close(last, expected, atol=1e-5, rtol=1e-5)


def test_attention_weights_are_returned_with_their_shapes():
    model = small_model()
    src, tgt = random_batch(model.cfg)
    logits, attn = model(src, tgt, return_attention=True)
    torch.testing.assert_close(logits, model(src, tgt), atol=1e-5, rtol=1e-5)
    b, s, t, h = src.size(0), src.size(1), tgt.size(1), model.cfg.n_heads
    assert [a.shape for a in attn["encoder"]] == [(b, h, s, s)] * 2
    assert [a.shape for a in attn["decoder"]] == [(b, h, t, t)] * 2
    assert [a.shape for a in attn["cross"]] == [(b, h, t, s)] * 2
    for cross in attn["cross"]:
        torch.testing.assert_close(cross.sum(-1), torch.ones(b, h, t))
        assert torch.all(cross[2, :, :, -2:] == 0)  # row 2 has two pads at the end


@pytest.mark.parametrize("name, vocab, millions", [("base", 37000, 65), ("big", 37000, 213)])
def test_presets_have_the_parameter_counts_of_table_3(name, vocab, millions):
    with torch.device("meta"):
        model = Transformer(ModelConfig.preset(name, vocab_size=vocab))
    assert abs(model.num_parameters() / 1e6 - millions) / millions < 0.05


def test_tiny_preset_is_transformer_tiny():
    cfg = ModelConfig.preset("tiny", vocab_size=10000)
    assert (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_heads) == (4, 128, 256, 4)
    assert abs(Transformer(cfg).num_parameters() / 1e6 - 2.6) < 0.1


def test_three_way_tying_shares_one_tensor():
    model = small_model()
    assert model.encoder.embed.weight is model.decoder.embed.weight is model.generator.weight
    untied = small_model(share_embeddings=False, tie_output=False)
    assert untied.num_parameters() == model.num_parameters() + 2 * 40 * 32


def test_save_and_load_round_trip(tmp_path):
    model = small_model(output_bias=True)
    src, tgt = random_batch(model.cfg)
    model.save(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    loaded = Transformer.load(tmp_path / "m").eval()
    torch.testing.assert_close(loaded(src, tgt), model(src, tgt))
    assert loaded.encoder.embed.weight is loaded.generator.weight


# bad input ------------------------------------------------------------------------------------

def test_d_model_not_divisible_by_heads_is_refused():
    with pytest.raises(ValueError, match=r"n_heads \(4\) must divide d_model \(30\)"):
        small_config(d_model=30)


def test_unknown_preset_and_unknown_key_are_refused():
    with pytest.raises(ValueError, match="unknown preset 'huge'.*'base'"):
        ModelConfig.preset("huge", vocab_size=10)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['d_mdoel'\]"):
        ModelConfig.preset("tiny", vocab_size=10, d_mdoel=3)


@pytest.mark.parametrize("src, message", [
    (torch.tensor([[5, 6, 40]]), r"src_ids holds token id 40, outside the vocabulary \[0, 40\)"),
    (torch.tensor([[5, -1]]), "src_ids holds token id -1"),
    (torch.tensor([5, 6]), r"src_ids must have shape \(batch, length\)"),
    (torch.tensor([[5.0, 6.0]]), "src_ids must hold integer token ids"),
])
def test_bad_token_ids_are_refused(src, message):
    model = small_model()
    with pytest.raises(ValueError, match=message):
        model(src, torch.tensor([[2, 5]]))


def test_batch_size_mismatch_and_bad_mask_are_refused():
    model = small_model()
    src, tgt = random_batch(model.cfg)
    with pytest.raises(ValueError, match="same batch size"):
        model(src, tgt[:2])
    with pytest.raises(ValueError, match="src_mask has shape"):
        model(src, tgt, src_mask=torch.ones(3, 1, 1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="tgt_mask has shape"):
        model(src, tgt, tgt_mask=torch.ones(1, 1, 6, 5, dtype=torch.bool))


def test_missing_or_corrupt_model_files_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        Transformer.load(tmp_path / "nothing")
    small_model().save(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        Transformer.load(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors: model weights not found"):
        Transformer.load(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="config.json: not a valid JSON model config"):
        Transformer.load(tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json: model config not found"):
        Transformer.load(tmp_path / "m")


def test_weights_that_do_not_match_the_config_are_reported(tmp_path):
    small_model().save(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["d_ff"] = 48
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has shape"):
        Transformer.load(tmp_path / "m")
    cfg["n_layers"] = 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        Transformer.load(tmp_path / "m")


@pytest.mark.parametrize("overrides", [{}, {"norm_first": True}, {"positional": "rope"}, {"positional": "alibi"},
                                       {"positional": "t5"}])
def test_beam_state_shares_caches_and_follows_reordered_hypotheses(overrides):
    """With group > 1 the beams of a sentence share one self-attention cache and attend to
    their ancestors through a mask; after re-rankings (a two-token prefix, then steps) and a
    dropped sentence, every row's logits equal a full forward pass over that row's history."""
    torch.manual_seed(0)
    model = small_model(**overrides).eval()
    src, _ = random_batch(model.cfg)
    k, vocab = 3, model.cfg.vocab_size
    memory, src_mask = model.encode(src)
    state = model.init_state(memory, src_mask, group=k)
    sentence = torch.arange(len(src)).repeat_interleave(k)         # source sentence of each row
    history = torch.randint(4, vocab, (len(sentence), 2))
    logits = model.decode_step(history, state)
    reorders = [torch.tensor([2, 0, 0, 4, 5, 4, 8, 8, 6]),        # re-rank within each sentence
                torch.tensor([1, 1, 2, 6, 7, 8]),                  # drop sentence 1, re-rank the others
                torch.tensor([5, 3, 4, 0, 1, 2])]                  # swap the two sentences
    # then 20 more steps of random re-rankings: past the caches' first 16 steps of room
    reorders += [torch.randint(0, k, (2, k)).add(torch.tensor([[0], [k]])).flatten() for _ in range(20)]
    for index in reorders:
        rows = index.view(-1, k)  # the rows each new hypothesis continues, k per kept sentence
        state.reorder(rows[:, 0] // k, rows % k)
        history, sentence = history[index], sentence[index]
        new = torch.randint(4, vocab, (len(index), 1))
        history = torch.cat([history, new], dim=1)
        logits = model.decode_step(new, state)
        expected = model(src[sentence], history)[:, -1:]
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
