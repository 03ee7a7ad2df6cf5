"""Pipeline parallelism across hosts against tensor parallelism on one host, on CPU, each a real server
(`lmi serve`), interleaved rounds (docs/multinode.md).

    python -m benchmarks.pipeline --model-dir models/small --rounds 3 --out benchmarks/results/pipeline_small.json

Configurations (engine=MPI, the paged engine, bf16):
- TP=2, one host: two ranks on this machine (Open MPI's shared-memory transport);
- TP=2, two hosts: the same two ranks, each in a network namespace of its own (tests/netns.py), over TCP
  on a bridge: what crossing hosts costs by itself;
- TP=2 x PP=2, four hosts: four ranks, one per namespace, the layers in two stages of a TP pair each.
The namespaces share this machine's cores: four ranks get what two got, so this measures the cost of
the stages (hand-overs, the stages taking turns), not the capacity more hosts would add. Open MPI cannot
know that the hosts share two cores (the hostfile gives each a slot), so a rank waiting in a collective
would spin on a core another rank needs: every configuration runs with `mpi_yield_when_idle=1` (a
waiting rank yields its core, as Open MPI does by itself on an oversubscribed host); `--spin` leaves
Open MPI's default.

Load: `--clients` closed-loop clients sending `--requests` requests of the 32x128 workload (32 prompt
tokens, 128 new, ignore_eos), streamed: generated tok/s over the run, latency p50 / p90, TTFT p90 and
time per output token p50; a table, the JSON and a PNG beside it. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.loadgen import RunResult, run_load
from benchmarks.server import BenchServer
from benchmarks.workloads import build_requests
from tests.netns import Hosts, unavailable

BASE = ("engine=MPI\noption.rolling_batch=lmi-dist\noption.max_rolling_batch_size=32\noption.dtype=bf16\n"
        "option.max_rolling_batch_prefill_tokens=1024\noption.kv_cache_memory=512MiB\n"
        "option.tensor_parallel_degree=2\n")
KEYS = ("throughput", "latency_p50", "latency_p90", "ttft_p90", "tpot_p50")


def plot(table: list[dict], path: str) -> None:
    """Throughput and latency per configuration, side by side; skipped with a warning without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["config"] for row in table]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(range(len(names)), [row["throughput"] for row in table])
    left.set_ylabel("generated tok/s")
    width = 0.4
    right.bar([i - width / 2 for i in range(len(names))], [row["latency_p50"] for row in table], width, label="p50")
    right.bar([i + width / 2 for i in range(len(names))], [row["latency_p90"] for row in table], width, label="p90")
    right.set_ylabel("request latency, s")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(range(len(names)), names, fontsize=8)
    fig.suptitle("TP x PP across network namespaces, 32x128 workload (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def configs(hosts: Hosts, tmp: Path) -> dict[str, str]:
    two = tmp / "hostfile-2"
    two.write_text("".join(f"{a} slots=1\n" for a in hosts.addrs[:2]))
    on_hosts = hosts.properties()
    return {"TP=2, one host": BASE,
            "TP=2, two hosts": BASE + on_hosts.replace(str(hosts.hostfile), str(two)),
            "TP=2 x PP=2, four hosts": BASE + "option.pipeline_parallel_degree=2\n" + on_hosts}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--out", default="benchmarks/results/pipeline.json")
    p.add_argument("--spin", action="store_true", help="Open MPI's default: waiting ranks spin (no yield)")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    bodies = build_requests("32x128", args.model_dir, args.requests, seed=0)
    env = dict(os.environ)
    if not args.spin:
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"  # mpirun passes it to every rank
    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    hosts = Hosts(tmp, 4)
    try:
        setups = configs(hosts, tmp)
        runs: dict[str, list[dict]] = {name: [] for name in setups}
        for r in range(args.rounds):
            for name, props in setups.items():
                server = BenchServer(name.split(",")[0].replace(" ", "").replace("=", ""), args.model_dir,
                                     properties=props, streams=True, env=env)
                try:
                    server.wait_ready()
                    run_load(server, bodies[:2], 2, None, seed=r)  # warm-up
                    wall, results, errors, samples = run_load(server, bodies, args.clients, None, seed=r)
                finally:
                    server.stop()
                    hosts.kill_leftovers()
                summary = RunResult(name, "32x128", r, wall, results, samples, errors).summary()
                runs[name].append(summary)
                print(f"  round {r + 1} {name:<24} {summary['throughput']:7.1f} tok/s  latency p50 "
                      f"{summary['latency_p50']:5.2f} s p90 {summary['latency_p90']:5.2f} s  ttft p90 "
                      f"{summary['ttft_p90']:5.2f} s  tpot p50 {summary['tpot_p50'] * 1e3:6.1f} ms  errors {errors}",
                      flush=True)
    finally:
        hosts.remove()
    table = []
    print(f"\n{args.model_dir}, bf16, {args.requests} requests 32 in / 128 out, {args.clients} clients, streamed, "
          f"waiting ranks {'spin' if args.spin else 'yield'}, medians of {args.rounds} rounds")
    print(f"  {'config':<24} {'tok/s':>8} {'vs TP=2':>8} {'lat p50 s':>10} {'lat p90 s':>10} {'ttft p90 s':>11} "
          f"{'tpot p50 ms':>12}")
    base = statistics.median(x["throughput"] for x in runs["TP=2, one host"])
    for name, got in runs.items():
        med = {k: statistics.median(x[k] for x in got) for k in KEYS}
        # the ratio of each round to the same round's TP=2 on one host, then the median
        ratio = statistics.median(a["throughput"] / b["throughput"] for a, b in zip(got, runs["TP=2, one host"]))
        table.append(dict(config=name, ratio=ratio, **med))
        print(f"  {name:<24} {med['throughput']:>8.1f} {ratio:>7.2f}x {med['latency_p50']:>10.2f} "
              f"{med['latency_p90']:>10.2f} {med['ttft_p90']:>11.2f} {med['tpot_p50'] * 1e3:>12.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "baseline_tok_s": base, "table": table, "runs": runs}, f, indent=1)
    print(f"wrote {args.out}")
    plot(table, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
