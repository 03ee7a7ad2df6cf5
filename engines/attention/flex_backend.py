"""The FlexAttention backend: PyTorch's `flex_attention` over the paged cache, the whole cache seen
as one long key/value sequence whose block mask comes from the block tables.

    k_cache[layer]: [kv_heads, num_blocks, block_size, head_dim]   (the torch backend's layout)
    keys of flex:   k_cache.view(1, kv_heads, num_blocks * block_size, head_dim)   physical slots

Queries go in rows, one flex batch element each, every row a run of tokens of one sequence:

    decode rows     [R, Hq, 1, D]     a decode, or one proposed token (its own context length)
    prefill rows    [R, Hq, 128, D]   128 consecutive tokens of a prefill chunk (the last row: fewer)

Row b reads the KV blocks of its sequence's block table: kv_indices[b] = the table row,
kv_num_blocks[b] = ceil(context / block_size), so the kernel visits the sequence's blocks only.
Which slot of a visited block a query sees is the mask_mod's business, through an inverse table
built per step from the block tables (scatter of each table's first ceil(len / bs) entries):

    inverse[s, physical block] = its logical index in sequence s, or -1
    query of row b, slot q at position p sees slot kv  iff  j = inverse[seq[b], kv // bs] >= 0 and
                                                          j * bs + kv % bs <= p   (causal, paged)

The mask_mod is the whole truth, the block mask only where to look: eager flex_attention (CPU)
applies the mask_mod to every slot of the cache, the compiled kernels (CUDA) to the visited
blocks. No block is declared "full" (unmasked): flex's decode kernel sizes its KV splits by the
whole key length when a mask has full blocks, here the whole cache. Table entries past a
sequence's blocks are never visited nor in its inverse row, so stale ids read nothing; a decode
step's pad sequences read their scratch slot.

A decode step is rows over the step buffers' views as they are (the block tables at full width,
the context lengths); what derives from them (the inverse table, kv_num_blocks) is recomputed in
place by layer 0's forward, inside the step, so a captured CUDA graph replays it too: decode
steps are graph-captured like the other backends'. A mixed step's rows are built on the host from
its chunks (eager steps only). Row counts are padded to buckets (pad rows: context 0, no
blocks), so compiled kernels meet few shapes.

On CUDA `flex_attention` is compiled once per process (torch.compile, static shapes: a kernel per
row bucket; flex's decode kernel packs a GQA group into its rows); blocks must be a multiple of 16
tokens (the kernels tile keys by 16 or more: `preferred_block_size`). The inverse table costs 4
bytes per (sequence, block) of the largest step. The Triton kernels have not run on a GPU yet;
dynamo traces the same mask_mod and block mask on CPU too (eager flex compiles the call with an
eager backend). On CPU flex_attention runs eagerly (also inside a decode step compiled with
option.cpu_compile: a graph break), because inductor's CPU kernel wants kv_indices as wide as the
key length, the whole cache per row. Eager flex is the unfused reference: it scores every slot of
the cache ([R, Hq, L, all slots]), exact but cache-sized work per step, a correctness path (the
tests') rather than a CPU serving one.
Sliding windows and logit softcaps: no backend takes them from the models yet.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from engines.attention.base import AttentionBackend
from engines.attention.step import StepView, bucket, token_buckets
from engines.devices import to_device
from engines.attention.torch_backend import store_kv

log = logging.getLogger(__name__)

PREFILL_ROW = 128  # query tokens per prefill row: flex's default sparse block, one q-block per row
ROW_BUCKETS = token_buckets(1 << 20)  # row counts: padded to these sizes (few compiled shapes)
MIN_BLOCK = 16  # tl.dot tiles keys by >= 16: the KV block (flex's sparse block) a multiple of it


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once per process (CUDA). A shape per row bucket and kind: more than
    dynamo's default 8 recompiles, past which it would fall back to the unfused eager path."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


@torch.compiler.disable
def eager_flex_attention(*args, **kwargs) -> torch.Tensor:
    """flex_attention unfused (CPU), never traced into a compiled step (option.cpu_compile: a graph
    break there), without its warning that this is unfused: here that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


class Rows(NamedTuple):
    """The queries of one flex_attention call: R rows of L slots."""

    seq: torch.Tensor  # [R] int64 each row's sequence (its row of the inverse table)
    ctx: torch.Tensor  # [R] int32 context length through the row's last token (pad rows: 0)
    length: torch.Tensor  # [R] int32 tokens in the row; slots past them are masked (pad rows: 0)
    block_mask: BlockMask  # kv_indices [R, 1, 1, W] the rows' block tables, kv_num_blocks [R, 1, 1]
    gather: torch.Tensor | None  # [R * L] the step's token in each slot (pads: 0); None: the step, one per row
    slots: torch.Tensor | None  # [n] the slots holding real tokens
    tokens: torch.Tensor | None  # [n] their tokens in the step


class FlexMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # [N] where each token's K/V goes (padding: the scratch block)
    block_table: torch.Tensor  # [S, W] int32 the step buffers' view
    seq_lens: torch.Tensor  # [S] int32
    inverse: torch.Tensor  # [S, num_blocks + 2] int32 logical block of each physical one (layer 0 fills it)
    decode: Rows | None  # decode rows (a decode step: all of its tokens, gather None)
    prefill: Rows | None  # prefill rows (mixed steps)


class FlexPagedBackend(AttentionBackend):
    name = "flex"
    block_dim = 1  # the blocks' axis of kv_cache_shape
    preferred_block_size = MIN_BLOCK

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if any(o.window or o.softcap for o in self.layers):
            raise ValueError("option.attention_backend=flex does not implement sliding windows or logit softcaps "
                             "(this model has them): use auto, triton or torch")
        self.scale = self.layers[0].scale  # one scale for every layer of the models flex serves
        is_cuda = self.device.type == "cuda"
        if is_cuda and self.block_size % MIN_BLOCK:
            raise ValueError(f"the flex backend needs option.kv_block_size a multiple of {MIN_BLOCK} on CUDA, "
                             f"not {self.block_size}")
        self._attend = compiled_flex_attention() if is_cuda else eager_flex_attention
        if not is_cuda:
            log.warning("attention backend flex on %s: flex_attention unfused, over every slot of the KV cache "
                        "each step (a correctness path; the torch backend is the one for serving here)", self.device)
        # keys per kernel tile: a power of two dividing the block (flex's sparse KV block)
        self._kernel_options = {"BLOCK_N": min(64, self.block_size & -self.block_size)} if is_cuda else None
        self._inverse = torch.empty(0, 0, dtype=torch.int32, device=self.device)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def warm_up(self, num_heads: int, decode_buckets: list[int], width_buckets: list[int]) -> None:
        """The inverse table for the largest decode step, before any graph holds a view of it. (The
        kernels compile on first use, during the engine's bucket warm-up.)"""
        self._inverse_rows(max(decode_buckets))

    def _inverse_rows(self, num_seqs: int) -> torch.Tensor:
        """A view [num_seqs, num_blocks + 2] of the inverse table (column num_blocks + 1: where the
        unused table entries are scattered). Grown on demand; a metadata keeps the buffer it viewed."""
        if self._inverse.shape[0] < num_seqs:
            self._inverse = torch.empty(num_seqs, self.num_blocks + 2, dtype=torch.int32, device=self.device)
        return self._inverse[:num_seqs]

    def metadata(self, view: StepView, static: bool = False) -> FlexMetadata:
        inverse = self._inverse_rows(view.num_seqs)
        if view.decode_only:  # every row a sequence (pads on the scratch block): the buffers' views
            s, dev = view.num_seqs, self.device
            seq = torch.arange(s, device=dev)
            rows = self._rows(inverse, seq, view.seq_lens, torch.ones(s, dtype=torch.int32, device=dev),
                              view.block_table, 1, None, None, None)
            return FlexMetadata(view.slot_mapping, view.block_table, view.seq_lens, inverse, rows, None)
        return self._mixed_metadata(view, inverse)

    def _mixed_metadata(self, view: StepView, inverse: torch.Tensor) -> FlexMetadata:
        """Decode rows (one-token chunks, each proposed token) and prefill rows (128 tokens of a
        chunk each), from the host's chunks (an eager step only)."""
        decode: list[tuple[int, int, int, int]] = []  # (sequence, context, length, first token) per row
        prefill: list[tuple[int, int, int, int]] = []
        start = 0
        for i, c in enumerate(view.chunks):
            if c.num_tokens == 1 or c.speculative:
                decode += [(i, c.start + j + 1, 1, start + j) for j in range(c.num_tokens)]
            else:
                for a in range(0, c.num_tokens, PREFILL_ROW):
                    n = min(PREFILL_ROW, c.num_tokens - a)
                    prefill.append((i, c.start + a + n, n, start + a))
            start += c.num_tokens
        return FlexMetadata(view.slot_mapping, view.block_table, view.seq_lens, inverse,
                            self._host_rows(inverse, view.block_table, decode, 1),
                            self._host_rows(inverse, view.block_table, prefill, PREFILL_ROW))

    def _host_rows(self, inverse: torch.Tensor, table: torch.Tensor, rows: list[tuple[int, int, int, int]],
                   width: int) -> Rows | None:
        """Rows of `width` slots from host tuples, padded to a row bucket with empty rows."""
        if not rows:
            return None
        num_rows = bucket(ROW_BUCKETS, len(rows))
        rows = rows + [(0, 0, 0, 0)] * (num_rows - len(rows))
        gather = [first + q if q < n else 0 for _, _, n, first in rows for q in range(width)]
        slots = [r * width + q for r, (_, _, n, _) in enumerate(rows) for q in range(n)]
        dev = self.device
        seq = to_device([r[0] for r in rows], dev, torch.long)
        return self._rows(inverse, seq, to_device([r[1] for r in rows], dev, torch.int32),
                          to_device([r[2] for r in rows], dev, torch.int32), table.index_select(0, seq), width,
                          to_device(gather, dev, torch.long), to_device(slots, dev, torch.long),
                          to_device([gather[s] for s in slots], dev, torch.long))

    def _rows(self, inverse: torch.Tensor, seq: torch.Tensor, ctx: torch.Tensor, length: torch.Tensor,
              kv_indices: torch.Tensor, width: int, gather: torch.Tensor | None, slots: torch.Tensor | None,
              tokens: torch.Tensor | None) -> Rows:
        """Rows over these tensors; the block mask's kv_num_blocks is left for layer 0 to fill."""
        num_rows, bs = seq.shape[0], self.block_size

        def mask_mod(b, h, q_idx, kv_idx):
            logical = inverse[seq[b], kv_idx // bs]  # the key's block in the row's sequence, or -1
            position = ctx[b] - length[b] + q_idx  # the query's
            return (logical >= 0) & (q_idx < length[b]) & (logical * bs + kv_idx % bs <= position)

        num_blocks = torch.zeros(num_rows, 1, 1, dtype=torch.int32, device=self.device)
        block_mask = BlockMask.from_kv_blocks(num_blocks, kv_indices.view(num_rows, 1, 1, -1),
                                              BLOCK_SIZE=(PREFILL_ROW, bs), mask_mod=mask_mod,
                                              seq_lengths=(width, (self.num_blocks + 1) * bs), compute_q_blocks=False)
        return Rows(seq, ctx, length, block_mask, gather, slots, tokens)

    def _refresh(self, meta: FlexMetadata) -> None:
        """What derives from the step buffers, in place (layer 0; in a captured graph, every replay):
        each sequence's inverse row from its first ceil(len / bs) table entries (the others go to
        the spare last column, never read), and each row's number of blocks."""
        bs, inverse, table = self.block_size, meta.inverse, meta.block_table
        logical = torch.arange(table.shape[1], dtype=torch.int32, device=table.device).expand_as(table)  # [S, W]
        used = logical < torch.div(meta.seq_lens + (bs - 1), bs, rounding_mode="floor").unsqueeze(1)
        columns = torch.where(used, table, inverse.shape[1] - 1).long()
        inverse.fill_(-1).scatter_(1, columns, logical)
        for rows in (meta.decode, meta.prefill):
            if rows is not None:
                rows.block_mask.kv_num_blocks.view(-1).copy_(torch.div(rows.ctx + (bs - 1), bs, rounding_mode="floor"))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: FlexMetadata):
        k_cache, v_cache = self.keys[layer], self.values[layer]
        store_kv(k[0], v[0], k_cache, v_cache, meta.slot_mapping)
        if layer == 0:
            self._refresh(meta)
        keys = k_cache.view(1, self.num_kv_heads, -1, self.head_dim)  # [1, Hkv, all slots, D]
        values = v_cache.view(1, self.num_kv_heads, -1, self.head_dim)
        q = q[0]  # [N, Hq, D]
        if meta.prefill is None and meta.decode.gather is None:  # a decode step: its tokens are the rows
            return self._call(q.unsqueeze(2), keys, values, meta.decode).reshape(q.shape).unsqueeze(0)
        out = torch.zeros_like(q)  # padding tokens stay zero
        for rows, width in ((meta.decode, 1), (meta.prefill, PREFILL_ROW)):
            if rows is None:
                continue
            rq = q.index_select(0, rows.gather).view(-1, width, *q.shape[1:]).transpose(1, 2)  # [R, Hq, L, D]
            ro = self._call(rq, keys, values, rows).transpose(1, 2).reshape(-1, *q.shape[1:])  # [R * L, Hq, D]
            out.index_copy_(0, rows.tokens, ro.index_select(0, rows.slots))
        return out.unsqueeze(0)

    def _call(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: Rows) -> torch.Tensor:
        return self._attend(q, keys, values, block_mask=rows.block_mask, scale=self.scale,
                            enable_gqa=q.shape[1] != keys.shape[1], kernel_options=self._kernel_options)
