"""Prefix-tuning (Li and Liang 2021) and prompt tuning (Lester et al. 2021): adapt a frozen model
through virtual tokens instead of changed weights, as Hugging Face PEFT builds them.

Prefix-tuning gives every self-attention layer ``length`` trainable key and value vectors that
stand before the keys and values of the real tokens; every query sees them (the padding and the
causal masks are extended by ``length`` visible keys). Without ``projection`` they are one table
(length × N · 2 · d_model, PEFT's ``PrefixEncoder``); with it they are made of a table
(length × d_model) by a two-layer network, Linear(d_model, hidden) → tanh → Linear(hidden,
N · 2 · d_model) (PEFT's ``prefix_projection``, ``encoder_hidden_size``), which Li and Liang
found trains more stably. Row i of that output holds, for each layer, its key and value at
prefix place i, heads side by side. The prefix carries no position: it is not turned by RoPE,
and the real tokens take the places after it (positions ``length`` …), as Hugging Face places
tokens after cached keys, which is how PEFT hands it the prefix. The prefix goes into the
self-attention of the last stack: an encoder's, a decoder's, and in an encoder-decoder the
decoder's only, as PEFT (0.21, with transformers 5) places it there: it builds keys and values
for the cross-attention too but drops them, and the encoder gets none. (PEFT's split of its table
for an encoder-decoder gives every decoder layer the first layer's keys and values; here each
layer has its own, as for the other archs.)

Prompt tuning prepends ``length`` trainable embeddings to the embeddings of the input (the
encoder's, or a decoder-only model's), where they take positions 0 … length-1 and the tokens
follow (PEFT's table for an encoder-decoder holds 2 · length rows, of which its forward reads
the first length: here only those); ``init: random`` draws them from N(0, 1) (PEFT's default),
``init: vocab`` copies the embeddings of tokens drawn at random from the vocabulary (PEFT's
``SAMPLE_VOCAB``). The outputs at the prompt's places are dropped from the logits; a classifier
pools over all places, as the PEFT-wrapped Hugging Face model does (BERT's first place is then
the prompt's).

Neither can be merged into the weights: the virtual tokens add keys (or positions), not a change
of W. A model directory holds them as adapters.safetensors (with a new classification head) and
prefix.json or prompt.json (the spec, the base directory and the SHA-256 of its weights), read
by model_dir.py as LoRA's lora.json is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import number
from ..errors import AtencionError


@dataclass
class PrefixSpec:
    """What ``train.prefix`` asks for: ``length`` key/value places per layer, made through the
    two-layer network of width ``hidden`` (0: d_model) when ``projection``."""

    length: int = 10
    projection: bool = False
    hidden: int = 0

    kind = "prefix"


@dataclass
class PromptSpec:
    """What ``train.prompt`` asks for: ``length`` virtual token embeddings, drawn at random or
    copied from the vocabulary's (``init``)."""

    length: int = 10
    init: str = "random"

    kind = "prompt"


SPECS = {"prefix": PrefixSpec, "prompt": PromptSpec}  # train.KEY → its spec
INITS = ("random", "vocab")


def spec_from_config(key: str, values, where: str | None = None) -> PrefixSpec | PromptSpec:
    """The spec of a ``train.prefix`` or ``train.prompt`` mapping, each value checked; errors name the key."""
    cls, where = SPECS[key], where or f"train.{key}"
    keys = [f.name for f in fields(cls)]
    if not isinstance(values, dict):
        raise AtencionError(f"{where}: expected a mapping with keys {keys}, got {values!r}")
    unknown = sorted(set(values) - set(keys))
    if unknown:
        raise AtencionError(f"{where}.{unknown[0]}: unknown key; {where} takes {keys}")
    spec = cls(**values)

    def whole(name: str, low: int) -> int:
        value = getattr(spec, name)
        try:
            value = None if isinstance(value, bool) else number(name, value, True)
        except AtencionError:
            value = None
        if value is None or value < low:
            raise AtencionError(f"{where}.{name}: expected an integer >= {low}, got {getattr(spec, name)!r}")
        return value

    spec.length = whole("length", 1)
    if key == "prefix":
        if not isinstance(spec.projection, bool):
            raise AtencionError(f"{where}.projection: expected true or false, got {spec.projection!r}")
        spec.hidden = whole("hidden", 0)
        if spec.hidden and not spec.projection:
            raise AtencionError(f"{where}.hidden: the width of the projection's network; set projection: true")
    elif spec.init not in INITS:
        raise AtencionError(f"{where}.init: expected one of {list(INITS)}, got {spec.init!r}")
    return spec


class PrefixEncoder(nn.Module):
    """PEFT's PrefixEncoder: the keys and values of ``length`` prefix places for ``layers`` layers
    of ``heads`` heads, from a table (or a table through a two-layer network)."""

    def __init__(self, spec: PrefixSpec, layers: int, d_model: int, heads: int):
        super().__init__()
        self.length, self.layers, self.heads = spec.length, layers, heads
        width = layers * 2 * d_model
        if spec.projection:
            hidden = spec.hidden or d_model
            self.embedding = nn.Embedding(spec.length, d_model)
            self.transform = nn.Sequential(nn.Linear(d_model, hidden), nn.Tanh(), nn.Linear(hidden, width))
        else:
            self.embedding = nn.Embedding(spec.length, width)
            self.transform = None

    def forward(self) -> list[tuple[Tensor, Tensor]]:
        """Per layer, its prefix keys and values, each (1, heads, length, d_k)."""
        rows = self.embedding.weight
        if self.transform is not None:
            rows = self.transform(rows)
        kv = rows.view(self.length, 2 * self.layers, self.heads, -1).permute(1, 2, 0, 3)  # (2N, h, length, d_k)
        return [(kv[2 * i][None], kv[2 * i + 1][None]) for i in range(self.layers)]


class PromptEmbedding(nn.Module):
    """PEFT's PromptEmbedding: ``length`` embeddings put before the input's."""

    def __init__(self, spec: PromptSpec, token_embedding: nn.Module):
        super().__init__()
        table = token_embedding.weight
        self.embedding = nn.Embedding(spec.length, table.size(1), device=table.device)
        if spec.init == "vocab":
            with torch.no_grad():
                self.embedding.weight.copy_(table[torch.randint(0, table.size(0), (spec.length,))])
        self.scale = getattr(token_embedding, "scale", 1.0)  # the tokens' √d_model (§3.4), if they are scaled

    @property
    def length(self) -> int:
        return self.embedding.num_embeddings

    def prepend(self, x: Tensor) -> Tensor:
        """``x`` (batch, length, d_model), the tokens' embeddings, after the prompt's."""
        prompt = (self.embedding.weight * self.scale).to(x.dtype)
        return torch.cat([prompt.expand(x.size(0), -1, -1), x], dim=1)


@dataclass
class VirtualInfo:
    """The virtual tokens a model carries and the base model they adapt."""

    spec: PrefixSpec | PromptSpec
    base: str            # the base model directory (absolute)
    base_sha256: str     # of its model.safetensors


def check_fits(model: nn.Module, spec: PrefixSpec | PromptSpec, where: str) -> None:
    """Refuse, in one line, a model the spec cannot adapt."""
    from .inputs import input_kind
    from .kinds import full_attention
    from .positional import relative_positions, rotates

    cfg = model.cfg
    key = f"train.{spec.kind}"
    if cfg.arch == "rnn" or not input_kind(cfg).tokens:
        raise AtencionError(f"{where}: {key} adapts a Transformer that reads tokens; this model is arch {cfg.arch!r} "
                            f"with inputs {(cfg.inputs or {}).get('kind', 'tokens')!r}")
    if spec.kind == "prompt":
        return
    if not full_attention(cfg):
        raise AtencionError(f"{where}: {key} adapts models whose self-attention is attention.kind full (the "
                            f"default), which takes its keys before the tokens'; this model's is attention.kind "
                            f"{cfg.attention['kind']!r}, which takes none: use train.prompt or train.lora")
    if cfg.kv_heads != cfg.n_heads:
        raise AtencionError(f"{where}: {key} adapts models whose every query head has a key/value head of its own "
                            f"(n_kv_heads equal to n_heads); this model's {cfg.n_heads} query heads share "
                            f"{cfg.kv_heads} (grouped-query attention, n_kv_heads {cfg.kv_heads}): use train.prompt "
                            f"or train.lora")
    relative = relative_positions(cfg)
    if relative is not None and not rotates(relative):
        raise AtencionError(f"{where}: {key} keys carry no position; positions {cfg.positional!r} add a bias by "
                            f"key position: use learned, sinusoidal or rope positions, or train.prompt")


def stack_of(model: nn.Module, kind: str) -> nn.Module:
    """The stack the virtual tokens go into: a prompt the first (the encoder, if there is one), a
    prefix the last (the decoder, if there is one), as PEFT places them."""
    first = model.encoder if model.cfg.arch != "decoder" else model.decoder
    last = model.decoder if model.cfg.arch != "encoder" else model.encoder
    return first if kind == "prompt" else last


def apply_virtual(model: nn.Module, spec: PrefixSpec | PromptSpec, base: str | os.PathLike, base_sha256: str,
                  trainable: list[str] = ()) -> None:
    """Give ``model`` (which holds the base weights) the virtual tokens of ``spec`` and freeze
    everything else but the parameters named in ``trainable`` (a task head the base lacks)."""
    check_fits(model, spec, "train." + spec.kind)
    for p in model.parameters():
        p.requires_grad_(False)
    stack = stack_of(model, spec.kind)
    device = stack.embed.weight.device
    if spec.kind == "prefix":
        stack.prefix = PrefixEncoder(spec, len(stack.layers), model.cfg.d_model, model.cfg.n_heads).to(device)
    else:
        stack.prompt = PromptEmbedding(spec, stack.embed)
    params = dict(model.named_parameters())
    for name in trainable:
        params[name].requires_grad_(True)
    model.virtual = VirtualInfo(spec, str(Path(base).resolve()), base_sha256)


def places(stack: nn.Module) -> tuple[int, int]:
    """The places the virtual tokens of a stack (an Encoder or a Decoder) add before the tokens'
    at the first step: a prompt's (queries and keys) and a prefix's (keys only)."""
    return (0 if stack.prompt is None else stack.prompt.length), (0 if stack.prefix is None else stack.prefix.length)


def visible_first(mask: Tensor, count: int) -> Tensor:
    """``mask`` (…, keys) with ``count`` keys before the others that every query sees."""
    return torch.cat([mask.new_ones(*mask.shape[:-1], count), mask], dim=-1)


def unmergeable(where: str, kind: str) -> AtencionError:
    """The one-line refusal of a command that needs plain weights (merge-lora, export, init_from)
    for a model adapted by ``kind`` ("prefix" or "prompt") tuning."""
    return AtencionError(f"{where}: is adapted by {kind} tuning (train.{kind}), which cannot be "
                         f"merged into the weights: its virtual tokens add keys or input places, not a change of W; "
                         f"use the model directory as it is (generate, classify, evaluate, serve)")
