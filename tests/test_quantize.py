"""Dynamic int8 decoding (nn/quantize.py): the quantized layers against float32 and against
torch.ao's own dynamic quantization, and the translations of a trained model."""

import warnings

import torch
from torch import nn

from atencion.data.batching import collate
from atencion.data.corpus import read_lines
from atencion.nn.model_dir import load_model_dir
from atencion.nn.quantize import Int8Linear, quantize_int8
from atencion.train.trainer import train
from conftest import random_batch, small_model
from test_training import tiny_config, write_corpus


def relative(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def test_int8_linear_is_float32_up_to_quantization_error_and_matches_torch_ao():
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 96)
    with torch.no_grad():
        linear.weight.copy_(0.1 * torch.randn(96, 64, generator=g))
        linear.weight[3] *= 20  # a row with a far larger range: per-row scales keep the others exact
    x = torch.randn(5, 7, 64, generator=g)
    got = Int8Linear(linear.weight, linear.bias)(x)
    want = linear(x)
    assert got.shape == want.shape
    assert 1e-4 < relative(got, want) < 0.02  # quantized, not copied; and close
    rows = [i for i in range(96) if i != 3]
    assert relative(got[..., rows], want[..., rows]) < 0.02
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        ao = quantize_dynamic(nn.Sequential(linear), {nn.Linear: per_channel_dynamic_qconfig})
    assert relative(got, ao(x)) < 0.5 * relative(got, want)  # the same scheme, independently built


def test_quantize_int8_replaces_every_linear_layer_of_a_copy():
    model = small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = quantize_int8(model)
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in quantized.modules()) == n_linear + 1  # + generator
    assert not any(isinstance(m, nn.Linear) for m in quantized.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # the original is untouched
    src, tgt = random_batch(model.cfg)
    assert relative(quantized(src, tgt), model(src, tgt)) < 0.05


def test_int8_next_token_choices_of_a_trained_model_match_float32(tmp_path):
    """Teacher-forced on the training pairs of a toy model: the int8 copy picks the float32
    model's most probable next token almost everywhere, and its distributions stay close."""
    data = write_corpus(tmp_path / "data", n=400)
    summary = train(tiny_config(data, **{"train.max_steps": 400, "train.max_epochs": 1000, "model.dropout": 0.0,
                                         "model.d_model": 64, "model.d_ff": 128, "model.n_heads": 4}),
                    tmp_path / "run")
    model, tokenizer = load_model_dir(summary["last_checkpoint"])
    pairs = zip(read_lines(data["data.train_src"])[:100], read_lines(data["data.train_tgt"])[:100])
    cfg = model.cfg
    batch = collate([(tokenizer.encode_src(s), tokenizer.encode_tgt(t)) for s, t in pairs],
                    cfg.pad_id, cfg.bos_id, cfg.eos_id)
    real = batch.tgt_out != cfg.pad_id
    with torch.no_grad():
        fp32 = model(batch.src, batch.tgt_in).softmax(-1)[real]
        int8 = quantize_int8(model)(batch.src, batch.tgt_in).softmax(-1)[real]
    assert (fp32.argmax(-1) == batch.tgt_out[real]).float().mean() > 0.9  # the model has learnt the task
    assert (int8.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.98
    assert (int8 - fp32).abs().sum(-1).max() / 2 < 0.15  # total variation distance, per position
