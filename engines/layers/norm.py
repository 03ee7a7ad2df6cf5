"""RMSNorm, computed in float32 as the reference implementations do, with the residual add before it
fused in (one kernel on CUDA: engines/layers/fused.py)."""

from __future__ import annotations

import torch
from torch import nn

from engines.layers.fused import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual: (norm(x + residual), x + residual), the sum in x's dtype as the
        reference decoder layers add it."""
        y, r = ops().add_rms_norm(x, residual, self.weight, self.eps)
        return y if residual is None else (y, r)
