"""Decode steps of the paged engine captured as CUDA graphs, one per batch-size bucket (as
nano-vllm's and vLLM's runners do): a decode step is a few hundred small kernels whose launch cost
dominates at small batches; a graph replays them with one launch.

Each graph owns static inputs (token ids, positions, the attention metadata at its bucket's size
with block tables as wide as the longest sequence can be) and a static output (the logits). A step
copies its inputs into the bucket's buffers and replays. The graphs are captured largest first and
share one memory pool. Only whole decode steps replay; prefill chunks (and mixed steps) run eagerly.
"""

from __future__ import annotations

import logging

import torch

from engines.attention.base import AttentionBackend, SeqSlice

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, buckets: list[int], max_width: int,
                 device: torch.device):
        self.model, self.backend, self.buckets = model, backend, sorted(buckets)
        self.max_width, self.device = max_width, device
        self.graphs: dict[int, tuple] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.buckets):  # the largest first: the others fit in its pool
            ids = torch.zeros((1, size), dtype=torch.long, device=self.device)
            positions = torch.zeros((1, size), dtype=torch.long, device=self.device)
            meta = self.backend.build_decode_metadata([], size, self.max_width)
            index = torch.arange(size, device=self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # lazy initialisation and autotuning outside the capture
                for _ in range(2):
                    self.model(ids, positions, self.backend, meta, index)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(ids, positions, self.backend, meta, index)
            pool = graph.pool()
            self.graphs[size] = (graph, ids, positions, meta, logits)
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.buckets)

    def can_run(self, size: int) -> bool:
        return size in self.graphs

    def run(self, seqs: list[SeqSlice], ids: list[int], positions: list[int], size: int) -> torch.Tensor:
        """One decode step of len(ids) <= size sequences → their logits [n, V] (valid until the next replay)."""
        graph, static_ids, static_positions, static_meta, logits = self.graphs[size]
        n = len(ids)
        static_ids.zero_()
        static_positions.zero_()
        static_ids[0, :n].copy_(torch.as_tensor(ids), non_blocking=True)  # a list, or sampled ids on the device
        static_positions[0, :n].copy_(torch.tensor(positions), non_blocking=True)
        fresh = self.backend.build_decode_metadata(seqs, size, self.max_width)
        for static, new in zip(static_meta, fresh):
            if isinstance(static, torch.Tensor):
                static.copy_(new, non_blocking=True)
        graph.replay()
        return logits[:n]
