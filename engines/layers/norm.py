"""RMSNorm, computed in float32 as the reference implementations do, with the residual add before it
fused in (one kernel on CUDA: engines/layers/fused.py); Gemma's (1 + weight) form; LayerNorm with a
bias (GPT-NeoX, Falcon) with the same residual contract."""

from __future__ import annotations

import torch
from torch import nn

from engines.layers.fused import UsesFusedOps


class RMSNorm(UsesFusedOps, nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, gemma: bool = False):
        super().__init__()
        self.eps = eps
        self.gemma = gemma  # y = norm(x) * (1 + weight), in float32 (the checkpoint stores weight - 1)
        self.weight = nn.Parameter(torch.zeros(hidden_size) if gemma else torch.ones(hidden_size),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual: (norm(x + residual), x + residual), the sum in x's dtype as the
        reference decoder layers add it."""
        if self.gemma:
            y, r = self.fused.add_rms_norm(x, residual, self.weight, self.eps, gemma=True)
        else:
            y, r = self.fused.add_rms_norm(x, residual, self.weight, self.eps)
        return y if residual is None else (y, r)


class LayerNorm(nn.Module):
    """torch's layer_norm (weight and bias); with a residual: (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float, *, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        r = x if residual is None else x + residual
        y = nn.functional.layer_norm(r, r.shape[-1:], self.weight, self.bias, self.eps)
        return y if residual is None else (y, r)
