"""When would a new request's first token come? (pure Python: no torch; docs/scheduling.md)

A `Forecast` is the queue as the scheduler left it after a step, reduced to what the estimate needs:
each running request's steps left, each waiting request's place, steps and prompt tokens. The engine
loop keeps the latest one (replaced whole, never changed), so that the engine's IO thread can shed a
request that cannot start in time the moment it arrives, instead of after the step in progress; the
scheduler checks again with the live queue when it takes the request.

    rows        a row frees up when its request's steps are done (start_step: each request ahead
                takes the first row to free up and holds it for its own steps)
    prompts     the prompt tokens ahead share each step's token budget with the decodes
    first token the later of the two, in steps, times a recent step time
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from engines.core.request import Request


class Queued(NamedTuple):
    key: tuple  # its place in the queue (ServiceLevel.key)
    steps: int  # steps it holds a row for, once it has one
    prompt: int  # prompt tokens still to compute


class Forecast(NamedTuple):
    step_s: float  # a recent step's time
    rows: list[int]  # each running request's steps left
    free_rows: int
    running_prompts: int  # the running requests' prompt tokens still to compute
    queue: list[Queued]  # the waiting requests, in queue order
    budget: int  # max_num_batched_tokens
    num_taken: int  # requests the engine had taken from its inbox when it was made


def prompt_left(r: Request) -> int:
    """Prompt (or recomputed) tokens still to compute; a decoding request's one token is a decode."""
    n = r.num_tokens - r.num_computed_tokens
    return n if n > 1 else 0


def steps_of(r: Request, budget: int) -> int:
    """The prompt's chunks before the one that samples, then a step a token."""
    return -(-max(prompt_left(r), 1) // budget) - 1 + r.num_remaining_tokens


def forecast_of(running: list[Request], waiting: Iterable[Request], key, max_num_seqs: int, budget: int,
                step_s: float, num_taken: int = 0) -> Forecast:
    return Forecast(step_s, [steps_of(r, budget) for r in running], max_num_seqs - len(running),
                    sum(prompt_left(r) for r in running),
                    [Queued(key(w), steps_of(w, budget), prompt_left(w)) for w in waiting], budget, num_taken)


def start_step(remaining: list[int], free_rows: int, ahead: list[int]) -> int:
    """Steps until a waiting request gets a row: `remaining` are the running requests' steps left,
    `free_rows` the batch's empty rows, `ahead` the steps each request queued before it will hold a row
    (an upper bound: one that stops early frees its row sooner)."""
    rows = [0] * max(free_rows, 0) + list(remaining)
    if not rows:
        return 0
    heapq.heapify(rows)
    for steps in ahead:
        heapq.heappush(rows, heapq.heappop(rows) + steps)
    return rows[0]


def first_token_s(f: Forecast, ahead: list[Queued], prompt_tokens: int) -> tuple[float, float]:
    """(seconds until a row is free for it, seconds until its first token) for a request of
    `prompt_tokens` with `ahead` queued before it."""
    start = start_step(f.rows, f.free_rows, [q.steps for q in ahead]) if ahead or f.free_rows <= 0 else 0
    prompts = f.running_prompts + sum(q.prompt for q in ahead) + prompt_tokens
    behind_prompts = -(-prompts // max(f.budget - len(f.rows), 1))
    first = max(start + -(-prompt_tokens // f.budget), behind_prompts)
    return start * f.step_s, first * f.step_s


class Screen:
    """The IO thread's side: requests it let through since the forecast was made count as queued
    ahead of the next (they are in the inbox, in order). Used by one thread only."""

    def __init__(self):
        self._let_through: deque[tuple[int, Queued]] = deque()  # (its number among the arrivals, ...)
        self._num_arrived = 0

    def first_token_s(self, f: Forecast, key: tuple, prompt_tokens: int) -> tuple[float, float]:
        while self._let_through and self._let_through[0][0] < f.num_taken:
            self._let_through.popleft()  # (the engine has it: in the forecast's queue now)
        ahead = [q for q in f.queue if q.key < key] + [q for _, q in self._let_through if q.key[0] <= key[0]]
        return first_token_s(f, ahead, prompt_tokens)

    def let_through(self, key: tuple, steps: int, prompt_tokens: int, queued: bool = True) -> None:
        """Every request sent on to the inbox (numbered as the engine counts them); `queued`: remembered
        until a forecast counts it (False while there are no forecasts: nothing would forget it)."""
        if queued:
            self._let_through.append((self._num_arrived, Queued(key, steps, prompt_tokens)))
        self._num_arrived += 1
