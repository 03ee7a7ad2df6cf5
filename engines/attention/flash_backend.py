"""The flash-attn backend (CUDA, used when `flash_attn` imports): flash-attn's own paged kernels.

    k_cache[layer]: [num_blocks, block_size, kv_heads, head_dim]   (flash-attn's paged layout)

This step's K/V are written by slot; decodes attend in one `flash_attn_with_kvcache` call over
their block tables (`cache_seqlens` = context lengths), all prefill chunks in one
`flash_attn_varlen_func` call over theirs (causal, aligned to the end of each context, so a chunk
sees its whole prefix). flash-attn 2 needs paged blocks of a multiple of 256 tokens: the engine
takes `preferred_block_size` from the backend.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engines.attention.base import AttentionBackend, SeqSlice
from engines.attention.torch_backend import decode_rows

BLOCK_SIZE = 256


class FlashMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # [N] long
    decode_rows: torch.Tensor  # [Bd] long
    decode_table: torch.Tensor  # [Bd, nb] int32
    decode_lens: torch.Tensor  # [Bd] int32
    prefill_rows: torch.Tensor  # [Np] long: the prefill chunks' tokens, in order
    prefill_table: torch.Tensor  # [P, nb] int32
    cu_q: torch.Tensor  # [P + 1] int32
    cu_k: torch.Tensor  # [P + 1] int32
    max_q: int
    max_k: int


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    preferred_block_size = BLOCK_SIZE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.block_size % BLOCK_SIZE:
            raise ValueError(f"the flash_attn backend needs option.kv_block_size a multiple of {BLOCK_SIZE}, "
                             f"not {self.block_size}")
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen, self._with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def build_metadata(self, seqs: list[SeqSlice], num_tokens: int | None = None) -> FlashMetadata:
        """Tokens past the sequences' up to `num_tokens` are padding: K/V to the scratch block, output 0."""
        bs, dev = self.block_size, self.device
        slots: list[int] = []
        for s in seqs:
            slots += [s.block_ids[p // bs] * bs + p % bs for p in range(s.context_len - s.num_query_tokens,
                                                                        s.context_len)]
        if num_tokens is not None:
            slots += [self.scratch_block * bs] * (num_tokens - len(slots))
        decodes = [s for s in seqs if s.num_query_tokens == 1]
        prefills = [s for s in seqs if s.num_query_tokens > 1]

        def table(group: list[SeqSlice]) -> torch.Tensor:
            nb = max((-(-s.context_len // bs) for s in group), default=0)
            return torch.tensor([s.block_ids[:nb] + [0] * (nb - len(s.block_ids[:nb])) for s in group],
                                dtype=torch.int32).view(len(group), nb).to(dev, non_blocking=True)

        cu_q, cu_k, rows = [0], [0], []
        for s in prefills:
            cu_q.append(cu_q[-1] + s.num_query_tokens)
            cu_k.append(cu_k[-1] + s.context_len)
            rows += range(s.query_start, s.query_start + s.num_query_tokens)

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        return FlashMetadata(t(slots, torch.long), t([s.query_start for s in decodes], torch.long), table(decodes),
                             t([s.context_len for s in decodes], torch.int32), t(rows, torch.long), table(prefills),
                             t(cu_q, torch.int32), t(cu_k, torch.int32),
                             max((s.num_query_tokens for s in prefills), default=0),
                             max((s.context_len for s in prefills), default=0))

    def build_decode_metadata(self, seqs: list[SeqSlice], num_rows: int, width: int) -> FlashMetadata:
        slots, table, lens = decode_rows(seqs, num_rows, width, self.block_size, self.scratch_block)
        dev = self.device

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        return FlashMetadata(t(slots, torch.long), torch.arange(num_rows, device=dev), t(table, torch.int32),
                             t(lens, torch.int32), t([], torch.long), torch.zeros((0, width), dtype=torch.int32, device=dev),
                             t([0], torch.int32), t([0], torch.int32), 0, 0)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: FlashMetadata):
        k_cache, v_cache = self.keys[layer], self.values[layer]
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k[0])
        flat_v.index_copy_(0, meta.slot_mapping, v[0])
        q = q[0]  # [N, Hq, D]
        out = torch.zeros_like(q)  # padding tokens stay zero
        if meta.decode_table.shape[0]:
            qd = q.index_select(0, meta.decode_rows).unsqueeze(1)  # [Bd, 1, Hq, D]
            od = self._with_kvcache(qd, k_cache, v_cache, cache_seqlens=meta.decode_lens,
                                    block_table=meta.decode_table, causal=True)
            out.index_copy_(0, meta.decode_rows, od.squeeze(1))
        if meta.prefill_table.shape[0]:
            qp = q.index_select(0, meta.prefill_rows)
            op = self._varlen(qp, k_cache, v_cache, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, causal=True,
                              block_table=meta.prefill_table)
            out.index_copy_(0, meta.prefill_rows, op)
        return out.unsqueeze(0)
