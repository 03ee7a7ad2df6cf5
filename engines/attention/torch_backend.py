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
from torch import nn

from engines.attention.base import AttentionBackend, SeqSlice, bucket


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v: [N, Hkv, D] → caches [Hkv, num_blocks, block_size, D] at the N slots."""
    heads, dim = k_cache.shape[0], k_cache.shape[-1]
    k_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


class TorchMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # [N] where each token's K/V goes (padding: the scratch block)
    block_table: torch.Tensor  # [Bd, nb] the decodes' blocks (past a row's end: masked)
    context_lens: torch.Tensor  # [Bd]
    decode_rows: torch.Tensor | None  # [bd <= Bd] the real decodes' tokens; None: all N tokens are decodes
    prefills: tuple = ()  # (query_start, num_query_tokens, context_len, block ids [nb]) per prefill chunk


def decode_metadata(slot_mapping: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor) -> TorchMetadata:
    """A decode-only step (the compiled path builds it from its own input buffers)."""
    return TorchMetadata(slot_mapping, block_table, context_lens, None)


class TorchPagedBackend(AttentionBackend):
    """Static shapes: the decodes' batch is padded to a bucket of max_num_seqs and their block
    tables to a bucket of the longest sequence's blocks, so that the batched matmuls meet a small
    set of shapes, all made by `warm_up` (each new bf16 matmul shape costs oneDNN ~0.4 MiB)."""

    name = "torch"

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def build_metadata(self, seqs: list[SeqSlice], num_tokens: int | None = None) -> TorchMetadata:
        """`num_tokens` >= the sequences' tokens: the rest are padding (written to the scratch block;
        their output is zero, or a one-token decode on it when every real token is a decode)."""
        bs, dev, scratch = self.block_size, self.device, self.scratch_block
        real = sum(s.num_query_tokens for s in seqs)
        num_tokens = real if num_tokens is None else num_tokens
        slots: list[int] = []
        decodes: list[tuple[int, int, list[int]]] = []  # (token index, context length, block ids) per decode row
        prefills = []
        for s in seqs:
            start = s.context_len - s.num_query_tokens
            slots += [s.block_ids[p // bs] * bs + p % bs for p in range(start, s.context_len)]
            if s.num_query_tokens == 1 or s.speculative:  # a proposal's tokens: a decode row each
                decodes += [(s.query_start + i, start + i + 1, s.block_ids) for i in range(s.num_query_tokens)]
            else:
                nb = -(-s.context_len // bs)
                prefills.append((s.query_start, s.num_query_tokens, s.context_len,
                                 torch.tensor(s.block_ids[:nb], dtype=torch.long, device=dev)))
        slots += [scratch * bs] * (num_tokens - real)
        decode_only = bool(decodes) and len(decodes) == real and all(row == i for i, (row, _, _) in enumerate(decodes))
        rows = None if decode_only else torch.tensor([row for row, _, _ in decodes], dtype=torch.long, device=dev)
        num_rows = num_tokens if decode_only else bucket(self.decode_buckets, len(decodes))
        nb = bucket(self.width_buckets, max((-(-ctx // bs) for _, ctx, _ in decodes), default=1))
        table = [blocks[:nb] + [0] * (nb - len(blocks[:nb])) for _, _, blocks in decodes]
        table += [[scratch] + [0] * (nb - 1)] * (num_rows - len(decodes))
        lens = [ctx for _, ctx, _ in decodes] + [1] * (num_rows - len(decodes))
        return TorchMetadata(torch.tensor(slots, dtype=torch.long, device=dev),
                             torch.tensor(table, dtype=torch.long, device=dev).view(num_rows, nb),
                             torch.tensor(lens, dtype=torch.long, device=dev), rows, tuple(prefills))

    def build_decode_metadata(self, seqs: list[SeqSlice], num_rows: int, width: int) -> TorchMetadata:
        rows = decode_rows(seqs, num_rows, width, self.block_size, self.scratch_block)
        return decode_metadata(*(torch.tensor(x, dtype=torch.long, device=self.device) for x in rows))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TorchMetadata):
        k_cache, v_cache = self.keys[layer], self.values[layer]
        store_kv(k[0], v[0], k_cache, v_cache, meta.slot_mapping)
        q = q[0]  # [N, Hq, D]
        if meta.decode_rows is None:  # decodes only: the compiled shape
            return decode_attention(q, k_cache, v_cache, meta.block_table, meta.context_lens).unsqueeze(0)
        out = torch.zeros_like(q)  # padding tokens stay zero
        rows = meta.decode_rows
        if rows.numel():
            qd = q.new_zeros((meta.block_table.shape[0],) + q.shape[1:])
            qd[: rows.numel()] = q[rows]
            out[rows] = decode_attention(qd, k_cache, v_cache, meta.block_table, meta.context_lens)[: rows.numel()]
        for start, n, ctx, blocks in meta.prefills:
            out[start:start + n] = prefill_attention(q[start:start + n], k_cache, v_cache, blocks, ctx)
        return out.unsqueeze(0)

    def warm_up(self, hq: int) -> None:
        """Every (decode bucket, width bucket) shape once."""
        for rows in self.decode_buckets:
            q = torch.zeros(rows, hq, self.head_dim, dtype=self.dtype, device=self.device)
            lens = torch.ones(rows, dtype=torch.long, device=self.device)
            for nb in self.width_buckets:
                table = torch.full((rows, nb), self.scratch_block, dtype=torch.long, device=self.device)
                decode_attention(q, self.keys[0], self.values[0], table, lens)


def decode_rows(seqs: list[SeqSlice], num_rows: int, width: int, block_size: int, scratch: int):
    """A decode-only step at a fixed shape as lists: (slots [num_rows], block table [num_rows][width],
    context lengths [num_rows]); rows past the sequences decode one padding token on the scratch block."""
    pad = num_rows - len(seqs)
    slots = [s.block_ids[(s.context_len - 1) // block_size] * block_size + (s.context_len - 1) % block_size
             for s in seqs] + [scratch * block_size] * pad
    table = [s.block_ids[:width] + [0] * (width - len(s.block_ids[:width])) for s in seqs]
    table += [[scratch] + [0] * (width - 1)] * pad
    return slots, table, [s.context_len for s in seqs] + [1] * pad


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [Hkv, blocks, bs, D], block_table [B, nb] → [Hkv, B, nb * bs, D] in one copy: an
    index_select of whole blocks as rows of a 2-D view (twice as fast as selecting along dim 1)."""
    heads, num_blocks, bs, dim = cache.shape
    b, nb = block_table.shape
    rows = (torch.arange(heads, device=cache.device).view(-1, 1) * num_blocks + block_table.reshape(1, -1)).view(-1)
    return cache.view(heads * num_blocks, bs * dim).index_select(0, rows).view(heads, b, nb * bs, dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     context_lens: torch.Tensor) -> torch.Tensor:
    """q: [B, Hq, D], one query per sequence → [B, Hq, D]. Two batched matmuls over the query groups
    (on CPU several times faster than SDPA's kernel for one query)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[0]
    keys = gather_blocks(k_cache, block_table)  # [Hkv, B, S, D]
    values = gather_blocks(v_cache, block_table)
    width = keys.shape[2]
    qg = q.view(b, hkv, hq // hkv, d).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * d ** -0.5  # [Hkv, B, G, S]
    mask = torch.arange(width, device=q.device).view(1, -1) < context_lens.view(-1, 1)  # [B, S]
    scores = scores.masked_fill(~mask.view(1, b, 1, width), float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(b, hq, d)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                      context_len: int) -> torch.Tensor:
    """q: [n, Hq, D], the last n of a sequence's context_len positions → [n, Hq, D]."""
    n, hq, d = q.shape
    hkv = k_cache.shape[0]
    keys = k_cache.index_select(1, blocks).view(hkv, -1, d)[:, :context_len].unsqueeze(0)  # [1, Hkv, ctx, D]
    values = v_cache.index_select(1, blocks).view(hkv, -1, d)[:, :context_len].unsqueeze(0)
    q_pos = torch.arange(context_len - n, context_len, device=q.device).view(-1, 1)
    mask = torch.arange(context_len, device=q.device).view(1, -1) <= q_pos  # [n, ctx]
    out = nn.functional.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values,
                                                     attn_mask=mask, enable_gqa=hkv != hq)
    return out[0].transpose(0, 1)
