"""`lmi tune`'s search, in plain Python: no server, no HTTP, no clock of its own (the caller's clock
and evaluator are passed in, so the tests drive it with a synthetic one).

Successive halving (Jamieson & Talwalkar 2016) with the start of a server as a fixed cost:

    rung 0   n candidates   window w        each: start + warm-up + w + drain + stop
    rung 1   n/3 best       window 3w
    rung 2   n/9 best       window 9w       ... until 2 or 3 are left: the last rung picks one

Every rung is re-planned from the time left, so that a budget spent faster or slower than
estimated moves the windows, never the deadline. "Best" means: meeting the targets with the most
throughput, then the closest to meeting them (the smallest worst ratio of measured to target).
The grid of vLLM's auto_tune (every cell the same window) is here too, for the comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

ETA = 3  # survivors per rung: one in three
FINAL_COUNT = 2  # a rung that would keep fewer than this is the last one


@dataclass(frozen=True)
class Targets:
    ttft_p90: float | None = None  # seconds
    tpot_p90: float | None = None  # seconds

    def violation(self, m: "Measurement | None") -> float:
        """The worst measured/target ratio: at most 1 meets every target; inf without a result or with
        errors (a config that fails requests meets nothing)."""
        if m is None or m.errors or m.num_requests == 0:
            return math.inf
        ratios = [0.0]
        for measured, target in ((m.ttft_p90, self.ttft_p90), (m.tpot_p90, self.tpot_p90)):
            if target is not None:
                ratios.append(math.inf if math.isnan(measured) else measured / target)
        return max(ratios)


@dataclass(frozen=True)
class Measurement:
    throughput: float  # generated tokens/s inside the window
    ttft_p50: float  # seconds
    ttft_p90: float
    tpot_p90: float
    num_requests: int  # requests started inside the window
    errors: int
    window_s: float
    num_censored: int = 0  # of those, still without a first token when measuring stopped (TTFT a lower bound)


@dataclass
class Trial:
    name: str
    properties: dict[str, str]  # the candidate's overrides of the base properties
    rung: int  # -1: the final interleaved comparison
    window_s: float
    measurement: Measurement | None = None
    failure: str | None = None  # why there is no measurement (the server did not start, ...)
    cost_s: float = 0.0  # wall time of the whole trial, server start and stop included


@dataclass
class Budget:
    """A wall-clock deadline on the caller's clock."""

    seconds: float
    clock: Callable[[], float]
    started: float = field(init=False)

    def __post_init__(self):
        self.started = self.clock()

    def remaining(self) -> float:
        return self.seconds - (self.clock() - self.started)


@dataclass
class Overhead:
    """What a trial costs besides its window (start, warm-up, drain, stop): a prior until one is
    measured, then the largest seen, so that the plan errs on the side of the deadline."""

    prior_s: float
    seen: list[float] = field(default_factory=list)

    def estimate(self) -> float:
        return max(self.seen) if self.seen else self.prior_s

    def observe(self, trial: Trial) -> None:
        if trial.measurement is not None:
            self.seen.append(max(trial.cost_s - trial.window_s, 0.0))


Evaluate = Callable[[object, float, int], Trial]  # (candidate, window seconds, rung) -> Trial


def rank_key(trial: Trial, targets: Targets) -> tuple:
    """Sort ascending: meeting the targets by throughput, then the rest by how far they miss."""
    v = targets.violation(trial.measurement)
    if v <= 1.0:
        return (0, -trial.measurement.throughput)
    return (1, v, -(trial.measurement.throughput if trial.measurement else 0.0))


def ranked(trials: Sequence[Trial], targets: Targets) -> list[Trial]:
    return sorted(trials, key=lambda t: rank_key(t, targets))


def rung_counts(n: int) -> list[int]:
    """Candidates per rung: n, ceil(n/3), ... while at least FINAL_COUNT would be kept."""
    counts = [n]
    while math.ceil(counts[-1] / ETA) >= FINAL_COUNT and counts[-1] > FINAL_COUNT:
        counts.append(math.ceil(counts[-1] / ETA))
    return counts


def plan_cost(n: int, window_s: float, overhead_s: float) -> float:
    """Seconds successive halving of n candidates takes with a first window of window_s."""
    return sum(c * (overhead_s + window_s * ETA ** k) for k, c in enumerate(rung_counts(n)))


def first_window(counts: Sequence[int], seconds: float, overhead_s: float, min_window_s: float,
                 max_window_s: float) -> float:
    """The first rung's window that spends `seconds` on these rungs (window k = ETA**k times it),
    clamped to [min_window_s, max_window_s]."""
    weight = sum(c * ETA ** k for k, c in enumerate(counts))
    window = (seconds - overhead_s * sum(counts)) / weight
    return min(max(window, min_window_s), max_window_s)


def how_many(num_candidates: int, seconds: float, overhead_s: float, min_window_s: float) -> int:
    """The most candidates (at least 1) whose halving fits `seconds` at the shortest window."""
    n = num_candidates
    while n > 1 and plan_cost(n, min_window_s, overhead_s) > seconds:
        n -= 1
    return n


def successive_halving(candidates: Sequence, evaluate: Evaluate, budget: Budget, targets: Targets, *,
                       overhead: Overhead, min_window_s: float, max_window_s: float) -> list[Trial]:
    """Every trial run, in order. candidates: best first guesses first (the first n are measured)."""
    results = _first_rung(candidates, evaluate, budget, overhead, min_window_s, max_window_s)
    trials = list(results)
    alive = [_candidate(candidates, t.name) for t in results]
    rung = 0
    while len(rung_counts(len(alive))) > 1 and len(results) == len(alive):  # more rungs, and time was left
        alive = [_candidate(alive, t.name) for t in ranked(results, targets)[:rung_counts(len(alive))[1]]]
        rung += 1
        counts = rung_counts(len(alive))
        window = first_window(counts, budget.remaining(), overhead.estimate(), min_window_s, max_window_s)
        results = _run_rung(alive, evaluate, budget, overhead, window, rung, min_window_s)
        trials += results
    return trials


def _first_rung(candidates: Sequence, evaluate: Evaluate, budget: Budget, overhead: Overhead, min_window_s: float,
                max_window_s: float) -> list[Trial]:
    """Rung 0, re-planned after each trial: how many candidates and how long a window follow from the
    whole budget and the overhead seen so far. The first trial is a probe at the shortest window: its
    start replaces the prior before the prior can spend the budget on a few long windows."""
    total = budget.remaining()
    results: list[Trial] = []
    while len(results) < how_many(len(candidates), total, overhead.estimate(), min_window_s):
        n = how_many(len(candidates), total, overhead.estimate(), min_window_s)
        window = first_window(rung_counts(n), total, overhead.estimate(), min_window_s, max_window_s) \
            if overhead.seen else min_window_s
        step = _run_rung([candidates[len(results)]], evaluate, budget, overhead, window, 0, min_window_s)
        if not step:
            break
        results += step
    return results


def _run_rung(alive: Sequence, evaluate: Evaluate, budget: Budget, overhead: Overhead, window: float, rung: int,
              min_window_s: float) -> list[Trial]:
    results = []
    for cand in alive:
        fitted = min(window, budget.remaining() - overhead.estimate())
        if fitted < min_window_s:
            break  # the deadline holds: what is left cannot measure another candidate
        trial = evaluate(cand, fitted, rung)
        overhead.observe(trial)
        results.append(trial)
    return results


def grid_search(candidates: Sequence, evaluate: Evaluate, budget: Budget, *, overhead: Overhead,
                min_window_s: float) -> list[Trial]:
    """vLLM's auto_tune: every cell of the grid measured once with the same window (the budget
    shared equally); cells the budget cannot reach are not measured."""
    share = budget.remaining() / max(len(candidates), 1)
    window = max(share - overhead.estimate(), min_window_s)
    trials = []
    for cand in candidates:
        if budget.remaining() - overhead.estimate() < window:
            break
        trial = evaluate(cand, window, 0)
        overhead.observe(trial)
        trials.append(trial)
    return trials


def best(trials: Sequence[Trial], targets: Targets) -> Trial | None:
    """The winner: the best of the last rung reached (the longest, freshest measurements)."""
    measured = [t for t in trials if t.measurement is not None]
    if not measured:
        return None
    last = max(t.rung for t in measured)
    return ranked([t for t in measured if t.rung == last], targets)[0]


def frontier(trials: Sequence[Trial], latency: Callable[[Measurement], float]) -> list[Trial]:
    """The trials no other beats on both throughput (higher) and `latency` (lower), by throughput."""
    points = [t for t in trials if t.measurement is not None and not t.measurement.errors]
    kept = []
    for t in points:
        m = t.measurement
        dominated = any(o.measurement.throughput >= m.throughput and latency(o.measurement) <= latency(m)
                        and (o.measurement.throughput, latency(o.measurement)) != (m.throughput, latency(m))
                        for o in points)
        if not dominated:
            kept.append(t)
    return sorted(kept, key=lambda t: t.measurement.throughput)


def _candidate(alive: Sequence, name: str):
    return next(c for c in alive if c.name == name)
