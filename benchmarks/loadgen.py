"""Load generator: drives real `lmi serve` processes over HTTP and compares engines side by side.

    python -m benchmarks.loadgen --model-dir models/small --configs dynamic,rolling \
        --workloads 32x128,256x32,mixed --requests 64 --concurrency 32 --rounds 3

Every configuration's server is started once and stays up; the rounds interleave them (round 1:
dynamic then rolling on each workload, round 2 again, ...) so that drift on a shared machine hits
all of them alike. The table reports medians over rounds and ratios against the first config.
Outputs: a table on stdout, `--out` JSON, and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import requests

from benchmarks.server import BenchServer, config_properties
from benchmarks.workloads import WORKLOADS, build_requests


@dataclass
class RequestResult:
    latency: float
    ttft: float
    num_tokens: int


@dataclass
class RunResult:
    config: str
    workload: str
    round: int
    wall: float
    results: list[RequestResult]
    ping_samples: list[dict] = field(default_factory=list)
    errors: int = 0

    def summary(self) -> dict:
        lat = sorted(r.latency for r in self.results)
        ttft = sorted(r.ttft for r in self.results)
        tokens = sum(r.num_tokens for r in self.results)
        tpot = sorted((r.latency - r.ttft) / max(r.num_tokens - 1, 1) for r in self.results)
        running = [s["running"] for s in self.ping_samples] or [0]
        slots = [s.get("kv_slots", 0) for s in self.ping_samples] or [0]
        kv = [s["metrics"] for s in self.ping_samples if s.get("metrics", {}).get("kv_slots_allocated")]
        # steady state: the samples taken while the batch was at least half its peak size
        steady = [m for m in kv if m["running"] >= max(running) / 2]
        unused = statistics.median(m["kv_slots_unused"] / m["kv_slots_allocated"] for m in steady) if steady else 0.0
        return {"throughput": tokens / self.wall, "latency_p50": _pct(lat, 50), "latency_p90": _pct(lat, 90),
                "ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90), "tpot_p50": _pct(tpot, 50),
                "max_running": max(running), "mean_running": statistics.fmean(running),
                "max_kv_slots": max(slots), "kv_unused_fraction": unused, "errors": self.errors, "wall": self.wall,
                "tokens": tokens}


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def send(url: str, body: dict, stream: bool) -> RequestResult:
    started = time.perf_counter()
    if not stream:  # dynamic batching answers all at once: TTFT is the latency
        resp = requests.post(url, json=body, timeout=1800)
        resp.raise_for_status()
        data = resp.json()
        data = data[0] if isinstance(data, list) else data
        elapsed = time.perf_counter() - started
        return RequestResult(elapsed, elapsed, data["details"]["generated_tokens"])
    ttft = None
    n = 0
    with requests.post(url, json=dict(body, stream=True), stream=True, timeout=1800) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line:
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            obj = json.loads(line)
            if "code" in obj and "token" not in obj:
                raise RuntimeError(obj.get("error"))
            n += 1
    return RequestResult(time.perf_counter() - started, ttft or 0.0, n)


def run_load(server: BenchServer, bodies: list[dict], concurrency: int, rate: float | None,
             seed: int, stream: bool = True) -> tuple[float, list[RequestResult], int, list[dict]]:
    """Closed loop with `concurrency` clients, or Poisson arrivals at `rate` requests/s."""
    url = server.url + "/invocations"
    stream = server.streams and stream
    samples: list[dict] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                samples.append(requests.get(server.url + "/ping", timeout=2).json())
            except requests.RequestException:
                pass
            stop.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    results: list[RequestResult] = []
    errors = 0
    started = time.perf_counter()
    workers = concurrency if rate is None else len(bodies)
    with ThreadPoolExecutor(workers) as pool:
        futures = []
        rng = random.Random(seed)
        for body in bodies:
            futures.append(pool.submit(send, url, body, stream))
            if rate is not None:
                time.sleep(rng.expovariate(rate))
        for f in futures:
            try:
                results.append(f.result())
            except Exception as exc:  # counted and reported, never hidden
                errors += 1
                print(f"  request failed: {exc}", file=sys.stderr)
    wall = time.perf_counter() - started
    stop.set()
    watcher.join()
    return wall, results, errors, samples


COLUMNS = [("throughput", "tok/s", 1), ("latency_p50", "lat p50 s", 1), ("latency_p90", "lat p90 s", 1),
           ("ttft_p50", "ttft p50 s", 1), ("ttft_p90", "ttft p90 s", 1), ("tpot_p50", "tpot ms", 1000),
           ("max_running", "max seqs", 1), ("mean_running", "mean seqs", 1), ("kv_unused_fraction", "kv unused", 1),
           ("errors", "errors", 1)]


def medians(runs: list[RunResult]) -> dict[tuple[str, str], dict]:
    grouped: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        grouped.setdefault((run.config, run.workload), []).append(run.summary())
    return {key: {k: statistics.median(s[k] for s in sums) for k in sums[0]} for key, sums in grouped.items()}


def print_table(table: dict[tuple[str, str], dict], configs: list[str], workloads: list[str]) -> None:
    head = f"{'workload':<10} {'config':<10} " + " ".join(f"{label:>11}" for _, label, _ in COLUMNS)
    print(head + f" {'x tok/s':>8} {'p90 lat /':>10}")
    print("-" * len(head + " " * 20))
    for w in workloads:
        base = table[(configs[0], w)]
        for c in configs:
            row = table[(c, w)]
            cells = " ".join(f"{row[k] * scale:>11.3f}" if isinstance(row[k], float) else f"{row[k]:>11}"
                             for k, _, scale in COLUMNS)
            speedup = row["throughput"] / base["throughput"]
            lat_ratio = base["latency_p90"] / row["latency_p90"]
            print(f"{w:<10} {c:<10} {cells} {speedup:>8.2f} {lat_ratio:>10.2f}")


def plot(table, configs, workloads, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(configs)
    for ax, (metric, label) in zip(axes, [("throughput", "generated tokens/s"), ("latency_p90", "p90 latency (s)"),
                                          ("ttft_p50", "TTFT p50 (s)")]):
        for i, c in enumerate(configs):
            xs = [j + i * width for j in range(len(workloads))]
            ax.bar(xs, [table[(c, w)][metric] for w in workloads], width, label=c)
        ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(workloads))], workloads)
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle("lmi-serve engines, same model, same load (medians over rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--configs", default="dynamic,rolling", help="comma list of: " + ", ".join(config_properties()))
    p.add_argument("--workloads", default="32x128,256x32,mixed", help="comma list of: " + ", ".join(WORKLOADS))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rate", type=float, help="Poisson arrivals (requests/s) instead of a closed loop")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--set", action="append", default=[], help="extra properties, e.g. rolling:option.x=1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stream", action="store_true",
                   help="plain JSON responses for every engine (TTFT then equals the latency)")
    p.add_argument("--out", default="benchmarks/results/loadgen.json")
    args = p.parse_args(argv)
    configs, workloads = args.configs.split(","), args.workloads.split(",")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    servers: dict[str, BenchServer] = {}
    runs: list[RunResult] = []
    try:
        for c in configs:  # one after the other: each engine measures its CPU at start
            servers[c] = BenchServer(c, args.model_dir, args.dtype, args.kv_cache_memory, args.set)
            servers[c].wait_ready()
        for rnd in range(args.rounds):
            for w in workloads:
                bodies = build_requests(w, args.model_dir, args.requests, args.seed + rnd)
                for c in configs:
                    wall, results, errors, samples = run_load(servers[c], bodies, args.concurrency, args.rate,
                                                              args.seed + rnd, stream=not args.no_stream)
                    runs.append(RunResult(c, w, rnd, wall, results, samples, errors))
                    s = runs[-1].summary()
                    print(f"round {rnd} {w:<8} {c:<8} {s['throughput']:8.1f} tok/s  p90 {s['latency_p90']:.2f} s  "
                          f"max seqs {s['max_running']}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    table = medians(runs)
    print()
    print_table(table, configs, workloads)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "medians": {f"{c}/{w}": v for (c, w), v in table.items()},
                   "runs": [dict(asdict(r), summary=r.summary(), results=None) for r in runs]}, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(table, configs, workloads, png)
    print(f"\nwrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
