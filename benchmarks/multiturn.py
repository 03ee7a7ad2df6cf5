"""Multi-turn chat against the KV tiers (docs/kv-tiers.md): conversations that resend their whole
history every turn, a working set several times the device KV pool, each a real `lmi serve`.

    python -m benchmarks.multiturn --model-dir models/small --out benchmarks/results/multiturn_small.json

Three parts, each printing a table (the host's CPU flags beside it):

- **turns**: `--conversations` conversations x `--turns` turns on /v1/chat/completions, streamed,
  one request at a time; each conversation opens with a document of its own (`--doc-tokens`, as
  a RAG or agent prompt does), each turn adds a question (`--question-tokens`) and the answer
  (`--answer-tokens`, ignore_eos). Three servers side by side, the same requests in turn to each:
  tiers off, the host tier, the disk tier only. TTFT p50/p90 per turn, generated tok/s over each
  server's busy time, the hit rate of the pool and of each tier, and a plot (TTFT p50 per turn).
- **copies**: two copies behind one front end (maxWorkers=2), conversations pinned to none
  (the front end sends each request to the less loaded copy, ties in turn): the prefix hit rate
  with the shared host tier and without it.
- **restart**: the disk tier across a restart: a fresh server with an empty tier answers a long
  prompt (cold); a fresh server on the tier that run left answers it again. Medians of `--rounds`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import requests

from benchmarks.peers import host
from benchmarks.server import BenchServer
from benchmarks.workloads import prompt_of_length
from benchmarks.plots import pyplot
from container.model_maker import corpus_lines
from handlers.tokenizer import TextTokenizer

BASE = ("engine=Python\noption.rolling_batch=lmi-dist\noption.max_rolling_batch_size=8\n"
        "option.max_rolling_batch_prefill_tokens=2048\noption.enable_prefix_caching=true\n")


def conversations(model_dir: str, n: int, turns: int, doc: int, question: int, seed: int) -> list[dict]:
    """Each conversation: its document (the system message) and its questions, one per turn."""
    tok = TextTokenizer(model_dir)
    corpus_ids = tok.encode(" ".join(corpus_lines() * 8))[1:]
    rng = random.Random(seed)
    return [{"doc": prompt_of_length(tok, corpus_ids, doc, rng),
             "questions": [prompt_of_length(tok, corpus_ids, question, rng) for _ in range(turns)]} for _ in range(n)]


def chat_turn(url: str, messages: list[dict], answer_tokens: int) -> tuple[float, float, str, int]:
    """One streamed chat completion → (TTFT s, latency s, the answer's text, its tokens)."""
    body = {"model": served_name(url), "messages": messages, "max_tokens": answer_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    ttft, text, n = None, [], 0
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=1800) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                ttft = ttft or time.perf_counter() - started
                text.append(delta)
                n += 1
    return ttft or 0.0, time.perf_counter() - started, "".join(text), n


_NAMES: dict[str, str] = {}


def served_name(url: str) -> str:
    if url not in _NAMES:
        _NAMES[url] = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return _NAMES[url]


def engine_metrics(url: str) -> dict[str, float]:
    """/metrics summed over copies: name{labels but copy} → value."""
    out: dict[str, float] = {}
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("lmi_") and not line.startswith("lmi_engine_ready"):
            name, value = line.rsplit(" ", 1)
            if "{" in name:
                base, labels = name.split("{", 1)
                kept = [lab for lab in labels.rstrip("}").split(",") if lab and not lab.startswith("copy=")]
                name = base + ("{" + ",".join(kept) + "}" if kept else "")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def hit_rates(m: dict[str, float]) -> dict[str, float]:
    query = m.get("lmi_prefix_cache_query_tokens_total", 0.0) or 1.0
    out = {"pool (all hits)": m.get("lmi_prefix_cache_hit_tokens_total", 0.0) / query}
    for tier in ("host", "disk"):
        hit = m.get(f'lmi_kv_tier_hit_tokens_total{{tier="{tier}"}}')
        if hit is not None:
            out[tier] = hit / query
            loads = m.get(f'lmi_kv_tier_loaded_blocks_total{{tier="{tier}"}}', 0.0)
            seconds = m.get(f'lmi_kv_tier_load_seconds_total{{tier="{tier}"}}', 0.0)
            out[f"{tier} load ms/block"] = 1000 * seconds / loads if loads else 0.0
    return out


def pct(values: list[float], q: int) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))] if values else float("nan")


def base(args) -> str:
    """Every server's properties: the paged engine, prefix caching, and --extra's lines."""
    return BASE + "".join(line.strip() + "\n" for line in args.extra.split(";") if line.strip())


def run_turns(args, convs: list[dict], scratch: str) -> dict:
    common = base(args)
    pool = f"option.kv_cache_memory={args.pool}\n"
    configs = {"tiers off": common + pool,
               "host tier": common + pool + f"option.kv_offload_memory=2GiB\n"
                                          f"option.kv_offload_memory_dir={scratch}/shm-turns\n",
               "disk tier": common + pool + f"option.kv_offload_dir={scratch}/disk-turns\noption.kv_offload_disk=4GiB\n"}
    servers = {name: BenchServer(name.replace(" ", "_"), args.model_dir, properties=props, streams=True)
               for name, props in configs.items()}
    ttft = {name: [[] for _ in range(args.turns)] for name in configs}
    busy = dict.fromkeys(configs, 0.0)
    tokens = dict.fromkeys(configs, 0)
    history = {name: [[{"role": "system", "content": c["doc"]}] for c in convs] for name in configs}
    try:
        for s in servers.values():
            s.wait_ready()
        for t in range(args.turns):
            for c, conv in enumerate(convs):
                order = list(configs)[(t + c) % 3:] + list(configs)[:(t + c) % 3]  # interleaved
                for name in order:
                    messages = history[name][c] + [{"role": "user", "content": conv["questions"][t]}]
                    first, latency, answer, n = chat_turn(servers[name].url, messages, args.answer_tokens)
                    ttft[name][t].append(first)
                    busy[name] += latency
                    tokens[name] += n
                    history[name][c] = messages + [{"role": "assistant", "content": answer}]
            print(f"turn {t + 1}: " + ", ".join(f"{n} {statistics.median(ttft[n][t]):.3f} s" for n in configs),
                  file=sys.stderr)
        metrics = {name: engine_metrics(s.url) for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    pool_tokens = metrics["tiers off"].get("lmi_kv_cache_blocks", 0) * 16
    return {"ttft": ttft, "throughput": {n: tokens[n] / busy[n] for n in configs},
            "hit_rates": {n: hit_rates(m) for n, m in metrics.items()}, "pool_tokens": pool_tokens,
            "working_set_tokens": metrics["tiers off"].get("lmi_prefix_cache_query_tokens_total", 0) / args.turns}


def run_copies(args, convs: list[dict], scratch: str) -> dict:
    common = base(args)
    pool = f"option.kv_cache_memory={args.pool}\nmaxWorkers=2\n"
    rates = {}
    for name, extra in (("without", ""), ("with shared host tier", f"option.kv_offload_memory=2GiB\n"
                                                                   f"option.kv_offload_memory_dir={scratch}/shm-copies\n")):
        server = BenchServer("copies", args.model_dir, properties=common + pool + extra, streams=True)
        try:
            server.wait_ready()
            from benchmarks.copies import all_copies_ready

            all_copies_ready(server.url, 2)
            history = [[{"role": "system", "content": c["doc"]}] for c in convs]
            for t in range(args.turns):
                for c, conv in enumerate(convs):
                    messages = history[c] + [{"role": "user", "content": conv["questions"][t]}]
                    answer = chat_turn(server.url, messages, args.answer_tokens)[2]
                    history[c] = messages + [{"role": "assistant", "content": answer}]
            rates[name] = hit_rates(engine_metrics(server.url))["pool (all hits)"]
        finally:
            server.stop()
    return rates


def run_restart(args, convs: list[dict], scratch: str) -> dict:
    """TTFT of a long prompt on a fresh server: with an empty disk tier, then on the tier it left."""
    prompt = [{"role": "system", "content": " ".join(c["doc"] for c in convs[:args.restart_docs])},
              {"role": "user", "content": convs[0]["questions"][0]}]
    cold, warm = [], []
    common = base(args)
    for r in range(args.rounds):
        folder = os.path.join(scratch, f"disk-restart-{r}")
        props = common + f"option.kv_cache_memory={args.restart_pool}\noption.kv_offload_dir={folder}\n"
        for runs in (cold, warm):
            server = BenchServer("restart", args.model_dir, properties=props, streams=True)
            try:
                server.wait_ready()
                runs.append(chat_turn(server.url, prompt, 4)[0])
            finally:
                server.stop()
    return {"cold": cold, "warm": warm, "prompt_tokens": len(TextTokenizer(args.model_dir).encode(
        prompt[0]["content"]))}


def print_tables(result: dict, turns: int) -> None:
    h = result["host"]
    print(f"\nhost: {h['cpu']}, {h['cores']} cores, flags: {h['flags']}")
    if "turns" in result:
        print_turns(result["turns"], turns)
    if "copies" in result:
        c = result["copies"]
        print("\ntwo copies, prefix hit rate: " + ", ".join(f"{k} {v:.3f}" for k, v in c.items()))
    if "restart" in result:
        r = result["restart"]
        cold, warm = statistics.median(r["cold"]), statistics.median(r["warm"])
        print(f"\nrestart, a {r['prompt_tokens']}-token prompt: TTFT cold {cold:.3f} s, after a restart on the disk "
              f"tier {warm:.3f} s ({warm / cold:.2f} of cold)")


def print_turns(t: dict, turns: int) -> None:
    names = list(t["ttft"])
    print(f"device pool {t['pool_tokens']:.0f} tokens; working set ~{t['working_set_tokens']:.0f} prompt tokens a "
          f"turn, {t['working_set_tokens'] / max(t['pool_tokens'], 1):.1f}x the pool")
    print("\nTTFT per turn, p50 / p90 seconds (ratio: tiers off p50 / this p50)")
    print(f"{'turn':>4} " + "".join(f"| {n:>26} " for n in names))
    for i in range(turns):
        cells = []
        for n in names:
            p50, p90 = pct(t["ttft"][n][i], 50), pct(t["ttft"][n][i], 90)
            ratio = pct(t["ttft"]["tiers off"][i], 50) / p50 if p50 else float("nan")
            cells.append(f"| {p50:7.3f} / {p90:7.3f} ({ratio:4.1f}x) ")
        print(f"{i + 1:>4} " + "".join(cells))
    print("\n" + "".join(f"{n}: {v:.1f} tok/s   " for n, v in t["throughput"].items()))
    for n, rates in t["hit_rates"].items():
        print(f"{n:>10}: " + ", ".join(f"{k} {v:.3f}" for k, v in rates.items()))


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, per_turn in result["turns"]["ttft"].items():
        ax.plot(range(1, len(per_turn) + 1), [pct(v, 50) for v in per_turn], marker="o", label=name)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title(f"multi-turn chat, {result['host']['flags']}", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multiturn")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--pool", default="16MiB", help="option.kv_cache_memory: the device pool")
    p.add_argument("--rounds", type=int, default=3, help="restarts measured")
    p.add_argument("--restart-docs", type=int, default=3, help="documents in the restart's long prompt")
    p.add_argument("--restart-pool", default="64MiB", help="option.kv_cache_memory of the restart part")
    p.add_argument("--parts", default="turns,copies,restart")
    p.add_argument("--extra", default="", help="more properties for every server, ';'-separated (a GPU: "
                                               "option.gpu_memory_utilization sizes the pool, not --pool)")
    p.add_argument("--out", default="benchmarks/results/multiturn.json")
    args = p.parse_args(argv)
    convs = conversations(args.model_dir, args.conversations, args.turns, args.doc_tokens, args.question_tokens, 0)
    scratch = tempfile.mkdtemp(prefix="multiturn-")
    result: dict = {"host": host(), "args": vars(args)}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    parts = {"turns": lambda: run_turns(args, convs, scratch), "copies": lambda: run_copies(args, convs[:3], scratch),
             "restart": lambda: run_restart(args, convs, scratch)}
    try:
        for name in args.parts.split(","):
            result[name] = parts[name]()
            with open(args.out, "w") as f:  # each part as it ends
                json.dump(result, f, indent=1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_tables(result, args.turns)
    if "turns" in result:
        plot(result, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
