"""One home per task. Each module here holds a task whole: its training side (a ``Task``: what
it reads, how it batches, its loss, how it validates), its use side (what a model trained for
it does, and how `atencion evaluate` scores it) and its ``SPEC`` (base.TaskSpec: the default
preset, the archs it trains, its metric, its command and server endpoint, what evaluate reads),
side by side as x-transformers keeps a wrapper's loss and its ``generate``.

    translate   an encoder-decoder or an RNN on parallel text        → translate
    lm          a GPT on plain text                                  → generate
    mlm         a BERT by masking                                    → fill-mask
    classify    a label per sentence, over an encoder or a decoder   → classify
    transcribe  speech to text: an encoder-decoder reading recordings → transcribe
    contrastive two towers (CLIP) over two modalities' pairs          → evaluate (zero-shot, retrieval)

The training configuration (train/config.py), the trainer, the command line (each task's
command: ``TaskSpec.command``), `atencion evaluate` and the server read ``TASKS`` instead of
keeping tables of their own. The task a model was trained for is saved
in its config.json (``ModelConfig.task``).

A new task is one module here: a ``Task`` subclass (``tokenizer_texts``/``train_tokenizer``,
``encode``, ``lengths`` or ``batches``, ``make_batch``, ``loss``, ``validate``), its use
functions, its command (``COMMAND = Command(...)``, arguments.py) and ``SPEC =
register_task(TaskSpec(..., command=COMMAND))``; then one import line below.
"""

from __future__ import annotations

from typing import Any

from ..errors import AtencionError
from ..fileio import need_dir
from ..nn.model_dir import directory_kind, load_config, read_towers_file

# isort: off  (the order they register in: of the commands in `atencion --help`, of the endpoints in /info)
from . import classify, contrastive, lm, mlm, transcribe, translate  # noqa: F401  (each registers its SPEC)

# isort: on
from .base import TASKS, USES, Task, TaskBatch, TaskSpec, check_model, describe, flag, model_task, uses

__all__ = ["TASKS", "USES", "Task", "TaskBatch", "TaskSpec", "check_model", "describe", "evaluate", "make_task",
           "model_task", "uses"]


def make_task(cfg) -> Task:
    """The training side of the task ``cfg.task`` (a TrainConfig) names, with its data read."""
    return TASKS[cfg.task].training(cfg)


def evaluate(model: str, warn=None, **options: Any) -> dict:
    """`atencion evaluate`: score the model directory ``model`` on a test set, as its task does
    (``TaskSpec.evaluate``); returns "task" and the scores with their settings. ``options`` are
    evaluate's arguments by name (src, ref, text, tsv, block_size, device, int8, batch_tokens,
    max_input_tokens, decode, ...; None: not given): one that belongs to another task's models
    is refused, as is a missing one the task needs."""
    model_dir = need_dir(model, "--model")
    if directory_kind(model_dir) == "towers":  # several towers, one config each (nn/towers.py)
        task = read_towers_file(model_dir)["task"]
        if task not in TASKS:
            raise AtencionError(f"{model_dir}/towers.json: task {task!r} is not a task of atencion; known: "
                                f"{list(TASKS)}")
        spec = TASKS[task]
        what = spec.kind
    else:
        cfg = load_config(model_dir)
        spec, what = TASKS[model_task(cfg)], describe(cfg)
    for option in dict.fromkeys(o for s in TASKS.values() for o in s.evaluate_options):
        if options.get(option) is not None and option not in spec.evaluate_options:
            kinds = " or ".join(s.kind for s in TASKS.values() if option in s.evaluate_options)
            raise AtencionError(f"{flag(option)} is for {kinds}; --model {model} is {what}: give "
                                f"{spec.evaluate_needs}")
    if any(options.get(option) is None for option in spec.evaluate_required):
        raise AtencionError(f"--model {model} is {what}: give {spec.evaluate_needs}")
    return {"task": spec.name, **spec.evaluate(model, options, warn)}
