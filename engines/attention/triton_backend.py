"""The Triton backend (CUDA without flash-attn; CPU tensors under Triton's interpreter in tests): one
kernel launch per layer attends every sequence of the step — decodes, proposed tokens and prefill
chunks — straight from the paged cache through the step buffers' block tables
(engines/kernels/paged_attention.py). The K/V layout and the slot writes are the torch backend's,
which is the kernel's oracle in the tests.

Its metadata is views of the step buffers only (no host facts), so the same code runs eagerly and
in a captured graph, for decode steps and mixed ones alike.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engines.attention.step import StepView
from engines.attention.torch_backend import TorchPagedBackend, store_kv


class TritonMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # [N] int64
    query_start: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, W] int32
    num_seqs: int  # S (a decode step's pad sequences included)
    has_padding: bool  # tokens past the last sequence (a mixed step's bucket padding)


class TritonPagedBackend(TorchPagedBackend):
    name = "triton"

    stores_fp8 = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from engines.kernels.paged_attention import paged_attention

        self._kernel = paged_attention

    def metadata(self, view: StepView, static: bool = False) -> TritonMetadata:
        has_padding = not view.decode_only and view.num_tokens > sum(c.num_tokens for c in view.chunks)
        return TritonMetadata(view.slot_mapping, view.query_start, view.seq_lens, view.block_table, view.num_seqs,
                              has_padding)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TritonMetadata):
        k_cache, v_cache = self.keys[layer], self.values[layer]
        store_kv(k[0], v[0], k_cache, v_cache, meta.slot_mapping)
        q = q[0]  # [N, Hq, D]
        out = torch.zeros_like(q) if meta.has_padding else torch.empty_like(q)  # padding rows stay zero
        opts = self.layers[layer]
        self._kernel(q, k_cache, v_cache, out, meta.query_start, meta.seq_lens, meta.block_table, meta.num_seqs,
                     opts.scale, window=opts.window or 0, softcap=opts.softcap or 0.0)
        return out.unsqueeze(0)

    def warm_up(self, num_heads: int, decode_buckets: list[int], width_buckets: list[int]) -> None:
        """Nothing: the kernel's shapes are compiled on first use, during the engine's bucket warm-up."""
        self.decode_buckets, self.width_buckets = list(decode_buckets), list(width_buckets)
