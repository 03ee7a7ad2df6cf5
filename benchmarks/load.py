"""Weight loading and cold start: the load cache vs our safetensors loader vs `from_pretrained`,
against the disk's own sequential read speed (the floor).

    lmi make-model models/1b --size 1b --dtype bfloat16          # 1.01 B parameters, 2.0 GB
    python -m benchmarks.load --model-dir models/1b --rounds 5 --out benchmarks/results/load_1b.json

Before every measured run the page cache is dropped for the checkpoint files and the load cache
(fsync, then posix_fadvise(POSIX_FADV_DONTNEED) on each file: no root needed), so each run reads
from the disk. The floor is the checkpoint's bytes read in 16 MiB pieces by 4 threads (this VM's
disk reads faster in parallel than in one stream, which is reported too). Each load runs in a fresh
Python process with its imports done before the clock starts, and ends when every page of every
weight is in memory (`from_pretrained` memory-maps: untouched pages are not read yet). The rounds
interleave the methods so that drift hits them alike. Reported: medians over rounds, GB/s, ratios
to the floor and to `from_pretrained`; then cold start to the first `/ping` 200 of a real
`lmi serve` with and without the cache (page cache dropped too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import requests

METHODS = ("floor", "floor_1_stream", "cache", "safetensors", "from_pretrained")
READ_CHUNK = 16 << 20
READ_THREADS = 4  # the floor: the checkpoint's bytes read in 16 MiB pieces by this many threads


def drop_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(*dirs: str) -> list[str]:
    return sorted(os.path.join(root, name) for d in dirs if d and os.path.isdir(d)
                  for root, _, names in os.walk(d) for name in names)


def checkpoint_bytes(model_dir: str) -> int:
    return sum(os.path.getsize(p) for p in files_under(model_dir) if p.endswith(".safetensors"))


# -- one measurement, in its own process ---------------------------------------------------------
def measure_one(method: str, model_dir: str, cache_dir: str, device: str = "cpu") -> dict:
    """One load; on CUDA (`--device cuda`) the weights end on the GPU: the cache goes through pinned
    staging buffers, from_pretrained is moved with .to()."""
    import torch

    if method.startswith("floor"):  # the checkpoint's bytes in large reads: the disk's own speed
        import concurrent.futures

        pieces = [(path, off) for path in files_under(model_dir) if path.endswith(".safetensors")
                  for off in range(0, os.path.getsize(path), READ_CHUNK)]
        local = __import__("threading").local()

        def read(piece) -> int:
            path, off = piece
            if not hasattr(local, "buf"):
                local.buf = bytearray(READ_CHUNK)
            fd = os.open(path, os.O_RDONLY)
            try:
                return os.preadv(fd, [local.buf], off)
            finally:
                os.close(fd)

        threads = 1 if method == "floor_1_stream" else READ_THREADS
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, pieces))
        return {"seconds": time.perf_counter() - started, "bytes": total}
    if method == "from_pretrained":
        from transformers import AutoModelForCausalLM

        started = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    else:
        from engines.dist import SingleProcess
        from engines.weights.loader import build_model
        from engines.models.registry import model_class
        from engines.spec import ModelSpec

        spec = ModelSpec.read(model_dir)
        cls = model_class(spec)
        started = time.perf_counter()
        model = build_model(cls, spec, model_dir, SingleProcess(), torch.bfloat16, torch.device(device), progress=False, load_cache_dir=cache_dir if method == "cache" else None)
    # every page of every weight in memory: from_pretrained memory-maps the file, so until a page
    # is touched it has not been read (ours read everything already: this costs them ~nothing)
    for p in model.parameters():
        p.data.view(-1).view(torch.uint8)[::4096].sum()
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"seconds": seconds, "bytes": nbytes}


def run_one(method: str, model_dir: str, cache_dir: str, drop: bool = True, device: str = "cpu") -> dict:
    if drop:
        drop_page_cache(files_under(model_dir, cache_dir))
    out = subprocess.run([sys.executable, "-m", "benchmarks.load", "--one", method, "--model-dir", model_dir,
                          "--cache-dir", cache_dir, "--device", device], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cold_start(model_dir: str, cache_dir: str | None, timeout: float = 600) -> float:
    """Seconds from `lmi serve` to its first /ping 200."""
    from benchmarks.server import BenchServer

    drop_page_cache(files_under(model_dir, cache_dir))
    extra = [f"paged:option.load_cache_dir={cache_dir}"] if cache_dir else []
    started = time.monotonic()
    server = BenchServer("paged", model_dir, "bf16", "64MB", extra)
    try:
        while time.monotonic() - started < timeout:
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {server.log_path}")
            try:
                if requests.get(server.url + "/ping", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"no /ping 200 in {timeout} s; see {server.log_path}")
    finally:
        server.stop()


# -- the benchmark -------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--cache-dir", help="load cache directory (default: a temporary one)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold-start-rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/load.json")
    p.add_argument("--device", default="cpu", help="where the weights end: cpu, or cuda (pinned staging)")
    p.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one, args.model_dir, args.cache_dir, args.device)))
        return 0

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="lmi-load-cache-")
    size = checkpoint_bytes(args.model_dir)
    print(f"checkpoint: {size / 1e9:.2f} GB in {args.model_dir}; load cache in {cache_dir}")
    run_one("cache", args.model_dir, cache_dir, device=args.device)  # writes the cache (not measured)
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for r in range(args.rounds):
        for method in METHODS:
            runs[method].append(run_one(method, args.model_dir, cache_dir, device=args.device))
            print(f"  round {r + 1} {method:<16} {runs[method][-1]['seconds']:7.2f} s", flush=True)
    run_one("floor_1_stream", args.model_dir, "", drop=False)
    warm = run_one("floor_1_stream", args.model_dir, "", drop=False)  # a check that dropping works: cached pages
    starts: dict[str, list[float]] = {"safetensors": [], "cache": []}
    for r in range(args.cold_start_rounds):
        for name in starts:
            starts[name].append(cold_start(args.model_dir, cache_dir if name == "cache" else None))
            print(f"  cold start {r + 1} {name:<12} {starts[name][-1]:7.2f} s", flush=True)

    med = {m: statistics.median(x["seconds"] for x in runs[m]) for m in METHODS}
    floor, hf = med["floor"], med["from_pretrained"]
    summary = {m: {"median_s": med[m], "runs_s": [x["seconds"] for x in runs[m]], "bytes": runs[m][0]["bytes"],
                   "gb_per_s": runs[m][0]["bytes"] / med[m] / 1e9, "vs_floor": med[m] / floor,
                   "speedup_vs_from_pretrained": hf / med[m]} for m in METHODS}
    cold = {name: {"median_s": statistics.median(v), "runs_s": v} for name, v in starts.items()}
    print(f"\nweight load, medians of {args.rounds} interleaved rounds, page cache dropped before each run")
    print(f"  {'method':<16} {'median s':>9} {'GB/s':>7} {'x floor':>8} {'vs from_pretrained':>19}")
    for m in METHODS:
        s = summary[m]
        print(f"  {m:<16} {s['median_s']:>9.2f} {s['gb_per_s']:>7.2f} {s['vs_floor']:>8.2f} "
              f"{s['speedup_vs_from_pretrained']:>18.2f}x")
    print(f"  (the floor read again with the page cache warm: {warm['seconds']:.2f} s)")
    print(f"cold start to /ping 200, medians of {args.cold_start_rounds}: "
          + ", ".join(f"{k} {v['median_s']:.2f} s" for k, v in cold.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model_dir": args.model_dir, "checkpoint_bytes": size, "rounds": args.rounds,
                   "load": summary, "warm_floor_s": warm["seconds"], "cold_start": cold}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
