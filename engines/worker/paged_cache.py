"""The paged KV cache: per layer one K and one V tensor split into fixed-size blocks.

    k_cache[layer]: [kv_heads, num_blocks * block_size, head_dim]     (heads first: see below)
    slot s = block_id * block_size + offset      (a token's place in the flattened cache)

A step runs one flattened, padding-free batch of tokens (prefill chunks and decodes together):

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]     (three decodes, two prefill chunks)
    slot_mapping[i]: where token i's K/V is written
    each sequence reads its K/V back through its block table (gathered slot indices, computed once
    per step and reused by every layer)

Decodes (one query each) attend together in one batched call; each prefill chunk attends on its
own, causally within the chunk and to everything before it. With heads first, one index_select
over the slot dimension gathers every decode's context already shaped [kv_heads, B, S, D], so the
batched matmuls read it without another copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.layers.attention import attention


@dataclass
class SeqSlice:
    """One sequence's part of a step."""

    query_start: int  # index of its first token in the flattened batch
    num_query_tokens: int
    context_len: int  # tokens in the cache once this step's are written (computed + scheduled)
    block_ids: list[int]


class StepMetadata:
    """Index tensors of one step, built once, shared by every layer."""

    def __init__(self, seqs: list[SeqSlice], block_size: int, device: torch.device):
        self.num_tokens = sum(s.num_query_tokens for s in seqs)
        slots = [_slots(s.block_ids, s.context_len - s.num_query_tokens, s.context_len, block_size, device)
                 for s in seqs]
        self.slot_mapping = torch.cat(slots) if slots else torch.empty(0, dtype=torch.long, device=device)
        decodes = [s for s in seqs if s.num_query_tokens == 1]
        self.decode_rows = torch.tensor([s.query_start for s in decodes], dtype=torch.long, device=device)
        width = max((s.context_len for s in decodes), default=0)
        if decodes:
            # [num_decodes * width]: the slot of every context position (past a row's end: masked out)
            num_blocks = -(-width // block_size)
            tables = torch.tensor([s.block_ids[:num_blocks] + [0] * (num_blocks - len(s.block_ids[:num_blocks]))
                                   for s in decodes], dtype=torch.long, device=device)
            pos = torch.arange(width, device=device)
            self.decode_slots = (tables[:, pos // block_size] * block_size + pos % block_size).view(-1)
            lengths = torch.tensor([s.context_len for s in decodes], dtype=torch.long, device=device)
            self.decode_mask = pos.view(1, -1) < lengths.view(-1, 1)  # [num_decodes, width]
            self.decode_width = width
        self.prefills = []  # (query_start, num_query_tokens, context slots [ctx], causal mask [1, 1, q, ctx])
        for s in seqs:
            if s.num_query_tokens > 1:
                ctx = _slots(s.block_ids, 0, s.context_len, block_size, device)
                offset = s.context_len - s.num_query_tokens
                q_pos = torch.arange(offset, s.context_len, device=device).view(-1, 1)
                mask = (torch.arange(s.context_len, device=device).view(1, -1) <= q_pos).view(1, 1, -1, s.context_len)
                self.prefills.append((s.query_start, s.num_query_tokens, ctx, mask))


def _slots(block_ids: list[int], start: int, end: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Slots of positions [start, end) of a sequence with this block table."""
    pos = torch.arange(start, end, device=device)
    table = torch.tensor(block_ids, dtype=torch.long, device=device)
    return table[pos // block_size] * block_size + pos % block_size


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_kv_heads, num_blocks * block_size, head_dim)  # blocks flattened to slots
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.meta: StepMetadata | None = None

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [1, N, Hq, D], k/v: [1, N, Hkv, D] for the step's N flattened tokens → [1, N, Hq, D]."""
        meta = self.meta
        k_cache, v_cache = self.keys[layer_idx], self.values[layer_idx]  # [Hkv, slots, D]
        k_cache[:, meta.slot_mapping] = k[0].transpose(0, 1)
        v_cache[:, meta.slot_mapping] = v[0].transpose(0, 1)
        q = q[0]  # [N, Hq, D]
        out = torch.empty_like(q)
        if meta.decode_rows.numel():
            out[meta.decode_rows] = self._decode_attention(q[meta.decode_rows], k_cache, v_cache, meta)
        for start, n, ctx, mask in meta.prefills:
            qp = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            kp = k_cache.index_select(1, ctx).unsqueeze(0)  # [1, Hkv, ctx, D]
            vp = v_cache.index_select(1, ctx).unsqueeze(0)
            out[start:start + n] = attention(qp, kp, vp, mask)[0].transpose(0, 1)
        return out.unsqueeze(0)

    @staticmethod
    def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: StepMetadata) -> torch.Tensor:
        """q: [B, Hq, D] one query per decode → [B, Hq, D]."""
        b, hq, d = q.shape
        hkv, width = k_cache.shape[0], meta.decode_width
        group = hq // hkv
        keys = k_cache.index_select(1, meta.decode_slots).view(hkv, b, width, d)  # [Hkv, B, S, D]
        values = v_cache.index_select(1, meta.decode_slots).view(hkv, b, width, d)
        qg = q.view(b, hkv, group, d).transpose(0, 1)  # [Hkv, B, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * d ** -0.5  # [Hkv, B, G, S]
        scores = scores.masked_fill(~meta.decode_mask.view(1, b, 1, width), float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)  # [Hkv, B, G, D]
        return out.transpose(0, 1).reshape(b, hq, d)
