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
the number of pairs in a batch.

Use (``evaluate_towers``): zero-shot classification of the first tower's items by the nearest
class centroid of the second tower's (the mean embedding of each label's items), and retrieval
both ways with Recall@1, where a retrieved item of the same label counts as correct; each beside
its chance.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor

from ..data.text import read_labelled_lines
from ..errors import AtencionError, Diverged
from ..fileio import need_file
from ..nn.inputs import INPUTS, input_kind
from ..nn.model_dir import build_model, load_model_dir
from ..nn.towers import Towers, info_nce
from .base import Task, TaskSpec, evaluating, register_task
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

    def model(self) -> Towers:
        return Towers({name: build_model(c) for name, c in self.configs.items()})

    def batches(self, epoch: int) -> list[list[tuple[int, int]]]:
        """This epoch's pairs, drawn from the seed and the epoch, in batches of train.max_tokens."""
        t = self.cfg.train
        drawn = pairs(self.first_labels, self.second_labels, torch.Generator().manual_seed(t.seed * 1_000_003 + epoch))
        return [drawn[k: k + t.max_tokens] for k in range(0, len(drawn), t.max_tokens)]

    def loss(self, model: Towers, batch: list[tuple[int, int]]) -> Tensor:
        return pair_loss(model, [self.first[i] for i, _ in batch], [self.second[j] for _, j in batch])

    @torch.no_grad()
    def validate(self, model: Towers, step: int) -> dict[str, float]:
        """The loss on pairs drawn once from the seed, and zero-shot accuracy of the first tower's
        validation items against the second tower's training centroids."""
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


def collate(model: Towers, name: str, examples: list[Tensor]) -> tuple[Tensor, Tensor | None]:
    inputs, lengths = INPUTS[model.towers[name].cfg.inputs["kind"]].collate(examples)
    device = model.log_scale.device
    return inputs.to(device), None if lengths is None else lengths.to(device)


def pair_loss(model: Towers, first: list[Tensor], second: list[Tensor]) -> Tensor:
    """The symmetric InfoNCE loss of a batch of pairs (first[i], second[i])."""
    a, b = model.names
    return info_nce(model.logits(model.embed(a, *collate(model, a, first)), model.embed(b, *collate(model, b, second))))


# use: embeddings, zero-shot, retrieval --------------------------------------------------------


@torch.no_grad()
def embed_all(model: Towers, name: str, examples: list[Tensor], batch: int = 256) -> Tensor:
    """The normalised embeddings (n, projection) of tower ``name``'s ``examples``, in order."""
    return torch.cat([model.embed(name, *collate(model, name, examples[k: k + batch])).cpu()
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


SPEC = register_task(TaskSpec(
    name="contrastive", kind="towers of two modalities (CLIP)", preset="vit-tiny", archs=("encoder",),
    metric="zero_shot_accuracy", label_smoothing=0.0, training=ContrastiveTask, use="embed",
    needs="towers trained contrastively (task contrastive)", can=can_embed, evaluate=evaluate_towers_dir,
    evaluate_options=("tsv", "other_tsv", "centroid_tsv"), evaluate_required=("tsv", "other_tsv", "centroid_tsv"),
    metrics=("zero_shot_accuracy",)))
