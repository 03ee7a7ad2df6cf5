"""Who joins the padded running batch this step (pure Python: no torch).

A request is admitted, first come first served, while
- the batch has fewer than `max_num_seqs` rows,
- the step's new prompt tokens stay within `max_num_batched_tokens` (the first waiting request is
  always allowed, however long, so that no prompt starves), and
- the batch weight stays within the KV budget. The weight is the peak number of token slots the
  padded cache will hold over the batch's lifetime, projected from each row's current length and
  remaining tokens: at future step t the cache holds rows(t) × width(t), where rows(t) counts the
  rows still running and width(t) is the longest of them (length now + t), padding included.
The queue stays in order: when the head does not fit, nobody behind it jumps ahead (also when
`take` refuses it: the LoRA slot its adapter needs is held by other adapters' rows).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from engines.core.request import Request


@dataclass(frozen=True)
class AdmissionLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_kv_tokens: int  # the KV budget in token slots (per rank, all layers)


def peak_slots(rows: list[tuple[int, int]]) -> int:
    """rows: (current length, tokens still to generate) → max over steps of rows × width."""
    peak = 0
    for horizon in sorted({r for _, r in rows} | {0}):
        alive = [(n, r) for n, r in rows if r >= horizon]
        if alive:
            peak = max(peak, len(alive) * (max(n for n, _ in alive) + horizon))
    return peak


def fits_alone(request: Request, limits: AdmissionLimits) -> bool:
    return peak_slots([(request.num_prompt_tokens, request.sampling.max_new_tokens)]) <= limits.max_kv_tokens


def admit(waiting: deque[Request], running: list[Request], limits: AdmissionLimits,
          take: Callable[[Request], bool] | None = None) -> list[Request]:
    """Pop and return the waiting requests that join the batch now; `take` (called last, for the head
    about to join) may refuse it."""
    rows = [(r.num_tokens, r.num_remaining_tokens) for r in running]
    admitted: list[Request] = []
    budget = limits.max_num_batched_tokens
    while waiting and len(rows) < limits.max_num_seqs:
        head = waiting[0]
        if admitted and head.num_prompt_tokens > budget:
            break
        candidate = rows + [(head.num_prompt_tokens, head.sampling.max_new_tokens)]
        if peak_slots(candidate) > limits.max_kv_tokens or take is not None and not take(head):
            break
        rows = candidate
        budget -= head.num_prompt_tokens
        admitted.append(waiting.popleft())
    return admitted
