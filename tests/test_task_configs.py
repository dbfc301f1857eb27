"""The training config asks each task's spec (tasks/base.py: ``TaskSpec``) what it reads and checks:
a data key the task does not read is refused naming the tasks that read it, and a task registered
from outside atencion is honoured as the built-in ones are."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

import pytest

from atencion.errors import AtencionError
from atencion.tasks import TASKS
from atencion.tasks.base import USES, TaskSpec, register_task
from atencion.train.config import dump_config, load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def config(tmp_path: Path, task: str) -> Path:
    path = tmp_path / f"{task}.yaml"
    path.write_text(f"task: {task}\n", encoding="utf-8")
    return path


def refusal(path: Path, sets: list[str]) -> str:
    with pytest.raises(AtencionError) as caught:
        load_config(path, sets)
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    return message


@pytest.mark.parametrize("task, setting, readers", [
    ("lm", "data.max_len=64", {"translate", "mlm", "classify", "transcribe"}),
    ("mlm", "data.block_size=64", {"lm"}),
    ("mlm", "data.train_tokens=t.tokens", {"lm"}),
    ("classify", "data.tokenizer_dir=tok", {"lm"}),
    ("translate", "data.header=yes", {"classify"}),
    ("translate", "data.mask_probability=0.2", {"mlm"}),
    ("classify", "data.joint=false", {"translate"}),
    ("transcribe", "data.valid_text=v.txt", {"lm", "mlm"}),
    ("lm", "data.empty_lines=error", {"translate", "classify"}),
])
def test_a_data_key_the_task_does_not_read_is_refused_naming_the_tasks_that_do(tmp_path, task, setting, readers):
    key = setting.split("=")[0]
    message = refusal(config(tmp_path, task), [setting])
    named = message.partition(f"{key} is for task")[2].partition(";")[0]
    assert f"{key} is for task" in message and f"task {task!r} does not read it" in message, message
    assert set(named.lstrip("s ").replace(" and ", ", ").split(", ")) == readers, message


def test_a_data_key_a_task_does_not_read_in_a_yaml_file_is_refused_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("task: lm\ndata:\n  train_text: t.txt\n  max_len: 64\n", encoding="utf-8")
    assert "data.max_len is for tasks" in refusal(path, [])
    towers = ROOT / "configs" / "clip_digits.yaml"  # contrastive reads no tokenizer's keys
    assert "data.vocab_size is for tasks" in refusal(towers, ["data.vocab_size=100"])
    assert "task 'contrastive' does not read it" in refusal(towers, ["data.tokenizer=char"])


@pytest.mark.parametrize("key, does", [("shift", "moves"), ("rotate", "turns")])
def test_image_augmentation_keeps_its_own_words(tmp_path, key, does):
    message = refusal(config(tmp_path, "mlm"), [f"data.{key}=2"])
    assert f"data.{key} {does} the images a classifier trains on; task 'mlm' reads none: set data.{key}: 0" \
        in message


def test_a_key_given_at_its_default_is_not_refused(tmp_path):
    cfg = load_config(config(tmp_path, "lm"), ["data.max_len=256", "data.shift=0", "data.joint=true"])
    assert cfg.data.max_len == 256


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_its_dump_loads_again(tmp_path, path):
    """A run writes its config whole (config.yaml, every key): it must train again as it is."""
    cfg = load_config(path)
    dumped = tmp_path / "config.yaml"
    dumped.write_text(dump_config(cfg), encoding="utf-8")
    assert load_config(dumped).to_dict() == cfg.to_dict()


def test_the_task_checks_of_a_spec_keep_their_messages(tmp_path):
    lm = config(tmp_path, "lm")
    assert "give data.train_text or data.train_tokens, not both" in refusal(
        lm, ["data.train_text=t.txt", "data.train_tokens=t.tokens"])
    assert "data.valid_tokens goes with data.train_tokens" in refusal(lm, ["data.valid_tokens=v.tokens"])
    assert "data.tokenizer: char is for the single-stack tasks" in refusal(config(tmp_path, "translate"),
                                                                         ["data.tokenizer=char"])
    towers = ROOT / "configs" / "clip_digits.yaml"
    assert "task contrastive trains new towers" in refusal(towers, ["train.init_from=somewhere"])
    assert "exactly ['towers', 'projection']" in refusal(towers, ["model.d_model=8"])


def test_a_decoder_classifier_pools_its_last_token_and_stands_in_two_labels(tmp_path):
    cfg = load_config(config(tmp_path, "classify"), ["model.preset=gpt-tiny", "data.max_len=100"])
    assert cfg.stand_in_values() == {"task": "classify", "num_labels": 2}
    assert cfg.model_config(100, None, cfg.stand_in_values()).pooling == "last"
    assert load_config(config(tmp_path, "lm")).stand_in_values() == {"task": "lm"}


# a task registered from outside atencion ----------------------------------------------------------


@contextmanager
def registered(spec: TaskSpec):
    """``spec`` in TASKS and USES for the block, removed after it."""
    register_task(spec)
    try:
        yield spec
    finally:
        del TASKS[spec.name], USES[spec.use]


def check_toy(cfg, source: str) -> None:
    if cfg.data.block_size % 8:
        raise AtencionError(f"{source}: task toy reads blocks of a multiple of 8 tokens, got {cfg.data.block_size}")


def toy_spec() -> TaskSpec:
    """A language model (LMTask trains it) that also reads data.header, with its own check, two
    labels stood in and sequences twice its block."""
    return dataclasses.replace(
        TASKS["lm"], name="toy", use="toy-use", kind="a toy", data_keys=(*TASKS["lm"].data_keys, "header"),
        check_config=check_toy, stand_in={"num_labels": 3}, model_defaults={"decoder": {"pooling": "mean"}},
        longest=lambda cfg: (2 * cfg.data.block_size, "data.block_size"))


def test_a_task_registered_from_outside_is_honoured_by_load_config_and_removed_after(tmp_path):
    path = config(tmp_path, "toy")
    with registered(toy_spec()):
        cfg = load_config(path, ["data.train_text=t.txt", "data.block_size=16", "data.header=yes"])
        assert cfg.task == "toy" and cfg.data.header == "yes" and TASKS["toy"].training is TASKS["lm"].training
        assert cfg.stand_in_values() == {"task": "toy", "num_labels": 3}
        assert cfg.model_config(100, None, cfg.stand_in_values()).pooling == "mean"
        assert "task toy reads blocks of a multiple of 8 tokens, got 12" in refusal(path, ["data.block_size=12"])
        assert "data.block_size gives sequences of up to 80 tokens" in refusal(
            path, ["data.block_size=40", "model.max_positions=64"])
        readers = refusal(path, ["data.max_len=64"]).partition("data.max_len is for tasks ")[2].partition(";")[0]
        assert readers and "toy" not in readers, readers
        assert "data.header is for tasks classify and toy" in refusal(config(tmp_path, "lm"), ["data.header=no"])
    assert "toy" not in TASKS and "toy-use" not in USES
    assert "task must be one of" in refusal(path, [])
    assert "data.header is for task classify;" in refusal(config(tmp_path, "lm"), ["data.header=no"])
