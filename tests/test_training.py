"""§5 training: loss, schedule, batching, checkpoints, exact resume, averaging, DDP."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from atencion import Transformer
from atencion.data.batching import collate, token_batches
from atencion.tasks.loss import label_smoothed_loss
from atencion.train.checkpoint import average_checkpoints, list_checkpoints
from atencion.train.config import load_config
from atencion.train.schedule import noam_lr
from atencion.train.trainer import train

WORDS = "uno dos tres cuatro cinco seis siete ocho nueve diez".split()
NUMBERS = "one two three four five six seven eight nine ten".split()


def write_corpus(directory: Path, n: int = 300, seed: int = 0) -> dict[str, str]:
    """A toy task: translate number words and reverse their order."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        idx = [rng.randrange(10) for _ in range(rng.randint(2, 6))]
        src.append(" ".join(WORDS[i] for i in idx))
        tgt.append(" ".join(NUMBERS[i] for i in reversed(idx)))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.es").write_text("\n".join(src) + "\n")
    (directory / "train.en").write_text("\n".join(tgt) + "\n")
    return {"data.train_src": str(directory / "train.es"), "data.train_tgt": str(directory / "train.en")}


def tiny_config(data: dict[str, str], **extra):
    overrides = {**data, "data.vocab_size": 40, "model.preset": "tiny", "model.d_model": 32,
                 "model.d_ff": 64, "model.n_layers": 1, "model.n_heads": 2, "model.dropout": 0.1,
                 "train.max_tokens": 256, "train.warmup": 20, "train.lr_peak": 0.01,
                 "train.progress": False, "train.tensorboard": False, "train.log_every": 1,
                 "train.threads": 1, **extra}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def one_and_two_processes(settings: dict, out: Path, port: int) -> tuple[Path, Path]:
    """Train ``settings`` (config keys → values) twice: one process accumulating 2 micro-batches
    (out/one), then torchrun with 2 CPU processes (gloo) of 1 micro-batch each (out/two); return
    the last checkpoint of each."""
    train(load_config(None, [f"{k}={v}" for k, v in {**settings, "train.accum_steps": 2}.items()]), out / "one")
    args = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(port), "-m", "atencion", "train", "configs/reference.yaml",
                          *args, "--set", "train.accum_steps=1", "--out", str(out / "two")],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).parent.parent,
                         capture_output=True, text=True)
    assert run.returncode == 0, f"torchrun failed ({run.returncode}):\n{run.stderr[-4000:]}"
    return tuple(list_checkpoints(out / name / "checkpoints")[-1] for name in ("one", "two"))


def test_label_smoothed_loss_matches_torch_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    target = torch.tensor([[4, 5, 6, 0, 0], [7, 8, 9, 10, 3]])
    loss, nll = label_smoothed_loss(logits, target, pad_id=0, epsilon=0.1)
    expected = F.cross_entropy(logits.view(-1, 11), target.view(-1), ignore_index=0,
                               label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, F.cross_entropy(logits.view(-1, 11), target.view(-1),
                                                    ignore_index=0, reduction="sum"))
    changed = logits.clone()
    changed[0, 3:] = 100.0  # whatever sits at padding positions counts for nothing
    torch.testing.assert_close(label_smoothed_loss(changed, target, 0, 0.1)[0], loss)


def test_learning_rate_warms_up_linearly_then_decays_as_inverse_square_root():
    d, w = 512, 4000
    assert noam_lr(1, d, w) == pytest.approx(d ** -0.5 * w ** -1.5)
    assert noam_lr(2000, d, w) == pytest.approx(2000 * d ** -0.5 * w ** -1.5)
    assert noam_lr(w, d, w) == pytest.approx(d ** -0.5 * w ** -0.5)
    assert noam_lr(4 * w, d, w) == pytest.approx(noam_lr(w, d, w) / 2)
    assert noam_lr(2000, 128, 2000, peak=0.005) == pytest.approx(0.005)


def test_token_batches_respect_the_budget_cover_every_example_and_are_reproducible():
    rng = random.Random(0)
    lengths = [(rng.randint(1, 30), rng.randint(1, 30)) for _ in range(500)]
    batches = token_batches(lengths, 200, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for b in batches:
        longest = max(max(lengths[i]) + 1 for i in b)
        assert len(b) * longest <= 200
    assert batches == token_batches(lengths, 200, seed=3)
    assert batches != token_batches(lengths, 200, seed=4)


def test_collate_shifts_the_target_right_for_teacher_forcing():
    batch = collate([([5, 6, 7], [8, 9]), ([5], [10, 11, 12])], pad_id=0, bos_id=2, eos_id=3)
    assert batch.src.tolist() == [[5, 6, 7, 3], [5, 3, 0, 0]]
    assert batch.tgt_in.tolist() == [[2, 8, 9, 0], [2, 10, 11, 12]]
    assert batch.tgt_out.tolist() == [[8, 9, 3, 0], [10, 11, 12, 3]]
    assert batch.n_tokens == 7


def test_short_training_run_brings_the_loss_far_below_its_start(tmp_path):
    data = write_corpus(tmp_path / "data", n=400)
    cfg = tiny_config(data, **{"train.max_steps": 80, "train.max_epochs": 100, "model.dropout": 0.0})
    summary = train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert summary["steps"] == 80
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])


def test_interrupted_and_resumed_run_ends_with_the_same_weights(tmp_path):
    data = write_corpus(tmp_path / "data")
    common = {"train.valid_every": 3, "train.max_epochs": 100}
    train(tiny_config(data, **common, **{"train.max_steps": 8}), tmp_path / "whole")
    train(tiny_config(data, **common, **{"train.max_steps": 3}), tmp_path / "split")
    with pytest.raises(ValueError, match="already holds a training run"):
        train(tiny_config(data, **common, **{"train.max_steps": 8}), tmp_path / "split")
    train(tiny_config(data, **common, **{"train.max_steps": 8}), tmp_path / "split", resume=True)
    whole = weights(list_checkpoints(tmp_path / "whole" / "checkpoints")[-1])
    split = weights(list_checkpoints(tmp_path / "split" / "checkpoints")[-1])
    assert whole.keys() == split.keys()
    for name in whole:
        assert torch.equal(whole[name], split[name]), name
    assert list_checkpoints(tmp_path / "split" / "checkpoints")[-1].name == "step_00000008"


def test_checkpoint_averaging_averages_the_weights(tmp_path):
    data = write_corpus(tmp_path / "data")
    train(tiny_config(data, **{"train.max_steps": 4, "train.valid_every": 2}), tmp_path / "run")
    checkpoints = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert len(checkpoints) == 2
    average_checkpoints(checkpoints, tmp_path / "avg")
    averaged = weights(tmp_path / "avg")
    a, b = weights(checkpoints[0]), weights(checkpoints[1])
    for name in averaged:
        torch.testing.assert_close(averaged[name], (a[name] + b[name]) / 2)
    Transformer.load(tmp_path / "avg")  # a usable model directory
    assert (tmp_path / "avg" / "spm.model").is_file()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_two_processes_equal_one_process_with_the_same_total_batch(tmp_path):
    """torchrun with 2 CPU processes (gloo), 1 micro-batch each = 1 process accumulating 2.
    Dropout is off: each process draws its own dropout masks."""
    data = write_corpus(tmp_path / "data")
    settings = {**data, "data.vocab_size": 40, "model.d_model": 32, "model.d_ff": 64, "model.n_layers": 1,
                "model.n_heads": 2, "model.dropout": 0.0, "train.max_tokens": 256, "train.warmup": 20,
                "train.lr_peak": 0.01, "train.progress": False, "train.tensorboard": False,
                "train.threads": 1, "train.max_steps": 5, "train.device": "cpu"}
    one, two = map(weights, one_and_two_processes(settings, tmp_path, 29531))
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-6, rtol=1e-5)


def test_pairs_over_the_maximum_length_are_dropped_and_counted(caplog):
    from atencion.tasks.translate import encode_pairs

    class Words:  # a stand-in tokenizer: one id per word
        def encode_src(self, text):
            return [5] * len(text.split())

        encode_tgt = encode_src

    pairs = [("a b", "c"), ("a b c d e", "f"), ("a", "b c d e f g"), ("x", "y")]
    with caplog.at_level("WARNING"):
        kept = encode_pairs(pairs, Words(), max_len=3, name="train corpus")
    assert kept == [([5, 5], [5]), ([5], [5])]
    assert "train corpus: dropped 2 of 4 pairs longer than data.max_len=3" in caplog.text


@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_generator_loss_equals_the_plain_loss_and_its_gradients(with_bias):
    from atencion.tasks.loss import generator_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 8, generator=g, requires_grad=True)
    weight = torch.randn(31, 8, generator=g, requires_grad=True)
    bias = torch.randn(31, generator=g, requires_grad=True) if with_bias else None
    target = torch.randint(4, 31, (5, 6), generator=g)
    target.view(-1)[23:] = 0  # 23 real tokens, then padding
    target = target.view(-1)[torch.randperm(30, generator=g)].view(5, 6)  # pads scattered
    keep = target.view(-1) != 0
    hidden_rows = hidden[: int(keep.sum())]

    loss, nll = generator_loss(hidden_rows, weight, bias, target, 0, 0.1, chunk=7)
    (loss * 1.7).backward()
    grads = [t.grad.clone() for t in (hidden, weight, bias) if t is not None]
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    logits = F.linear(hidden_rows, weight, bias)
    expected, expected_nll = label_smoothed_loss(logits, target, 0, 0.1)
    (expected * 1.7).backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, expected_nll)
    for got, want in zip(grads, [t.grad for t in (hidden, weight, bias) if t is not None]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_generator_loss_stays_exact_when_a_target_probability_underflows():
    """A target 200 nats below the best token: its probability is 0 in float32, so the loss
    must come from log_softmax (finite, as the plain loss), not from log(p_y)."""
    from atencion.tasks.loss import generator_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=g)
    weight = torch.randn(31, 8, generator=g)
    bias = torch.zeros(31)
    bias[5] = 200.0
    hidden, weight, bias = (t.requires_grad_() for t in (hidden, weight, bias))
    target = torch.tensor([7, 5, 9, 5, 11, 12])
    loss, nll = generator_loss(hidden, weight, bias, target, 0, 0.1, chunk=4)
    loss.backward()
    grads = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    expected, expected_nll = label_smoothed_loss(F.linear(hidden, weight, bias), target, 0, 0.1)
    expected.backward()
    assert torch.isfinite(loss) and expected_nll > 400
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, expected_nll)
    for got, t in zip(grads, (hidden, weight, bias)):
        torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=1e-4)


def test_generator_loss_without_autograd_computes_the_loss_only(monkeypatch):
    from atencion.tasks.loss import generator_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(20, 8, generator=g, requires_grad=True)
    weight = torch.randn(31, 8, generator=g, requires_grad=True)
    target = torch.randint(4, 31, (20,), generator=g)
    with_grad = generator_loss(hidden, weight, None, target, 0, 0.1, chunk=6)
    products = []
    real_matmul = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: products.append(1) or real_matmul(a, b))
    with torch.no_grad():
        without = generator_loss(hidden, weight, None, target, 0, 0.1, chunk=6)
    assert products == []                       # no gradient products under no_grad
    torch.testing.assert_close(without[0], with_grad[0].detach())
    torch.testing.assert_close(without[1], with_grad[1])


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_chunked_generator_loss_under_bf16_autocast_is_as_accurate_as_the_plain_bf16_loss(device):
    """The gradient is computed during the forward pass, under autocast: from the bf16 logits
    the loss saw, with fp32 products (mixing precisions there doubled the error in an earlier
    version). Errors are measured against the fp32 loss; the plain bf16 path is the yardstick."""
    from atencion.tasks.loss import generator_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 64, generator=g).to(device).requires_grad_()
    weight = (0.6 * torch.randn(500, 64, generator=g)).to(device).requires_grad_()
    bias = torch.randn(500, generator=g).to(device).requires_grad_()
    target = torch.randint(4, 500, (300,), generator=g).to(device)
    params = (hidden, weight, bias)

    def gradients(loss_fn, bf16):
        for p in params:
            p.grad = None
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    plain = lambda: label_smoothed_loss(F.linear(hidden, weight, bias), target, 0, 0.1)[0]  # noqa: E731
    chunked = lambda: generator_loss(hidden, weight, bias, target, 0, 0.1, chunk=64)[0]  # noqa: E731
    want_loss, reference = gradients(plain, bf16=False)
    got_loss, got_grads = gradients(chunked, bf16=True)
    yard_loss, yardsticks = gradients(plain, bf16=True)
    assert abs(got_loss - want_loss) <= 1.1 * abs(yard_loss - want_loss) + 1e-3 * want_loss
    for got, yardstick, want in zip(got_grads, yardsticks, reference):
        error = (got - want).norm() / want.norm()
        assert error <= 1.1 * (yardstick - want).norm() / want.norm()
        assert error < 0.01
