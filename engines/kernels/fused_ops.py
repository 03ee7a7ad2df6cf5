"""Fused elementwise/row kernels of a decode step: residual add + RMSNorm, rotary embedding, gated MLP
activations. Each Triton function has a PyTorch twin of the same name in engines/kernels/torch_ops.py
that defines its numerics exactly (it runs wherever the kernels do not, and is their oracle in tests).

All kernels compute in float32 and round to the input dtype where the reference (torch ops in that
dtype) rounds, so bf16/fp16 results match the reference to within one rounding step and float32 to
~1e-6. They are CUDA-graph capturable: no host syncs, grids come from shapes only (compile them once,
by a warm-up call, before capture). Row-wise inputs may have any row stride; ones whose last dimension
is strided are copied first (rotary's q and k, written in place, may have any strides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_NORM_BLOCK = 65536  # one tile per row; tuned for hidden sizes up to 16384


def _num_warps(block: int) -> int:
    """Warps for a one-dimensional tile of `block` elements: about 16 elements a thread, 1 to 16 warps."""
    return min(max(block // 512, 1), 16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as a 2-D [N, H] tensor (a view when possible) whose rows are contiguous."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# -- Residual add + RMSNorm ----------------------------------------
@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, r_ptr, stride_x, stride_res, stride_y, stride_r,
                         H, eps, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dt = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        r = (x.to(tl.float32) + res.to(tl.float32)).to(dt)  # torch's `x + residual` in x.dtype
        tl.store(r_ptr + row * stride_r + cols, r, mask=mask)
    else:
        r = x
    rf = r.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(rf * rf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        y = rf * inv * (1.0 + w)
    else:
        y = (rf * inv).to(dt).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + cols, y.to(dt), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused `r = x + residual; y = RMSNorm(r)`: one pass per row. Returns (y, r).

    x: [..., H]; residual: same shape and dtype, or None; weight: [H] (normally x.dtype). y is a new
    tensor of x's shape and dtype. r is a new tensor when residual is given (neither x nor residual is
    modified), and x itself when residual is None. Numerics: engines/kernels/torch_ops.py's `add_rms_norm`.
    """
    H = x.shape[-1]
    block = triton.next_power_of_2(H)
    if block > _MAX_NORM_BLOCK:
        raise ValueError(f"add_rms_norm: hidden size {H} exceeds the one-tile limit {_MAX_NORM_BLOCK}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("add_rms_norm: residual must have x's shape and dtype")
    x2, weight = _rows(x), weight.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        res2, r, r2 = x2, x, x2
    else:
        res2 = _rows(residual)
        r = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        r2 = r.view(-1, H)
    n = x2.shape[0]
    if n == 0:
        return y, r
    y2 = y.view(-1, H)
    _add_rms_norm_kernel[(n,)](x2, res2, weight, y2, r2, x2.stride(0), res2.stride(0), y2.stride(0),
                               r2.stride(0), H, eps, HAS_RESIDUAL=residual is not None, GEMMA=gemma,
                               BLOCK=block, num_warps=_num_warps(block))
    return y, r


# -- Rotary embedding ----------------------------------------
@triton.jit
def _rotate_heads(base, heads, num_heads, stride_h, stride_d, first, second, pair_mask, c1, s1, c2, s2):
    """Rotate the pairs (first, second) of heads `heads` of one token at `base`, in place."""
    dt = base.dtype.element_ty
    mask = (heads[:, None] < num_heads) & pair_mask[None, :]
    p1 = base + heads[:, None] * stride_h + first[None, :] * stride_d
    p2 = base + heads[:, None] * stride_h + second[None, :] * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    # out = x * cos + rotated * sin, each product and the sum rounded to x.dtype as torch does
    o1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(p1, o1.to(dt), mask=mask)
    tl.store(p2, o2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, stride_pos, stride_qn, stride_qh, stride_qd,
                   stride_kn, stride_kh, stride_kd, stride_cos, stride_sin, num_q_heads, num_k_heads,
                   HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dt = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + token * stride_pos).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    pair_mask = i < HALF
    if INTERLEAVED:
        first = 2 * i
        second = first + 1
    else:
        first = i
        second = i + HALF
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    # the reference casts the float32 tables to x.dtype first
    c1 = tl.load(cos_row + first, mask=pair_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + second, mask=pair_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + first, mask=pair_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + second, mask=pair_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_qn, heads, num_q_heads, stride_qh, stride_qd, first, second,
                  pair_mask, c1, s1, c2, s2)
    _rotate_heads(k_ptr + token * stride_kn, heads, num_k_heads, stride_kh, stride_kd, first, second,
                  pair_mask, c1, s1, c2, s2)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, *, rot_dim: int | None = None,
                     interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding applied IN PLACE to q and k, which are returned.

    positions: [N] int64/int32 (each < P; not bounds-checked); q: [N, Hq, D]; k: [N, Hk, D] with q's
    dtype; any strides (e.g. views split from a fused qkv tensor, which is then modified in place).
    cos, sin: [P, >= rot_dim] tables with contiguous rows, from torch_ops.rotary_tables (any float dtype; cast
    to q.dtype as the reference does). rot_dim (default cos.shape[-1], even, <= D): only the first
    rot_dim dims of each head rotate; the rest are left untouched. One program rotates up to ~2048
    pairs (all heads of a 7B model's token). Numerics: engines/kernels/torch_ops.py's `rotary_embedding`.
    """
    rot_dim = cos.shape[-1] if rot_dim is None else rot_dim
    n, num_q_heads, d = q.shape
    num_k_heads = k.shape[1]
    if k.shape[0] != n or k.shape[2] != d or k.dtype != q.dtype or positions.shape != (n,):
        raise ValueError("rotary_embedding: want positions [N], q [N, Hq, D], k [N, Hk, D] of one dtype")
    if rot_dim % 2 or rot_dim > d or rot_dim > cos.shape[-1] or cos.shape != sin.shape \
            or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"rotary_embedding: bad rot_dim {rot_dim} for head dim {d}, tables {cos.shape}")
    if n == 0:
        return q, k
    half = rot_dim // 2
    block_half = triton.next_power_of_2(half)
    heads = triton.next_power_of_2(max(num_q_heads, num_k_heads))
    block_h = min(heads, max(1, 2048 // block_half))
    grid = (n, triton.cdiv(max(num_q_heads, num_k_heads), block_h))
    _rotary_kernel[grid](positions, q, k, cos, sin, positions.stride(0), *q.stride(), *k.stride(),
                         cos.stride(0), sin.stride(0), num_q_heads, num_k_heads, HALF=half,
                         INTERLEAVED=interleaved, BLOCK_HALF=block_half, BLOCK_H=block_h, num_warps=4)
    return q, k


# -- Gated MLP activations ----------------------------------------
@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, I, GELU_TANH: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))), tanh(u) = sign(u) (1 - e) / (1 + e)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-2.0 * tl.abs(u))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(u < 0, -t, t)
        act = 0.5 * gate * (1.0 + t)
    else:
        act = gate / (1.0 + tl.exp(-gate))
    out = act.to(dt).to(tl.float32) * up  # the activation, then the product, rounded to x.dtype
    tl.store(out_ptr + row * stride_out + cols, out.to(dt), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    """act(x[..., :I]) * x[..., I:] as a new [..., I] tensor; programs of up to 1024 columns of a row."""
    if x.shape[-1] % 2:
        raise ValueError(f"act_and_mul: last dim {x.shape[-1]} is odd")
    inter = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    out2 = out.view(-1, inter)
    block = min(triton.next_power_of_2(inter), 1024)
    grid = (x2.shape[0], triton.cdiv(inter, block))
    _act_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), inter, GELU_TANH=gelu_tanh, BLOCK=block,
                              num_warps=_num_warps(block) * 2)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: x [..., 2I] → new tensor [..., I] = silu(x[..., :I]) * x[..., I:]. The silu is computed in
    float32 and rounded to x.dtype, then the product is rounded again (see `reference_silu_and_mul`)."""
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): x [..., 2I] → new tensor [..., I] = gelu_tanh(x[..., :I]) * x[..., I:], rounded as
    `silu_and_mul` (see `reference_gelu_tanh_and_mul`)."""
    return _act_and_mul(x, gelu_tanh=True)
