"""Scheduling against service-level objectives (docs/scheduling.md): priorities, a TPOT target and
deadlines, each measured on real `lmi serve` processes with streamed requests (jsonlines).

    python -m benchmarks.slo --model-dir models/small           # ~9.5 min: results/slo_small.json + .png
    python -m benchmarks.slo --model-dir models/small --quick   # ~2.5 min, one short round of each part

Three parts, each printing a table (the host's CPU flags above them); the JSON is written as each
part ends, a part that cannot run (a server that refuses its keys) says why and the others go on:

- **priority**: the saturated throughput of the workload first (`--capacity-clients` clients in
  a closed loop on the default config: generated tokens/s over the last 70% of the run / tokens
  per request). Then Poisson arrivals at `--overload` x that rate for `--window` s, open loop
  (each request sent on schedule whatever the replies), `--high-share` of them priority 0 and the
  rest priority 1, against the default server (fcfs; it gets them without `priority` if it
  refuses the field, as a 400) and one with `option.scheduling_policy=priority`: both up for the
  whole part, rounds interleaved, medians. After the window `--drain` s without arrivals, then
  every open connection is closed (the server aborts those requests). A request that never got its
  first token counts at the time it waited: a percentile that lands on one is a lower bound (≥).
- **tpot**: one client's time per output token first, then `option.target_tpot_ms` = T =
  `--tpot-factor` x that, and `--tpot-clients` clients in a closed loop for `--tpot-seconds` on
  that server and on the default one: per-request TPOT p90 and inter-token p90 against T.
- **deadlines**: the overload of the priority part on the default config, every request with
  `parameters.timeout` (or the X-Request-Timeout header, `--deadline-via`): how many are shed
  (503), how soon the 503 comes (send → status line) and whether a served one started late.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import requests

from benchmarks.peers import host
from benchmarks.server import BenchServer
from benchmarks.workloads import prompt_of_length
from benchmarks.plots import pyplot
from container.model_maker import corpus_lines
from handlers.tokenizer import TextTokenizer

PROPERTIES = ("engine=Python\noption.rolling_batch=lmi-dist\noption.max_rolling_batch_size={seqs}\n"
              "option.max_rolling_batch_prefill_tokens={prefill}\noption.kv_cache_memory={kv}\n"
              "http_threads={threads}\njob_queue_size=4096\n")
QUICK = {"rounds": 1, "capacity_seconds": 10.0, "window": 12.0, "drain": 3.0, "tpot_seconds": 10.0,
         "deadline_window": 10.0}


@dataclass
class Shot:
    """One request as the client saw it; times in seconds."""

    cls: str  # "high" | "low" | "all"
    timeout: float | None = None  # the deadline it carried
    sent: float = 0.0  # after the run began
    status: int = 0  # 0: no status line (closed by us, or the connection failed)
    answered: float | None = None  # send → status line
    times: list[float] = field(default_factory=list)  # send → each token line
    finished: bool = False  # the line with generated_text arrived
    retry_after: str | None = None
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.times[0] if self.times else None

    @property
    def is_refused(self) -> bool:
        return self.status not in (0, 200)


class Client:
    """Streamed /invocations requests, each on a connection of its own that `abort` can close."""

    def __init__(self, url: str):
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port
        self.t0 = time.perf_counter()
        self.closed = False
        self._open: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()

    def send(self, body: dict, shot: Shot, headers: dict | None = None) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=3600)
        with self._lock:
            if self.closed:
                shot.error = "not sent"
                return
            self._open.add(conn)
        started = time.perf_counter()
        shot.sent = started - self.t0
        try:
            conn.request("POST", "/invocations", json.dumps(body),
                         {"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            shot.answered, shot.status = time.perf_counter() - started, resp.status
            if resp.status != 200:
                shot.retry_after = resp.getheader("Retry-After")
                shot.error = resp.read()[:300].decode(errors="replace")
                return
            for line in iter(resp.readline, b""):
                if not line.strip():
                    continue
                obj = json.loads(line)
                if "token" not in obj:  # an error line after the first token
                    shot.error = str(obj.get("error", obj))[:300]
                    return
                if obj["token"] is not None:
                    shot.times.append(time.perf_counter() - started)
                shot.finished = shot.finished or "generated_text" in obj
        except (OSError, http.client.HTTPException, ValueError) as exc:
            shot.error = shot.error or f"{type(exc).__name__}: {exc}"[:300]
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def abort(self, threads: list[threading.Thread]) -> float:
        """Close every open connection (again, until every thread has ended) → when, after t0."""
        with self._lock:
            self.closed = True
        at = time.perf_counter() - self.t0
        while any(t.is_alive() for t in threads):
            with self._lock:
                conns = list(self._open)
            for conn in conns:
                if conn.sock is not None:
                    try:
                        conn.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            for t in threads:
                t.join(0.05)
        return at


def open_loop(url: str, plan: list[tuple[float, Shot, dict, dict]], window: float, drain: float) -> float:
    """Send each request at its time (s after start) until `window`; close what is open `drain` s
    later (sooner when every request has ended) → the time of the close."""
    client = Client(url)
    threads = []
    for at, shot, body, headers in plan:
        if at >= window:
            break
        time.sleep(max(0.0, client.t0 + at - time.perf_counter()))
        threads.append(threading.Thread(target=client.send, args=(body, shot, headers), daemon=True))
        threads[-1].start()
    end = client.t0 + window + drain
    for t in threads:
        t.join(max(0.0, end - time.perf_counter()))
    return client.abort(threads)


def closed_loop(url: str, bodies: list[dict], clients: int, seconds: float) -> tuple[list[Shot], float]:
    """`clients` clients, each sending its next request when the last ends, for `seconds` s; then
    every open connection is closed → (the requests, the time of the close)."""
    client = Client(url)
    shots: list[Shot] = []

    def run(i: int) -> None:
        while time.perf_counter() - client.t0 < seconds and not client.closed:
            shot = Shot("all")
            shots.append(shot)
            client.send(bodies[i % len(bodies)], shot)
            i += clients

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, client.t0 + seconds - time.perf_counter()))
    return shots, client.abort(threads)


# -- statistics ------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))] if values else float("nan")


def ttft_pct(shots: list[Shot], q: float, closed_at: float) -> tuple[float, bool]:
    """The TTFT percentile of the requests not refused, one that never started counting the time it
    waited → (value, whether it is only a lower bound)."""
    waited = [s.ttft for s in shots if s.ttft is not None]
    censored = [closed_at - s.sent for s in shots if s.ttft is None and not s.is_refused and s.error != "not sent"]
    value = pct(waited + censored, q)
    return value, bool(censored) and value >= min(censored)


def tokens_between(shots: list[Shot], start: float, end: float) -> int:
    return sum(start <= s.sent + t < end for s in shots for t in s.times)


def tpot(shot: Shot) -> float:
    return (shot.times[-1] - shot.times[0]) / (len(shot.times) - 1)


def medians(runs: list[dict]) -> dict:
    """Numbers: the median over rounds; flags (lower bounds): set when any round's is."""
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, bool):
            out[key] = any(r[key] for r in runs)
        elif isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in runs)
    return out


# -- servers and requests --------------------------------------------------------------------------
def properties(args, extra: str = "") -> str:
    return PROPERTIES.format(seqs=args.max_seqs, prefill=args.prefill_tokens, kv=args.kv_cache_memory,
                             threads=args.http_threads) + extra + \
        "".join(line.strip() + "\n" for line in args.extra.split(";") if line.strip())


def start(name: str, args, props: str) -> BenchServer:
    """A ready server, or a RuntimeError that quotes the end of its log (a key it refuses, ...)."""
    server = BenchServer(name, args.model_dir, properties=props, streams=True)
    try:
        server.wait_ready()
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        with open(server.log_path) as f:
            tail = "".join(f.readlines()[-6:])
        raise RuntimeError(f"{exc}\n{tail}") from None
    return server


def wait_idle(url: str, timeout: float = 90) -> None:
    """Until /ping shows nothing waiting or running twice in a row (its snapshot may be 1 s old)."""
    deadline, idle = time.monotonic() + timeout, 0
    while time.monotonic() < deadline and idle < 2:
        try:
            body = requests.get(url + "/ping", timeout=5).json()
            idle = idle + 1 if not body.get("waiting") and not body.get("running") else 0
        except (requests.RequestException, ValueError):
            idle = 0
        time.sleep(0.5)
    if idle < 2:
        print(f"  {url} still busy after {timeout} s", file=sys.stderr)


def prompts(args, count: int = 64) -> list[str]:
    tok = TextTokenizer(args.model_dir)
    corpus_ids = tok.encode(" ".join(corpus_lines() * 8))[1:]
    rng = random.Random(args.seed)
    return [prompt_of_length(tok, corpus_ids, args.prompt_tokens, rng) for _ in range(count)]


def body(prompt: str, new_tokens: int, **params) -> dict:
    return {"inputs": prompt, "stream": True,
            "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True, **params}}


def arrivals(rate: float, window: float, seed: str) -> list[float]:
    rng, at, times = random.Random(f"arrivals {seed}"), 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at >= window:
            return times
        times.append(at)


def accepts(url: str, params: dict) -> tuple[bool, str]:
    """Whether a one-token request with these parameters is served (not a 4xx) → (ok, the reply)."""
    resp = requests.post(url + "/invocations", json={"inputs": "Hello", "parameters": {"max_new_tokens": 1, **params}},
                         timeout=120)
    return resp.status_code < 400, f"{resp.status_code} {resp.text[:200]}"


def cpu_line() -> str:
    info = host()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    kept = sorted({f for f in flags if f == "avx2" or f.startswith(("avx512", "amx"))})
    return f"host: {info['cpu']}, {info['cores']} cores; CPU flags: {' '.join(kept) or 'no avx2/avx512/amx'}"


# -- part 1: priorities ----------------------------------------------------------------------------
def measure_capacity(args, server: BenchServer, texts: list[str]) -> dict:
    """Saturated requests/s: generated tokens/s over the last 70% of a closed loop / tokens a request."""
    bodies = [body(t, args.new_tokens) for t in texts]
    shots, closed = closed_loop(server.url, bodies, args.capacity_clients, args.capacity_seconds)
    wait_idle(server.url)
    warm = 0.3 * closed
    tokens_per_s = tokens_between(shots, warm, closed) / (closed - warm)
    refused = [s for s in shots if s.is_refused]
    if not tokens_per_s:
        raise RuntimeError(f"no token in the capacity run ({len(refused)} refused: "
                           f"{refused[0].error if refused else '-'})")
    return {"requests_per_s": tokens_per_s / args.new_tokens, "tokens_per_s": tokens_per_s,
            "clients": args.capacity_clients, "seconds": closed}


def priority_plan(args, texts: list[str], rate: float, rnd: int, send_priority: bool) -> list:
    """The same arrivals and classes for every policy of a round; priority 0 (high) or 1 (low)."""
    rng = random.Random(f"classes {args.seed} {rnd}")  # not the arrivals' draws: those would make classes
    plan = []                                          # follow the gaps
    for i, at in enumerate(arrivals(rate, args.window, f"priority {args.seed} {rnd}")):
        high = rng.random() < args.high_share
        params = {"priority": 0 if high else 1} if send_priority else {}
        plan.append((at, Shot("high" if high else "low"), body(texts[i % len(texts)], args.new_tokens, **params), {}))
    return plan


def overload_summary(shots: list[Shot], window: float, closed_at: float) -> dict:
    row: dict = {"sent": len(shots), "sent_high": sum(s.cls == "high" for s in shots)}
    for cls in ("high", "low"):
        for q in (50, 90):
            row[f"{cls}_ttft_p{q}"], row[f"{cls}_ttft_p{q}_lower_bound"] = \
                ttft_pct([s for s in shots if s.cls == cls], q, closed_at)
    done = [s.sent + s.times[-1] for s in shots if s.finished]
    row.update(done_in_window=sum(t < window for t in done), done_in_drain=sum(t >= window for t in done),
               unfinished=sum(bool(s.times) and not s.finished for s in shots),
               never_started=sum(not s.times and not s.is_refused for s in shots),
               refused=sum(s.is_refused for s in shots))
    row["requests_per_s"] = row["done_in_window"] / window
    row["tokens_per_s"] = tokens_between(shots, 0.0, window) / window
    return row


def run_priority(args, default: BenchServer, capacity: dict, texts: list[str]) -> dict:
    servers = {"fcfs": default}
    rate = args.overload * capacity["requests_per_s"]
    part: dict = {"capacity": capacity, "rate": rate, "rounds": {"fcfs": [], "priority": []},
                  "high_ttft": {"fcfs": [], "priority": []}, "high_unstarted": {"fcfs": 0, "priority": 0}}
    try:
        servers["priority"] = start("slo-priority", args, properties(args, "option.scheduling_policy=priority\n"))
        ok, reply = accepts(servers["priority"].url, {"priority": 1})
        if not ok:
            raise RuntimeError(f"the priority server refuses parameters.priority: {reply}")
        part["fcfs_takes_priority"], reply = accepts(default.url, {"priority": 1})
        if not part["fcfs_takes_priority"]:
            print(f"  fcfs refuses parameters.priority ({reply}): sent without it there", file=sys.stderr)
        for rnd in range(args.rounds):
            for policy in (("fcfs", "priority") if rnd % 2 == 0 else ("priority", "fcfs")):
                send = policy == "priority" or part["fcfs_takes_priority"]
                plan = priority_plan(args, texts, rate, rnd, send)
                closed = open_loop(servers[policy].url, plan, args.window, args.drain)
                wait_idle(servers[policy].url)
                shots = [shot for _, shot, _, _ in plan if shot.error != "not sent"]
                row = overload_summary(shots, args.window, closed)
                part["rounds"][policy].append(row)
                part["high_ttft"][policy] += [s.ttft for s in shots if s.cls == "high" and s.ttft is not None]
                part["high_unstarted"][policy] += sum(s.cls == "high" and s.ttft is None for s in shots)
                print(f"  round {rnd} {policy:<8}: sent {row['sent']}, high TTFT p90 {row['high_ttft_p90']:.2f} s, "
                      f"done in window {row['done_in_window']}, refused {row['refused']}", file=sys.stderr)
                report_refusals(shots)
    finally:
        if "priority" in servers:
            servers["priority"].stop()
    part["medians"] = {p: medians(rows) for p, rows in part["rounds"].items()}
    return part


def report_refusals(shots: list[Shot]) -> None:
    refused = [s for s in shots if s.is_refused or (s.error and s.status == 200)]
    if refused:
        print(f"    {len(refused)} refused or failed, e.g. {refused[0].status} {refused[0].error}", file=sys.stderr)


# -- part 2: a TPOT target -------------------------------------------------------------------------
def single_client_tpot(url: str, texts: list[str], new_tokens: int, count: int = 3) -> float:
    """The median TPOT (s) of `count` requests sent one at a time: the decode step at batch 1."""
    values = []
    for text in texts[:count]:
        shot = Shot("all")
        Client(url).send(body(text, new_tokens), shot)
        if not shot.finished or len(shot.times) < 2:
            raise RuntimeError(f"a single request failed: {shot.status} {shot.error}")
        values.append(tpot(shot))
    return statistics.median(values)


def tpot_summary(shots: list[Shot], closed_at: float) -> dict:
    done = [s for s in shots if s.finished and len(s.times) > 1]
    per_request = [tpot(s) for s in done]
    gaps = [b - a for s in shots for a, b in zip(s.times, s.times[1:])]
    return {"done": len(done), "tpot_p50_ms": 1000 * pct(per_request, 50), "tpot_p90_ms": 1000 * pct(per_request, 90),
            "itl_p90_ms": 1000 * pct(gaps, 90), "ttft_p90_s": pct([s.ttft for s in done], 90),
            "tokens_per_s": tokens_between(shots, 0.0, closed_at) / closed_at,
            "refused": sum(s.is_refused for s in shots)}


def run_tpot(args, default: BenchServer, texts: list[str]) -> dict:
    single = single_client_tpot(default.url, texts, args.tpot_new_tokens)
    target = args.target_tpot_ms or max(1, round(args.tpot_factor * 1000 * single))
    print(f"  one client: {1000 * single:.1f} ms/token -> target {target} ms", file=sys.stderr)
    names = ("no target", f"target {target} ms")
    part: dict = {"single_client_tpot_ms": 1000 * single, "target_ms": target,
                  "rounds": {n: [] for n in names}, "tpot_ms": {n: [] for n in names}}
    servers = {names[0]: default}
    try:
        servers[names[1]] = start("slo-tpot", args, properties(args, f"option.target_tpot_ms={target}\n"))
        bodies = [body(t, args.tpot_new_tokens) for t in texts]
        for rnd in range(args.rounds):
            for name in (names if rnd % 2 == 0 else names[::-1]):
                shots, closed = closed_loop(servers[name].url, bodies, args.tpot_clients, args.tpot_seconds)
                wait_idle(servers[name].url)
                row = tpot_summary(shots, closed)
                part["rounds"][name].append(row)
                part["tpot_ms"][name] += [1000 * tpot(s) for s in shots if s.finished and len(s.times) > 1]
                print(f"  round {rnd} {name}: TPOT p90 {row['tpot_p90_ms']:.1f} ms, {row['tokens_per_s']:.1f} tok/s",
                      file=sys.stderr)
                report_refusals(shots)
    finally:
        if names[1] in servers:
            servers[names[1]].stop()
    part["medians"] = {n: medians(rows) for n, rows in part["rounds"].items()}
    return part


# -- part 3: deadlines -----------------------------------------------------------------------------
def deadline_plan(args, texts: list[str], rate: float, rnd: int) -> list:
    plan = []
    for i, at in enumerate(arrivals(rate, args.deadline_window, f"deadlines {args.seed} {rnd}")):
        shot = Shot("all", timeout=args.timeout)
        if args.deadline_via == "header":
            headers = {"X-Request-Timeout": str(args.timeout)}
            plan.append((at, shot, body(texts[i % len(texts)], args.new_tokens), headers))
        else:
            plan.append((at, shot, body(texts[i % len(texts)], args.new_tokens, timeout=args.timeout), {}))
    return plan


def deadline_summary(shots: list[Shot], window: float) -> dict:
    served = [s for s in shots if s.status == 200]
    shed = [s for s in shots if s.status == 503]
    answered_ms = [1000 * s.answered for s in shed]
    late = [s for s in served if s.ttft is not None and s.ttft > s.timeout]
    n = max(len(shots), 1)
    return {"sent": len(shots), "served": len(served), "shed": len(shed), "shed_fraction": len(shed) / n,
            "other_refusals": sum(s.is_refused and s.status != 503 for s in shots),
            "unanswered": sum(s.status == 0 for s in shots),
            "shed_p50_ms": pct(answered_ms, 50), "shed_p90_ms": pct(answered_ms, 90),
            "shed_max_ms": max(answered_ms, default=float("nan")),
            "shed_within_50ms": sum(ms <= 50 for ms in answered_ms) / max(len(shed), 1),
            "retry_after": sum(s.retry_after is not None for s in shed) / max(len(shed), 1),
            "late": len(late), "late_fraction": len(late) / max(len(served), 1),
            "served_ttft_p90": pct([s.ttft for s in served if s.ttft is not None], 90),
            "goodput_per_s": sum(s.finished and s.sent + s.times[-1] < window for s in served) / window}


def run_deadlines(args, default: BenchServer, capacity: dict, texts: list[str]) -> dict:
    rate = args.overload * capacity["requests_per_s"]
    part: dict = {"rate": rate, "timeout": args.timeout, "via": args.deadline_via, "rounds": [],
                  "shed_ms": [], "served_ttft": []}
    for rnd in range(args.rounds):
        plan = deadline_plan(args, texts, rate, rnd)
        open_loop(default.url, plan, args.deadline_window, args.drain)
        wait_idle(default.url)
        shots = [shot for _, shot, _, _ in plan if shot.error != "not sent"]
        row = deadline_summary(shots, args.deadline_window)
        part["rounds"].append(row)
        part["shed_ms"] += [1000 * s.answered for s in shots if s.status == 503]
        part["served_ttft"] += [s.ttft for s in shots if s.status == 200 and s.ttft is not None]
        print(f"  round {rnd}: sent {row['sent']}, shed {row['shed']}, late {row['late']}", file=sys.stderr)
        report_refusals([s for s in shots if s.status != 503])
    part["medians"] = medians(part["rounds"])
    return part


# -- report ----------------------------------------------------------------------------------------
def table(rows: dict[str, dict], columns: list[tuple[str, str, str]]) -> None:
    """One line per row; a value that is only a lower bound (key + '_lower_bound') is marked ≥."""
    width = max(len(name) for name in rows) + 1
    print(f"{'':<{width}}" + "".join(f"{head:>15}" for _, head, _ in columns))
    for name, row in rows.items():
        cells = [("≥" if row.get(key + "_lower_bound") else "") + format(row.get(key, float("nan")), fmt)
                 for key, _, fmt in columns]
        print(f"{name:<{width}}" + "".join(f"{cell:>15}" for cell in cells))


def print_priority(part: dict, args) -> None:
    cap, med = part["capacity"], part["medians"]
    print(f"\n## priority: capacity {cap['requests_per_s']:.2f} req/s ({cap['tokens_per_s']:.0f} tok/s, "
          f"{args.prompt_tokens} in / {args.new_tokens} out, {cap['clients']} clients); arrivals "
          f"{part['rate']:.2f} req/s ({args.overload}x) for {args.window:.0f} s + {args.drain:.0f} s drain, "
          f"{args.high_share:.0%} priority 0; medians of {args.rounds} round(s)")
    table(med, [("sent", "sent", ".0f"), ("high_ttft_p50", "high TTFT p50", ".3f"),
                ("high_ttft_p90", "high TTFT p90", ".3f"), ("low_ttft_p90", "low TTFT p90", ".3f"),
                ("done_in_window", "done in window", ".0f"), ("done_in_drain", "in drain", ".0f"),
                ("unfinished", "unfinished", ".0f"), ("never_started", "never started", ".0f"),
                ("refused", "refused", ".0f"), ("requests_per_s", "req/s", ".2f"), ("tokens_per_s", "tok/s", ".1f")])
    fcfs, prio = med["fcfs"]["high_ttft_p90"], med["priority"]["high_ttft_p90"]
    bound = "≥" if med["fcfs"]["high_ttft_p90_lower_bound"] else ""
    ratio = fcfs / prio if prio > 0 else float("nan")
    verdict = "met" if ratio >= 5 else "NOT met" if ratio == ratio else "not measured"
    print(f"high-priority TTFT p90: fcfs {bound}{fcfs:.3f} s / priority {prio:.3f} s = {bound}{ratio:.1f}x lower "
          f"under priority (goal ≥ 5x: {verdict}); TTFT in seconds, ≥: a lower bound (a request that never "
          f"started counts the time it waited)")


def print_tpot(part: dict, args) -> None:
    target = part["target_ms"]
    print(f"\n## tpot: one client {part['single_client_tpot_ms']:.1f} ms/token -> option.target_tpot_ms={target}; "
          f"{args.tpot_clients} clients, closed loop, {args.prompt_tokens} in / {args.tpot_new_tokens} out, "
          f"{args.tpot_seconds:.0f} s; medians of {args.rounds} round(s)")
    rows = {name: dict(row, ratio=row["tpot_p90_ms"] / target) for name, row in part["medians"].items()}
    table(rows, [("done", "done", ".0f"), ("tpot_p50_ms", "TPOT p50 ms", ".1f"), ("tpot_p90_ms", "TPOT p90 ms", ".1f"),
                 ("ratio", "p90 / T", ".2f"), ("itl_p90_ms", "ITL p90 ms", ".1f"), ("ttft_p90_s", "TTFT p90 s", ".2f"),
                 ("tokens_per_s", "tok/s", ".1f"), ("refused", "refused", ".0f")])
    got = part["medians"][f"target {target} ms"]["tpot_p90_ms"]
    base = part["medians"]["no target"]["tokens_per_s"]
    verdict = "met" if got <= 1.1 * target else "NOT met" if got == got else "not measured"
    print(f"TPOT p90 {got:.1f} ms vs T {target} ms: {got / target:.2f} T (goal ≤ 1.10 T: {verdict}); throughput "
          f"{part['medians'][f'target {target} ms']['tokens_per_s'] / base:.2f}x of no target")


def print_deadlines(part: dict, args) -> None:
    m = part["medians"]
    print(f"\n## deadlines: timeout {part['timeout']} s on every request ({part['via']}), arrivals "
          f"{part['rate']:.2f} req/s ({args.overload}x) for {args.deadline_window:.0f} s; "
          f"medians of {args.rounds} round(s)")
    table({"default": m}, [("sent", "sent", ".0f"), ("served", "served", ".0f"), ("shed", "shed 503", ".0f"),
                           ("other_refusals", "other refused", ".0f"), ("unanswered", "unanswered", ".0f"),
                           ("shed_p50_ms", "503 p50 ms", ".1f"), ("shed_p90_ms", "503 p90 ms", ".1f"),
                           ("shed_max_ms", "503 max ms", ".1f"), ("late", "late served", ".0f"),
                           ("served_ttft_p90", "TTFT p90 s", ".3f"), ("goodput_per_s", "goodput/s", ".2f")])
    print(f"shed {m['shed_fraction']:.1%} of requests; {m['shed_within_50ms']:.1%} of 503s within 50 ms "
          f"(goal: all); {m['retry_after']:.0%} with Retry-After; late among served {m['late_fraction']:.1%} (goal 0)")


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    if "medians" in result.get("priority", {}):
        part = result["priority"]
        for policy, values in part["high_ttft"].items():
            n = len(values) + part["high_unstarted"][policy]
            axes[0].step(sorted(values), [(i + 1) / n for i in range(len(values))], where="post", label=policy)
        axes[0].set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of high-priority requests",
                    title="high-priority TTFT at overload (never started: above the curve)")
        axes[0].legend()
    if "medians" in result.get("tpot", {}):
        part = result["tpot"]
        for name, values in part["tpot_ms"].items():
            axes[1].step(sorted(values), [(i + 1) / len(values) for i in range(len(values))], where="post", label=name)
        for x, style in ((part["target_ms"], "--"), (1.1 * part["target_ms"], ":")):
            axes[1].axvline(x, color="gray", linestyle=style)
        axes[1].set(xlabel="per-request TPOT (ms); lines: T, 1.1 T", ylabel="fraction of requests",
                    title="TPOT with and without option.target_tpot_ms")
        axes[1].legend()
    if "medians" in result.get("deadlines", {}):
        part = result["deadlines"]
        for name, values in (("time to 503 (shed)", part["shed_ms"]),
                             ("TTFT (served)", [1000 * v for v in part["served_ttft"]])):
            if values:
                axes[2].step(sorted(values), [(i + 1) / len(values) for i in range(len(values))], where="post",
                             label=name)
        for x, style in ((50, ":"), (1000 * part["timeout"], "--")):
            axes[2].axvline(x, color="gray", linestyle=style)
        axes[2].set(xscale="log", xlabel="ms after send; lines: 50 ms, the timeout", ylabel="fraction",
                    title="deadlines at overload")
        axes[2].legend()
    for ax in axes:
        ax.set_ylim(0, 1.02)
    fig.suptitle(f"lmi-serve scheduling SLOs, {result['args']['model_dir']}; {result['host_line']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- main ------------------------------------------------------------------------------------------
def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.slo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--parts", default="priority,tpot,deadlines")
    p.add_argument("--quick", action="store_true", help="one short round of each part: " +
                   ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32, help="per request, priority and deadline parts")
    p.add_argument("--capacity-clients", type=int, default=64)
    p.add_argument("--capacity-seconds", type=float, default=30.0)
    p.add_argument("--overload", type=float, default=1.5, help="arrival rate / measured capacity")
    p.add_argument("--window", type=float, default=30.0, help="seconds of arrivals, priority part")
    p.add_argument("--drain", type=float, default=5.0, help="seconds after the window before closing the rest")
    p.add_argument("--high-share", type=float, default=0.2)
    p.add_argument("--tpot-factor", type=float, default=1.75, help="T = this x one client's TPOT")
    p.add_argument("--target-tpot-ms", type=int, help="T itself instead")
    p.add_argument("--tpot-clients", type=int, default=32)
    p.add_argument("--tpot-seconds", type=float, default=25.0)
    p.add_argument("--tpot-new-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=1.5, help="seconds, every request of the deadline part")
    p.add_argument("--deadline-via", choices=("parameter", "header"), default="parameter")
    p.add_argument("--deadline-window", type=float, default=20.0)
    p.add_argument("--max-seqs", type=int, default=32, help="option.max_rolling_batch_size")
    p.add_argument("--prefill-tokens", type=int, default=1024, help="option.max_rolling_batch_prefill_tokens")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--http-threads", type=int, default=256, help="per HTTP worker: more than the requests in flight")
    p.add_argument("--extra", default="", help="more properties for every server, ';'-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="default benchmarks/results/slo_<model dir's name>[_quick].json")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.out is None:
        name = os.path.basename(os.path.normpath(args.model_dir))
        args.out = f"benchmarks/results/slo_{name}{'_quick' * args.quick}.json"
    return args


def run_parts(args, result: dict, texts: list[str]) -> None:
    """Each part in turn, saved as it ends; a part that fails records why and the next one runs."""
    parts = args.parts.split(",")
    default = start("slo-default", args, properties(args))
    try:
        capacity: dict | Exception = {}
        if {"priority", "deadlines"} & set(parts):
            try:
                capacity = measure_capacity(args, default, texts)
                print(f"capacity: {capacity['requests_per_s']:.2f} req/s", file=sys.stderr)
            except Exception as exc:  # reported by the parts that need it
                capacity = exc
        runners = {"priority": lambda: run_priority(args, default, capacity, texts),
                   "tpot": lambda: run_tpot(args, default, texts),
                   "deadlines": lambda: run_deadlines(args, default, capacity, texts)}
        for name in parts:
            print(f"{name} ...", file=sys.stderr)
            load = os.getloadavg()[0]
            try:
                if isinstance(capacity, Exception) and name != "tpot":
                    raise RuntimeError(f"capacity not measured: {capacity}")
                result[name] = runners[name]()
            except Exception as exc:  # the part says why; the others still run
                result[name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"  {name} failed: {exc}", file=sys.stderr)
            result[name]["load_average"] = [load, os.getloadavg()[0]]  # other jobs on the host skew the figures
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        default.stop()


def main(argv=None) -> int:
    args = parse(argv)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    result: dict = {"host": host(), "host_line": cpu_line(), "args": vars(args)}
    run_parts(args, result, prompts(args))
    print(f"\n{result['host_line']}")
    printers = {"priority": print_priority, "tpot": print_tpot, "deadlines": print_deadlines}
    for name in args.parts.split(","):
        if "error" in result[name]:
            print(f"\n## {name}: not measured: {result[name]['error']}")
        else:
            printers[name](result[name], args)
        before, after = result[name]["load_average"]
        print(f"(load average during the part: {before:.1f} at its start, {after:.1f} at its end, "
              f"{os.cpu_count()} cores)")
    png = os.path.splitext(args.out)[0] + ".png"
    plot(result, png)
    print(f"\nwrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
