"""The flash-attn backend (CUDA, chosen by auto when `flash_attn` imports): flash-attn's own paged kernels.

    k_cache[layer]: [num_blocks, block_size, kv_heads, head_dim]   (flash-attn's paged layout)

This step's K/V are written by slot; a decode step attends in one `flash_attn_with_kvcache` call
over the step buffers' block tables (`cache_seqlens` = context lengths: all views, so a captured
graph replays it); a mixed step in one `flash_attn_varlen_func` call over every sequence (causal,
aligned to the end of each context, so a chunk sees its whole prefix and a decode is a chunk of
one). flash-attn 2 needs paged blocks of a multiple of 256 tokens: the engine takes
`preferred_block_size` from the backend.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engines.attention.base import AttentionBackend
from engines.attention.step import StepView

BLOCK_SIZE = 256


class FlashMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # [N] long
    block_table: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start: torch.Tensor | None  # [S + 1] int32; None: a decode step (one query per sequence)
    cu_seq_lens: torch.Tensor | None  # [S + 1] int32
    num_query_tokens: int  # tokens of the sequences (the rest are padding)
    max_query_len: int
    max_seq_len: int


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    block_dim = 0  # the blocks' axis of kv_cache_shape
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

    def metadata(self, view: StepView, static: bool = False) -> FlashMetadata:
        if view.decode_only:
            return FlashMetadata(view.slot_mapping, view.block_table, view.seq_lens, None, None, view.num_seqs, 1, 0)
        cu = torch.nn.functional.pad(view.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return FlashMetadata(view.slot_mapping, view.block_table, view.seq_lens, view.query_start, cu,
                             sum(c.num_tokens for c in view.chunks), max(c.num_tokens for c in view.chunks),
                             max(c.context_len for c in view.chunks))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: FlashMetadata):
        k_cache, v_cache = self.keys[layer], self.values[layer]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k[0])
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v[0])
        q, opts = q[0], self.layers[layer]  # [N, Hq, D]
        # flash-attn's window counts the keys before the query; ours (transformers') includes it
        kwargs = dict(softmax_scale=opts.scale, window_size=(opts.window - 1 if opts.window else -1, -1),
                      softcap=opts.softcap or 0.0)
        if meta.query_start is None:  # one query per row, pad rows on the scratch block
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                     block_table=meta.block_table, causal=True, **kwargs)
            return out.squeeze(1).unsqueeze(0)
        n = meta.num_query_tokens
        out = torch.zeros_like(q)  # padding tokens stay zero
        out[:n] = self._varlen(q[:n], k_cache, v_cache, meta.query_start, meta.cu_seq_lens, meta.max_query_len,
                               meta.max_seq_len, causal=True, block_table=meta.block_table, **kwargs)
        return out.unsqueeze(0)
