"""Decode steps run per batch bucket over the step buffers' static views: captured as CUDA graphs
on CUDA (one per bucket, as nano-vllm's and vLLM's runners do: a decode step is hundreds of small
kernels whose launch cost dominates at small batches; a graph replays them with one launch), and
run eagerly over the very same views on CPU, where the tests check them.

A bucket's metadata is built once, from the buffers' views at the bucket's size (`static=True`:
views only, block tables at their full width), so a replay sees whatever the step's `write` put
in the buffers and nothing else: a pad or a table entry that only works because of the eager
path's host facts fails on CPU too. Capture is the only CUDA-only part: after two warm-up runs on
a side stream (Triton compiles, cuBLAS sets up), each bucket is captured largest first into one
memory pool; its output (the logits of its rows) stays valid until the next replay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engines.attention.base import AttentionBackend
from engines.attention.step import StepView
from engines.worker.step_buffers import StepBuffers

log = logging.getLogger(__name__)

Forward = Callable[[StepView, object], torch.Tensor]  # (view, metadata) → logits [rows, V]


class StepGraphs:
    def __init__(self, forward: Forward, backend: AttentionBackend, buffers: StepBuffers):
        self.forward, self.backend, self.buffers = forward, backend, buffers
        self.buckets = list(buffers.decode_buckets)
        self.is_cuda = buffers.device.type == "cuda"
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for rows in reversed(self.buckets):  # the largest first: the others fit in its pool
            view = self.buffers.static_view(rows)
            meta = self.backend.metadata(view, static=True)
            if not self.is_cuda:
                self._replays[rows] = lambda view=view, meta=meta: self.forward(view, meta)
                continue
            graph, logits = self._capture_cuda(view, meta, pool)
            pool = graph.pool()
            self._replays[rows] = lambda graph=graph, logits=logits: (graph.replay(), logits)[1]
        if self.is_cuda:
            torch.cuda.synchronize(self.buffers.device)
        log.info("decode steps %s for batch sizes %s", "captured as CUDA graphs" if self.is_cuda
                 else "on static buffers (CPU: run eagerly)", self.buckets)

    def _capture_cuda(self, view: StepView, meta, pool):
        device = self.buffers.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # lazy initialisation, Triton compilation, outside the capture
            for _ in range(2):
                self.forward(view, meta)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.forward(view, meta)
        return graph, logits

    def can_run(self, rows: int) -> bool:
        return rows in self._replays

    def replay(self, rows: int) -> torch.Tensor:
        """The decode step the buffers hold, at bucket `rows` → logits [rows, V]."""
        return self._replays[rows]()
