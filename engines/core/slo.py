"""Scheduling to a service level (pure Python: no torch; docs/scheduling.md).

    StepTimes   the measured step time as a linear model of what a step computes, refitted from the
                last steps: seconds ≈ base + a·tokens + b·requests + c·context tokens
    Pacer       option.target_tpot_ms: how many requests may decode together and how many prompt
                tokens a step may add so that the predicted step time stays under the target
    FairShare   option.fair_share_key: start-time fair queuing over tenants at admission
    ServiceLevel  what the scheduler asks: queue order, who is preempted first, pacing, deadlines
                (when a first token would come: engines/core/forecast.py)
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque

from engines.core.forecast import Forecast, first_token_s, forecast_of
from engines.core.request import Request

log = logging.getLogger(__name__)

MIN_SAMPLES = 8  # steps measured before the model predicts anything
WINDOW = 256  # the steps it is fitted on: the latest, so that it follows the host's drift
REFIT_EVERY = 8
RIDGE = 1e-9  # keeps the fit defined while decode-only steps make tokens and requests collinear
PROMPT_RATIO_WEIGHT = 0.05  # how fast the pacer's prompt/output ratio follows new requests


class StepTimes:
    """seconds ≈ w · (1, tokens, requests, context / 1000), least squares over the last WINDOW steps
    (the sums of the normal equations are kept as steps come and go: a step costs a few additions)."""

    def __init__(self, fit: bool = True):
        self._fit = fit
        self._samples: deque[tuple[tuple[float, ...], float]] = deque()
        self._xx = [[0.0] * 4 for _ in range(4)]
        self._xy = [0.0] * 4
        self._since_fit = 0
        self.weights: tuple[float, ...] | None = None
        self.num_observed = 0

    @staticmethod
    def features(num_tokens: int, num_seqs: int, num_context: int) -> tuple[float, ...]:
        return 1.0, float(num_tokens), float(num_seqs), num_context / 1000.0

    def observe(self, num_tokens: int, num_seqs: int, num_context: int, seconds: float) -> None:
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        sample = (self.features(num_tokens, num_seqs, num_context), seconds)
        self._samples.append(sample)
        self._account(sample, 1.0)
        if len(self._samples) > WINDOW:
            self._account(self._samples.popleft(), -1.0)
        self._since_fit += 1
        self.num_observed += 1
        if self._fit and len(self._samples) >= MIN_SAMPLES and (self.weights is None or self._since_fit >= REFIT_EVERY):
            self.weights = _solve(self._xx, self._xy)
            self._since_fit = 0

    def _account(self, sample: tuple[tuple[float, ...], float], sign: float) -> None:
        x, y = sample
        for i in range(4):
            self._xy[i] += sign * x[i] * y
            row = self._xx[i]
            for j in range(4):
                row[j] += sign * x[i] * x[j]

    def predict(self, num_tokens: int, num_seqs: int, num_context: int) -> float | None:
        if self.weights is None:
            return None
        x = self.features(num_tokens, num_seqs, num_context)
        return max(sum(w * v for w, v in zip(self.weights, x)), 0.0)

    @property
    def recent_p90(self) -> float | None:
        """The 90th percentile of the last 16 steps' times (what a step costs now, whatever it computes,
        on the safe side: deadlines are estimated with it)."""
        n = min(len(self._samples), 16)
        if not n:
            return None
        recent = sorted(self._samples[-1 - i][1] for i in range(n))
        return recent[int(0.9 * (n - 1))]


def _solve(xx: list[list[float]], xy: list[float]) -> tuple[float, ...]:
    """The ridge-regularised normal equations (4 × 4), by Gaussian elimination with pivoting."""
    n = len(xy)
    a = [[xx[i][j] + RIDGE * (i == j) for j in range(n)] + [xy[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-18:
            continue
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * p for v, p in zip(a[r], a[col])]
    return tuple(a[i][n] / a[i][i] if abs(a[i][i]) >= 1e-18 else 0.0 for i in range(n))


class Pacer:
    """option.target_tpot_ms: the steps a decoding request waits through must not take longer than
    the target. A batch of n decoding requests also prefills the requests that replace them as they
    finish: on average (prompt tokens / output tokens) prompt tokens per decode per step. So a request
    joins only if n + 1 decodes plus that share of prompt tokens fit the target; a step's prompt
    tokens are what the target leaves beside its decodes. Before the model has measured enough steps
    the batch grows by one request a step measured; one request always runs, and a step always has
    room for `min_chunk` prompt tokens, so that everything moves."""

    def __init__(self, target_s: float, step_times: StepTimes, min_chunk: int = 16):
        self.target_s = target_s
        self.step_times = step_times
        self.min_chunk = min_chunk
        self.prompt_per_output = 0.0  # recent requests' prompt tokens computed / max_new_tokens (moving mean)
        self._warned = False

    def admitted(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        ratio = num_prompt_tokens / max(max_new_tokens, 1)
        self.prompt_per_output += PROMPT_RATIO_WEIGHT * (ratio - self.prompt_per_output)

    def token_budget(self, num_seqs: int, num_context: int, ceiling: int) -> int:
        """Tokens a step of `num_seqs` requests over `num_context` cached tokens may compute."""
        w = self.step_times.weights
        if w is None or w[1] <= 0:
            return ceiling
        room = (self.target_s - w[0] - w[2] * num_seqs - w[3] * num_context / 1000.0) / w[1]
        return max(min(int(room), ceiling), min(num_seqs + self.min_chunk, ceiling))

    def seq_tokens(self) -> int:
        """What one more request in a step costs, in tokens' worth of step time."""
        w = self.step_times.weights
        return 0 if w is None or w[1] <= 0 else max(math.ceil(w[2] / w[1]), 0)

    def can_add(self, num_seqs: int, num_context: int) -> bool:
        """May one more request decode beside `num_seqs` others (over `num_context` cached tokens)?"""
        if num_seqs == 0:
            return True
        if num_seqs == 1 and not self._warned:
            alone = self.step_times.predict(1, 1, num_context)
            if alone is not None and alone > self.target_s:
                self._warned = True
                log.warning("option.target_tpot_ms=%.0f is below the measured step time of a single request "
                            "(%.0f ms here): the batch is held at one request", self.target_s * 1000, alone * 1000)
        n = num_seqs + 1
        predicted = self.step_times.predict(math.ceil(n * (1 + self.prompt_per_output)), n, num_context)
        if predicted is None:  # not measured yet: the batch grows by one request per step measured
            return num_seqs < self.step_times.num_observed
        return predicted <= self.target_s


class FairShare:
    """Start-time fair queuing: each request gets a start tag, max(the virtual time, where its
    tenant's last request ends), and ends `cost` later (prompt + max_new_tokens); waiting requests
    are admitted by tag. A tenant that floods the queue pushes only its own tags back: a newcomer
    starts at the virtual time, ahead of the flood, and backlogged tenants share tokens evenly."""

    def __init__(self):
        self.virtual_time = 0.0
        self._finish: dict[str, float] = {}

    def tag(self, tenant: str, cost: int) -> float:
        start = max(self.virtual_time, self._finish.get(tenant, 0.0))
        self._finish[tenant] = start + cost
        return start

    def admitted(self, tag: float) -> None:
        self.virtual_time = max(self.virtual_time, tag)


POLICY_FCFS = "fcfs"
POLICY_PRIORITY = "priority"


class Shed(Exception):
    """A request that cannot start before its deadline: answered 503 now, with when to retry."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServiceLevel:
    """What the scheduler asks about service levels: the order requests wait in, who is preempted
    first, how big a step may be (Pacer), who is shed. The default (fcfs, no target, no shares, no
    deadlines) keeps the queue as it always was: arrival order, a preempted request at its head."""

    def __init__(self, policy: str = POLICY_FCFS, pacer: Pacer | None = None, fair_share: FairShare | None = None,
                 clock=time.monotonic):
        if policy not in (POLICY_FCFS, POLICY_PRIORITY):
            raise ValueError(f"scheduling policy {policy!r}: expected {POLICY_FCFS} or {POLICY_PRIORITY}")
        self.by_priority = policy == POLICY_PRIORITY
        self.pacer = pacer
        self.fair_share = fair_share
        self.ordered = self.by_priority or fair_share is not None  # else a plain FIFO
        self.step_times = pacer.step_times if pacer is not None else StepTimes(fit=False)
        self.clock = clock
        self._deadlines: dict[str, Request] = {}  # waiting requests that must start by a time
        self.num_shed = 0
        self.num_priority_preemptions = 0
        self.tenants: dict[str, list[int]] = {}  # tenant -> [admitted requests, admitted tokens, shed]

    def key(self, req: Request) -> tuple:
        return (req.priority if self.by_priority else 0, req.fair_tag, req.arrival)

    def arrived(self, req: Request) -> None:
        if self.fair_share is not None:
            req.fair_tag = self.fair_share.tag(req.tenant, req.max_num_tokens)
            self.tenants.setdefault(req.tenant, [0, 0, 0])

    def enqueue(self, waiting: deque[Request], req: Request, preempted: bool = False) -> None:
        if req.deadline is not None and not preempted:
            self._deadlines[req.request_id] = req
        if self.ordered:
            bisect.insort(waiting, req, key=self.key)
        elif preempted:
            waiting.appendleft(req)  # (the newest running request: first in line again)
        else:
            waiting.append(req)

    def admit(self, running: list[Request], req: Request) -> None:
        """`req` leaves the queue for the running batch, which priority keeps in key order (the last
        is preempted first)."""
        self._deadlines.pop(req.request_id, None)
        if self.by_priority:
            bisect.insort(running, req, key=self.key)
        else:
            running.append(req)
        if self.pacer is not None:
            self.pacer.admitted(req.num_tokens - req.num_computed_tokens, req.sampling.max_new_tokens)
        if self.fair_share is not None:
            self.fair_share.admitted(req.fair_tag)
            stats = self.tenants[req.tenant]
            stats[0] += 1
            stats[1] += req.max_num_tokens

    def left(self, req: Request) -> None:
        """Aborted or finished while waiting."""
        self._deadlines.pop(req.request_id, None)

    def take_expired(self, waiting: deque[Request]) -> list[Request]:
        """Waiting requests that can no longer start in time (a step from now is past their deadline):
        out of the queue, for the engine to answer 503."""
        if not self._deadlines:
            return []
        soon = self.clock() + (self.step_times.recent_p90 or 0.0)
        expired = [r for r in self._deadlines.values() if soon > r.deadline]
        for req in expired:
            waiting.remove(req)
            self.shed(req)
        return expired

    def shed(self, req: Request) -> None:
        self._deadlines.pop(req.request_id, None)
        self.num_shed += 1
        if req.tenant in self.tenants:
            self.tenants[req.tenant][2] += 1

    def shed_if_late(self, req: Request, running: list[Request], waiting: deque[Request], max_num_seqs: int,
                     max_num_batched_tokens: int) -> None:
        """Take `req` (just queued) out of the queue and raise Shed when its first token is expected after
        its deadline (Retry-After: when a row is expected to free up for it)."""
        estimate = self.first_token_estimate_s(req, running, waiting, max_num_seqs, max_num_batched_tokens)
        if estimate is None:
            return
        start, first = estimate
        if self.clock() + first > req.deadline:
            waiting.remove(req)
            self.shed(req)
            raise Shed(f"{req.request_id}: its first token would come in about {first:.2f} s, after its deadline "
                       f"({max(req.deadline - self.clock(), 0.0):.2f} s from now)", start)

    def first_token_estimate_s(self, req: Request, running: list[Request], waiting: deque[Request], max_num_seqs: int,
                               budget: int) -> tuple[float, float] | None:
        """(when `req`, just queued, would get a row; when its first token would come), in seconds from
        now (engines/core/forecast.py); None before any step was measured."""
        f = self.forecast(running, (w for w in waiting if w is not req), max_num_seqs, budget)
        if f is None:
            return None
        key = self.key(req)
        return first_token_s(f, [q for q in f.queue if not self.ordered or q.key < key], req.num_tokens)

    def forecast(self, running: list[Request], waiting, max_num_seqs: int, budget: int,
                 num_taken: int = 0) -> Forecast | None:
        step_s = self.step_times.recent_p90
        return None if step_s is None else forecast_of(running, waiting, self.key, max_num_seqs, budget, step_s,
                                                       num_taken)

    def metrics(self, waiting: deque[Request], running: list[Request], num_shed_elsewhere: int = 0) -> dict[str, float]:
        out = {"requests_shed": self.num_shed + num_shed_elsewhere,
               "priority_preemptions": self.num_priority_preemptions}
        if self.pacer is not None and self.step_times.weights is not None:
            out["step_time_model_decode_seconds"] = self.step_times.predict(len(running), len(running),
                                                                            sum(r.num_tokens for r in running)) or 0.0
        if self.fair_share is not None:
            counts = {t: [0, 0] for t in self.tenants}
            for i, group in enumerate((waiting, running)):
                for r in group:
                    counts.setdefault(r.tenant, [0, 0])[i] += 1
            for tenant, (admitted, tokens, shed) in self.tenants.items():
                out[f"tenant/admitted_requests/{tenant}"] = admitted
                out[f"tenant/admitted_tokens/{tenant}"] = tokens
                out[f"tenant/shed_requests/{tenant}"] = shed
                out[f"tenant/waiting/{tenant}"] = counts[tenant][0]
                out[f"tenant/running/{tenant}"] = counts[tenant][1]
        return out


def service_level(sched, block_size: int = 16) -> ServiceLevel:
    """The ServiceLevel a SchedulerConfig asks for (option.scheduling_policy, target_tpot_ms, fair_share_key)."""
    pacer = Pacer(sched.target_tpot_ms / 1000, StepTimes(), block_size) if sched.target_tpot_ms else None
    return ServiceLevel(sched.scheduling_policy, pacer, FairShare() if sched.fair_share_key else None)
