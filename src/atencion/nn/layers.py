"""The layers of §3.1: position-wise feed-forward (§3.3), residual + LayerNorm, encoder and decoder layers."""

from __future__ import annotations

from torch import Tensor, nn

from .attention import KVCache, MultiHeadAttention, Packing, RelativeTerms
from .dropout import Dropout


class FeedForward(nn.Module):
    """§3.3, eq. (2): FFN(x) = max(0, x W1 + b1) W2 + b2 (ReLU; GELU as an option)."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", bias: bool = True):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)
        self.activation = {"relu": nn.functional.relu, "gelu": nn.functional.gelu}[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.activation(self.linear1(x)))


class Residual(nn.Module):
    """§5.4 and §3.1: LayerNorm(x + Dropout(Sublayer(x))) (post-LN, the paper's),
    or x + Dropout(Sublayer(LayerNorm(x))) with ``norm_first`` (pre-LN)."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, sublayer) -> tuple[Tensor, Tensor | None]:
        """``sublayer`` maps a tensor to (output, attention weights or None)."""
        if self.norm_first:
            out, weights = sublayer(self.norm(x))
            return x + self.dropout(out), weights
        out, weights = sublayer(x)
        return self.norm(x + self.dropout(out)), weights


class EncoderLayer(nn.Module):
    """§3.1: self-attention, then the feed-forward network, each inside a residual block."""

    def __init__(self, d_model, n_heads, d_ff, dropout, attention_dropout, activation,
                 norm_first, eps, bias=True):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, attention_dropout, bias)
        self.ffn = FeedForward(d_model, d_ff, activation, bias)
        self.res_attn = Residual(d_model, dropout, norm_first, eps)
        self.res_ffn = Residual(d_model, dropout, norm_first, eps)

    def forward(self, x: Tensor, mask: Tensor | None, need_weights: bool = False,
                packing: Packing | None = None, positions: RelativeTerms | None = None):
        """``x``: (batch, length, d_model), or with a ``packing`` its real positions (n, d_model)."""
        x, weights = self.res_attn(x, lambda y: self.self_attn(y, mask=mask, need_weights=need_weights,
                                                               packing=packing, positions=positions))
        x, _ = self.res_ffn(x, lambda y: (self.ffn(y), None))
        return x, weights


class DecoderLayer(nn.Module):
    """§3.1: masked self-attention, encoder-decoder attention, feed-forward; each residual."""

    def __init__(self, d_model, n_heads, d_ff, dropout, attention_dropout, activation,
                 norm_first, eps, bias=True):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, attention_dropout, bias)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, attention_dropout, bias, cross=True)
        self.ffn = FeedForward(d_model, d_ff, activation, bias)
        self.res_self = Residual(d_model, dropout, norm_first, eps)
        self.res_cross = Residual(d_model, dropout, norm_first, eps)
        self.res_ffn = Residual(d_model, dropout, norm_first, eps)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        self_mask: Tensor | None,
        memory_mask: Tensor | None,
        self_cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
        need_weights: bool = False,
        positions: RelativeTerms | None = None,
    ):
        x, self_weights = self.res_self(x, lambda y: self.self_attn(
            y, mask=self_mask, cache=self_cache, need_weights=need_weights, positions=positions))
        x, cross_weights = self.res_cross(x, lambda y: self.cross_attn(
            y, memory, mask=memory_mask, cache=cross_cache, need_weights=need_weights))
        x, _ = self.res_ffn(x, lambda y: (self.ffn(y), None))
        return x, self_weights, cross_weights
