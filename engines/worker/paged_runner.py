"""Executes the scheduler's plan on the paged KV cache: one flattened token batch per step.

The runner keeps its own copy of what it needs per request (token ids, block table, computed
count), updated from the plan's diffs, so that the same plan can drive ranks that have no
scheduler (tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.core.scheduler import SchedulerOutput
from engines.worker.model_runner import ModelRunner
from engines.worker.paged_cache import PagedKVCache, SeqSlice, StepMetadata


@dataclass
class _SeqState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    extra: dict = field(default_factory=dict)


class PagedRunner:
    """Every public method is a step operation (rank 0 mirrors it to the other ranks)."""

    def __init__(self, runner: ModelRunner):
        if not runner.is_native:
            raise ValueError("the paged engine needs a natively implemented architecture (Llama, Mistral, Qwen2); "
                             "use option.rolling_batch=scheduler for others")
        self.runner = runner
        self.cache: PagedKVCache | None = None
        self.states: dict[str, _SeqState] = {}

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The KV cache (rank 0 sizes it and tells the others)."""
        r = self.runner
        self.block_size = block_size
        self.cache = PagedKVCache(r.num_layers, num_blocks, block_size, r.num_kv_heads, r.head_dim, r.dtype, r.device)

    def warm_up(self, num_tokens: int) -> int:
        return self.runner.warm_up(num_tokens)

    def apply_plan(self, plan: SchedulerOutput) -> None:
        """Take in what changed: finished/preempted requests, new ones, new blocks."""
        for rid in list(plan.finished_ids) + list(plan.preempted_ids):
            self.states.pop(rid, None)
        for new in plan.new_requests:
            self.states[new.request_id] = _SeqState(list(new.token_ids), list(new.block_ids),
                                                    new.num_computed_tokens)
        for cached in plan.cached_requests:
            st = self.states[cached.request_id]
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> tuple[list[str], torch.Tensor | None]:
        """Run the step; → (ids of the requests that produce a token, their logits [n, V])."""
        self.apply_plan(plan)
        seqs: list[SeqSlice] = []
        ids: list[int] = []
        positions: list[int] = []
        logits_index: list[int] = []
        sampling_ids: list[str] = []
        for rid, n in plan.num_scheduled_tokens.items():
            st = self.states[rid]
            start = st.num_computed_tokens
            seqs.append(SeqSlice(len(ids), n, start + n, st.block_ids))
            ids += st.token_ids[start:start + n]
            positions += range(start, start + n)
            if start + n == len(st.token_ids):  # the chunk reaches the end: it yields a token
                logits_index.append(len(ids) - 1)
                sampling_ids.append(rid)
            st.num_computed_tokens = start + n
        if not ids:
            return [], None
        device = self.runner.device
        self.cache.meta = StepMetadata(seqs, self.block_size, device)
        try:
            logits = self.runner.model(torch.tensor([ids], device=device), torch.tensor([positions], device=device),
                                       self.cache, torch.tensor(logits_index, dtype=torch.long, device=device))
        finally:
            self.cache.meta = None
        return sampling_ids, logits

    def append_tokens(self, tokens: dict[str, int]) -> None:
        """The tokens rank 0 sampled this step (the next step computes from them)."""
        for request_id, token_id in tokens.items():
            st = self.states.get(request_id)
            if st is not None:
                st.token_ids.append(token_id)
