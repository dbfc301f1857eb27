"""Task ``contrastive``: CLIP (Radford et al. 2021) over two modalities — two encoder towers
(nn/towers.py), one per modality, trained with the symmetric InfoNCE loss and a learned
temperature on pairs of examples of the same label; used zero-shot and for retrieval.

The model section names the towers and the shared space's width:

    model:
      towers:
        image: {inputs: {kind: patches, ...}, d_model: 64, ...}       # an ordinary model section each
        audio: {inputs: {kind: spectrogram, ...}, pooling: mean, ...}
      projection: 64

The data are two labelled TSVs of files (``label<TAB>path``, paths relative to the TSV's folder):
data.train_src for the first tower, data.train_tgt for the second (data.valid_src and
data.valid_tgt choose the checkpoint). Every epoch each item of the first is paired with an item
of the second of the same label drawn at random from the seed and the epoch (a run repeats its
pairs, and --resume continues from the last checkpoint as an unbroken run would); train.max_tokens is
the number of pairs in a batch (a micro-batch of one process).

Training is the trainer's (train/trainer.py), as for every task: the task builds its own model
(``model``: the towers, saved as a towers directory), its batches are ``PairBatch``es, and after
each update it clips the temperature (``after_update``). Under torchrun (DDP, FSDP) the loss is
that of the global batch, every process's pairs: the embeddings are gathered from every process
as open_clip's ``gather_features`` does (``gather``: this process's keep their gradient, the
others' come without), so the loss and the update are the one-process ones on the same pairs
(``global_info_nce``).

Use (``evaluate_towers``): zero-shot classification of the first tower's items by the nearest
class centroid of the second tower's (the mean embedding of each label's items), and retrieval
both ways with Recall@1, where a retrieved item of the same label counts as correct; each beside
its chance.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..config import MODEL_KEYS
from ..data.text import read_labelled_lines
from ..errors import AtencionError, Diverged
from ..fileio import need_file
from ..nn.inputs import INPUTS, input_kind
from ..nn.model_dir import build_model, load_model_dir
from ..nn.towers import Towers, info_nce
from .base import Task, TaskSpec, evaluating, model_device, register_task
from .classify import read_rows

log = logging.getLogger(__name__)


# the configuration ---------------------------------------------------------------------------


def tower_configs(cfg) -> dict:
    """Each tower's ModelConfig: its section over its input kind's preset, an encoder whose
    classification head (num_labels = model.projection) is the projection."""
    out = {}
    for name, section in cfg.model["towers"].items():
        try:  # a tower's section read as a model section of its own (cfg's class: train/config.TrainConfig)
            tower = type(cfg)(task="contrastive", model=dict(section)).model_config(
                0, None, {"task": "contrastive", "num_labels": cfg.model["projection"]})
        except AtencionError as err:
            raise AtencionError(f"model.towers.{name}: {err}") from None
        if tower.arch != "encoder" or input_kind(tower).tokens:
            raise AtencionError(f"model.towers.{name}: a tower is an encoder of images or sounds (model.inputs "
                                f"patches or spectrogram), got arch {tower.arch!r} reading "
                                f"{tower.inputs['kind'] if tower.inputs else 'tokens'}")
        out[name] = tower
    return out


# the data ------------------------------------------------------------------------------------


def read_labelled_files(settings: dict, tsv: str, labels: list[str] | None, what: str
                        ) -> tuple[list[Tensor], list[int], list[str]]:
    """The files a ``label<TAB>path`` TSV names (header: none), read as ``settings`` (a tower's
    inputs) says, their label indices and the label names (learned here when ``labels`` is None)."""
    need_file(tsv, what)
    rows, labels, _, lines = read_labelled_lines(tsv, labels, header="no", empty_lines="error")
    if not rows:
        raise AtencionError(f"{what} {tsv}: no rows")
    return read_rows(settings, tsv, rows, lines, f"{what} {tsv}"), [label for label, _ in rows], labels


def pairs(first: list[int], second: list[int], generator: torch.Generator) -> list[tuple[int, int]]:
    """Each item of ``first`` (its labels) in a random order, with an item of ``second`` of the
    same label drawn at random; a label ``second`` lacks is refused."""
    by_label: dict[int, list[int]] = {}
    for j, label in enumerate(second):
        by_label.setdefault(label, []).append(j)
    out = []
    for i in torch.randperm(len(first), generator=generator).tolist():
        choices = by_label.get(first[i])
        if not choices:
            raise AtencionError(f"label index {first[i]}: no item of the second tower to pair with")
        out.append((i, choices[int(torch.randint(len(choices), (1,), generator=generator))]))
    return out


@dataclass
class PairBatch:
    """One micro-batch of pairs: each tower's collated inputs, (inputs, lengths) by tower name, in
    the pairs' order; its units are the pairs (the loss is summed over them), its tokens the
    positions both towers read."""

    towers: dict[str, tuple[Tensor, Tensor | None]]
    units: int
    tokens: int

    def to(self, device) -> PairBatch:
        return PairBatch({name: (inputs.to(device), None if lengths is None else lengths.to(device))
                          for name, (inputs, lengths) in self.towers.items()}, self.units, self.tokens)


class ContrastiveTask(Task):
    """The training side: the two towers' examples, this epoch's pairs, the loss and validation."""

    name = "contrastive"
    tokens = False

    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg.data
        for key in ("train_src", "train_tgt"):
            if getattr(d, key) is None:
                raise AtencionError(f"task contrastive needs data.train_src (the first tower's label<TAB>path TSV) "
                                    f"and data.train_tgt (the second's); data.{key} is missing")
        if (d.valid_src is None) != (d.valid_tgt is None):
            raise AtencionError("task contrastive: give data.valid_src and data.valid_tgt together, or neither")
        self.configs = tower_configs(cfg)
        first, second = (c.inputs for c in self.configs.values())
        self.first, self.first_labels, self.labels = read_labelled_files(first, d.train_src, None, "data.train_src")
        self.second, self.second_labels, _ = read_labelled_files(second, d.train_tgt, self.labels, "data.train_tgt")
        self.valid = None
        if d.valid_src is not None:
            self.valid = (read_labelled_files(first, d.valid_src, self.labels, "data.valid_src")[:2]
                          + read_labelled_files(second, d.valid_tgt, self.labels, "data.valid_tgt")[:2])

    def train_tokenizer(self) -> None:
        return None  # images and sounds: no vocabulary

    def encode(self, tokenizer) -> None:
        pass

    def model(self) -> Towers:
        return Towers({name: build_model(c) for name, c in self.configs.items()})

    def check_resumed(self, saved, checkpoint: Path) -> None:
        if not isinstance(saved, Towers):
            raise AtencionError(f"{checkpoint}: holds one model, not the towers of task contrastive; the task cannot "
                                f"change on --resume")
        for name, tower in saved.towers.items():
            if tower.cfg != self.configs.get(name):
                raise AtencionError(f"{checkpoint / name / 'config.json'}: not the tower model.towers.{name} "
                                    f"gives now; the model section cannot change on --resume")

    def has_validation(self) -> bool:
        return self.valid is not None

    def batches(self, epoch: int) -> list[list[tuple[int, int]]]:
        """This epoch's pairs, drawn from the seed and the epoch, in batches of train.max_tokens."""
        t = self.cfg.train
        drawn = pairs(self.first_labels, self.second_labels, torch.Generator().manual_seed(t.seed * 1_000_003 + epoch))
        return [drawn[k: k + t.max_tokens] for k in range(0, len(drawn), t.max_tokens)]

    def make_batch(self, indices: list[tuple[int, int]], step: int, part: int) -> PairBatch:
        towers, tokens = {}, 0
        for side, ((name, c), examples) in enumerate(zip(self.configs.items(), (self.first, self.second))):
            chosen = [examples[pair[side]] for pair in indices]
            kind = INPUTS[c.inputs["kind"]]
            towers[name] = kind.collate(chosen)
            tokens += sum(kind.positions(e, c.inputs) for e in chosen)
        return PairBatch(towers, len(indices), tokens)

    def loss(self, forward, model: Towers, batch: PairBatch) -> tuple[Tensor, Tensor]:
        """This process's part of the symmetric InfoNCE loss of the global batch, summed over its
        pairs (``global_info_nce``), twice: it is its own negative log-likelihood."""
        embeddings, scale = forward(batch.towers)
        loss = global_info_nce(*embeddings.values(), scale)
        return loss, loss.detach()

    def after_update(self, model: Towers) -> dict[str, float]:
        """Clip the temperature at 100 (t ≤ log 100), as CLIP's training does; the update's log
        line shows it."""
        model.clamp_()
        log_scale = model.log_scale.detach()
        log_scale = log_scale.full_tensor() if hasattr(log_scale, "full_tensor") else log_scale  # fsdp: its shards
        return {"temperature": round(math.exp(-float(log_scale)), 4)}

    @torch.no_grad()
    def validate(self, model: Towers, device, step: int) -> dict[str, float]:
        """The loss on pairs drawn once from the seed, and zero-shot accuracy of the first tower's
        validation items against the second tower's training centroids (every process alike)."""
        first, first_labels, second, second_labels = self.valid
        drawn = pairs(first_labels, second_labels, torch.Generator().manual_seed(self.cfg.train.seed))
        b = self.cfg.train.max_tokens
        with evaluating(model):
            losses = [(pair_loss(model, [first[i] for i, _ in part], [second[j] for _, j in part]), len(part))
                      for part in (drawn[k: k + b] for k in range(0, len(drawn), b))]
            loss = sum(float(value) * n for value, n in losses) / len(drawn)
            if not math.isfinite(loss):
                raise Diverged(step, "validation loss", loss)
            names = model.names
            centroids = class_centroids(embed_all(model, names[1], self.second, b), self.second_labels,
                                        len(self.labels))
            accuracy = zero_shot(embed_all(model, names[0], first, b), first_labels, centroids)
        return {"valid_loss": loss, "valid_zero_shot_accuracy": accuracy}


def gather(x: Tensor) -> tuple[Tensor, int]:
    """Every process's rows of ``x`` (n_p, d; n_p may differ), in rank order, and the index of
    this process's first row, as open_clip's ``gather_features`` (gather_with_grad off): this
    process's rows keep their gradient, the others' come without. One process: ``x``, 0."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x, 0
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([x.size(0)], device=x.device))
    sizes = [int(n) for n in sizes]
    padded = F.pad(x.detach(), (0, 0, 0, max(sizes) - x.size(0)))  # all_gather takes tensors of one shape
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    parts = [part[:n] for part, n in zip(parts, sizes)]
    parts[rank] = x
    return torch.cat(parts), sum(sizes[:rank])


def global_info_nce(first: Tensor, second: Tensor, scale: Tensor) -> Tensor:
    """This process's part of the symmetric InfoNCE loss of the global batch (every process's
    pairs: ``gather``), summed over pairs; one process: the loss of its batch times its pairs.

    Its value is the part of this process's pairs (their rows' and columns' cross-entropies,
    halved), so that the parts sum to the global batch's loss. Its gradient is, with respect to
    this process's embeddings, that of the whole global loss (the others' embeddings are
    constants here) and, with respect to the temperature, that of its part. Summed over the
    processes (DDP and FSDP average the gradients; the trainer scales by their number), both give
    the one-process gradient of the global batch exactly."""
    both, offset = gather(torch.cat([first, second], 1))
    a, b = both.split([first.size(1), second.size(1)], 1)
    similarities = a @ b.t()
    targets = torch.arange(similarities.size(0), device=similarities.device)

    def per_pair(logits: Tensor) -> Tensor:  # pair i: the cross-entropies of row i and column i, halved
        return (F.cross_entropy(logits, targets, reduction="none")
                + F.cross_entropy(logits.t(), targets, reduction="none")) / 2

    whole = per_pair(scale.detach() * similarities).sum()  # the gradient into this process's embeddings
    part = per_pair(scale * similarities.detach())[offset: offset + first.size(0)].sum()  # value, temperature
    return part + (whole - whole.detach())


def collate(model: Towers, name: str, examples: list[Tensor]) -> tuple[Tensor, Tensor | None]:
    inputs, lengths = INPUTS[model.towers[name].cfg.inputs["kind"]].collate(examples)
    device = model_device(model)
    return inputs.to(device), None if lengths is None else lengths.to(device)


def pair_loss(model: Towers, first: list[Tensor], second: list[Tensor]) -> Tensor:
    """The symmetric InfoNCE loss of a batch of pairs (first[i], second[i]), on this process alone."""
    a, b = model.names
    embeddings, scale = model({a: collate(model, a, first), b: collate(model, b, second)})
    return info_nce(scale * embeddings[a] @ embeddings[b].t())


# use: embeddings, zero-shot, retrieval --------------------------------------------------------


@torch.no_grad()
def embed_all(model: Towers, name: str, examples: list[Tensor], batch: int = 256) -> Tensor:
    """The normalised embeddings (n, projection) of tower ``name``'s ``examples``, in order
    (through the model's forward: under FSDP its hooks gather the weights)."""
    return torch.cat([model({name: collate(model, name, examples[k: k + batch])})[0][name].cpu()
                      for k in range(0, len(examples), batch)])


def class_centroids(embeddings: Tensor, labels: list[int], n: int) -> Tensor:
    """The mean embedding of each label's items, normalised (n, projection); a label without items
    gets zeros (it is never the nearest)."""
    sums = torch.zeros(n, embeddings.size(1)).index_add_(0, torch.tensor(labels), embeddings)
    return torch.nn.functional.normalize(sums, dim=-1)


def zero_shot(embeddings: Tensor, labels: list[int], centroids: Tensor) -> float:
    """The share of ``embeddings`` whose nearest centroid (cosine) is their own label's."""
    return float(((embeddings @ centroids.t()).argmax(-1) == torch.tensor(labels)).float().mean())


def recall_at_1(queries: Tensor, query_labels: list[int], gallery: Tensor, gallery_labels: list[int]) -> float:
    """The share of queries whose most similar gallery item has the query's label."""
    nearest = (queries @ gallery.t()).argmax(-1)
    return float((torch.tensor(gallery_labels)[nearest] == torch.tensor(query_labels)).float().mean())


def retrieval_chance(query_labels: list[int], gallery_labels: list[int]) -> float:
    """Recall@1 of a gallery item drawn at random: the mean share of the gallery with the query's label."""
    gallery = torch.tensor(gallery_labels)
    return float(torch.stack([(gallery == label).float().mean() for label in query_labels]).mean())


def evaluate_towers(model: Towers, first: tuple[list[Tensor], list[int]], second: tuple[list[Tensor], list[int]],
                    centroid: tuple[list[Tensor], list[int]], n_labels: int, batch: int = 256) -> dict:
    """Zero-shot accuracy of the first tower's test items by the nearest centroid of ``centroid``
    (the second tower's labelled items), and Recall@1 both ways between ``first`` and ``second``,
    each beside its chance."""
    a, b = model.names
    with evaluating(model):
        e_first, e_second = embed_all(model, a, first[0], batch), embed_all(model, b, second[0], batch)
        centroids = class_centroids(embed_all(model, b, centroid[0], batch), centroid[1], n_labels)
    present = len(set(centroid[1]))
    return {"zero_shot_accuracy": round(zero_shot(e_first, first[1], centroids), 4),
            "zero_shot_chance": round(1 / present, 4),
            f"recall_at_1_{a}_to_{b}": round(recall_at_1(e_first, first[1], e_second, second[1]), 4),
            f"recall_at_1_{b}_to_{a}": round(recall_at_1(e_second, second[1], e_first, first[1]), 4),
            f"chance_{a}_to_{b}": round(retrieval_chance(first[1], second[1]), 4),
            f"chance_{b}_to_{a}": round(retrieval_chance(second[1], first[1]), 4),
            a: len(first[1]), b: len(second[1]), "centroid_items": len(centroid[1]), "temperature":
                round(1 / math.exp(model.log_scale.item()), 4)}


def evaluate_towers_dir(model: str, options: dict[str, Any], warn=None) -> dict:
    """`atencion evaluate` for towers: --tsv (the first tower's test files), --other-tsv (the
    second tower's) and --centroid-tsv (the second tower's labelled files whose label means
    classify the first's: its training items), each label<TAB>path."""
    loaded, _ = load_model_dir(model, options.get("device", "cpu"), towers=True)
    a, b = loaded.names
    settings = {name: loaded.towers[name].cfg.inputs for name in loaded.names}
    centroid = read_labelled_files(settings[b], options["centroid_tsv"], None, "--centroid-tsv")
    labels = centroid[2]
    first = read_labelled_files(settings[a], options["tsv"], labels, "--tsv")
    second = read_labelled_files(settings[b], options["other_tsv"], labels, "--other-tsv")
    scores = evaluate_towers(loaded, first[:2], second[:2], centroid[:2], len(labels))
    return {**scores, "model": model, "towers": loaded.names, "tsv": options["tsv"],
            "other_tsv": options["other_tsv"], "centroid_tsv": options["centroid_tsv"]}


def can_embed(model, tokenizer) -> bool:
    return isinstance(model, Towers)


TOWERS_SECTION = ("towers", "projection")  # its model section


def check_towers_section(model: dict, source: str) -> None:
    """The model section of a contrastive run: exactly ``towers`` (two named model sections) and
    ``projection`` (a positive width); each tower's own keys are checked as a model section's."""

    if set(model) != set(TOWERS_SECTION):
        raise AtencionError(f"{source}: task contrastive's model section holds exactly {list(TOWERS_SECTION)} "
                            f"(towers: {{NAME: model section}}, projection: WIDTH), got {sorted(model)}")
    towers, width = model["towers"], model["projection"]
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise AtencionError(f"{source}: model.projection must be a positive integer, got {width!r}")
    if not isinstance(towers, dict) or len(towers) != 2 or not all(isinstance(n, str) and n and n == Path(n).name
                                                                   for n in towers):
        raise AtencionError(f"{source}: model.towers must map two names (directory names) to model sections, "
                            f"got {towers!r}")
    for name, section in towers.items():
        if not isinstance(section, dict):
            raise AtencionError(f"{source}: model.towers.{name} must be a model section (a mapping), got {section!r}")
        bad = sorted(set(section) - MODEL_KEYS)
        if bad:
            raise AtencionError(f"{source}: unknown key model.towers.{name}.{bad[0]}; known model keys: "
                                f"{sorted(MODEL_KEYS)}")


def check_contrastive_config(cfg, source: str) -> None:
    """New towers; each tower's section checked now as a model section is."""
    t = cfg.train
    if t.init_from is not None or any(getattr(t, key) is not None for key in ("lora", "prefix", "prompt")):
        raise AtencionError(f"{source}: task contrastive trains new towers; train.init_from, train.lora, "
                            f"train.prefix and train.prompt are for the single-model tasks")
    try:
        tower_configs(cfg)
    except AtencionError as err:
        raise AtencionError(f"{source}: {err}") from None


SPEC = register_task(TaskSpec(
    name="contrastive", kind="towers of two modalities (CLIP)", preset="vit-tiny", archs=("encoder",),
    metric="zero_shot_accuracy", label_smoothing=0.0, training=ContrastiveTask, use="embed",
    needs="towers trained contrastively (task contrastive)", can=can_embed, evaluate=evaluate_towers_dir,
    evaluate_options=("tsv", "other_tsv", "centroid_tsv"), evaluate_required=("tsv", "other_tsv", "centroid_tsv"),
    metrics=("zero_shot_accuracy",),
    data_keys=("train_src", "train_tgt", "valid_src", "valid_tgt"), check_config=check_contrastive_config,
    check_model_section=check_towers_section))
