"""Embedding throughput: lmi-serve's pooling engine against sentence-transformers on the same model, in one run.

    python -m benchmarks.embeddings [--size mini] [--rounds 3] [--requests 640] [--dtype fp32]

The model: a random-weight BERT of all-MiniLM-L6-v2's shape (6 layers, 384 wide; container/encoder_maker.py)
with sentence-transformers' files (mean pooling, normalised). The peer: sentence-transformers behind the
simplest HTTP server one writes for it (Flask, a thread per request, `model.encode(texts)` per request:
requests are never batched together), so both sides pay for HTTP and JSON. Each request embeds one
sentence of the embedded corpus (10 to 40 tokens).

    batch 1        one client, one request at a time: latency and sentences/s
    32 clients     32 clients sending back to back: sentences/s and latency p50 / p90

The systems are measured in turns, `--rounds` times, and the medians reported with the ratio ours / peer;
the host's CPU flags are printed beside the table (bf16 is fast only with AVX-512 BF16 or AMX, so the
comparison runs in fp32 unless --dtype says otherwise). Also printed, for scale: sentence-transformers'
own `encode` of all the sentences in batches of 32, in-process (no HTTP: the ceiling of batching).
Writes benchmarks/results/embeddings.json and .png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import requests

from benchmarks.plots import pyplot
from benchmarks.server import BenchServer, _free_port
from benchmarks.slo import cpu_line, pct

RESULTS = os.path.join(os.path.dirname(__file__), "results")
CLIENTS = 32


def sentences(n: int) -> list[str]:
    from container.model_maker import corpus_lines

    lines = [line.strip() for line in corpus_lines() if 40 <= len(line.strip()) <= 200]
    return [lines[i % len(lines)] for i in range(n)]


def st_server(model_dir: str, port: int, dtype: str) -> None:
    """The peer: sentence-transformers behind Flask, one encode per request (run in a child process)."""
    import torch
    from flask import Flask, jsonify, request
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    app = Flask("st")

    @app.post("/embed")
    def embed():
        texts = request.get_json()["inputs"]
        return jsonify(model.encode(texts if isinstance(texts, list) else [texts]).tolist())

    @app.get("/ping")
    def ping():
        return "ok"

    from werkzeug.serving import make_server

    make_server("127.0.0.1", port, app, threaded=True).serve_forever()


class StServer:
    def __init__(self, model_dir: str, dtype: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w", prefix="bench-st-", suffix=".log", delete=False)
        code = f"from benchmarks.embeddings import st_server; st_server({model_dir!r}, {self.port}, {dtype!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sentence-transformers server exited; see {self.log.name}")
            try:
                if requests.get(self.url + "/ping", timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError("sentence-transformers server not ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def drive(url: str, texts: list[str], clients: int) -> dict:
    """Send each text as one /embed request from `clients` threads; → sentences/s and latencies (ms)."""
    latencies: list[float] = []
    lock = threading.Lock()
    session = threading.local()

    def one(text: str) -> None:
        s = getattr(session, "s", None) or requests.Session()
        session.s = s
        started = time.perf_counter()
        resp = s.post(url + "/embed", json={"inputs": [text]}, timeout=120)
        resp.raise_for_status()
        assert len(resp.json()) == 1
        with lock:
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, texts))
    wall = time.perf_counter() - started
    return {"sentences_per_s": len(texts) / wall, "p50_ms": pct(latencies, 50), "p90_ms": pct(latencies, 90)}


def offline_encode(model_dir: str, texts: list[str]) -> float:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    model.encode(texts[:64], batch_size=32)
    started = time.perf_counter()
    model.encode(texts, batch_size=32)
    return len(texts) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.embeddings")
    parser.add_argument("--size", default="mini", choices=("tiny", "mini"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=640, help="requests per 32-client run")
    parser.add_argument("--single", type=int, default=100, help="requests per batch-1 run")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args(argv)
    from container.encoder_maker import make_encoder

    model_dir = tempfile.mkdtemp(prefix="bench-embed-")
    make_encoder(model_dir, "bert-embed", size=args.size)
    texts = sentences(args.requests)
    props = (f"option.dtype={args.dtype}\noption.max_rolling_batch_size=64\n"
             "option.max_rolling_batch_prefill_tokens=8192\n")
    ours, peer = BenchServer("lmi-serve", model_dir, properties=props), StServer(model_dir, args.dtype)
    runs: dict[str, dict[str, list[dict]]] = {"lmi-serve": {"1": [], "32": []},
                                               "sentence-transformers": {"1": [], "32": []}}
    try:
        ours.wait_ready()
        peer.wait_ready()
        systems = {"lmi-serve": ours.url, "sentence-transformers": peer.url}
        for url in systems.values():
            drive(url, texts[:64], CLIENTS)  # warm-up: threads, connections, first shapes
        for r in range(args.rounds):
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                runs[name]["1"].append(drive(systems[name], texts[:args.single], 1))
                runs[name]["32"].append(drive(systems[name], texts, CLIENTS))
                print(f"round {r + 1} {name}: " + ", ".join(
                    f"{c} client(s) {runs[name][c][-1]['sentences_per_s']:.1f}/s" for c in ("1", "32")), flush=True)
    finally:
        ours.stop()
        peer.stop()
    report(runs, offline_encode(model_dir, texts), args)
    return 0


def median_of(results: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def report(runs: dict, offline: float, args) -> None:
    table = {name: {c: median_of(r) for c, r in by.items()} for name, by in runs.items()}
    print(f"\n{cpu_line()}")
    print(f"model: BERT {args.size} ({'6 layers, 384 wide' if args.size == 'mini' else '2 layers, 64 wide'}), "
          f"{args.dtype}; medians of {args.rounds} rounds, systems in turns\n")
    print(f"{'system':24} {'batch 1 /s':>11} {'p50 ms':>8} {'32 clients /s':>14} {'p50 ms':>8} {'p90 ms':>8}")
    for name, row in table.items():
        one, many = row["1"], row["32"]
        print(f"{name:24} {one['sentences_per_s']:11.1f} {one['p50_ms']:8.1f} {many['sentences_per_s']:14.1f} "
              f"{many['p50_ms']:8.1f} {many['p90_ms']:8.1f}")
    ratio = {c: table["lmi-serve"][c]["sentences_per_s"] / table["sentence-transformers"][c]["sentences_per_s"]
             for c in ("1", "32")}
    print(f"\nlmi-serve / sentence-transformers: batch 1 {ratio['1']:.2f}x, 32 clients {ratio['32']:.2f}x")
    print(f"sentence-transformers encode in-process, batches of 32, no HTTP: {offline:.1f} sentences/s")
    os.makedirs(RESULTS, exist_ok=True)
    out = {"host": cpu_line(), "size": args.size, "dtype": args.dtype, "rounds": args.rounds, "runs": runs,
           "medians": table, "ratio": ratio, "st_offline_batch32_per_s": offline}
    with open(os.path.join(RESULTS, "embeddings.json"), "w") as f:
        json.dump(out, f, indent=2)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    names, width = list(table), 0.38
    for k, c in enumerate(("1", "32")):
        ax.bar([i + k * width for i in range(len(names))], [table[n][c]["sentences_per_s"] for n in names], width,
               label=f"{c} client{'s' if c != '1' else ''}")
    ax.set_xticks([i + width / 2 for i in range(len(names))], names)
    ax.set_ylabel("sentences / s")
    ax.set_title(f"embeddings, BERT {args.size} {args.dtype}\n" + "\n".join(textwrap.wrap(cpu_line(), 100)),
                 fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "embeddings.png"), dpi=120)


if __name__ == "__main__":
    sys.exit(main())
