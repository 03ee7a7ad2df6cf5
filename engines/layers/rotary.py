"""Rotary position embeddings with cos/sin tables (no complex numbers: compile-friendly), applied by
the fused op (in place on CUDA: engines/layers/fused.py)."""

from __future__ import annotations

import torch
from torch import nn

from engines.kernels.torch_ops import rotary_tables
from engines.layers.fused import ops


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        cos, sin = rotary_tables(inv_freq, max_positions)
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [..., tokens, heads, head_dim], k likewise, positions: [..., tokens] → rotated (q, k)."""
        shape_q, shape_k = q.shape, k.shape
        q, k = ops().rotary_embedding(positions.reshape(-1), q.reshape(-1, *shape_q[-2:]),
                                      k.reshape(-1, *shape_k[-2:]), self.cos, self.sin)
        return q.reshape(shape_q), k.reshape(shape_k)

