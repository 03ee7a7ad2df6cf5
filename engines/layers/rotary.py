"""Rotary position embeddings: cos/sin tables by position (no complex numbers: compile-friendly), applied
by the fused op (in place on CUDA: engines/layers/fused.py).

The tables hold every position a sequence may reach, so each scaling kind is a way to fill them:

    default   angle p * inv_freq,  inv_freq[j] = theta^(-2j/d)
    linear    inv_freq / factor                                    (position interpolation)
    dynamic   default up to max_position_embeddings (transformers rescales the base only past it)
    llama3    long wavelengths / factor, short ones kept, a smooth ramp between (Llama 3.1+)
    yarn      a per-dimension ramp between interpolated and extrapolated frequencies, and cos/sin
              scaled by the attention factor 0.1 ln(factor) + 1
    longrope  short_factor rescales positions below original_max_position_embeddings, long_factor
              those at or past it; cos/sin scaled by sqrt(1 + ln(factor) / ln(original)) (Phi-3)

longrope by position is where we part from transformers: it picks one factor set per forward from
the longest sequence, so a token's rotation depends on what it was batched with (and K cached
before a sequence crossed the limit keeps the short rotation). Below the limit the two agree.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engines.kernels.torch_ops import rotary_tables
from engines.layers.fused import UsesFusedOps
from engines.spec import RopeSpec

def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def rope_tables(rope: RopeSpec, dim: int, max_positions: int,
                max_position_embeddings: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin [max_positions, dim] for `dim` rotating dims of each head."""
    inv_freq = default_inv_freq(rope.theta, dim)
    original = rope.get("original_max_position_embeddings", max_position_embeddings)
    scale = 1.0
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.get("factor")
    elif rope.kind == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    elif rope.kind == "yarn":
        inv_freq, scale = _yarn(rope, dim, original, max_position_embeddings)
    elif rope.kind == "longrope":
        return _longrope(rope, dim, max_positions, original, max_position_embeddings)
    cos, sin = rotary_tables(inv_freq, max_positions)
    return (cos * scale, sin * scale) if scale != 1.0 else (cos, sin)


def _llama3(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    factor, low, high = rope.get("factor"), rope.get("low_freq_factor"), rope.get("high_freq_factor")
    original = rope.get("original_max_position_embeddings")
    wavelength = 2 * math.pi / inv_freq
    # 0 for wavelengths longer than original / low (interpolate fully), 1 below original / high (keep)
    keep = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - keep) * inv_freq / factor + keep * inv_freq


def _yarn(rope: RopeSpec, dim: int, original: int, declared: int | None) -> tuple[torch.Tensor, float]:
    factor = rope.get("factor") or declared / original
    scale = rope.get("attention_factor")
    if scale is None:
        def mscale(s: float, m: float = 1.0) -> float:
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        scale = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.get("beta_fast", 32)), correction_dim(rope.get("beta_slow", 1))
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    extrapolated = default_inv_freq(rope.theta, dim)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp), float(scale)


def _longrope(rope: RopeSpec, dim: int, max_positions: int, original: int,
              declared: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    factor = rope.get("factor") or declared / original
    scale = rope.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = default_inv_freq(rope.theta, dim)
    short = rotary_tables(base / torch.tensor(rope.get("short_factor"), dtype=torch.float32), max_positions)
    long = rotary_tables(base / torch.tensor(rope.get("long_factor"), dtype=torch.float32), max_positions)
    is_long = (torch.arange(max_positions) >= original).view(-1, 1)
    return tuple(torch.where(is_long, lt, st) * scale for st, lt in zip(short, long))


class RotaryEmbedding(UsesFusedOps, nn.Module):
    def __init__(self, rope: RopeSpec, rotary_dim: int, max_positions: int,
                 max_position_embeddings: int | None):
        super().__init__()
        cos, sin = rope_tables(rope, rotary_dim, max_positions, max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, rotary_dim]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [..., tokens, heads, head_dim], k likewise, positions: [..., tokens] → rotated (q, k)."""
        shape_q, shape_k = q.shape, k.shape
        q, k = self.fused.rotary_embedding(positions.reshape(-1), q.reshape(-1, *shape_q[-2:]),
                                      k.reshape(-1, *shape_k[-2:]), self.cos, self.sin)
        return q.reshape(shape_q), k.reshape(shape_k)
