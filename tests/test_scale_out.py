"""Scale-out (train/distributed.py): FSDP2 with two CPU processes equals one process accumulating
two micro-batches, its checkpoints load into one process and resume either way, a rank killed
with SIGKILL leaves the last checkpoint whole, two "nodes" on the loopback address equal one node,
and activation checkpointing gives the gradients of the plain backward."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atencion.config import ModelConfig
from atencion.nn.model_dir import build_model, load_model
from atencion.train.checkpoint import list_checkpoints
from atencion.train.config import load_config
from atencion.train.distributed import set_activation_checkpointing
from atencion.train.trainer import train

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")


def write_data(directory: Path) -> dict[str, dict[str, str]]:
    """A translation corpus of number words and a text for a language model; the settings of each task."""
    words = "uno dos tres cuatro cinco seis siete ocho nueve diez".split()
    numbers = "one two three four five six seven eight nine ten".split()
    g = torch.Generator().manual_seed(0)
    src, tgt = [], []
    for _ in range(300):
        idx = torch.randint(0, 10, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        src.append(" ".join(words[i] for i in idx))
        tgt.append(" ".join(numbers[i] for i in reversed(idx)))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.es").write_text("\n".join(src) + "\n")
    (directory / "train.en").write_text("\n".join(tgt) + "\n")
    (directory / "text.txt").write_text("\n".join(f"{a} and then {b}" for a, b in zip(src, tgt)) + "\n")
    common = {"model.d_ff": 64, "model.n_heads": 2, "model.dropout": 0.0, "train.warmup": 20,
              "train.lr_peak": 0.01, "train.progress": False, "train.tensorboard": False, "train.threads": 1,
              "train.device": "cpu", "train.clip_norm": 0.5,
              # W^K's bias has no gradient (softmax ignores a shift per query) but rounding noise of
              # 1e-10, which Adam with the paper's eps of 1e-9 turns into whole steps: the noise of a
              # sum taken in another order would then decide those weights
              "train.adam_eps": 1e-5}
    return {
        "translate": {**common, "data.train_src": str(directory / "train.es"),
                      "data.train_tgt": str(directory / "train.en"), "data.vocab_size": 40, "model.d_model": 32,
                      "model.n_layers": 2, "train.max_tokens": 256, "train.valid_bleu": False},
        "lm": {**common, "task": "lm", "data.train_text": str(directory / "text.txt"), "data.tokenizer": "char",
               "data.block_size": 32, "model.preset": "gpt-tiny", "model.d_model": 32, "model.n_layers": 2,
               "train.max_tokens": 128},
    }


def one_process(settings: dict, out: Path, resume: bool = False, **more) -> Path:
    """One process accumulating two micro-batches: the last checkpoint."""
    values = {**settings, "train.accum_steps": 2, **more}
    train(load_config(None, [f"{k}={v}" for k, v in values.items()]), out, resume=resume)
    return list_checkpoints(out / "checkpoints")[-1]


def launch(settings: dict, out: Path, port: int, *launcher: str, resume: bool = False, **more) -> list[str]:
    """The torchrun command of a run of ``settings`` with one micro-batch per process."""
    args = [a for k, v in {**settings, "train.accum_steps": 1, **more}.items() for a in ("--set", f"{k}={v}")]
    return [sys.executable, "-m", "torch.distributed.run", *(launcher or ("--nproc_per_node", "2", "--master_port",
            str(port))), "-m", "atencion", "train", "configs/reference.yaml", *args, "--out", str(out),
            *(["--resume"] if resume else [])]


def run(command: list[str]) -> None:
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}"


def assert_same_checkpoint(a: Path, b: Path) -> None:
    for name in ("model.safetensors", "optimizer.safetensors"):
        mine, theirs = load_file(str(a / name)), load_file(str(b / name))
        assert mine.keys() == theirs.keys(), name
        for key in mine:
            torch.testing.assert_close(theirs[key], mine[key], atol=1e-6, rtol=1e-5, msg=f"{name}: {key}")


@pytest.mark.parametrize("task", ["translate", "lm"])
def test_fsdp_on_two_processes_equals_one_process_accumulating_two(task, tmp_path):
    settings = write_data(tmp_path / "data")[task]
    one = one_process({**settings, "train.max_steps": 5}, tmp_path / "one")
    run(launch({**settings, "train.max_steps": 5}, tmp_path / "two", 29561, **{"train.distributed": "fsdp"}))
    two = list_checkpoints(tmp_path / "two" / "checkpoints")[-1]
    assert_same_checkpoint(one, two)
    # what the two processes wrote loads into one, and computes what the one-process model does
    ids = torch.randint(4, 20, (2, 9), generator=torch.Generator().manual_seed(1))
    loaded, reference = load_model(two).eval(), load_model(one).eval()
    with torch.no_grad():
        inputs = (ids, ids) if task == "translate" else (ids,)
        torch.testing.assert_close(loaded(*inputs), reference(*inputs), atol=1e-5, rtol=1e-5)
    log = (tmp_path / "two" / "log.jsonl").read_text()
    assert '"stopped_by": "max_steps"' in log


def test_a_one_process_checkpoint_resumes_under_fsdp_and_back(tmp_path):
    settings = {**write_data(tmp_path / "data")["translate"], "train.valid_every": 3}
    whole = one_process({**settings, "train.max_steps": 6}, tmp_path / "whole")
    # one process for 3 updates, then two processes under fsdp to 6
    one_process({**settings, "train.max_steps": 3}, tmp_path / "to_fsdp")
    run(launch({**settings, "train.max_steps": 6}, tmp_path / "to_fsdp", 29562, resume=True,
               **{"train.distributed": "fsdp"}))
    assert_same_checkpoint(whole, list_checkpoints(tmp_path / "to_fsdp" / "checkpoints")[-1])
    # two processes under fsdp for 3 updates, then one process to 6
    run(launch({**settings, "train.max_steps": 3}, tmp_path / "from_fsdp", 29563, **{"train.distributed": "fsdp"}))
    back = one_process({**settings, "train.max_steps": 6}, tmp_path / "from_fsdp", resume=True)
    assert_same_checkpoint(whole, back)


def test_a_rank_killed_with_sigkill_leaves_the_last_checkpoint_whole_and_resumable(tmp_path):
    settings = {**write_data(tmp_path / "data")["translate"], "train.valid_every": 2, "train.max_epochs": 1000,
                "train.distributed": "fsdp"}
    out = tmp_path / "run"
    launcher = subprocess.Popen(launch({**settings, "train.max_steps": 100000}, out, 29564), cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while len(list_checkpoints(out / "checkpoints")) < 3 and time.time() < deadline:
            time.sleep(0.2)
        assert len(list_checkpoints(out / "checkpoints")) >= 3, "no checkpoints within 120 s"
        ranks = subprocess.run(["ps", "--ppid", str(launcher.pid), "-o", "pid="], capture_output=True,
                               text=True).stdout.split()
        assert len(ranks) == 2, ranks
        os.kill(int(ranks[-1]), signal.SIGKILL)
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode != 0
    last = list_checkpoints(out / "checkpoints")[-1]
    load_model(last)  # whole: the model loads
    step = int(last.name.split("_")[1])
    run(launch({**settings, "train.max_steps": step + 2}, out, 29565, resume=True))
    assert list_checkpoints(out / "checkpoints")[-1].name == f"step_{step + 2:08d}"


def test_two_nodes_on_the_loopback_address_equal_one_node(tmp_path):
    settings = {**write_data(tmp_path / "data")["lm"], "train.max_steps": 4, "train.distributed": "fsdp"}
    run(launch(settings, tmp_path / "one_node", 29566))
    nodes = [subprocess.Popen(launch(settings, tmp_path / "two_nodes", 0, "--nnodes", "2", "--nproc_per_node", "1",
                                     "--node_rank", str(rank), "--rdzv_backend", "c10d", "--rdzv_endpoint",
                                     "127.0.0.1:29567", "--rdzv_id", "atencion-test"),
                              cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    errors = [node.communicate(timeout=300)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    assert_same_checkpoint(list_checkpoints(tmp_path / "one_node" / "checkpoints")[-1],
                           list_checkpoints(tmp_path / "two_nodes" / "checkpoints")[-1])


def test_no_process_writes_in_the_run_directory_before_every_process_has_checked_it(tmp_path, monkeypatch):
    """A rank that starts late must not find the main rank's first files in --out and refuse it as
    a directory that is not a run (a CI run lost rank 1 so): the first barrier comes before any write."""
    import atencion.train.trainer as trainer_module
    from atencion.train.distributed import Dist

    out, seen = tmp_path / "run", []

    class Recording(Dist):
        def barrier(self) -> None:
            seen.append(sorted(p.name for p in out.iterdir()) if out.exists() else [])

    monkeypatch.setattr(trainer_module, "init_distributed", lambda device: Recording())
    settings = write_data(tmp_path / "data")["translate"]
    train(load_config(None, [f"{k}={v}" for k, v in {**settings, "train.max_steps": 1}.items()]), out)
    assert seen and seen[0] == [], f"files in --out at the first barrier: {seen[0] if seen else 'no barrier'}"


@pytest.mark.parametrize("arch", ["encoder-decoder", "decoder", "encoder"])
def test_activation_checkpointing_gives_the_gradients_of_the_plain_backward(arch):
    cfg = ModelConfig(vocab_size=50, arch=arch, d_model=32, d_ff=64, n_heads=4, n_layers=2, dropout=0.2,
                      attention_dropout=0.1, max_positions=64)
    model = build_model(cfg).train()
    ids = torch.randint(4, 50, (3, 11), generator=torch.Generator().manual_seed(0))
    inputs = (ids, ids[:, :7]) if arch == "encoder-decoder" else (ids,)
    first = next(m for m in model.modules() if type(m).__name__ == "Block")
    calls = []
    first.self_attn.register_forward_hook(lambda *_: calls.append(1))

    def gradients(on: bool, seed: int = 3) -> dict[str, torch.Tensor]:
        assert set_activation_checkpointing(model, on) == (4 if arch == "encoder-decoder" else 2)
        model.zero_grad()
        calls.clear()
        torch.manual_seed(seed)  # the same dropout masks
        model(*inputs).logsumexp(-1).sum().backward()
        assert len(calls) == (2 if on else 1)  # checkpointed: the block runs again in backward
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain, recomputed = gradients(False), gradients(True)
    assert plain.keys() == recomputed.keys() and plain
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], atol=1e-6, rtol=0, msg=name)
    other = gradients(False, seed=4)  # other masks, other gradients: the masks are what is matched above
    assert any(not torch.allclose(other[name], plain[name]) for name in plain)


# token files ------------------------------------------------------------------------------------


def tokenize(tmp_path: Path, texts: list[Path], tokenizer: Path, name: str) -> Path:
    from atencion.cli import main

    out = tmp_path / name
    assert main(["tokenize", *map(str, texts), "--tokenizer", str(tokenizer), "--out", str(out)]) == 0
    return out


def test_a_token_file_reads_back_the_tokens_written_across_file_boundaries(tmp_path):
    from atencion.data.tokenizer import Tokenizer
    from atencion.data.tokens import HEADER_BYTES, TokenStream, read_header
    from atencion.tasks.lm import text_stream

    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("hola mundo\nadiós\n")
    second.write_text("otra línea más\n")
    tokenizer = Tokenizer.train_text(["hola mundo", "adiós", "otra línea más"], "char", 0)
    tokenizer.save(tmp_path / "tok")
    files = [tokenize(tmp_path, [first], tmp_path / "tok", "a.tokens"),
             tokenize(tmp_path, [second], tmp_path / "tok", "b.tokens")]
    expected = text_stream(["hola mundo", "adiós"], tokenizer) + text_stream(["otra línea más"], tokenizer)
    stream = TokenStream(files, "data.train_tokens", tokenizer)
    assert stream.numel() == len(expected)
    assert stream[0:stream.numel()].tolist() == expected
    for a in range(0, len(expected), 3):  # every slice, those across the boundary too
        for b in range(a, len(expected) + 1, 4):
            assert stream[a:b].tolist() == expected[a:b]
    header = read_header(files[0], "x")
    assert header["dtype"] == "uint16" and header["count"] == len(text_stream(["hola mundo", "adiós"], tokenizer))
    assert files[0].stat().st_size == HEADER_BYTES + 2 * header["count"]


def test_a_vocabulary_beyond_65536_ids_is_written_as_uint32(tmp_path):
    from atencion.data.tokens import TokenStream, write_tokens

    class Big:  # a stand-in tokenizer: what write_tokens asks of one
        src_vocab_size = 70_000

        def save(self, directory):
            (Path(directory) / "vocab.txt").write_text("big")

    ids = [0, 65_535, 65_536, 69_999]
    header = write_tokens(tmp_path / "big.tokens", [ids], Big(), ["x"])
    assert header["dtype"] == "uint32"
    assert TokenStream(tmp_path / "big.tokens", "x")[0:4].tolist() == ids


def test_token_files_are_refused_in_one_line_when_damaged_foreign_or_there_already(tmp_path, capsys):
    from atencion.cli import main
    from atencion.data.tokenizer import Tokenizer

    (tmp_path / "t.txt").write_text("abc\n")
    Tokenizer.train_text(["abc"], "char", 0).save(tmp_path / "tok")
    Tokenizer.train_text(["xyz"], "char", 0).save(tmp_path / "other")
    good = tokenize(tmp_path, [tmp_path / "t.txt"], tmp_path / "tok", "t.tokens")
    before = good.read_bytes()
    assert main(["tokenize", str(tmp_path / "t.txt"), "--tokenizer", str(tmp_path / "tok"), "--out", str(good)]) == 2
    assert "exists" in capsys.readouterr().err and good.read_bytes() == before
    (tmp_path / "cut.tokens").write_bytes(before[:-1])
    (tmp_path / "text.tokens").write_text("not tokens\n")
    base = {"task": "lm", "data.tokenizer_dir": str(tmp_path / "tok"), "model.preset": "gpt-tiny",
            "data.block_size": 2, "train.max_steps": 1, "train.progress": False, "train.tensorboard": False}
    cases = {str(tmp_path / "cut.tokens"): "cut short", str(tmp_path / "text.tokens"): "not a token file"}
    for path, words in cases.items():
        args = [f"--set={k}={v}" for k, v in {**base, "data.train_tokens": path}.items()]
        assert main(["train", "configs/reference.yaml", *args, "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert words in err and path in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    args = [f"--set={k}={v}" for k, v in {**base, "data.train_tokens": str(good),
                                          "data.tokenizer_dir": str(tmp_path / "other")}.items()]
    assert main(["train", "configs/reference.yaml", *args, "--out", str(tmp_path / "run2")]) == 2
    assert "another tokenizer" in capsys.readouterr().err


def test_fsdp_on_token_files_equals_one_process_on_the_text(tmp_path):
    """The stream a token file holds is the text's: one process on the text and two (each reading
    its own blocks of the memory-mapped files) end with the same weights."""
    settings = write_data(tmp_path / "data")["lm"]
    text = Path(settings.pop("data.train_text"))
    lines = text.read_text().splitlines()
    (tmp_path / "train.txt").write_text("\n".join(lines[:200]) + "\n")
    (tmp_path / "more.txt").write_text("\n".join(lines[200:260]) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(lines[260:]) + "\n")
    settings = {**settings, "train.max_steps": 4}
    one = one_process({**settings, "data.train_text": f"[{tmp_path / 'train.txt'}, {tmp_path / 'more.txt'}]",
                       "data.valid_text": tmp_path / "valid.txt"}, tmp_path / "one")
    tokenizer = one.parent.parent  # the run directory holds the tokenizer it trained
    files = [tokenize(tmp_path, [tmp_path / name], tokenizer, f"{name}.tokens") for name in ("train.txt", "more.txt")]
    valid = tokenize(tmp_path, [tmp_path / "valid.txt"], tokenizer, "valid.tokens")
    run(launch({**settings, "data.train_tokens": f"[{files[0]}, {files[1]}]", "data.valid_tokens": valid,
                "data.tokenizer_dir": tokenizer}, tmp_path / "two", 29568, **{"train.distributed": "fsdp"}))
    assert_same_checkpoint(one, list_checkpoints(tmp_path / "two" / "checkpoints")[-1])
    records = [line for line in (tmp_path / "two" / "log.jsonl").read_text().splitlines() if "valid_loss" in line]
    reference = [line for line in (tmp_path / "one" / "log.jsonl").read_text().splitlines() if "valid_loss" in line]
    assert records and records[-1].split('"valid_loss": ')[1][:8] == reference[-1].split('"valid_loss": ')[1][:8]


def test_the_gpt2_124m_recipe_in_miniature_trains_under_fsdp_on_token_files_and_generates(tmp_path):
    """configs/gpt2_124m.yaml as it is, but a small model and a few updates on the CPU: a Hugging
    Face byte-level BPE tokenizer directory, token files written by `atencion tokenize`, two
    processes under fsdp; the result generates."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from atencion.cli import main
    from test_hf_dirs import byte_level_bpe

    byte_level_bpe().save_pretrained(tmp_path / "tokenizer")
    text = write_data(tmp_path / "data")["lm"]["data.train_text"]
    train_tokens = tokenize(tmp_path, [Path(text)], tmp_path / "tokenizer", "train.tokens")
    valid_tokens = tokenize(tmp_path, [tmp_path / "data" / "train.en"], tmp_path / "tokenizer", "valid.tokens")
    small = {"model.n_layers": 2, "model.d_model": 32, "model.d_ff": 64, "model.n_heads": 2,
             "model.max_positions": 64, "data.block_size": 32, "train.max_tokens": 128, "train.accum_steps": 1,
             "train.max_steps": 3, "train.warmup": 1, "train.valid_every": 3, "train.bf16": False,
             "train.distributed": "fsdp", "train.device": "cpu", "train.threads": 1, "train.progress": False,
             "train.tensorboard": False, "data.train_tokens": train_tokens, "data.valid_tokens": valid_tokens,
             "data.tokenizer_dir": tmp_path / "tokenizer"}
    args = [a for k, v in small.items() for a in ("--set", f"{k}={v}")]
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29569", "-m",
         "atencion", "train", "configs/gpt2_124m.yaml", *args, "--out", str(tmp_path / "run")])
    summary = [line for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines() if "summary" in line]
    assert '"steps": 3' in summary[-1]
    assert main(["generate", "--model", str(tmp_path / "run" / "best"), "--prompt", "the cat",
                 "--max-new-tokens", "5", "--temperature", "0"]) == 0
