"""The plan of one step: what the scheduler hands the model runners (pure Python: no torch).

A plan says only what changed since the last one, so that the same plan drives ranks that have no
scheduler (tensor parallelism; it crosses to them as one msgpack message):

    new_requests      requests the runner has no state for (first scheduled, or back after a
                      preemption): their tokens, their whole block table, their sampling settings
    cached_requests   requests it knows: the block ids appended (or, after speculation trimmed the
                      table, the table from `first_block` on), and the computed count
    scheduled         in step order, each request's tokens to compute this step and the proposed
                      tokens among them (speculative decoding)
    preempted_ids     drop their state: they come back as new
    finished_ids      finished or aborted since the last plan
    lora_loads        LoRA adapters to load into device slots before the step (option.max_loras)
    num_steps         > 1: a multi-step decode, every scheduled request computing one token a step
    kv_saves          blocks cached since the last plan, to write down the KV tiers before this
                      step runs (docs/kv-tiers.md)
"""

from __future__ import annotations

import msgspec

from engines.sampling_params import SamplingParams


class NewRequest(msgspec.Struct):
    request_id: str
    token_ids: list[int]  # prompt + tokens generated so far (recomputed after a preemption)
    num_prompt_tokens: int
    block_ids: list[int]  # its whole block table
    num_computed_tokens: int  # already in the cache (prefix hit): compute from this position on
    sampling: SamplingParams
    lora_name: str | None = None  # its LoRA adapter


class CachedRequest(msgspec.Struct):
    request_id: str
    new_block_ids: list[int]  # the block table from index first_block on
    num_computed_tokens: int  # before this step's tokens
    first_block: int = 0  # blocks kept from the last plan (fewer when speculation trimmed the table)


class ScheduledSeq(msgspec.Struct):
    request_id: str
    num_tokens: int  # computed this step: a prefill chunk, 1 for a decode, 1 + k with k proposed tokens
    spec_token_ids: list[int] = []  # the proposed tokens (the last k of num_tokens) to verify


class LoraLoad(msgspec.Struct):
    slot: int
    name: str


class BlockRef(msgspec.Struct, array_like=True):
    """A full KV block as the KV tiers name it: its place in the pool, its chained hash, and the
    parent and tokens a tier checks before loading it (engines/core/block_manager.py)."""

    block_id: int
    hash: int
    parent: bytes
    tokens: bytes


class StepPlan(msgspec.Struct):
    plan_id: int = 0
    scheduled: list[ScheduledSeq] = []
    new_requests: list[NewRequest] = []
    cached_requests: list[CachedRequest] = []
    preempted_ids: list[str] = []
    finished_ids: list[str] = []
    num_steps: int = 1
    lora_loads: list[LoraLoad] = []
    kv_saves: list[BlockRef] = []

    def add(self, request_id: str, num_tokens: int, spec_token_ids: list[int] | None = None) -> None:
        self.scheduled.append(ScheduledSeq(request_id, num_tokens, spec_token_ids or []))

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def scheduled_ids(self) -> list[str]:
        return [s.request_id for s in self.scheduled]

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Request id → tokens it computes this step, in step order."""
        return {s.request_id: s.num_tokens for s in self.scheduled}

    @property
    def spec_token_ids(self) -> dict[str, list[int]]:
        """Request id → its proposed tokens, for the requests that speculate."""
        return {s.request_id: s.spec_token_ids for s in self.scheduled if s.spec_token_ids}
