"""Soak test: one real server, a closed loop of many clients sending a seeded mix of requests.

    python -m benchmarks.soak --model-dir models/small --config paged --clients 256 --duration 180 \
        [--dtype bf16] [--kv-cache-memory 256MB] [--set KEY=VALUE ...] [--out benchmarks/results/soak.json] [--seed 0]

Kinds: plain JSON, streaming, stop sequences (both), seeded sampling, and deliberate disconnects (a
stream closed after its first line, a raw-socket request closed after sending); no streaming under
dynamic batching. Every request is answered (by status), malformed (not strict JSON, a 200 without
generated_text or with its stop sequence in it), hung (no answer within REQUEST_TIMEOUT_S), lost
(connection error) or disconnected (on purpose). Also: /ping latency every 0.5 s, RSS of every server
process, KV blocks free after the drain. Exit status 1 on any lost/malformed/hung request, a /ping over
2 s or unanswered, no drain, or KV still held. Writes a table, `--out` JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import socket
import sys
import threading
import time

import requests
import urllib3

from benchmarks.server import BASE, BenchServer
from benchmarks.workloads import prompt_of_length
from container.model_maker import corpus_lines
from handlers.tokenizer import TextTokenizer

# a request is hung when it has no answer this long after it was sent: beyond the server's own
# promise (option.predict_timeout, 240 s by default, after which it answers 424); --request-timeout
REQUEST_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 10.0
PING_EVERY_S, PING_TIMEOUT_S, PING_SLOW_S = 0.5, 10.0, 2.0
DRAIN_TIMEOUT_S = 60.0
STOPS = [" the", "e", ".", " and"]
KINDS = {"plain": 30, "stream": 25, "stop_plain": 10, "stop_stream": 10, "sampled": 10,
         "disconnect_stream": 7, "disconnect_plain": 8}


def strict_json(data: bytes | str):
    """json.loads that rejects NaN/Infinity and bytes that are not UTF-8 (both raise ValueError)."""
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data, parse_constant=reject)


def _read_timeout(exc: Exception) -> bool:
    """requests reports a read timeout mid-stream as a ConnectionError wrapping urllib3's ReadTimeoutError."""
    return not isinstance(exc, requests.ConnectTimeout) and (isinstance(exc, requests.Timeout) or any(
        isinstance(a, urllib3.exceptions.ReadTimeoutError) for a in exc.args))


def check_answer(status: int, body: bytes, stop: str | None) -> tuple[str, str, int]:
    """(outcome, reason, tokens) for a complete non-streaming response."""
    try:
        obj = strict_json(body)
    except ValueError:
        return "malformed", f"{status} body not strict JSON", 0
    if status != 200:
        return ("answered", "", 0) if isinstance(obj, dict) and "code" in obj else ("malformed", f"{status} no code", 0)
    tokens = 0
    for item in obj if isinstance(obj, list) else [obj]:
        if not isinstance(item, dict) or not isinstance(item.get("generated_text"), str):
            return "malformed", "200 without generated_text", 0
        if stop and stop in item["generated_text"]:
            return "malformed", "stop sequence in generated_text", 0
        tokens += item.get("details", {}).get("generated_tokens", 0)
    return "answered", "", tokens


class Client:
    def __init__(self, server: BenchServer, prompts: list[str], seed: int):
        self.server, self.prompts, self.rng = server, prompts, random.Random(seed)
        self.session = requests.Session()
        self.url = server.url + "/invocations"
        kinds = {k: w for k, w in KINDS.items() if server.streams or "stream" not in k}
        self.kinds, self.weights = list(kinds), list(kinds.values())

    def run(self, deadline: float, records: list[dict]) -> None:
        while time.monotonic() < deadline:
            kind = self.rng.choices(self.kinds, self.weights)[0]
            started = time.monotonic()
            outcome, status, reason, tokens = self.one(kind)
            records.append({"kind": kind, "outcome": outcome, "status": status, "reason": reason, "tokens": tokens,
                            "latency": time.monotonic() - started})
            if outcome == "lost":  # a dead server refuses at once: no busy loop
                time.sleep(0.2)
        self.session.close()

    def one(self, kind: str) -> tuple[str, int | None, str, int]:
        rng = self.rng
        params = {"max_new_tokens": rng.randint(1, 64), "details": True}
        stop = rng.choice(STOPS) if kind.startswith("stop") else None
        if stop:
            params["stop_sequences"] = [stop]
        if kind == "sampled":
            params.update(do_sample=True, seed=rng.randrange(2**31), temperature=0.8, top_p=0.9)
        stream = kind.endswith("stream")
        body = {"inputs": rng.choice(self.prompts), "parameters": params, "stream": stream}
        if kind == "disconnect_plain":
            return self.disconnect_plain(body)
        try:
            with self.session.post(self.url, json=body, stream=stream,
                                   timeout=(CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S)) as resp:
                if stream and resp.status_code == 200:
                    return self.read_stream(resp, kind, stop)
                outcome, reason, tokens = check_answer(resp.status_code, resp.content, stop)
                return outcome, resp.status_code, reason, tokens
        except Exception as e:  # noqa: BLE001 - every failure is classified, none is raised
            if _read_timeout(e):
                return "hung", None, "timeout", 0
            return "lost", None, type(e).__name__, 0

    def read_stream(self, resp, kind: str, stop: str | None) -> tuple[str, int | None, str, int]:
        limit = time.monotonic() + REQUEST_TIMEOUT_S
        tokens, final = 0, None
        for line in resp.iter_lines():
            if not line:
                continue
            try:
                obj = strict_json(line)
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                return "malformed", 200, "stream line not a JSON object", tokens
            if kind == "disconnect_stream":
                return "disconnected", 200, "", 0  # leaving the with-block closes the socket
            if "code" in obj and "token" not in obj:
                return "answered", obj["code"], "error line in stream", tokens
            tokens += "token" in obj
            if "generated_text" in obj:
                final = obj["generated_text"]
            if time.monotonic() > limit:
                return "hung", 200, "stream over its budget", tokens
        if not isinstance(final, str):
            return "malformed", 200, "stream ended without generated_text", tokens
        if stop and stop in final:
            return "malformed", 200, "stop sequence in generated_text", tokens
        return "answered", 200, "", tokens

    def disconnect_plain(self, body: dict) -> tuple[str, int | None, str, int]:
        data = json.dumps(body).encode()
        try:
            sock = socket.create_connection(("127.0.0.1", self.server.port), timeout=CONNECT_TIMEOUT_S)
            with sock:
                sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
                time.sleep(self.rng.uniform(0.0, 0.3))
        except OSError as e:
            return "lost", None, type(e).__name__, 0
        return "disconnected", None, "", 0


def ping_loop(url: str, stop: threading.Event, samples: list[dict], t0: float) -> None:
    while not stop.is_set():
        started = time.monotonic()
        sample = {"t": started - t0, "latency": None, "status": None}
        try:
            resp = requests.get(url + "/ping", timeout=PING_TIMEOUT_S)
            sample.update(latency=time.monotonic() - started, status=resp.status_code)
            sample.update({k: v for k, v in resp.json().items() if k in ("running", "waiting")})
        except (requests.RequestException, ValueError):
            pass
        samples.append(sample)
        stop.wait(PING_EVERY_S)


def process_tree(root: int) -> dict[int, str]:
    """pid -> role for `root` and all its descendants, from /proc/*/stat."""
    parent, cmd = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
    roles, todo = {root: "launcher"}, [root]
    while todo:
        pid = todo.pop()
        for child in (p for p, pp in parent.items() if pp == pid):
            c = cmd.get(child, "")
            if "engines.process.serve" in c:
                roles[child] = "engine"
            elif "gunicorn" in c:
                roles[child] = "gunicorn-worker" if roles[pid].startswith("gunicorn") else "gunicorn-master"
            else:
                roles[child] = (c.split() or ["?"])[0].rsplit("/", 1)[-1]
            todo.append(child)
    return roles


def rss_loop(root: int, stop: threading.Event, series: dict[str, list], t0: float, every: float) -> None:
    while not stop.is_set():
        for pid, role in process_tree(root).items():
            try:
                with open(f"/proc/{pid}/status") as f:
                    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            except (OSError, StopIteration):
                continue
            series.setdefault(f"{role}:{pid}", []).append((time.monotonic() - t0, kb / 1024))
        stop.wait(every)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def read_metrics(url: str) -> dict[str, float]:
    out = {}
    for line in requests.get(url + "/metrics", timeout=PING_TIMEOUT_S).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def drain(url: str) -> bool:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            body = requests.get(url + "/ping", timeout=PING_TIMEOUT_S).json()
            if body.get("running") == 0 and body.get("waiting") == 0:
                return True
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.5)
    return False


def plot(series: dict[str, list], pings: list[dict], warm_t: float, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for name, points in sorted(series.items()):
        ax1.plot([t for t, _ in points], [m for _, m in points], label=name)
    ax1.axvline(warm_t, color="grey", linestyle=":", label="warm-up point")
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend(fontsize=7, ncol=2)
    ok = [p for p in pings if p["latency"] is not None]
    ax2.plot([p["t"] for p in ok], [p["latency"] for p in ok], ".", markersize=3, label="/ping latency")
    missed = [p["t"] for p in pings if p["latency"] is None]
    ax2.plot(missed, [PING_TIMEOUT_S] * len(missed), "rx", label="unanswered")
    ax2.axhline(PING_SLOW_S, color="red", linestyle="--", linewidth=0.8)
    ax2.set_ylabel("/ping (s)")
    ax2.set_xlabel("seconds since load start")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def run(args, prompts: list[str]) -> dict:
    """Start the server, load it for args.duration, drain it, read /metrics; raw observations."""
    server = BenchServer(args.config, args.model_dir, args.dtype, args.kv_cache_memory,
                         [f"{args.config}:{s}" for s in args.set])
    raw = {"records": [], "pings": [], "series": {}, "server_log": server.log_path}
    stop = threading.Event()
    try:
        server.wait_ready()
        print(f"server ready ({args.config}, log {server.log_path}); {args.clients} clients, {args.duration:g} s",
              flush=True)
        t0 = time.monotonic()
        deadline = t0 + args.duration
        every = min(5.0, max(1.0, args.duration / 60))
        watchers = [threading.Thread(target=ping_loop, args=(server.url, stop, raw["pings"], t0), daemon=True),
                    threading.Thread(target=rss_loop, args=(server.proc.pid, stop, raw["series"], t0, every),
                                     daemon=True)]
        clients = [threading.Thread(target=Client(server, prompts, args.seed * 100003 + i).run,
                                    args=(deadline, raw["records"]), daemon=True) for i in range(args.clients)]
        for t in watchers + clients:
            t.start()
        for t in clients:  # each stops by itself: no new request after the deadline, each one bounded
            t.join(max(0.0, deadline + REQUEST_TIMEOUT_S + CONNECT_TIMEOUT_S + 5 - time.monotonic()))
        raw["stuck_clients"] = sum(t.is_alive() for t in clients)
        raw["load_s"] = time.monotonic() - t0
        raw["drained"] = drain(server.url)
        try:
            raw["metrics"] = read_metrics(server.url)
        except (requests.RequestException, ValueError) as e:
            raw["metrics"] = {"error": str(e)}
        stop.set()
        for t in watchers:
            t.join(PING_TIMEOUT_S + 1)
    finally:
        stop.set()
        server.stop()
    return raw


def summarize(raw: dict, warm_t: float, prefix_caching: bool) -> dict:
    records, pings, series, metrics = raw["records"], raw["pings"], raw["series"], raw["metrics"]
    outcomes = collections.Counter(r["outcome"] for r in records)
    lat = [s["latency"] for s in pings if s["latency"] is not None]
    kv_total, kv_free = metrics.get("lmi_kv_cache_blocks"), metrics.get("lmi_kv_cache_free_blocks")
    kv_ok = "error" not in metrics and metrics.get("lmi_kv_slots_in_use", 0) == 0 and (
        kv_total is None or kv_free is not None and (kv_free <= kv_total if prefix_caching else kv_free == kv_total))
    last_t = max((pts[-1][0] for pts in series.values()), default=0.0)
    rss = {}
    for name, pts in sorted(series.items()):
        warm, end = next((m for t, m in pts if t >= warm_t), pts[0][1]), pts[-1][1]
        rss[name] = {"warm_mib": warm, "end_mib": end, "growth_pct": 100 * (end - warm) / warm,
                     "exited": pts[-1][0] < last_t - 10}
    s = {"requests": len(records), "outcomes": dict(outcomes), "load_s": raw["load_s"],
         "answered_by_status": dict(collections.Counter(str(r["status"]) for r in records
                                                        if r["outcome"] == "answered")),
         "reasons": dict(collections.Counter(f"{r['outcome']}: {r['reason']}" for r in records
                                             if r["outcome"] in ("malformed", "hung", "lost")).most_common()),
         "by_kind": {k: dict(collections.Counter(r["outcome"] for r in records if r["kind"] == k)) for k in KINDS},
         "tokens": sum(r["tokens"] for r in records),
         "ping": {"probes": len(pings), "p50": pct(lat, 50), "p99": pct(lat, 99), "max": max(lat, default=None),
                  "over_2s": sum(x > PING_SLOW_S for x in lat), "unanswered": len(pings) - len(lat),
                  "non_200": sum(p["status"] not in (None, 200) for p in pings)},
         "drained": raw["drained"], "stuck_clients": raw["stuck_clients"], "prefix_caching": prefix_caching,
         "kv": {"free_blocks": kv_free, "blocks": kv_total, "slots_in_use": metrics.get("lmi_kv_slots_in_use"),
                "ok": kv_ok}, "rss": rss}
    ping = s["ping"]
    failures = [f"{n} {o}" for o in ("lost", "malformed", "hung") if (n := outcomes[o])]
    failures += [f"{ping['over_2s']} /ping over 2 s"] * bool(ping["over_2s"])
    failures += [f"{ping['unanswered']} /ping unanswered"] * bool(ping["unanswered"])
    failures += ["engine did not drain"] * (not raw["drained"])
    failures += [f"{raw['stuck_clients']} clients stuck"] * bool(raw["stuck_clients"])
    failures += [f"KV not released or /metrics unreadable (free blocks {kv_free} of {kv_total}, slots in use "
                 f"{metrics.get('lmi_kv_slots_in_use')})"] * (not kv_ok)
    s["failures"] = failures
    s["warnings"] = [f"{ping['non_200']} /ping answered non-200"] * bool(ping["non_200"])
    s["verdict"] = ("FAIL: " + "; ".join(failures) if failures else "PASS") + (
        f" (warning: {'; '.join(s['warnings'])})" if s["warnings"] else "")
    return s


def print_report(s: dict, args) -> None:
    def fmt(x):
        return "-" if x is None else f"{x:.3f}"

    o, ping, kv = collections.Counter(s["outcomes"]), s["ping"], s["kv"]
    print(f"\nsoak: {args.config}, {args.clients} clients, {s['load_s']:.0f} s of load (duration {args.duration:g} s)")
    print(f"  requests sent      {s['requests']}")
    print(f"  answered           {o['answered']}  by status: {dict(sorted(s['answered_by_status'].items()))}")
    for name in ("malformed", "hung", "lost", "disconnected"):
        print(f"  {name:<18} {o[name]}")
    for reason, n in list(s["reasons"].items())[:8]:
        print(f"    {n:>6}  {reason}")
    print(f"  tokens generated   {s['tokens']}  ({s['tokens'] / s['load_s']:.1f}/s)")
    print(f"  /ping (load+drain) {ping['probes']} probes  p50 {fmt(ping['p50'])} s  p99 {fmt(ping['p99'])} s  "
          f"max {fmt(ping['max'])} s  over 2 s: {ping['over_2s']}  unanswered: {ping['unanswered']}  "
          f"non-200: {ping['non_200']}")
    print(f"  drained            {s['drained']}")
    blocks = "n/a" if kv["blocks"] is None else f"{kv['free_blocks']:g} / {kv['blocks']:g}"
    note = " (prefix caching on: cached blocks may stay)" if s["prefix_caching"] else ""
    print(f"  KV blocks free     {blocks}{note}  slots in use {kv['slots_in_use']}")
    print(f"  {'RSS (MiB)':<26} {'warm-up':>9} {'end':>9} {'growth':>8}")
    for name, r in s["rss"].items():
        print(f"  {name:<26} {r['warm_mib']:>9.1f} {r['end_mib']:>9.1f} {r['growth_pct']:>7.1f}%"
              + ("  (exited)" if r["exited"] else ""))
    print(f"\nverdict: {s['verdict']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--config", default="paged", choices=list(BASE))
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--kv-cache-memory", default="256MB")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra serving.properties")
    p.add_argument("--out", default="benchmarks/results/soak.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S,
                   help="seconds without an answer that make a request hung (default beyond predict_timeout)")
    p.add_argument("--warmup", type=float, help="seconds of load before the RSS baseline (default a third)")
    args = p.parse_args(argv)
    globals()["REQUEST_TIMEOUT_S"] = args.request_timeout
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    prefix_caching = any(s.replace(" ", "").lower() == "option.enable_prefix_caching=true" for s in args.set)

    tok, rng = TextTokenizer(args.model_dir), random.Random(args.seed)
    corpus_ids = tok.encode(" ".join(corpus_lines() * 8))[1:]
    prompts = [prompt_of_length(tok, corpus_ids, rng.randint(4, 200), rng) for _ in range(64)]
    raw = run(args, prompts)
    warm_t = args.warmup if args.warmup is not None else args.duration / 3
    summary = summarize(raw, warm_t, prefix_caching)
    print_report(summary, args)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), **summary, "metrics": raw["metrics"], "ping_samples": raw["pings"],
                   "rss_series": raw["series"], "warm_t": warm_t, "server_log": raw["server_log"]}, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    drawn = plot(raw["series"], raw["pings"], warm_t, png)
    print(f"wrote {args.out}" + (f" and {png}" if drawn else " (no plot: pip install -e '.[bench]' for matplotlib)"))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
