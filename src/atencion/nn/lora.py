"""LoRA (Hu et al. 2021): fine-tune a trained model through low-rank adapters.

A frozen linear layer W x + b becomes W x + b + (α / r) · B A dropout(x), with A (r × d_in)
drawn as torch initialises a linear layer and B (d_out × r) zero, so the adapted model starts
as the model it adapts. Only A and B (and a task head the base model lacks) are trained; the
base weights are not copied into the adapted model's directory, which names its base by path and
by the SHA-256 of its weights, checked whenever the adapters are loaded (model_dir.py writes and
reads those files).

Targets are module names: ``attention`` (``in_proj``, W^Q, W^K and W^V stacked, and
``out_proj``, W^O), ``ffn`` (``linear1``, ``linear2``, and a gated network's ``linear3``:
Llama's gate_proj, down_proj, up_proj), ``all`` (every linear layer but the classification
head and MoE routers), ``embeddings`` (the token embedding tables), or patterns
(``decoder.layers.*.self_attn.in_proj``; a pattern without a dot also matches as the last part
of a name, as Hugging Face PEFT matches). The stacked ``in_proj`` gets one adapter of rank r
from d_model to 3 · d_model ((h + 2g) · d_k under grouped-query attention). An embedding table
E (vocabulary × d_model) becomes E + (α / r) · (B A)ᵀ with A (r × vocabulary) zero and B
(d_model × r) drawn from N(0, 1), as PEFT adapts embeddings; the adapted table is a
parametrization of the weight, so the output projection tied to it (§3.4) reads the adapted
table too, and merging changes nothing.

``merge_lora`` folds the adapters into plain weights: W ← W + (α / r) · B A.
"""

from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import number
from ..errors import AtencionError
from .dropout import Dropout
from .matvec import Linear, linear

SHORTHANDS = {"attention": ["in_proj", "out_proj"], "ffn": ["linear1", "linear2", "linear3"]}


@dataclass
class LoraSpec:
    """What ``train.lora`` asks for: rank r, α (the update is scaled by α / r), dropout on the
    adapter's input, and the target names or patterns."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] | str = "attention"

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            self.targets = [self.targets]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, values: dict, where: str = "train.lora") -> "LoraSpec":
        """The spec of a ``train.lora`` mapping, each value checked; errors name the key."""
        if not isinstance(values, dict):
            raise AtencionError(f"{where}: expected a mapping with keys {sorted(KEYS)}, got {values!r}")
        unknown = sorted(set(values) - set(KEYS))
        if unknown:
            raise AtencionError(f"{where}.{unknown[0]}: unknown key; {where} takes {sorted(KEYS)}")
        spec = {**KEYS, **values}

        def checked(key: str, integer: bool, fits, expected: str) -> int | float:
            """The value of ``key`` as the other config sections read numbers (``3e-3``, which YAML 1.1
            reads as a string, too), refused unless it ``fits``."""
            try:
                value = number(key, spec[key], integer)
            except AtencionError:
                value = None
            if value is None or not fits(value):
                raise AtencionError(f"{where}.{key}: expected {expected}, got {spec[key]!r}")
            return value

        rank = checked("rank", True, lambda r: r >= 1, "an integer >= 1")
        alpha = checked("alpha", False, lambda a: a > 0, "a number > 0")
        dropout = checked("dropout", False, lambda p: 0 <= p < 1, "a number in [0, 1)")
        targets = spec["targets"]
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
            raise AtencionError(f"{where}.targets: expected attention, ffn, all, or a list of module names or "
                                f"patterns, got {spec['targets']!r}")
        return cls(rank, alpha, dropout, targets)


KEYS = {f.name: f.default for f in fields(LoraSpec)}  # the keys of train.lora, with their defaults


class LoRALinear(nn.Module):
    """Hu et al. (2021), eq. 3: h = W₀x + ΔW x = W₀x + B A x, here ``base(x) + scaling ·
    B(A(dropout(x)))`` over a frozen ``nn.Linear`` (scaling α / r, §4.1)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's initialisation (as PEFT's)
        self.scaling = alpha / rank
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling

    def rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features ``start:stop`` only (the cross-attention query, or its keys and values)."""
        bias = None if self.base.bias is None else self.base.bias[start:stop]
        low = F.linear(self.dropout(x), self.lora_A)
        return linear(x, self.base.weight[start:stop], bias) + F.linear(low, self.lora_B[start:stop]) * self.scaling

    def merged(self) -> nn.Linear:
        """The base layer with the update folded in."""
        with torch.no_grad():
            self.base.weight += (self.lora_B @ self.lora_A) * self.scaling
        return self.base

    def extra_repr(self) -> str:
        return f"rank={self.lora_A.size(0)}, scaling={self.scaling:g}"


class EmbeddingDelta(nn.Module):
    """The parametrization E ↦ E + scaling · (B A)ᵀ of an embedding table (and of every layer
    tied to it)."""

    def __init__(self, vocab_size: int, d_model: int, rank: int, alpha: float, device=None):
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros(rank, vocab_size, device=device))
        self.lora_B = nn.Parameter(torch.randn(d_model, rank, device=device))
        self.scaling = alpha / rank

    def forward(self, weight: Tensor) -> Tensor:
        return weight + (self.lora_B @ self.lora_A).t() * self.scaling


def _embeddings(model: nn.Module) -> dict[str, nn.Module]:
    """The token embedding tables, by name (a table shared by encoder and decoder once)."""
    from .positional import TokenEmbedding

    return {name: module for name, module in model.named_modules() if isinstance(module, TokenEmbedding)}


def _adapt_embedding(model: nn.Module, embed: nn.Module, spec: "LoraSpec") -> None:
    from torch.nn.utils import parametrize

    weight = embed.weight
    holders = [m for m in model.modules() if m._parameters.get("weight") is weight]  # the table and its ties
    delta = EmbeddingDelta(weight.size(0), weight.size(1), spec.rank, spec.alpha, weight.device)
    for module in holders:
        parametrize.register_parametrization(module, "weight", delta, unsafe=True)


def _merge_embeddings(model: nn.Module) -> None:
    from torch.nn.utils import parametrize

    for delta in {id(m): m for m in model.modules() if isinstance(m, EmbeddingDelta)}.values():
        holders = [m for m in model.modules() if parametrize.is_parametrized(m, "weight")
                   and m.parametrizations.weight[0] is delta]
        original = holders[0].parametrizations.weight.original
        with torch.no_grad():
            adapted = delta(original)
        for module in holders:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        with torch.no_grad():
            original.copy_(adapted)


def _eligible(model: nn.Module) -> dict[str, nn.Linear]:
    """Every linear layer an adapter may wrap, by name."""
    return {name: module for name, module in model.named_modules()
            if type(module) in (nn.Linear, Linear)
            and not name.startswith("classifier.") and not name.endswith(".router")}


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def select_targets(model: nn.Module, spec: LoraSpec, where: str = "train.lora") -> list[str]:
    """The names of the linear layers ``spec.targets`` names, checked: every target matches a
    linear layer, and the rank is at most each layer's smaller side."""
    eligible = _eligible(model)
    chosen: list[str] = []
    for target in spec.targets:
        if target == "all":
            found = list(eligible)
        elif target == "embeddings":
            found = list(_embeddings(model))
        else:
            patterns = SHORTHANDS.get(target, [target])
            found = [name for name in eligible if any(_matches(name, p) for p in patterns)]
        if not found:
            examples = sorted({name.rsplit(".", 1)[-1] for name in eligible})
            raise AtencionError(f"{where}.targets: {target!r} matches no linear layer of the model; use attention, "
                                f"ffn, all, or names such as {examples} (or full names like {next(iter(eligible))!r})")
        chosen += [name for name in found if name not in chosen]
    for name in chosen:
        layer = model.get_submodule(name)
        sides = (layer.in_features, layer.out_features) if name in eligible else tuple(layer.weight.shape)
        if spec.rank > min(sides):
            raise AtencionError(f"{where}.rank: {spec.rank} is larger than layer {name} "
                                f"({sides[0]} → {sides[1]}) allows; expected at most {min(sides)}")
    return chosen


@dataclass
class LoraInfo:
    """The adapters a model carries and the base model they adapt."""

    spec: LoraSpec
    modules: list[str]
    base: str            # the base model directory (absolute)
    base_sha256: str     # of its model.safetensors


def apply_lora(model: nn.Module, spec: LoraSpec, base: str | os.PathLike, base_sha256: str,
               trainable: list[str] = ()) -> list[str]:
    """Wrap the targeted linear layers of ``model`` (which holds the base weights) in adapters and
    freeze everything else but the parameters named in ``trainable`` (a task head the base
    lacks). Returns the wrapped names."""
    names = select_targets(model, spec)
    tables = _embeddings(model)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        if name in tables:
            _adapt_embedding(model, tables[name], spec)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), spec.rank, spec.alpha, spec.dropout))
    params = dict(model.named_parameters())
    for name in trainable:
        params[name].requires_grad_(True)
    model.lora = LoraInfo(spec, names, str(Path(base).resolve()), base_sha256)
    return names


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter of ``model`` into its base weights, in place: a plain model again."""
    if getattr(model, "lora", None) is None:
        return model
    _merge_embeddings(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, module.merged())
    for p in model.parameters():
        p.requires_grad_(True)
    model.lora = None
    return model


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    """What a LoRA model's directory stores: the trainable tensors (adapters, a new head)."""
    return {name: p.detach().contiguous().cpu() for name, p in model.named_parameters() if p.requires_grad}
