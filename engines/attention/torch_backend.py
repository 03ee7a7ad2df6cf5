"""The torch attention backend (CPU, and CUDA without flash-attn): plain PyTorch ops over blocks.

    k_cache[layer]: [kv_heads, num_blocks, block_size, head_dim]     (heads first, then blocks)
    slot s = block_id * block_size + offset      (a token's place in the flattened cache)

This step's K/V are written by slot (`store_kv`). Decodes (one query each) attend together in one
batched call: one index_select per layer gathers whole blocks of every decode's block table,
already shaped [kv_heads, B, S, D] for the batched matmuls. Gathering blocks instead of slots moves the same bytes as block_size
times fewer, longer rows (a 16-token block of 64-dim bf16 heads is one 2 KiB copy, not sixteen
128-byte ones). Each prefill chunk attends on its own, causally within the chunk and to the
context before it, with SDPA. The few tokens of a decode with proposals to verify (speculative
decoding) are decode rows, each with its own context length: one batched call, not a prefill each.
One block past the cache's end is scratch: padding tokens write
their K/V there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engines.attention.base import AttentionBackend
from engines.attention.step import LayerOptions, StepView, bucket
from engines.devices import to_device
from engines.layers.attention import masked_attention, softcap


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v: [N, Hkv, D] → caches [Hkv, num_blocks, block_size, D] at the N slots. An fp8 cache takes
    them rounded to fp8 (saturating at the format's largest value), copied as bytes (PyTorch's
    index_copy has no fp8 kernel)."""
    heads, dim = k_cache.shape[0], k_cache.shape[-1]
    if k_cache.dtype.itemsize == 1:
        k, v = k.to(k_cache.dtype).view(torch.uint8), v.to(v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


class TorchMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # [N] where each token's K/V goes (padding: the scratch block)
    block_table: torch.Tensor  # [Bd, nb] the decode rows' blocks (past a row's end: masked)
    context_lens: torch.Tensor  # [Bd]
    decode_rows: torch.Tensor | None  # [bd <= Bd] the decode rows' tokens; None: all N tokens are decodes
    prefills: tuple = ()  # (query_start, num_query_tokens, context_len, block ids [nb]) per prefill chunk


class TorchPagedBackend(AttentionBackend):
    """Static shapes: a decode step's rows are a bucket of max_num_seqs (the step buffers pad it) and
    its block tables a bucket of the longest sequence's blocks (all of them for a captured step), so
    that the batched matmuls meet a small set of shapes, all made by `warm_up` (each new bf16 matmul
    shape costs oneDNN ~0.4 MiB)."""

    name = "torch"
    block_dim = 1  # the blocks' axis of kv_cache_shape
    stores_fp8 = True

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def allocate(self, num_blocks: int) -> None:
        super().allocate(num_blocks)
        self.decode_buckets: list[int] = []  # the shapes warm_up made (none: steps run at their own sizes)
        self.width_buckets: list[int] = []

    def metadata(self, view: StepView, static: bool = False) -> TorchMetadata:
        if view.decode_only:  # every row a decode (pad rows decode the scratch block): the buffers' views
            width = view.block_table.shape[1] if static else bucket(self.width_buckets, view.width)
            return TorchMetadata(view.slot_mapping, view.block_table[:, :width], view.seq_lens, None)
        return self._mixed_metadata(view)

    def _mixed_metadata(self, view: StepView) -> TorchMetadata:
        """Decode rows (one-token chunks, and each proposed token with its own context length)
        batched; prefill chunks one by one. Built from the host's chunks (an eager step only)."""
        bs, dev = self.block_size, self.device
        decodes: list[tuple[int, int, list[int]]] = []  # (token index, context length, block ids) per decode row
        prefills = []
        start = 0
        for c in view.chunks:
            if c.num_tokens == 1 or c.speculative:
                decodes += [(start + i, c.start + i + 1, c.block_ids) for i in range(c.num_tokens)]
            else:
                nb = -(-c.context_len // bs)
                prefills.append((start, c.num_tokens, c.context_len, to_device(c.block_ids[:nb], dev, torch.long)))
            start += c.num_tokens
        num_rows = bucket(self.decode_buckets, len(decodes)) if decodes else 0
        nb = bucket(self.width_buckets, max((-(-ctx // bs) for _, ctx, _ in decodes), default=1))
        table = [blocks[:nb] + [0] * (nb - len(blocks[:nb])) for _, _, blocks in decodes]
        table += [[self.scratch_block] + [0] * (nb - 1)] * (num_rows - len(decodes))
        lens = [ctx for _, ctx, _ in decodes] + [1] * (num_rows - len(decodes))
        return TorchMetadata(view.slot_mapping, to_device(table, dev, torch.long).view(num_rows, nb),
                             to_device(lens, dev, torch.long), to_device([row for row, _, _ in decodes], dev, torch.long),
                             tuple(prefills))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TorchMetadata):
        k_cache, v_cache = self.keys[layer], self.values[layer]
        store_kv(k[0], v[0], k_cache, v_cache, meta.slot_mapping)
        q, opts = q[0], self.layers[layer]  # [N, Hq, D]
        if meta.decode_rows is None:  # decodes only: the compiled and captured shape
            return self.decode(q, k_cache, v_cache, meta.block_table, meta.context_lens, opts).unsqueeze(0)
        out = torch.zeros_like(q)  # padding tokens stay zero
        rows = meta.decode_rows
        if rows.numel():
            qd = q.new_zeros((meta.block_table.shape[0],) + q.shape[1:])
            qd[: rows.numel()] = q[rows]
            out[rows] = self.decode(qd, k_cache, v_cache, meta.block_table, meta.context_lens, opts)[: rows.numel()]
        for start, n, ctx, blocks in meta.prefills:
            out[start:start + n] = prefill_attention(q[start:start + n], k_cache, v_cache, blocks, ctx, opts)
        return out.unsqueeze(0)

    @staticmethod
    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               context_lens: torch.Tensor, opts: LayerOptions) -> torch.Tensor:
        """The decode rows' attention (the CPU backend's kernel replaces it)."""
        return decode_attention(q, k_cache, v_cache, block_table, context_lens, opts)

    def warm_up(self, num_heads: int, decode_buckets: list[int], width_buckets: list[int]) -> None:
        """Every (decode bucket, width bucket) shape once; the widths are the ones steps use from now on."""
        self.decode_buckets, self.width_buckets = list(decode_buckets), list(width_buckets)
        for rows in decode_buckets:
            q = torch.zeros(rows, num_heads, self.head_dim, dtype=self.dtype, device=self.device)
            lens = torch.ones(rows, dtype=torch.long, device=self.device)
            for nb in width_buckets:
                table = torch.full((rows, nb), self.scratch_block, dtype=torch.long, device=self.device)
                first = self.held.start
                decode_attention(q, self.keys[first], self.values[first], table, lens, self.layers[first])


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache [Hkv, blocks, bs, D], block_table [B, nb] (int32 or int64) → [Hkv, B, nb * bs, D] in one
    copy: an index_select of whole blocks as rows of a 2-D view (twice as fast as selecting along dim 1);
    in `dtype` (an fp8 cache's blocks are selected as bytes, then widened)."""
    heads, num_blocks, bs, dim = cache.shape
    b, nb = block_table.shape
    rows = (torch.arange(heads, device=cache.device).view(-1, 1) * num_blocks
            + block_table.reshape(1, -1).long()).view(-1)
    return read_rows(cache.view(heads * num_blocks, bs * dim), 0, rows, dtype).view(heads, b, nb * bs, dim)


def read_rows(cache: torch.Tensor, dim: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache.index_select(dim, index) in `dtype`."""
    if cache.dtype == dtype:
        return cache.index_select(dim, index)
    return cache.view(torch.uint8).index_select(dim, index).view(cache.dtype).to(dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     context_lens: torch.Tensor, opts: LayerOptions) -> torch.Tensor:
    """q: [B, Hq, D], one query per sequence (at position context_len - 1) → [B, Hq, D]. Two batched
    matmuls over the query groups (on CPU several times faster than SDPA's kernel for one query)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[0]
    keys = gather_blocks(k_cache, block_table, q.dtype)  # [Hkv, B, S, D]
    values = gather_blocks(v_cache, block_table, q.dtype)
    width = keys.shape[2]
    qg = q.view(b, hkv, hq // hkv, d).transpose(0, 1)  # [Hkv, B, G, D]
    scores = softcap(torch.matmul(qg, keys.transpose(-1, -2)).float() * opts.scale, opts.softcap)  # [Hkv, B, G, S]
    cols, lens = torch.arange(width, device=q.device).view(1, -1), context_lens.view(-1, 1)
    mask = cols < lens  # [B, S]
    if opts.window:
        mask &= cols >= lens - opts.window
    scores = scores.masked_fill(~mask.view(1, b, 1, width), float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(b, hq, d)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                      context_len: int, opts: LayerOptions) -> torch.Tensor:
    """q: [n, Hq, D], the last n of a sequence's context_len positions → [n, Hq, D]."""
    n, hq, d = q.shape
    hkv = k_cache.shape[0]
    keys = read_rows(k_cache, 1, blocks, q.dtype).view(hkv, -1, d)[:, :context_len].unsqueeze(0)  # [1, Hkv, ctx, D]
    values = read_rows(v_cache, 1, blocks, q.dtype).view(hkv, -1, d)[:, :context_len].unsqueeze(0)
    q_pos = torch.arange(context_len - n, context_len, device=q.device).view(-1, 1)
    cols = torch.arange(context_len, device=q.device).view(1, -1)
    mask = cols <= q_pos  # [n, ctx]
    if opts.window:
        mask &= cols > q_pos - opts.window
    return masked_attention(q.transpose(0, 1).unsqueeze(0), keys, values, mask, opts)[0].transpose(0, 1)
