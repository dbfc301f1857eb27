"""The CUDA and bf16 paths, checked against the CPU path. Skipped where torch sees no GPU (CI has
none); run them on a GPU machine with `python -m pytest tests/test_cuda.py`. The bf16 loss is
checked on both devices in test_training.py."""

import json

import pytest
import torch

from atencion import Transformer
from atencion.decode.search import beam_search, greedy_search
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
