"""The CUDA and bf16 paths, checked against the CPU path. Skipped where torch sees no GPU (CI has
none); run them on a GPU machine with `python -m pytest tests/test_cuda.py`."""

import json

import pytest
import torch
import torch.nn.functional as F

from atencion import Transformer
from atencion.decode.search import beam_search, greedy_search
from atencion.train.loss import generator_loss, label_smoothed_loss
from atencion.train.trainer import train

from conftest import random_batch, small_model
from test_training import tiny_config, weights, write_corpus

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _full_fp32():
    """fp32 on the GPU means fp32: no TF32 matrix products in these comparisons."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("pre_norm", [False, True])
def test_forward_on_the_gpu_equals_the_cpu(pre_norm):
    model = small_model(pre_norm=pre_norm)
    src, tgt = random_batch(model.cfg)
    expected = model(src, tgt)
    got = model.cuda()(src.cuda(), tgt.cuda()).cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_greedy_and_beam_search_on_the_gpu_return_the_cpu_hypotheses():
    model = small_model(seed=3)
    src, _ = random_batch(model.cfg, batch=6, src_len=9)
    cpu_greedy = greedy_search(model, src, 0.0, 12)
    cpu_beam = beam_search(model, src, 4, 0.6, 0.0, 12, nbest=4)
    model.cuda()
    assert greedy_search(model, src.cuda(), 0.0, 12) == cpu_greedy
    gpu_beam = beam_search(model, src.cuda(), 4, 0.6, 0.0, 12, nbest=4)
    assert [[h.tokens for h in hyps] for hyps in gpu_beam] == [[h.tokens for h in hyps] for hyps in cpu_beam]
    for gpu_hyps, cpu_hyps in zip(gpu_beam, cpu_beam):
        for g, c in zip(gpu_hyps, cpu_hyps):
            assert g.score == pytest.approx(c.score, abs=1e-4)


def test_chunked_generator_loss_under_cuda_bf16_autocast_matches_the_plain_bf16_loss():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(700, 64, generator=g).cuda().requires_grad_()
    weight = (0.6 * torch.randn(500, 64, generator=g)).cuda().requires_grad_()
    bias = torch.randn(500, generator=g).cuda().requires_grad_()
    target = torch.randint(4, 500, (700,), generator=g).cuda()
    params = (hidden, weight, bias)

    def gradients(loss_fn, bf16):
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    plain = lambda: label_smoothed_loss(F.linear(hidden, weight, bias), target, 0, 0.1)[0]  # noqa: E731
    chunked = lambda: generator_loss(hidden, weight, bias, target, 0, 0.1, chunk=128)[0]  # noqa: E731
    want_loss, reference = gradients(plain, bf16=False)
    got_loss, got = gradients(chunked, bf16=True)
    yard_loss, yardstick = gradients(plain, bf16=True)
    assert abs(got_loss - want_loss) <= 1.1 * abs(yard_loss - want_loss) + 1e-3 * want_loss
    for g_, y, w in zip(got, yardstick, reference):
        assert (g_ - w).norm() / w.norm() <= 1.1 * (y - w).norm() / w.norm()


def test_bf16_training_on_the_gpu_learns_and_resumes(tmp_path):
    data = write_corpus(tmp_path / "data", n=400)
    common = {"train.device": "cuda", "train.bf16": True, "train.max_epochs": 100,
              "model.dropout": 0.0, "train.valid_every": 20}
    summary = train(tiny_config(data, **common, **{"train.max_steps": 80}), tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert summary["steps"] == 80
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])
    # the checkpoint holds fp32 weights that load on the CPU and translate there
    model = Transformer.load(summary["last_checkpoint"], map_location="cpu")
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    resumed = train(tiny_config(data, **common, **{"train.max_steps": 100}), tmp_path / "run", resume=True)
    assert resumed["steps"] == 100
    assert weights(resumed["last_checkpoint"]).keys() == weights(summary["last_checkpoint"]).keys()
