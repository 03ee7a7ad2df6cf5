"""A request as the rolling engines track it (pure Python: no torch)."""

from __future__ import annotations

import enum
from typing import NamedTuple

from engines.protocol import FINISH_ABORT, FINISH_EOS, FINISH_LENGTH
from engines.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class InFlight(NamedTuple):
    """What the last plan that scheduled a request adds once its results are applied (async
    scheduling: the next plan is made before that)."""

    plan_id: int
    num_computed: int  # tokens it computes
    num_emitted: int  # tokens it emits (0: a prefill chunk short of the end)


class PrefixProbe(NamedTuple):
    """The first block a request computes that the prefix cache may hold later: its prefix hash and
    the position it ends at. While a running request is short of `end`, a waiting request whose next
    block has the same hash waits for the cache instead of computing it too."""

    hash: int
    end: int


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 eos_token_ids: frozenset[int], arrival: int, lora_name: str | None = None, *,
                 priority: int = 0, tenant: str = "", deadline: float | None = None):
        self.request_id = request_id
        self.lora_name = lora_name  # its LoRA adapter (None: the base model): part of its prefix-cache key
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.output_token_ids: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.arrival = arrival  # admission order (first come, first served)
        # service level (engines/core/slo.py, docs/scheduling.md)
        self.priority = priority  # lower is served first (option.scheduling_policy=priority)
        self.tenant = tenant  # option.fair_share_key: its share at admission
        self.fair_tag = 0.0  # its start tag in the tenants' fair queue
        self.deadline = deadline  # clock time by which it must start (its first token), or None
        self._stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else eos_token_ids)
        # paged engine only (scheduler + block manager): K/V held in blocks of the paged cache
        self.num_computed_tokens = 0  # tokens of all_token_ids whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, found in the prefix cache when last scheduled anew
        self.block_ids: list[int] = []  # block table: token at position p lives in block_ids[p // block_size]
        # its first blocks wholly outside a sliding window, given back (BlockManager.release_outside_window)
        self.num_released_blocks = 0
        self.num_preemptions = 0
        self.prefix_probe: PrefixProbe | None = None
        # speculative decoding: the proposer's guesses of the next tokens, verified by the next step
        self.spec_token_ids: list[int] = []
        # async scheduling: the last plan that scheduled it, whose results update() has not applied yet
        self.in_flight: InFlight | None = None
        self.holds_lora_slot = False  # running with its adapter's slot held (engines/core/lora_slots.py)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_generated_tokens

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus every token it may still generate: its KV footprint at the end."""
        return self.num_prompt_tokens + self.sampling.max_new_tokens

    @property
    def num_remaining_tokens(self) -> int:
        return self.sampling.max_new_tokens - self.num_generated_tokens

    @property
    def can_speculate(self) -> bool:
        """Penalties depend on every token before the one sampled, logit masks on the count of them:
        those requests decode one at a time."""
        sp = self.sampling
        return sp.repetition_penalty == 1.0 and not sp.has_output_penalties and not sp.has_logit_masks

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        """Record a generated token and finish the request when it is a stop token or the last one."""
        self.output_token_ids.append(token_id)
        if token_id in self._stop_ids:
            self.finish(FINISH_EOS)
        elif self.num_generated_tokens >= self.sampling.max_new_tokens:
            self.finish(FINISH_LENGTH)

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason

    def abort(self) -> None:
        self.finish(FINISH_ABORT)
