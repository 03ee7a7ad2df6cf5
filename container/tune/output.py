"""What `lmi tune` leaves behind: the chosen serving.properties (with the evidence in its header),
tune.json, tune.md and frontier.png beside it, and the table and verdict on stdout."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Sequence

from container.tune.report import markdown_table, plot_frontier, rows, text_table, trial_json
from container.tune.search import Budget, Measurement, Targets, Trial
from container.tune.server import write_properties
from container.tune.space import Candidate, Pruned
from container.tune.verify import Verdict, decide, median_of


def verdict_of(finals: Sequence[Trial], pick: Trial | None, kept: Sequence[Candidate], pruned: Sequence[Pruned],
               targets: Targets) -> tuple[Verdict, dict[str, Measurement | None]]:
    """The decision from the final comparison's medians, and those medians by name."""
    names = list(dict.fromkeys(t.name for t in finals))
    medians = {n: median_of([t for t in finals if t.name == n]) for n in names}
    if not any(c.name == "defaults" for c in kept):
        why = next((p.reason for p in pruned if p.candidate.name == "defaults"), "not tried")
        chosen = pick.name if pick is not None else "defaults"
        return Verdict(chosen, None, None, f"the defaults cannot run here ({why}); {chosen} is the best found"), medians
    if pick is None:
        return Verdict("defaults", None, None, "no trial was measured: the budget is too small for one start "
                       "and window; the defaults are written unchanged"), medians
    if not finals:
        return Verdict(pick.name, None, None, f"no time was left for the fresh comparison: {pick.name} is the "
                       "search's best by its own measurements"), medians
    return decide(medians.get("defaults"), medians.get(pick.name), pick.name, targets), medians


def report(args, setup, kept: Sequence[Candidate], pruned: Sequence[Pruned], trials: Sequence[Trial],
           finals: Sequence[Trial], pick: Trial | None, total: Budget) -> int:
    """Write everything, print the table and verdict; 0 when the written configuration meets the
    targets measured fresh, 1 when it does not (or could not be measured)."""
    targets = Targets(args.ttft_p90, args.tpot_p90)
    verdict, medians = verdict_of(finals, pick, kept, pruned, targets)
    chosen = next((c for c in kept if c.name == verdict.chosen), Candidate("defaults", ()))
    out_dir = setup.out_dir
    os.makedirs(out_dir, exist_ok=True)
    header = (f"lmi tune, {time.strftime('%Y-%m-%d %H:%M')}: {verdict.text}\n"
              f"targets: p90 TTFT {args.ttft_p90} s, p90 TPOT {args.tpot_p90} s; {workload_text(args)}\n"
              f"configuration: {chosen.name}")
    write_properties(args.out, {**setup.base, **chosen.properties}, header)
    table = rows([*trials, *finals], targets)
    print(text_table(table))
    print()
    for name, m in medians.items():
        rounds = sum(1 for t in finals if t.name == name)
        print(f"final (medians of {rounds} interleaved rounds) {name}: {_said(m, targets)}")
    print(f"{len(kept)} candidates could run here, {len(trials)} trials measured; {len(pruned)} pruned "
          f"before starting (tune.json says why)")
    print(f"verdict: {verdict.text}")
    print(f"wrote {args.out} ({chosen.name}); {total.seconds - total.remaining():.0f} s of a "
          f"{total.seconds:.0f} s budget")
    body = {"args": {k: v for k, v in vars(args).items() if k != "fn"}, "host": asdict(setup.host),
            "verdict": asdict(verdict), "chosen": chosen.properties,
            "final_medians": {n: asdict(m) if m else None for n, m in medians.items()},
            "trials": [trial_json(t) for t in trials], "final": [trial_json(t) for t in finals],
            "pruned": [{"name": p.candidate.name, "properties": p.candidate.properties, "reason": p.reason}
                       for p in pruned], "elapsed_s": total.seconds - total.remaining()}
    body["host"]["cpu_flags"] = sorted(setup.host.cpu_flags)
    with open(os.path.join(out_dir, "tune.json"), "w") as f:
        json.dump(body, f, indent=1, default=str)
    with open(os.path.join(out_dir, "tune.md"), "w") as f:
        f.write(f"# lmi tune\n\n{verdict.text}\n\n{workload_text(args)}\n\n{markdown_table(table)}\n")
    why_not = plot_frontier(trials, targets, os.path.join(out_dir, "frontier.png"), finals=medians)
    print(why_not or f"wrote {os.path.join(out_dir, 'tune.json')}, tune.md and frontier.png")
    final = medians.get(chosen.name)
    return 0 if final is not None and targets.violation(final) <= 1 else 1


def workload_text(args) -> str:
    load = f"{args.concurrency or 16} clients" if args.rate is None else f"{args.rate:g} requests/s"
    what = f"trace {args.trace}" if args.trace else \
        f"prompts {args.prompt_tokens} and outputs {args.output_tokens} tokens (spread {args.spread:g})"
    return f"workload: {what}, {load}"


def _said(m: Measurement | None, targets: Targets) -> str:
    if m is None:
        return "not measured"
    meets = "meets" if targets.violation(m) <= 1 else "misses"
    return (f"{m.throughput:.1f} tok/s, p90 TTFT {m.ttft_p90:.3f} s, p90 TPOT {m.tpot_p90 * 1000:.1f} ms, "
            f"{m.errors} errors: {meets} the targets")
