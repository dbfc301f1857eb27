"""Token embeddings (§3.4) and positional encodings (§3.5)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import AtencionError


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))."""
    position = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)
    inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table.float()


class SinusoidalPositionalEncoding(nn.Module):
    """§3.5: fixed sinusoids, added to the embeddings; the table grows for longer inputs."""

    def __init__(self, d_model: int, n_positions: int = 1024):
        super().__init__()
        self.d_model = d_model
        self.register_buffer("table", sinusoidal_table(n_positions, d_model), persistent=False)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        """PE for positions offset … offset+length-1, shape (length, d_model)."""
        end = offset + length
        if end > self.table.size(0):
            self.table = sinusoidal_table(max(end, 2 * self.table.size(0)), self.d_model).to(self.table.device)
        return self.table[offset:end]


class LearnedPositionalEmbedding(nn.Module):
    """Table 3, row (E): a learned vector per position instead of sinusoids."""

    def __init__(self, d_model: int, n_positions: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_positions, d_model))
        nn.init.normal_(self.weight, std=d_model ** -0.5)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        end = offset + length
        if end > self.weight.size(0):
            raise AtencionError(
                f"sequence reaches position {end} but learned positions stop at max_positions="
                f"{self.weight.size(0)}; shorten the input or raise max_positions"
            )
        return self.weight[offset:end]


class TokenEmbedding(nn.Module):
    """§3.4: learned embeddings of dimension d_model, multiplied by √d_model."""

    def __init__(self, vocab_size: int, d_model: int, pad_id: int, scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        nn.init.normal_(self.weight, std=d_model ** -0.5)
        self.pad_id = pad_id
        self.scale = math.sqrt(d_model) if scale else 1.0

    def forward(self, ids: Tensor) -> Tensor:
        return nn.functional.embedding(ids, self.weight) * self.scale
