"""A mixture of experts in place of the feed-forward network (§3.3): E expert FFNs and a router
that sends each token to k of them (Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch
Transformer, Fedus et al. 2022; Mixtral, Jiang et al. 2024).

For a token x, with router probabilities p = softmax(x W_r) over the E experts,

    MoE(x) = Σ_{i ∈ topk(p)} g_i · FFN_i(x),    g_i = p_i / Σ_{j ∈ topk(p)} p_j

(Mixtral's gates, ``gate: renormalize``: the k chosen probabilities renormalised to sum to 1;
with k = 1 the gate is exactly 1, so the router learns from the load-balancing loss alone), or
g_i = p_i (``gate: switch``, Switch Transformer's: the gate of a top-1 expert is its
probability, so the task's gradient reaches the router). The load-balancing loss of Switch
(eq. 4-6), over the T tokens of a forward pass,

    L_aux = E · Σ_i f_i · P_i,   f_i = (1/T) Σ_t 1[i ∈ topk(t)],   P_i = (1/T) Σ_t p_i(t)

is smallest (k) when both the assignments f and the probabilities P are uniform; only P
carries a gradient, and it pushes probability away from the busiest experts.

A capacity limit (training only, ``capacity_factor`` > 0) gives each expert at most
C = ceil(capacity_factor · T · k / E) assignments, first come first served in token order; an
assignment over it is dropped (that expert adds nothing to that token), and a token dropped by
all its experts gets a zero output: the residual connection carries it through unchanged.
Evaluation has no limit, so decoding step by step with the KV cache equals the full pass.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class MoEFeedForward(nn.Module):
    """A router (d_model → E, no bias) over ``experts`` (each an FFN of eq. 2), top-``top_k``
    per token. Each forward keeps what the trainer logs: ``aux_loss`` (L_aux, with its
    gradient), ``routed`` (assignments per expert, before the capacity limit), ``dropped``
    (assignments over capacity) and ``tokens`` (T)."""

    def __init__(self, d_model: int, experts: list[nn.Module], top_k: int, capacity_factor: float = 0.0,
                 gate: str = "renormalize"):
        super().__init__()
        self.router = nn.Linear(d_model, len(experts), bias=False)
        self.experts = nn.ModuleList(experts)
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.renormalize = gate == "renormalize"
        self.aux_loss: Tensor | None = None
        self.routed: Tensor | None = None
        self.dropped: Tensor | None = None
        self.tokens = 0

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (..., d_model), every row a token (the encoder's packed real positions too)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n_experts, k = len(self.experts), self.top_k
        probs = self.router(x).float().softmax(dim=-1)                        # p, (T, E)
        top_p, top_i = probs.topk(k, dim=-1)                                   # (T, k)
        if not self.renormalize:
            gates = top_p                                                      # g = p (Switch)
        elif k == 1:
            # p / p is 1, but its gradient is rounding noise (~1e-9), not 0; sign(p) is 1 (p >= 1/E > 0)
            # with a zero gradient, and keeps the router in the output's graph, as DDP expects
            gates = torch.sign(top_p)
        else:
            gates = top_p / top_p.sum(dim=-1, keepdim=True)                    # g, renormalised: sums to 1
        # the T·k assignments in token order: token t's first choice, its second, ..., then t + 1's
        expert = top_i.reshape(-1)
        token = torch.arange(x.size(0), device=x.device).repeat_interleave(k)
        gate = gates.reshape(-1)
        self.routed = torch.bincount(expert, minlength=n_experts).float()
        self.tokens = x.size(0)
        f, p_mean = self.routed / max(self.tokens, 1), probs.mean(dim=0)
        self.aux_loss = n_experts * (f * p_mean).sum()
        kept = self._within_capacity(expert)
        self.dropped = (~kept).sum() if kept is not None else torch.zeros((), dtype=torch.long, device=x.device)
        if kept is not None:
            expert, token, gate = expert[kept], token[kept], gate[kept]
        out = torch.zeros_like(x)
        order = expert.argsort(stable=True)  # the assignments grouped by expert, in token order
        counts = torch.bincount(expert, minlength=n_experts).tolist()
        for ffn, group in zip(self.experts, order.split(counts)):
            if len(group):
                rows = token[group]
                y = ffn(x[rows]) * gate[group, None]
                out.index_add_(0, rows, y.to(out.dtype))
        return out.view(shape)

    def _within_capacity(self, expert: Tensor) -> Tensor | None:
        """Which assignments an expert takes (None: all): the first C of each, in token order."""
        if not (self.training and self.capacity_factor > 0):
            return None
        n_experts = len(self.experts)
        capacity = math.ceil(self.capacity_factor * expert.numel() / n_experts)  # T · k / E assignments each
        one_hot = nn.functional.one_hot(expert, n_experts)
        position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=1)  # 1 for an expert's first assignment, ...
        return position <= capacity


def has_experts(moe: dict | None, index: int) -> bool:
    """Whether layer ``index`` (from 0) of a stack has experts under ``ModelConfig.moe``."""
    return moe is not None and (moe["layers"] == "all" or index % 2 == 1)


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The model's mixture-of-experts layers, in module order (encoder, then decoder; bottom up)."""
    return [module for module in model.modules() if isinstance(module, MoEFeedForward)]


def moe_aux_loss(model: nn.Module) -> Tensor | None:
    """The load-balancing loss of the last forward pass, averaged over the MoE layers (None
    without any)."""
    layers = [layer for layer in moe_layers(model) if layer.aux_loss is not None]
    if not layers:
        return None
    return torch.stack([layer.aux_loss for layer in layers]).mean()


def active_parameters(model: nn.Module) -> int:
    """The parameters one token passes through: all, less the E - k experts it skips per MoE layer."""
    skipped = sum(sum(p.numel() for p in layer.experts[0].parameters()) * (len(layer.experts) - layer.top_k)
                  for layer in moe_layers(model))
    return sum(p.numel() for p in model.parameters()) - skipped


class RoutingStats:
    """What the router did between two log lines, summed over forward passes: the assignments
    per layer and expert, the dropped ones, and the load-balancing loss. Kept on the model's
    device (no synchronisation per step); ``sums`` can be all-reduced over processes."""

    def __init__(self, layers: list[MoEFeedForward]):
        self.layers = layers
        self.experts = len(layers[0].experts)
        device = layers[0].router.weight.device
        # per layer: assignments to each expert, dropped assignments, L_aux summed, forward passes
        self.sums = torch.zeros(len(layers), self.experts + 3, dtype=torch.float64, device=device)

    @classmethod
    def of(cls, model: nn.Module) -> "RoutingStats | None":
        layers = moe_layers(model)
        return cls(layers) if layers else None

    def add(self) -> None:
        """Count the layers' last forward pass."""
        e = self.experts
        for row, layer in zip(self.sums, self.layers):
            row[:e] += layer.routed
            row[e] += layer.dropped
            row[e + 1] += layer.aux_loss.detach()
            row[e + 2] += 1

    def record(self) -> dict:
        """``moe_share``: each layer's share of assignments per expert (a row sums to 1);
        ``moe_dropped``: the share of assignments dropped over capacity; ``moe_aux``: the mean
        L_aux. Then start counting afresh."""
        e = self.experts
        sums = self.sums.cpu()
        routed = sums[:, :e]
        total = routed.sum(dim=1, keepdim=True).clamp_min(1)
        record = {"moe_share": [[round(v, 4) for v in row] for row in (routed / total).tolist()],
                  "moe_dropped": round(float(sums[:, e].sum() / total.sum()), 6),
                  "moe_aux": round(float(sums[:, e + 1].sum() / sums[:, e + 2].sum().clamp_min(1)), 6)}
        self.sums.zero_()
        return record
