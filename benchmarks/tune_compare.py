"""`lmi tune`'s search against vLLM's auto_tune method, the same budget each, on the same host.

    python -m benchmarks.tune_compare --model-dir models/small --budget 15m --concurrency 16 \
        --prompt-tokens 128 --output-tokens 64 --ttft-p90 1.0 --tpot-p90 0.150

1. halving: `lmi tune`'s successive halving over every knob of this host (container/tune/search.py);
2. grid: vLLM's benchmarks/auto_tune: every cell of max_num_seqs x max_num_batched_tokens served and
   measured once with the same window (the budget shared equally), the winner the highest throughput
   under the latency cap (ours: the p90 TTFT and TPOT targets, at the same concurrency; auto_tune's
   cap is a p99 end-to-end latency, met by lowering the request rate). With no cell under the cap,
   auto_tune names none; here the closest is taken, and the table says it misses;
3. the defaults and both winners measured again, fresh servers, interleaved rounds (order rotating),
   medians over rounds and ratios against the defaults.

Output: the table, the CPU's model and flags, `--out` JSON and a PNG beside it. Wall time: two
budgets, plus three starts and rounds x 3 x (warm-up + final window + drain) for the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

from container.tune import command as tune
from container.tune.output import workload_text
from container.tune.report import plot_frontier, trial_json
from container.tune.search import Budget, Overhead, Trial, best, grid_search, ranked, successive_halving
from container.tune.server import Evaluator
from container.tune.space import Candidate, label, prune
from container.tune.verify import interleaved, median_of

GRID_SEQS = (4, 8, 16, 32, 64)  # auto_tune's NUM_SEQS_LIST, at this host's scale
GRID_TOKENS = (256, 512, 1024, 2048)  # NUM_BATCHED_TOKENS_LIST
FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")


def grid_cells() -> list[Candidate]:
    cells = []
    for seqs in GRID_SEQS:
        for tokens in GRID_TOKENS:
            props = {"option.max_rolling_batch_size": str(seqs), "option.max_rolling_batch_prefill_tokens": str(tokens)}
            cells.append(Candidate(label(props), tuple(props.items())))
    return cells


def cpu_info() -> dict:
    model, flags = "unknown", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                if key.strip() in ("flags", "Features") and not flags:
                    flags = value.split()
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags_of_note": [f for f in FLAGS_OF_NOTE if f in flags],
            "flags": flags}


def search(name: str, cands: list[Candidate], setup, args, workdir: str) -> tuple[list[Trial], Trial | None, float]:
    """One method's trials, its pick, and the seconds it took."""
    targets = tune.targets_of(args)
    budget = Budget(args.budget, time.monotonic)
    evaluate = Evaluator(setup.base, setup.local_dir, setup.bodies, setup.load, os.path.join(workdir, name), budget,
                         on_phase=lambda text: print(f"  [{name}] {text}", file=sys.stderr, flush=True))
    overhead = Overhead(tune.DEFAULT_OVERHEAD_S)
    if name == "halving":
        trials = successive_halving(cands, evaluate, budget, targets, overhead=overhead,
                                    min_window_s=args.min_window, max_window_s=args.max_window)
        pick = best(trials, targets)
    else:
        trials = grid_search(cands, evaluate, budget, overhead=overhead, min_window_s=args.min_window)
        measured = [t for t in trials if t.measurement is not None]
        pick = ranked(measured, targets)[0] if measured else None
    return trials, pick, args.budget - budget.remaining()


def final_round(setup, args, picks: dict[str, Trial | None], workdir: str) -> list[Trial]:
    """The defaults and each method's pick (once each), fresh servers, interleaved rounds."""
    by_name = {"defaults": Candidate("defaults", ())}
    for trial in picks.values():
        if trial is not None:
            by_name.setdefault(trial.name, Candidate(trial.name, tuple(trial.properties.items())))
    evaluate = Evaluator(setup.base, setup.local_dir, setup.bodies, setup.load, os.path.join(workdir, "final"),
                         Budget(3600, time.monotonic),
                         on_phase=lambda text: print(f"  [final] {text}", file=sys.stderr, flush=True))
    return interleaved(list(by_name.values()), evaluate, args.verify_rounds, args.final_window,
                       keep_up=setup.host.num_gpus == 0)


def table(picks: dict[str, Trial | None], finals: list[Trial], spent: dict[str, float], counts: dict[str, int],
          targets) -> tuple[list[str], dict]:
    rows = [("defaults", "defaults")] + [(method, t.name if t else "none") for method, t in picks.items()]
    base = median_of([t for t in finals if t.name == "defaults"])
    lines = [f"{'method':<9} {'trials':>6} {'search s':>8} {'tok/s':>8} {'x defaults':>10} {'p90 TTFT s':>10} "
             f"{'p90 TPOT ms':>11} {'meets':>5}  config"]
    record = {}
    for method, name in rows:
        m = median_of([t for t in finals if t.name == name])
        ratio = m.throughput / base.throughput if m and base and base.throughput else float("nan")
        meets = "yes" if m and targets.violation(m) <= 1 else "no"
        cells = (f"{m.throughput:8.1f} {ratio:10.2f} {m.ttft_p90:10.3f} {m.tpot_p90 * 1000:11.1f}" if m
                 else f"{'-':>8} {'-':>10} {'-':>10} {'-':>11}")
        lines.append(f"{method:<9} {counts.get(method, 0):>6} {spent.get(method, 0):>8.0f} {cells} {meets:>5}  {name}")
        record[method] = {"config": name, "median": asdict(m) if m else None, "ratio_vs_defaults": ratio,
                          "meets": meets}
    return lines, record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune_compare")
    tune.add_arguments(p)
    p.add_argument("--final-window", type=float, default=30.0, help="the comparison's window, s (default 30)")
    p.set_defaults(out="benchmarks/results/tune_compare.json")
    args = p.parse_args(argv)
    targets = tune.targets_of(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    workdir = os.path.splitext(os.path.abspath(args.out))[0] + "_logs"
    setup = tune.prepare(args)
    kept, pruned = tune.space(setup, args)
    cells, _ = prune(grid_cells(), setup.checker)
    started = time.monotonic()
    results = {name: search(name, cands, setup, args, workdir) for name, cands in (("halving", kept), ("grid", cells))}
    picks = {name: r[1] for name, r in results.items()}
    finals = final_round(setup, args, picks, workdir)
    lines, record = table(picks, finals, {n: r[2] for n, r in results.items()},
                          {n: len(r[0]) for n, r in results.items()}, targets)
    info = cpu_info()
    print(f"\nhost: {info['model']}, {info['cores']} cores; flags of note: {' '.join(info['flags_of_note']) or 'none'}")
    print(f"cpu flags (/proc/cpuinfo): {' '.join(info['flags'])}")
    print(f"{workload_text(args)}; targets: p90 TTFT {args.ttft_p90} s, "
          f"p90 TPOT {args.tpot_p90} s; search budget {args.budget:.0f} s per method; final: medians of "
          f"{args.verify_rounds} interleaved rounds of {args.final_window:.0f} s\n")
    print("\n".join(lines))
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "host": info, "summary": record, "wall_s": time.monotonic() - started,
                   "trials": {n: [trial_json(t) for t in r[0]] for n, r in results.items()},
                   "final": [trial_json(t) for t in finals]}, f, indent=1, default=str)
    png = os.path.splitext(args.out)[0] + ".png"
    trials = [_tagged(t, n) for n, r in results.items() for t in r[0]]
    finals_by_method = {f"{method}: {t.name}" if t else method: median_of([f for f in finals if t and f.name == t.name])
                        for method, t in picks.items()}
    finals_by_method["defaults"] = median_of([f for f in finals if f.name == "defaults"])
    plot_frontier(trials, targets, png, finals=finals_by_method, group=lambda t: t.name.split(":")[0],
                  title="lmi tune (halving) vs vLLM auto_tune (grid): every trial, same budget; stars: final medians")
    print(f"\nwrote {args.out} and {png}")
    return 0


def _tagged(trial: Trial, method: str) -> Trial:
    """The trial with its method in its name (the plot groups by it)."""
    return Trial(f"{method}: {trial.name}", trial.properties, trial.rung, trial.window_s, trial.measurement,
                 trial.failure, trial.cost_s)


if __name__ == "__main__":
    sys.exit(main())
