"""What every converter does the same way: refuse a setting the other library cannot express,
walk one name map in either direction, and load a converted state dict only when it sets every
parameter.

A new family: one module here with its name map, its config translation, and one entry in
interop/__init__.py's table. The name map is a list of :class:`Pair`; :func:`import_tensors`
reads it from Hugging Face to atencion, :func:`export_tensors` from atencion to Hugging Face.
To read a Hugging Face model directory without building transformers' model (interop/hf_dir.py),
the module also names its ``MODEL_TYPE`` (config.json's ``model_type``) and splits its importer
in two: ``import_config(hf_config, architecture)`` (the ModelConfig of that class) and
``import_state(cfg, state)`` (the atencion tensors from any mapping of Hugging Face names, a
model's state dict or a checkpoint read tensor by tensor); ``TIED`` names the tensors a saved
checkpoint leaves out because they are another one."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from ..errors import AtencionError


class Pair(NamedTuple):
    """One row of a family's name map: the atencion parameter ``ours`` is the Hugging Face
    parameter ``theirs`` or, when ``theirs`` names several (W^Q, W^K, W^V), their concatenation
    along dim 0. ``to_ours`` / ``to_theirs`` turn one side into the other (a transpose, a
    permutation of rows; None: as is), acting on the concatenated tensor. ``sizes``: the rows of
    each of ``theirs`` when they differ (grouped-query attention's smaller W^K, W^V); None: equal."""

    ours: str
    theirs: str | tuple[str, ...]
    to_ours: Callable[[Tensor], Tensor] | None = None
    to_theirs: Callable[[Tensor], Tensor] | None = None
    sizes: tuple[int, ...] | None = None


def weight_and_bias(ours: str, theirs: str | tuple[str, ...], to_ours=None, to_theirs=None,
                    sizes: tuple[int, ...] | None = None) -> list[Pair]:
    """The two Pairs of a module with a weight and a bias (a Linear, a LayerNorm), both turned by
    the same functions: ``theirs`` names the module(s), without ``.weight``."""
    names = (theirs,) if isinstance(theirs, str) else theirs
    return [Pair(f"{ours}.{p}", tuple(f"{t}.{p}" for t in names) if len(names) > 1 else f"{names[0]}.{p}",
                 to_ours, to_theirs, sizes) for p in ("weight", "bias")]


def per_head_qkv(n_heads: int) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """(to_ours, to_theirs) between a projection fused per head, whose output rows (and bias) are
    (heads, [q; k; v], d_k) (GPT-NeoX's and Bloom's ``query_key_value``), and atencion's
    ``in_proj``, which stacks all the queries, then all the keys, then all the values."""
    def to_ours(t: Tensor) -> Tensor:
        return t.reshape(n_heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    def to_theirs(t: Tensor) -> Tensor:
        return t.reshape(3, n_heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    return to_ours, to_theirs


def _names(pair: Pair) -> tuple[str, ...]:
    return (pair.theirs,) if isinstance(pair.theirs, str) else pair.theirs


def import_tensors(name_map: list[Pair], state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The atencion tensors of ``name_map`` read from a Hugging Face state dict."""
    out: dict[str, Tensor] = {}
    for pair in name_map:
        names = _names(pair)
        value = state[names[0]] if len(names) == 1 else torch.cat([state[name] for name in names])
        out[pair.ours] = pair.to_ours(value) if pair.to_ours else value
    return out


def export_tensors(name_map: list[Pair], state: dict[str, Tensor],
                   target: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The Hugging Face tensors of ``name_map`` read from an atencion state dict. Given
    ``target`` (the Hugging Face model's own state dict), a parameter the atencion model lacks
    (``bias=False``) is written as zeros of the target's shape; without it, one is a KeyError."""
    out: dict[str, Tensor] = {}
    for pair in name_map:
        names = _names(pair)
        if pair.ours not in state and target is not None:
            out.update((name, torch.zeros_like(target[name])) for name in names)
            continue
        value = state[pair.ours]
        value = pair.to_theirs(value) if pair.to_theirs else value
        parts = value.split(list(pair.sizes)) if pair.sizes else value.chunk(len(names))
        out.update(zip(names, parts) if len(names) > 1 else [(names[0], value)])
    return out


def classifier_values(hf_config, pooling: str) -> dict:
    """The ModelConfig values of a ``*ForSequenceClassification``'s head: ``num_labels``, its
    label names (``id2label``, in id order) and where it reads (``pooling``)."""
    n = int(hf_config.num_labels)
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(n)]
    return {"task": "classify", "num_labels": n, "pooling": pooling,
            "labels": labels if len(set(labels)) == n else None}


def require(cfg, settings: list[tuple[str, object]], who: str, target: str) -> None:
    """Raise AtencionError naming the first (key, value) of ``settings`` that ``cfg`` does not have."""
    for key, value in settings:
        if getattr(cfg, key) != value:
            raise AtencionError(f"{who}: {key}={getattr(cfg, key)!r} cannot be expressed by {target}, which needs "
                                f"{key}={value!r}")


def require_paper_blocks(cfg, who: str, target: str) -> None:
    """Raise AtencionError naming the first block of today's decoder (grouped-query attention,
    q/k/v biases, a gated feed-forward network, RoPE scaling) that ``target``, a family with the
    paper's blocks, cannot express."""
    if cfg.kv_heads != cfg.n_heads:
        raise AtencionError(f"{who}: n_kv_heads={cfg.n_kv_heads} (grouped-query attention) cannot be expressed by "
                            f"{target}, whose keys and values have n_heads ({cfg.n_heads}) heads")
    if cfg.qkv_bias and not cfg.bias:
        raise AtencionError(f"{who}: qkv_bias=True with bias=False cannot be expressed by {target}, whose "
                            f"projections all have biases or none")
    if cfg.activation in ("swiglu", "geglu"):
        raise AtencionError(f"{who}: activation={cfg.activation!r} (a gated feed-forward network) cannot be "
                            f"expressed by {target}")
    if cfg.rope_scaling is not None:
        raise AtencionError(f"{who}: rope_scaling={cfg.rope_scaling!r} cannot be expressed by {target}")


def import_decoder_tensors(name_map: list[Pair], state: dict[str, Tensor], tied: bool) -> dict[str, Tensor]:
    """:func:`import_tensors` for a decoder-only model, whose output projection, when ``tied``, is
    its embedding table (Hugging Face checkpoints store it once, or as a copy)."""
    out = import_tensors(name_map, state)
    if tied:
        out["generator.weight"] = out["decoder.embed.weight"]
    return out


def load_exported(hf_model, state: dict[str, Tensor], who: str):
    """``hf_model`` (eval mode) with ``state`` loaded, once ``state`` names exactly its tensors."""
    expected = set(hf_model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise AtencionError(f"{who}: weights do not match; missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf_model.load_state_dict(state)
    return hf_model.eval()


def load_complete(model, state: dict[str, Tensor], who: str):
    """``model`` with ``state`` loaded, once ``state`` covers every parameter; returns it."""
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise AtencionError(f"{who} left parameters unset: {sorted(missing)[:5]}")
    model.load_state_dict(state)
    return model
