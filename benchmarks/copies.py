"""Model copies per host (maxWorkers) on CPU: two copies of one thread each against one copy with two
threads, the same load, interleaved rounds, each a fresh real server (`lmi serve`).

    python -m benchmarks.copies --model-dir models/small --rounds 3 --out benchmarks/results/copies_small.json

Load: `--clients` closed-loop clients sending `--requests` requests of the 32x128 workload (32
prompt tokens, 128 new, ignore_eos), streamed; generated tok/s over the run, latency p50 / p90 and
TTFT p90 per request. Two copies: each engine pinned to one core (engines/process/serve.py), one torch thread
each, behind the one front end that sends each request to the copy with the fewest outstanding
tokens. One copy: the usual engine, two torch threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import requests

from benchmarks.loadgen import RunResult, run_load
from benchmarks.server import BenchServer
from benchmarks.workloads import build_requests

BASE = ("engine=Python\noption.rolling_batch=lmi-dist\noption.max_rolling_batch_size=32\noption.dtype=bf16\n"
        "option.max_rolling_batch_prefill_tokens=1024\noption.kv_cache_memory=512MiB\n")
CONFIGS = {"1 copy x 2 threads": BASE, "2 copies x 1 thread": BASE + "maxWorkers=2\n"}


def all_copies_ready(url: str, copies: int, timeout: float = 300) -> None:
    """/ping is healthy once one copy is: wait for every copy's lmi_engine_ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = requests.get(url + "/metrics", timeout=10).text
        ready = [line for line in text.splitlines() if line.startswith("lmi_engine_ready") and line.endswith(" 1.0")]
        if len(ready) >= copies:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{copies} copies not ready in {timeout} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.copies")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--out", default="benchmarks/results/copies.json")
    args = p.parse_args(argv)
    bodies = build_requests("32x128", args.model_dir, args.requests, seed=0)
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        for name, props in CONFIGS.items():
            server = BenchServer(name.replace(" ", "_"), args.model_dir, properties=props, streams=True)
            try:
                server.wait_ready()
                all_copies_ready(server.url, 2 if "maxWorkers" in props else 1)
                run_load(server, bodies[:2], 2, None, seed=r)  # warm-up
                wall, results, errors, samples = run_load(server, bodies, args.clients, None, seed=r)
            finally:
                server.stop()
            summary = RunResult(name, "32x128", r, wall, results, samples, errors).summary()
            runs[name].append(summary)
            print(f"  round {r + 1} {name:<20} {summary['throughput']:7.1f} tok/s  latency p50 "
                  f"{summary['latency_p50']:5.2f} s p90 {summary['latency_p90']:5.2f} s  ttft p90 "
                  f"{summary['ttft_p90']:5.2f} s  errors {errors}", flush=True)
    table = []
    print(f"\n{args.model_dir}, bf16, {args.requests} requests 32 in / 128 out, {args.clients} clients, streamed, "
          f"medians of {args.rounds} rounds")
    print(f"  {'config':<20} {'tok/s':>8} {'lat p50 s':>10} {'lat p90 s':>10} {'ttft p90 s':>11}")
    for name in CONFIGS:
        med = {k: statistics.median(x[k] for x in runs[name])
               for k in ("throughput", "latency_p50", "latency_p90", "ttft_p90")}
        table.append(dict(config=name, **med))
        print(f"  {name:<20} {med['throughput']:>8.1f} {med['latency_p50']:>10.2f} {med['latency_p90']:>10.2f} "
              f"{med['ttft_p90']:>11.2f}")
    one, two = (statistics.median(x["throughput"] for x in runs[n]) for n in CONFIGS)
    print(f"  two copies / one: {two / one:.2f}x throughput")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "table": table, "runs": runs}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
