"""Self-attention on TP-aware projections; where K/V live is the backend's business.

The backend (the padded KV cache, or a paged backend of engines/attention) is chosen once per
engine and handed to every forward with the step's metadata: `backend.forward(layer_idx, q, k, v,
meta)` stores this step's K/V and returns the attention output.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from engines.dist import Communicator
from engines.layers.linear import ColumnParallelLinear, RowParallelLinear
from engines.layers.norm import RMSNorm
from engines.layers.rotary import RotaryEmbedding
from engines.spec import local_kv_heads


class AttentionBackend(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q: [B, T, heads, D], k/v: [B, T, kv_heads, D] (this step's) → [B, T, heads, D]."""


class Attention(nn.Module):
    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, comm: Communicator, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm_eps: float | None = None):
        super().__init__()
        world = comm.world_size
        if num_heads % world:
            raise ValueError(f"{num_heads} attention heads do not split over {world} ranks")
        self.layer_idx = layer_idx
        self.num_heads = num_heads // world
        self.num_kv_heads, replicated = local_kv_heads(num_kv_heads, world)
        self.head_dim = head_dim
        self.rotary = rotary
        self.kv_size = kv_size = num_kv_heads * head_dim  # all ranks'
        local_kv = self.num_kv_heads * head_dim
        # fused [q | k | v]; with replicated KV heads each rank keeps the one head its q heads use
        self.qkv_proj = ColumnParallelLinear(hidden_size, [num_heads * head_dim, kv_size, kv_size], comm,
                                             bias=qkv_bias, local_sizes=[self.num_heads * head_dim, local_kv, local_kv])
        if replicated:
            head = comm.rank * num_kv_heads // world
            self.kv_rows: tuple[int, int] | None = (head * head_dim, (head + 1) * head_dim)
        else:
            self.kv_rows = None
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, comm, bias=o_bias)
        # Qwen3: each head's q and k RMS-normalised before the rotation
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.comm = comm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, meta) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = backend.forward(self.layer_idx, q, k, v, meta)  # [B, T, heads, D]
        return self.o_proj(out.reshape(b, t, q_size))


def softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap) (Gemma-2's attention and final logit softcapping); scores without a cap."""
    return scores if not cap else torch.tanh(scores / cap) * cap


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, opts) -> torch.Tensor:
    """q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; mask: bool, broadcastable to [B, 1, T, S] (True attends);
    opts: the layer's LayerOptions (scale, softcap; the window is the mask's). SDPA, unless the
    layer caps its scores (then scores, cap, mask and softmax in float32, as transformers' eager
    attention computes them)."""
    hq, hkv = q.shape[1], k.shape[1]
    if not opts.softcap:
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=opts.scale,
                                                          enable_gqa=hkv != hq)
    if hkv != hq:
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    scores = softcap(torch.matmul(q, k.transpose(-1, -2)).float() * opts.scale, opts.softcap)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, opts) -> torch.Tensor:
    """Masked attention with grouped KV heads, heads first.

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; mask: bool, broadcastable to [B, 1, T, S] (True attends).
    One new token per row (decode) takes two small batched matmuls over the query groups, which on
    CPU is several times faster than SDPA's kernel; longer queries (prefill) use SDPA.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    if t > 1:
        return masked_attention(q, k, v, mask, opts)
    group = hq // hkv
    scores = softcap(torch.matmul(q.view(b, hkv, group, d), k.transpose(-1, -2)).float() * opts.scale,
                     opts.softcap)  # [B, Hkv, G, S]
    scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(b, hq, 1, d)
