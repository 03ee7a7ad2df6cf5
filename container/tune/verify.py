"""The last step of `lmi tune`: the chosen configuration and the defaults measured again, fresh and
interleaved (round 1: A then B, round 2: B then A, ...), so that drift on a shared machine hits both
alike; the answer is the medians over rounds and their ratio, never the search's own numbers.

On a CPU host every server of the comparison stays up through the rounds (an idle one costs memory,
not compute); on a GPU host each would claim the GPU memory, so each window starts its own.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from container.tune.load import measure
from container.tune.search import Measurement, Targets, Trial
from container.tune.server import Evaluator, StartFailure
from container.tune.space import Candidate


@dataclass(frozen=True)
class Verdict:
    chosen: str  # the name of the configuration written
    defaults_meet: bool | None  # None: the defaults could not be measured
    ratio: float | None  # chosen / defaults generated tokens/s (medians)
    text: str


def interleaved(cands: Sequence[Candidate], evaluate: Evaluator, rounds: int, window_s: float,
                keep_up: bool) -> list[Trial]:
    """rounds x len(cands) trials (rung -1), in the order measured; the order rotates each round."""
    if not keep_up:
        return [evaluate(cands[(i + r) % len(cands)], window_s, -1) for r in range(rounds) for i in range(len(cands))]
    servers, trials = {}, []
    try:
        for cand in cands:
            evaluate.on_phase(f"final: starting {cand.name}")
            servers[cand.name] = server = evaluate.start(cand, f"final-{len(servers)}")
            try:
                server.wait_ready(max(evaluate.budget.remaining(), 60.0))
            except StartFailure as exc:
                trials.append(Trial(cand.name, cand.properties, -1, window_s, failure=str(exc)))
                server.stop()
                del servers[cand.name]
        for r in range(rounds):
            for i in range(len(cands)):
                cand = cands[(i + r) % len(cands)]
                if cand.name in servers:
                    trials.append(_measure_up(evaluate, servers[cand.name].port, cand, window_s, r))
    finally:
        for server in servers.values():
            server.stop()
    return trials


def _measure_up(evaluate: Evaluator, port: int, cand: Candidate, window_s: float, rnd: int) -> Trial:
    evaluate.on_phase(f"final round {rnd + 1}: {cand.name}")
    started = evaluate.clock()
    m, error = measure("127.0.0.1", port, evaluate.bodies, evaluate.load, window_s, evaluate.clock)
    return Trial(cand.name, cand.properties, -1, window_s, m, error, evaluate.clock() - started)


def median_of(trials: Sequence[Trial]) -> Measurement | None:
    """The medians over rounds of one configuration's measurements (None when none was measured)."""
    ms = [t.measurement for t in trials if t.measurement is not None]
    if not ms:
        return None
    med = {k: statistics.median(getattr(m, k) for m in ms) for k in ("throughput", "ttft_p50", "ttft_p90", "tpot_p90")}
    return Measurement(**med, num_requests=sum(m.num_requests for m in ms), errors=sum(m.errors for m in ms),
                       window_s=sum(m.window_s for m in ms), num_censored=sum(m.num_censored for m in ms))


def decide(defaults: Measurement | None, pick: Measurement | None, pick_name: str, targets: Targets) -> Verdict:
    """Which to write: the pick when it meets the targets and the defaults do not, or it is faster
    with both meeting them; else the defaults (with the evidence), or the one that misses by less."""
    if pick_name == "defaults":
        met = None if defaults is None else targets.violation(defaults) <= 1
        return Verdict("defaults", met, 1.0, "the defaults are the best configuration the search found"
                       + ("" if met is None else f"; measured fresh they {'meet' if met else 'miss'} the targets"))
    if defaults is None or pick is None:
        missing = "the defaults" if defaults is None else pick_name
        return Verdict(pick_name if pick is not None else "defaults", None, None,
                       f"{missing} could not be measured in the final comparison")
    d_meets, p_meets = targets.violation(defaults) <= 1, targets.violation(pick) <= 1
    ratio = pick.throughput / defaults.throughput if defaults.throughput else float("inf")
    said = f"{pick_name}: {ratio:.2f}x the defaults' generated tokens/s"
    if p_meets and (not d_meets or ratio > 1):
        why = "the defaults miss the targets" if not d_meets else "both meet the targets"
        return Verdict(pick_name, d_meets, ratio, f"{said}; {why}")
    if d_meets:
        why = "it misses the targets measured fresh" if not p_meets else "it is no faster measured fresh"
        return Verdict("defaults", True, ratio, f"the defaults are best: they meet the targets and {said} ({why})")
    better = pick_name if targets.violation(pick) < targets.violation(defaults) else "defaults"
    return Verdict(better, False, ratio, f"no configuration meets the targets measured fresh; {said}; "
                   f"{better} misses them by less")
