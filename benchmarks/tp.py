"""Tensor parallelism on CPU ranks: decode step time at TP=1 and TP=2, all-reduce cost, peak RSS.

    python -m benchmarks.tp --model-dir models/small --batch 8 --steps 32 --rounds 3
    python -m benchmarks.tp --model-dir models/small --served 16 --rounds 3 \
        --out benchmarks/results/tp_served_small.json     # real servers: TP=2 under mpirun vs one process

Each configuration runs as real processes (TP=2 under mpirun); rounds alternate TP=1 and TP=2.
A worker loads the model with the sharded loader, reports its peak RSS after loading (VmHWM), then
times prefill and decode steps of a padded batch, counting the time spent inside all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def worker(args) -> None:
    import torch

    from engines.config import ModelConfig
    from engines.dist import make_communicator, rank_info
    from engines.worker.model_runner import ModelRunner
    from engines.spec import ModelSpec

    info = rank_info(os.environ)
    if info.world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.world_size))
    comm = make_communicator(info)
    baseline_kb = _status_kb("VmRSS")  # torch and friends imported, no weights yet
    reduce_time = [0.0]
    reduce_calls = [0]
    real = comm.all_reduce

    def timed(t):
        started = time.perf_counter()
        out = real(t)
        reduce_time[0] += time.perf_counter() - started
        reduce_calls[0] += 1
        return out

    comm.all_reduce = timed
    runner = ModelRunner(ModelConfig(local_dir=args.model_dir, dtype=args.dtype), ModelSpec.read(args.model_dir, 2048),
                         comm)
    runner.load()
    peak_kb = _status_kb("VmHWM")
    prompts = [list(range(5, 5 + args.prompt_len))] * args.batch
    _, cache = runner.prefill(prompts)
    for _ in range(3):
        runner.decode(cache, [7] * args.batch)
    reduce_time[0], reduce_calls[0] = 0.0, 0
    started = time.perf_counter()
    for _ in range(args.steps):
        runner.decode(cache, [7] * args.batch)
    step = (time.perf_counter() - started) / args.steps
    result = {"rank": info.rank, "world": info.world_size, "step_ms": step * 1000,
              "allreduce_ms_per_step": reduce_time[0] / args.steps * 1000,
              "allreduces_per_step": reduce_calls[0] / args.steps,
              "peak_rss_mb": peak_kb / 1024, "baseline_rss_mb": baseline_kb / 1024}
    with open(os.path.join(args.result_dir, f"rank{info.rank}.json"), "w") as f:  # ranks share stdout
        json.dump(result, f)


def run(tp: int, args) -> list[dict]:
    result_dir = tempfile.mkdtemp(prefix="tp-bench-")
    cmd = [sys.executable, "-m", "benchmarks.tp", "--worker", "--model-dir", args.model_dir, "--dtype", args.dtype,
           "--batch", str(args.batch), "--steps", str(args.steps), "--prompt-len", str(args.prompt_len),
           "--result-dir", result_dir]
    if tp > 1:
        cmd = ["mpirun", "--allow-run-as-root", "--bind-to", "none", "-np", str(tp), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    try:
        rows = []
        for rank in range(tp):
            with open(os.path.join(result_dir, f"rank{rank}.json")) as f:
                rows.append(json.load(f))
    except OSError:
        raise RuntimeError(f"TP={tp} run failed:\n{out.stdout}\n{out.stderr}") from None
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)
    return rows


def served(args) -> int:
    """TP=2 under mpirun against one process using the same cores, both real `lmi serve` servers
    up for the whole run, rounds interleaved."""
    from benchmarks.peers import host, lmi_run, workload
    from benchmarks.server import BenchServer
    from handlers.tokenizer import TextTokenizer

    prompts, tok = workload(args.model_dir, args.served, 32), TextTokenizer(args.model_dir)
    servers = {"TP=1, one process": BenchServer("paged+tp1", args.model_dir, None, "512MiB"),
               "TP=2, mpirun": BenchServer("paged+tp2", args.model_dir, None, "512MiB",
                                           ["paged+tp2:engine=MPI", "paged+tp2:option.tensor_parallel_degree=2"])}
    runs: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for s in servers.values():
            s.wait_ready()
        for rnd in range(args.rounds):
            for name, s in servers.items():
                runs[name].append(lmi_run(s, prompts, 128, tok))
                print(f"round {rnd} {name}: {runs[name][-1]:.1f} tok/s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    med = {name: statistics.median(v) for name, v in runs.items()}
    ratio = med["TP=2, mpirun"] / med["TP=1, one process"]
    info = host()
    print(f"\n{args.model_dir}, {args.served} clients x 32 in / 128 out, medians of {args.rounds} rounds; host "
          f"{info['cpu']}, {info['cores']} cores, {info['flags']}")
    for name, value in med.items():
        print(f"  {name:<20} {value:8.1f} tok/s")
    print(f"  TP=2 / one process: {ratio:.2f}x")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "host": info, "runs": runs, "medians_tok_s": med, "tp2_over_tp1": ratio}, f,
                  indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    p.add_argument("--served", type=int, metavar="CLIENTS",
                   help="instead: real servers (the host's default dtype), one process with every core against "
                        "TP=2 under mpirun, CLIENTS concurrent clients of 32 in / 128 out, generated tok/s")
    p.add_argument("--out", default="benchmarks/results/tp.json")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.served:
        return served(args)
    runs: dict[int, list[list[dict]]] = {1: [], 2: []}
    for rnd in range(args.rounds):
        for tp in (1, 2):
            runs[tp].append(run(tp, args))
            r0 = runs[tp][-1][0]
            print(f"round {rnd} TP={tp}: {r0['step_ms']:.1f} ms/step, all-reduce {r0['allreduce_ms_per_step']:.2f} "
                  f"ms/step, peak RSS {[round(r['peak_rss_mb']) for r in runs[tp][-1]]} MB", flush=True)
    med = {tp: {k: statistics.median(rows[0][k] for rows in rs) for k in rs[0][0] if k not in ("rank", "world")}
           for tp, rs in runs.items()}
    peak2 = max(statistics.median(rows[i]["peak_rss_mb"] for rows in runs[2]) for i in range(2))
    print(f"\n{'TP':>3} {'step ms':>9} {'all-reduce ms/step':>19} {'all-reduces':>12} {'peak RSS MB':>12} "
          f"{'RSS over import MB':>19}")
    for tp in (1, 2):
        m = med[tp]
        print(f"{tp:>3} {m['step_ms']:>9.1f} {m['allreduce_ms_per_step']:>19.2f} {m['allreduces_per_step']:>12.0f} "
              f"{m['peak_rss_mb']:>12.0f} {m['peak_rss_mb'] - m['baseline_rss_mb']:>19.0f}")
    print(f"\nTP=2 / TP=1 step time: {med[2]['step_ms'] / med[1]['step_ms']:.2f}; "
          f"largest rank peak RSS / single rank: {peak2 / med[1]['peak_rss_mb']:.2f}; "
          f"over the import baseline: {(med[2]['peak_rss_mb'] - med[2]['baseline_rss_mb']) / (med[1]['peak_rss_mb'] - med[1]['baseline_rss_mb']):.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "runs": runs, "medians": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
