"""The PyTorch twins of the fused Triton ops (engines/kernels/fused_ops.py): the same functions,
in plain PyTorch, defining the numerics the kernels match. They run wherever the kernels do not
(CPU, CUDA without triton), and are the kernels' oracle in tests. No triton import here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                           *, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm → (y, r). r = x + residual in x.dtype (x when residual is None); then

    - default (Llama, our RMSNorm): n = (rf * rsqrt(mean(rf^2) + eps)).to(x.dtype) with rf = r.float(),
      y = (weight * n).to(x.dtype) (with weight in x.dtype that is one rounded product in x.dtype);
    - gemma=True (Gemma's (1 + weight) form, multiplied in float32 before one cast):
      y = (rf * rsqrt(mean(rf^2) + eps) * (1.0 + weight.float())).to(x.dtype).
    """
    r = x if residual is None else x + residual
    rf = r.float()
    normed = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.float())).to(x.dtype), r
    return (weight * normed.to(x.dtype)).to(x.dtype), r


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, *, rot_dim: int | None = None,
                     interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q [N, Hq, D] and k [N, Hk, D] (new tensors; the kernel rotates
    in place). For x in (q, k), all in x.dtype:

    c = cos[positions, :rot_dim].to(x.dtype), s likewise, broadcast over heads; xr = x[..., :rot_dim];
    rotated = cat([-xr[..., h:], xr[..., :h]]) with h = rot_dim // 2 (neox "rotate half"), or with
    interleaved=True (GPT-J) rotated[2i] = -xr[2i+1], rotated[2i+1] = xr[2i];
    out = cat([xr * c + rotated * s, x[..., rot_dim:]]).
    """
    rot_dim = cos.shape[-1] if rot_dim is None else rot_dim
    full = rot_dim == cos.shape[-1]
    c = (cos[positions] if full else cos[positions, :rot_dim]).unsqueeze(-2).to(q.dtype)  # [N, 1, rot_dim]
    s = (sin[positions] if full else sin[positions, :rot_dim]).unsqueeze(-2).to(q.dtype)
    out = []
    for x in (q, k):
        xr = x[..., :rot_dim]
        if interleaved:
            rotated = torch.stack([-xr[..., 1::2], xr[..., 0::2]], dim=-1).flatten(-2)
        else:
            rotated = torch.cat([-xr[..., rot_dim // 2:], xr[..., :rot_dim // 2]], dim=-1)
        y = xr * c + rotated * s
        out.append(y if rot_dim == x.shape[-1] else torch.cat([y, x[..., rot_dim:]], dim=-1))
    return out[0], out[1]


def rotary_tables(inv_freq: torch.Tensor, max_positions: int, *,
                  interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin tables [P, 2 * len(inv_freq)]: angle p * inv_freq[j] at column j and j + rot_dim/2
    (neox: cat([freqs, freqs])), or at columns 2j and 2j+1 (interleaved: freqs.repeat_interleave(2))."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """torch's silu(x[..., :I]) * x[..., I:] in x.dtype."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """torch's gelu(x[..., :I], approximate="tanh") * x[..., I:] in x.dtype."""
    inter = x.shape[-1] // 2
    return F.gelu(x[..., :inter], approximate="tanh") * x[..., inter:]
