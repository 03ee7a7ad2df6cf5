"""Paged attention in one Triton launch for a whole step: decodes, short chunks (speculative
verification) and long prefill chunks with cached context before them, over the project's paged KV
layout (k_cache/v_cache: [Hkv, num_blocks, block_size, D], heads first, then blocks).

Grid: (cdiv(T, BLOCK_Q) + num_seqs, Hkv). Sequence i owns the query-tile programs from
query_start[i] // BLOCK_Q + i up to the next sequence's first; the `+ i` leaves room for each
sequence's partial tiles, so sequence i always has at least cdiv(q_len_i, BLOCK_Q) programs and no
program spans two sequences. A program finds its sequence by binary search over query_start (no
metadata beyond the arguments); spare programs (and those past the last sequence) return at once:

    tokens         | a a a a | b | c c c c c c | pad pad |     BLOCK_Q = 4, num_seqs = 3, T = 13
    query_start      0         4   5             11
    first program    0         2   3                         query_start[i] // 4 + i
    program          0: a[0:4]  1: spare  2: b  3: c[0:4]  4: c[4:6]  5, 6: spare   (grid 4 + 3)

Each program takes BLOCK_Q query tokens of one sequence times the G query heads of its kv head and
packs them into the M dimension of tl.dot (row r = token r // G_PAD, head r % G_PAD; G padded to a
power of two), so one pass over a KV tile serves the whole GQA group: a decode reads each K/V byte
once per kv head. KV tiles of BLOCK_N positions are gathered token by token through the block table
(any power-of-two block size: a tile may span many blocks or part of one), under an online softmax
in float32 (exp2 of log2-domain scores, running max and sum). Tiles past the program's last query
position (causal) and before its first query's window start are never visited; masks handle the
edges, head_dim padding (D_PAD >= 16) and G padding. No load reaches past a sequence's context.

Tile sizes come from Python ints only (CUDA-graph friendly, no autotuning): BLOCK_M = BLOCK_Q *
G_PAD follows the average query rows per sequence (T * G / num_seqs) as a power of two in [16, 128]:
decode batches get 16-row tiles (mma.sync), prefill chunks 64-128 rows (wgmma); BLOCK_N = 64. Half
of both for head_dim > 128 and for float32 (exact "ieee" dots), so that bf16/fp16 tiles spill no
registers on sm_90 (checked with ptxas; tests/test_triton_attention.py compiles a few configurations).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): scores live in the log2 domain
TWO_LOG2E = tl.constexpr(2 * LOG2E)  # tanh(x) = 1 - 2 / (exp2(x * TWO_LOG2E) + 1)
NO_WINDOW = 1 << 30  # "window 0": farther back than any context


class Tiles(NamedTuple):
    block_m: int  # query rows per program: block_q tokens x g_pad heads
    block_q: int
    block_n: int  # KV positions per tile
    g_pad: int
    d_pad: int
    num_warps: int
    num_stages: int


def choose_tiles(num_tokens: int, num_seqs: int, group: int, head_dim: int, elem_size: int = 2) -> Tiles:
    """Tile sizes for a step of `num_tokens` tokens (padding included) over `num_seqs` sequences.
    Sized so that nothing spills on sm_90 (checked with ptxas): float32 (exact "ieee" dots on CUDA
    cores, twice the bytes per element) and head_dim > 128 get half-size tiles."""
    g_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    wide, fp32 = d_pad > 128, elem_size > 2
    cap = (64 if wide else 128) // (2 if fp32 else 1)
    rows = triton.next_power_of_2(max(1, num_tokens * group // max(1, num_seqs)))  # query rows per sequence
    block_m = max(g_pad, min(max(16, rows), cap))  # tl.dot needs M >= 16; a group never splits
    block_n = 32 if wide or fp32 else 64
    num_warps = 8 if block_m * d_pad >= (4096 if fp32 else 16384) else 4
    return Tiles(block_m, block_m // g_pad, block_n, g_pad, d_pad, num_warps, 3)


@triton.jit
def _find_sequence(query_start, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i < num_seqs whose first program (query_start[i] // BLOCK_Q + i) is <= pid."""
    lo = pid * 0  # a tensor, not a constexpr: loop-carried
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2  # both non-negative: truncating and floor division agree
        first = tl.load(query_start + mid).to(tl.int32) // BLOCK_Q + mid
        lo = tl.where(first <= pid, mid, lo)
        hi = tl.where(first <= pid, hi, mid)
    return lo


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with float32 accumulation. UPCAST (the interpreter only): it keeps bfloat16 as raw uint16
    bits and multiplies those, so the same bf16 values go in as float32 (exact, like tensor cores)."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, qs_ptr, lens_ptr, table_ptr,
        num_seqs, qk_scale, softcap, window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kh, stride_kb, stride_ks, stride_vh, stride_vb, stride_vs, stride_table,
        G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        STAGES: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(qs_ptr, pid, num_seqs, BLOCK_Q)
    q_first = tl.load(qs_ptr + seq).to(tl.int32)  # the sequence's first token in the batch
    q_len = tl.load(qs_ptr + seq + 1).to(tl.int32) - q_first
    first = (pid - (q_first // BLOCK_Q + seq)) * BLOCK_Q  # this tile's first token, within the sequence
    if first >= q_len:  # a spare program (or past the last sequence)
        return
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    ctx0 = seq_len - q_len  # position of the sequence's first query token

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    tok = first + rows // G_PAD  # [BLOCK_M] token within the sequence
    head = rows % G_PAD  # [BLOCK_M] head within the group
    row_ok = (tok < q_len) & (head < G)
    pos = ctx0 + tok  # [BLOCK_M] the query's position in its sequence
    dims = tl.arange(0, D_PAD)  # [D_PAD]
    dim_ok = dims < D
    q_tok = (q_first + tok).to(tl.int64)
    q_head = kv_head * G + head
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :],
                mask=io_mask, other=0.0)  # [BLOCK_M, D_PAD]

    # keys the tile can see: [window start of its first query, position of its last query]
    kv_hi = ctx0 + tl.minimum(first + BLOCK_Q, q_len)  # exclusive
    kv_lo = tl.maximum(ctx0 + first - window + 1, 0) // BLOCK_N * BLOCK_N
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    table = table_ptr + seq.to(tl.int64) * stride_table
    cols = tl.arange(0, BLOCK_N)  # [BLOCK_N]

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile must not make NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in tl.range(kv_lo, kv_hi, BLOCK_N, num_stages=STAGES):  # cp.async pipelined on GPUs
        kpos = start + cols  # [BLOCK_N]
        k_ok = kpos < kv_hi  # never past the context: later table entries are arbitrary
        block = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)  # [BLOCK_N]
        offset = kpos % BLOCK_SIZE
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_base + (block * stride_kb + offset * stride_ks)[:, None] + dims[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:  # s = dot * scale / softcap; then softcap * LOG2E * tanh(s), tanh from exp2 (saturates)
            s = softcap * (1.0 - 2.0 / (tl.exp2(s * TWO_LOG2E) + 1.0))
        back = pos[:, None] - kpos[None, :]  # [BLOCK_M, BLOCK_N] how far back each key is
        s = tl.where((back >= 0) & (back < window), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (block * stride_vb + offset * stride_vs)[:, None] + dims[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # l_i is 0 only on masked (unstored) rows
    tl.store(o_ptr + q_tok[:, None] * stride_ot + q_head[:, None] * stride_oh + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=io_mask)


def paged_attention(q, k_cache, v_cache, out, query_start, seq_lens, block_table, num_seqs: int, scale: float,
                    *, window: int = 0, softcap: float = 0.0) -> None:
    """out[t] = softmax(scale * q[t] K^T, causal/window-masked) V for the tokens of the first
    `num_seqs` sequences; q/out: [T, Hq, D], caches: [Hkv, NB, BS, D]; other rows of out untouched."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and v_cache.shape == k_cache.shape and out.shape == q.shape
    assert block_size & (block_size - 1) == 0, "the block size must be a power of two"
    assert q.stride(-1) == out.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    if num_seqs == 0 or num_tokens == 0:
        return
    group = num_heads // num_kv_heads
    t = choose_tiles(num_tokens, num_seqs, group, head_dim, q.element_size())
    grid = (triton.cdiv(num_tokens, t.block_q) + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, query_start, seq_lens, block_table,
        # log2-domain scores: the scale (or the softcap's outer factor) carries LOG2E
        num_seqs, scale / softcap if softcap > 0 else scale * LOG2E, softcap * LOG2E,
        window if window > 0 else NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        G=group, G_PAD=t.g_pad, BLOCK_Q=t.block_q, BLOCK_N=t.block_n, D=head_dim, D_PAD=t.d_pad,
        BLOCK_SIZE=block_size, SOFTCAP=softcap > 0,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 models: no TF32 rounding
        UPCAST=bool(triton.knobs.runtime.interpret) and q.dtype == torch.bfloat16,
        STAGES=t.num_stages, num_warps=t.num_warps)


def reference_paged_attention(q, k_cache, v_cache, query_start, seq_lens, block_table, num_seqs, scale, *,
                              window=0, softcap=0.0) -> torch.Tensor:
    """The oracle: one sequence at a time, keys gathered by position, float32 softmax; rows of
    tokens outside the first `num_seqs` sequences are zero."""
    out = torch.zeros_like(q)
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = q.shape[1] // num_kv_heads
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for i in range(num_seqs):
        a, b, ctx = starts[i], starts[i + 1], lens[i]
        if b == a:
            continue
        kpos = torch.arange(ctx, device=q.device)  # [ctx]
        blocks = block_table[i].long()[kpos // block_size]
        keys = k_cache[:, blocks, kpos % block_size].float().repeat_interleave(group, 0)  # [Hq, ctx, D]
        values = v_cache[:, blocks, kpos % block_size].float().repeat_interleave(group, 0)
        scores = torch.einsum("thd,hkd->htk", q[a:b].float(), keys) * scale  # [Hq, n, ctx]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        back = torch.arange(ctx - (b - a), ctx, device=q.device).view(-1, 1) - kpos.view(1, -1)  # [n, ctx]
        allowed = (back >= 0) & ((back < window) if window > 0 else True)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[a:b] = torch.einsum("htk,hkd->thd", scores.softmax(-1), values).to(q.dtype)
    return out
