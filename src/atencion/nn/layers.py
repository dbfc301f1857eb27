"""The layers of §3.1: position-wise feed-forward (§3.3), residual + normalization, the one
block every stack is built from (self-attention, cross-attention in a decoder that has an
encoder, feed-forward: dense, or a mixture of experts, nn/moe.py), and the output projection
to the vocabulary (§3.4) that every model ends with.

``Block(cfg)`` is where a block's options are read from the ModelConfig: a new one (as the gated
feed-forward network, grouped-query attention and q/k/v biases were) is a ModelConfig field
(config.py: its default is the paper's, its check, its README row) read here, or in the module
Block builds with it."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .attention import KVCache, MultiHeadAttention, Packing, RelativeTerms
from .dropout import Dropout
from .kinds import make_kind
from .matvec import Linear, RMSNorm, linear
from .moe import MoEFeedForward, has_experts

ACTIVATIONS = {
    "relu": nn.functional.relu,                                               # the paper, §3.3
    "gelu": nn.functional.gelu,                                               # BERT (erf form)
    "gelu-tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),         # GPT-2's "gelu_new"
    "swiglu": nn.functional.silu,                                             # Swish_1 = SiLU, gating (Llama)
    "geglu": nn.functional.gelu,                                              # GELU, gating
}
GATED = ("swiglu", "geglu")  # the activations of a gated feed-forward network (GatedFeedForward)


def make_norm(cfg) -> nn.Module:
    """LayerNorm (the paper, BERT, GPT-2) or RMSNorm (T5: scale only, no mean, no bias)."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


class FeedForward(nn.Module):
    """§3.3, eq. (2): FFN(x) = max(0, x W1 + b1) W2 + b2 (ReLU; GELU as an option)."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", bias: bool = True):
        super().__init__()
        self.linear1 = Linear(d_model, d_ff, bias=bias)
        self.linear2 = Linear(d_ff, d_model, bias=bias)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.activation(self.linear1(x)))


class GatedFeedForward(nn.Module):
    """GLU variants of eq. (2) (Shazeer 2020): FFN(x) = W2(act(x W1) ⊙ x W3), SwiGLU with Swish
    (SiLU, Llama's), GEGLU with GELU; d_ff is the gated width. Llama names W1 ``gate_proj``, W3
    ``up_proj``, W2 ``down_proj``; here ``linear1``, ``linear3``, ``linear2``."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "swiglu", bias: bool = True):
        super().__init__()
        self.linear1 = Linear(d_model, d_ff, bias=bias)   # W1, the gate
        self.linear2 = Linear(d_ff, d_model, bias=bias)   # W2
        self.linear3 = Linear(d_model, d_ff, bias=bias)   # W3, gated
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.activation(self.linear1(x)) * self.linear3(x))


def feed_forward(cfg) -> nn.Module:
    """The feed-forward network of ``cfg``: eq. (2), or its gated variant for ``swiglu``/``geglu``."""
    ffn = GatedFeedForward if cfg.activation in GATED else FeedForward
    return ffn(cfg.d_model, cfg.d_ff, cfg.activation, cfg.bias)


class Residual(nn.Module):
    """§5.4 and §3.1: Norm(x + Dropout(Sublayer(x))) (post-LN, the paper's),
    or x + Dropout(Sublayer(Norm(x))) with ``norm_first`` (pre-LN)."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = make_norm(cfg)
        self.dropout = Dropout(cfg.dropout)
        self.norm_first = cfg.norm_first

    def forward(self, x: Tensor, sublayer) -> tuple[Tensor, Tensor | None]:
        """``sublayer`` maps a tensor to (output, attention weights or None)."""
        if self.norm_first:
            out, weights = sublayer(self.norm(x))
            return x + self.dropout(out), weights
        out, weights = sublayer(x)
        return self.norm(x + self.dropout(out)), weights


class Block(nn.Module):
    """§3.1: self-attention, then (in the decoder of an encoder-decoder) encoder-decoder
    attention, then the feed-forward network, each inside a residual block. The encoder's
    blocks (and BERT's) have no cross-attention; the decoder's self-attention is masked
    (causal) by the mask the stack passes. With ``cfg.moe``, the feed-forward network of the
    chosen layers (``index``: the block's place in its stack, from 0) is a mixture of experts. With
    ``cfg.attention``, self-attention is computed by that kind (nn/kinds/), ``causal`` in a decoder;
    with ``cfg.d_ff`` 0 there is no feed-forward sub-layer (the attention-only models of Olsson et
    al. 2022, whose circuits are read head by head);
    ``shared``: what the kind's layers share (Linformer's layerwise projection). Self-attention
    has ``cfg.kv_heads`` key/value heads (grouped-query attention); ``qkv_bias`` adds biases to
    the q, k, v projections."""

    def __init__(self, cfg, cross: bool = False, index: int = 0, causal: bool = False,
                 shared: nn.Module | None = None):
        super().__init__()
        heads = dict(attention_dropout=cfg.attention_dropout, bias=cfg.bias, scale=cfg.scale_attention,
                     qkv_bias=cfg.qkv_bias)
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, kind=make_kind(cfg, causal, index, shared),
                                            n_kv_heads=cfg.kv_heads, **heads)
        self.res_self = Residual(cfg)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cross=True, **heads) if cross else None
        self.res_cross = Residual(cfg) if cross else None
        if has_experts(cfg.moe, index):
            experts = [feed_forward(cfg) for _ in range(cfg.moe["experts"])]
            self.ffn = MoEFeedForward(cfg.d_model, experts, cfg.moe["top_k"], cfg.moe["capacity_factor"],
                                      cfg.moe["gate"])
        else:  # d_ff 0: no feed-forward sub-layer, nor its residual block (an attention-only model)
            self.ffn = feed_forward(cfg) if cfg.d_ff else None
        self.res_ffn = Residual(cfg) if self.ffn is not None else None
        # train.activation_checkpointing: keep only the block's input for backward and compute its
        # activations again there (torch.utils.checkpoint; the dropout masks are drawn again alike)
        self.checkpointing = False

    def forward(self, *args, **kwargs) -> tuple[Tensor, Tensor | None, Tensor | None]:
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, *args, use_reentrant=False, **kwargs)
        return self._forward(*args, **kwargs)

    def _forward(
        self,
        x: Tensor,
        self_mask: Tensor | None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        self_cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
        need_weights: bool = False,
        packing: Packing | None = None,
        positions: RelativeTerms | None = None,
        prefix: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``x``: (batch, length, d_model), or with a ``packing`` its real positions (n, d_model).
        ``prefix``: self-attention's prefix keys and values (nn/prefix.py). Returns the output and
        the self- and cross-attention weights (None unless asked)."""
        x, self_weights = self.res_self(x, lambda y: self.self_attn(
            y, mask=self_mask, cache=self_cache, need_weights=need_weights, packing=packing, positions=positions,
            prefix=prefix))
        cross_weights = None
        if self.cross_attn is not None:
            x, cross_weights = self.res_cross(x, lambda y: self.cross_attn(
                y, memory, mask=memory_mask, cache=cross_cache, need_weights=need_weights))
        if self.ffn is not None:
            x, _ = self.res_ffn(x, lambda y: (self.ffn(y), None))
        return x, self_weights, cross_weights


class Generator(nn.Module):
    """§3.4: the pre-softmax linear projection to the vocabulary (optionally tied to the embeddings)."""

    def __init__(self, d_model: int, vocab_size: int, bias: bool, tied_weight: nn.Parameter | None):
        super().__init__()
        if tied_weight is not None:
            self.weight = tied_weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
            nn.init.normal_(self.weight, std=d_model ** -0.5)
        self.bias = nn.Parameter(torch.zeros(vocab_size)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
