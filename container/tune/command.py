"""`lmi tune`: find the serving.properties that gives the most generated tokens/s on this host while
meeting p90 TTFT and TPOT targets, by serving each candidate for real and measuring it.

    lmi tune --model-dir M --prompt-tokens 128 --output-tokens 64 --concurrency 16 \
             --ttft-p90 1.0 --tpot-p90 0.150 --budget 15m --out tuned/serving.properties

Steps: the candidates of this host (container/tune/space.py), less what the configuration check
and the memory plan refuse; successive halving over them within the budget (search.py), each
trial a real server (server.py) under the load (load.py); the pick and the defaults
measured again, interleaved (verify.py); the table, JSON, markdown and PNG (report.py).
The search's heavy modules load inside `run`, so that `lmi --help` stays quick.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from container.tune.search import Targets

if TYPE_CHECKING:  # the heavy modules load in run()
    from container.tune.load import LoadShape
    from container.tune.space import Candidate, Checker, Host, Pruned

DEFAULT_OVERHEAD_S = 20.0  # a trial's start + warm-up + drain + stop before one is measured
VERIFY_ROUNDS = 3
VERIFY_SHARE = 0.35


def parse_duration(text: str) -> float:
    """Seconds from `90s`, `15m`, `1h`, `1h30m` or a bare number of seconds."""
    match = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not text.strip() or match is None or not any(match.groups()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a duration such as 90s, 15m or 1h")
    h, m, s = (float(g) if g else 0.0 for g in match.groups())
    return h * 3600 + m * 60 + s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", required=True, help="the model directory")
    p.add_argument("--properties", help="base serving.properties: the defaults the search changes (default: none)")
    work = p.add_argument_group("workload")
    work.add_argument("--prompt-tokens", type=int, default=128, help="mean prompt length in tokens (default 128)")
    work.add_argument("--output-tokens", type=int, default=64, help="mean output length in tokens (default 64)")
    work.add_argument("--spread", type=float, default=0.25,
                      help="lengths drawn uniformly within mean x (1 -/+ spread) (default 0.25)")
    work.add_argument("--trace", help="JSON lines of {prompt_tokens, output_tokens} or {inputs, parameters}, "
                                      "instead of the lengths")
    load = work.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="clients in a closed loop (default 16)")
    load.add_argument("--rate", type=float, help="Poisson arrivals in requests/s instead of a closed loop")
    goal = p.add_argument_group("targets and budget")
    goal.add_argument("--ttft-p90", type=float, help="p90 time to first token target, seconds")
    goal.add_argument("--tpot-p90", type=float, help="p90 time per output token target, seconds")
    goal.add_argument("--budget", type=parse_duration, default=parse_duration("15m"),
                      help="wall-clock time for the whole run, final comparison included: 90s, 15m, 1h (default 15m)")
    how = p.add_argument_group("search")
    how.add_argument("--knobs", help="comma list of the knobs to search (default: all of this host's): "
                                     "max_num_seqs, max_num_batched_tokens, scheduling, quantize, dtype, target_tpot, "
                                     "layout")
    how.add_argument("--warmup", type=float, default=5.0, help="seconds of load before a window (default 5)")
    how.add_argument("--min-window", type=float, default=8.0, help="the shortest measured window, s (default 8)")
    how.add_argument("--max-window", type=float, default=60.0, help="the longest measured window, s (default 60)")
    how.add_argument("--verify-rounds", type=int, default=VERIFY_ROUNDS,
                     help=f"interleaved rounds of the final comparison (default {VERIFY_ROUNDS})")
    how.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="tuned/serving.properties",
                   help="where the chosen serving.properties goes; the table, JSON and plot go beside it "
                        "(default tuned/serving.properties)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def targets_of(args) -> Targets:
    return Targets(ttft_p90=args.ttft_p90, tpot_p90=args.tpot_p90)


@dataclass
class Setup:
    """What every search needs, built once: the base, the requests, the host, the checker."""

    base: dict[str, str]
    local_dir: str
    bodies: list[dict]
    host: Host
    checker: Checker
    load: LoadShape
    out_dir: str


def prepare(args) -> Setup:
    from container import config as cfgmod
    from container.properties import read_properties
    from container.tune.load import LoadShape
    from container.tune.space import Checker, this_host
    from container.tune.workload import Lengths, build_bodies, longest_sequence, read_trace
    from engines.weights.artifacts import resolve_model

    for name in ("prompt_tokens", "output_tokens", "concurrency"):
        if (getattr(args, name) or 1) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.rate is not None and args.rate <= 0 or not 0 <= args.spread < 1:
        raise ValueError("--rate must be above 0 and --spread in [0, 1)")
    base = read_properties(args.properties) if args.properties else {}
    resolved = cfgmod.resolve(base, os.environ)
    local_dir = resolve_model(resolved["option.model_id"], args.model_dir, revision=resolved["option.revision"],
                              download_dir=resolved["download_dir"] or cfgmod.default_download_dir(os.environ))
    if args.trace:
        bodies = build_bodies(local_dir, trace=read_trace(args.trace), seed=args.seed)
    else:
        bodies = build_bodies(local_dir, lengths=Lengths(args.prompt_tokens, args.output_tokens, args.spread),
                              seed=args.seed)
    prompt, output = longest_sequence(bodies, local_dir)
    host = this_host()
    checker = Checker(base, local_dir, os.environ, host, prompt, output)
    load = LoadShape(concurrency=None if args.rate else (args.concurrency or 16), rate=args.rate,
                     warmup_s=args.warmup, seed=args.seed)
    return Setup(base, local_dir, bodies, host, checker, load, os.path.dirname(os.path.abspath(args.out)))


def space(setup: Setup, args) -> tuple[list[Candidate], list[Pruned]]:
    """(the candidates to try in order, those pruned with the reason)."""
    from container.tune.space import candidates, knobs, not_searched, prune

    only = [k.strip() for k in args.knobs.split(",") if k.strip()] if args.knobs else None
    settings = knobs(setup.host, concurrency=setup.load.concurrency, tpot_target_s=args.tpot_p90, only=only)
    skipped = "; ".join(f"{k} ({why})" for k, why in not_searched(setup.host, args.tpot_p90).items() if not only)
    print(f"knobs: {', '.join(f'{k} ({len(v) - 1})' for k, v in settings.items())}"
          + (f"; not searched on this host: {skipped}" if skipped else ""), flush=True)
    return prune(candidates(settings, seed=args.seed), setup.checker)


def run(args) -> int:
    from container.tune.report import Progress
    from container.tune.search import Budget, Overhead, best, successive_halving
    from container.tune.server import Evaluator
    from container.tune.verify import interleaved

    clock = time.monotonic
    total = Budget(args.budget, clock)
    setup = prepare(args)
    kept, pruned = space(setup, args)
    if not kept:
        raise ValueError("nothing to try: " + "; ".join(f"{p.candidate.name}: {p.reason}" for p in pruned[:3]))
    overhead = Overhead(DEFAULT_OVERHEAD_S)
    # the final comparison: two starts, and rounds x two windows; at most VERIFY_SHARE of a small budget
    reserve = min(2 * overhead.estimate() + args.verify_rounds * 2 * (args.warmup + 2 * args.min_window),
                  VERIFY_SHARE * args.budget) if args.verify_rounds else 0.0
    progress = Progress(args.budget, clock, enabled=not args.no_progress)
    try:
        search_budget = Budget(max(args.budget - reserve, 0.0), clock)
        evaluate = Evaluator(setup.base, setup.local_dir, setup.bodies, setup.load,
                             os.path.join(setup.out_dir, "logs"), search_budget, on_phase=progress.say, clock=clock)
        trials = successive_halving(kept, evaluate, search_budget, targets_of(args), overhead=overhead,
                                    min_window_s=args.min_window, max_window_s=args.max_window)
        pick = best(trials, targets_of(args))
        final = [c for c in kept if c.name == "defaults" or (pick is not None and c.name == pick.name)]
        rounds, window = verify_plan(total.remaining(), len(final), args, overhead.estimate())
        evaluate.budget = total
        finals = interleaved(final, evaluate, rounds, window, keep_up=setup.host.num_gpus == 0) \
            if pick and rounds else []
    finally:
        progress.close()
    from container.tune.output import report

    return report(args, setup, kept, pruned, trials, finals, pick, total)


def verify_plan(remaining_s: float, num_configs: int, args, overhead_s: float) -> tuple[int, float]:
    """The final comparison's (rounds, window): what is left shared by its measurements, the window
    within its limits; fewer rounds when the shortest windows do not fit (0: no time for it)."""
    rounds = args.verify_rounds
    while rounds and num_configs * (overhead_s + rounds * (args.warmup + args.min_window)) > remaining_s:
        rounds -= 1
    if not rounds:
        return 0, args.min_window
    per = (remaining_s - num_configs * overhead_s) / (rounds * num_configs) - args.warmup
    return rounds, min(max(per, args.min_window), args.max_window)
