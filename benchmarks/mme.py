"""Several models behind one server (SageMaker's multi-model mode, container/registry.py), measured on
a real `lmi serve` process: what a cold model costs its first request, and what evictions cost a
skewed mix of requests.

    python -m benchmarks.mme                  # ~4.5 min on 2 cores: results/mme.json + .png
    python -m benchmarks.mme --rounds 1 --requests 30 --cold-size tiny   # ~1.5 min, a smoke run

The server starts with no model (SAGEMAKER_MULTI_MODEL=true, model_url_pattern=.*); models are
registered with POST /models, each with `required_memory_mb` (`--need-mb`), so the budget
(option.max_models_memory) holds an exact number of them. Two parts, each printing a markdown table
(the host's CPU flags above them):

- **cold**: the first request of a model that is not loaded: POST /models (synchronous: 200 once
  loaded) + its first POST /predictions/<name>, for two copies of one model (`--cold-size`, made
  once): one loading its safetensors files, one with `option.load_cache_dir` in its serving.properties
  (the cache written by one load before the clock starts). `--cold-rounds` rounds, the two variants
  interleaved (their order alternating), each unregistered (DELETE) after it; the page cache dropped
  for the model's files and the load cache before every load (`--keep-page-cache`: not). Reported:
  medians, the ratio, the engine's own weight-load and ready phases (from the server log, with a
  check that the cache was read), and the latency of the same request once loaded (warm).
- **mix**: `--models` tiny models, requested with Zipf(`--zipf`) popularity (model k with
  probability ∝ 1/k^s): `--requests` requests, the same sequence for both servers, taken in order by
  `--clients` concurrent client threads (closed loop), against a server whose budget holds every
  model (all hits) and one whose budget holds `--hold` (the least recently used idle model is
  unloaded; its next request loads it again). The models are registered least popular first, so the
  most popular are loaded when a round starts. Both servers up for the whole part, `--rounds`
  rounds interleaved, medians. Reported: req/s, p50/p90 latency, hit rate = 1 - loads during the
  round / requests (the servers' lmi_model_loads_total counters; a request that waits for a load
  another request started counts as a hit), the share answered within `--fast-s` (those that did
  not wait for any load), evictions (lmi_model_evictions_total), and the requests answered 503
  (retried, `--retries`) or failed, with what those answers said.

Every server's log is scanned for warnings and errors, which are printed and kept in the JSON;
`--logs DIR` keeps the whole logs. The CPU seconds the host's other processes used (not this program
nor its servers) are reported per cold load and per part: other work on a 2-core host skews these
figures (a test suite running beside it doubled a cold load).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time

import requests

from benchmarks.load import drop_page_cache, files_under
from benchmarks.server import BenchServer, _processes
from benchmarks.slo import cpu_line, host, pct
from benchmarks.tune_compare import cpu_info
from benchmarks.plots import pyplot

MIB = 1 << 20
PROMPT = "The river ran past the old mill and"
PHASE = re.compile(r"startup phase (weight_load|ready): ([\d.]+) s")
CACHE_READ = re.compile(r"loaded \d+ bytes from the load cache")
METRIC = re.compile(r'^lmi_model_(loads|evictions|unloads)_total\{model="([^"]+)"\} ([\d.e+]+)$')
NOTEWORTHY = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: the server's imports


# -- the server ------------------------------------------------------------------------------------
class MmeServer(BenchServer):
    """`lmi serve` in multi-model mode with no model, its budget holding `hold` models of `need_mb`."""

    def __init__(self, name: str, work: str, hold: int, need_mb: int):
        empty = os.path.join(work, "empty")  # (no config.json: the server starts with no model)
        os.makedirs(empty, exist_ok=True)
        self.budget = hold * need_mb * MIB + MIB
        props = (f"model_url_pattern=.*\noption.max_models_memory={self.budget}\n"
                 f"download_dir={os.path.join(work, 'downloads')}\n")
        env = dict(os.environ, SAGEMAKER_MULTI_MODEL="true",
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        super().__init__(name, empty, properties=props, env=env)
        self.need_mb = need_mb
        self.notes: list[str] = []
        try:
            self.wait_ready()
        except (RuntimeError, TimeoutError):
            self.close()
            raise

    def close(self, keep_log_in: str | None = None) -> None:
        """SIGTERM (its models' engines stop with it), its log's warnings kept (the whole log copied to
        `keep_log_in`), its temporary dir removed."""
        self.stop()
        if keep_log_in:
            os.makedirs(keep_log_in, exist_ok=True)
            shutil.copy(self.log_path, os.path.join(keep_log_in, f"{self.name}.log"))
        with open(self.log_path, errors="replace") as f:  # (the progress bars' carriage returns cut off)
            self.notes = [f"{self.name}: {line.rstrip()[-400:]}" for line in f if NOTEWORTHY.search(line)]
        shutil.rmtree(self.dir, ignore_errors=True)

    def register(self, name: str, url: str) -> None:
        resp = requests.post(self.url + "/models", json={"model_name": name, "url": url,
                                                         "required_memory_mb": str(self.need_mb)}, timeout=900)
        if resp.status_code != 200:
            raise RuntimeError(f"POST /models {name}: {resp.status_code} {resp.text[:300]}; see {self.log_path}")

    def unregister(self, name: str) -> None:
        resp = requests.delete(f"{self.url}/models/{name}", timeout=900)
        if resp.status_code != 200:
            raise RuntimeError(f"DELETE /models/{name}: {resp.status_code} {resp.text[:300]}")
        deadline = time.monotonic() + 60  # (its engines stopped: gone from the list)
        while name in self.listing() and time.monotonic() < deadline:
            time.sleep(0.1)

    def listing(self) -> dict[str, str]:
        models = requests.get(self.url + "/models", timeout=30).json()["models"]
        return {m["modelName"]: m["status"] for m in models}

    def counters(self) -> dict[str, dict[str, float]]:
        """{"loads": {model: n}, "evictions": ..., "unloads": ...} from /metrics."""
        out: dict[str, dict[str, float]] = {"loads": {}, "evictions": {}, "unloads": {}}
        for line in requests.get(self.url + "/metrics", timeout=30).text.splitlines():
            m = METRIC.match(line)
            if m:
                out[m.group(1)][m.group(2)] = float(m.group(3))
        return out

    def log_size(self) -> int:
        return os.path.getsize(self.log_path)

    def log_since(self, offset: int) -> str:
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            return f.read()


def predict(url: str, name: str, new_tokens: int, retries: int = 0, refusals: list | None = None) \
        -> tuple[float, int, int]:
    """One POST /predictions/<name> → (seconds, status, 503s retried); a 503 is retried at once. Every
    answer other than 200 is appended to `refusals` as "status: its text" (the model's name as N)."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}
    started, retried = time.perf_counter(), 0
    while True:
        try:
            resp = requests.post(f"{url}/predictions/{name}", json=body, timeout=900)
            status, text = resp.status_code, resp.text
        except requests.RequestException as exc:
            status, text = 0, f"{type(exc).__name__}: {exc}"
        if status != 200 and refusals is not None:
            refusals.append(f"{status}: {text[:300]}".replace(name, "N"))
        if status != 503 or retried >= retries:
            return time.perf_counter() - started, status, retried
        retried += 1


def other_cpu() -> dict[int, float]:
    """CPU seconds so far of every process that is not this one or its descendant (the servers, their
    engines): the host's other work, which skews the figures."""
    table, mine, todo = _processes(), {os.getpid()}, [os.getpid()]
    while todo:
        parent = todo.pop()
        children = [pid for pid, (ppid, _) in table.items() if ppid == parent and pid not in mine]
        mine.update(children)
        todo += children
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for pid in table.keys() - mine:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return out


def other_cpu_since(before: dict[int, float]) -> float:
    """CPU seconds other processes used since `before` (processes that started and ended between are missed)."""
    return sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in other_cpu().items())


# -- models ----------------------------------------------------------------------------------------
def make_models(work: str, args) -> tuple[dict[str, str], list[str]]:
    """The cold part's two variants of one model ({variant: dir}) and the mix's tiny models (dirs)."""
    from container.model_maker import make_model

    kv = f"option.kv_cache_memory={args.kv_cache_memory}\n"
    base = os.path.join(work, "cold-safetensors")
    make_model(base, arch="llama", size=args.cold_size, seed=100)
    cached = os.path.join(work, "cold-cache")
    shutil.copytree(base, cached)  # (copy2: the same mtimes, the same checkpoint to the cache's fingerprint)
    with open(os.path.join(base, "serving.properties"), "w") as f:
        f.write(kv)
    with open(os.path.join(cached, "serving.properties"), "w") as f:
        f.write(kv + f"option.load_cache_dir={os.path.join(work, 'load-cache')}\n")
    mix = []
    for i in range(args.models):
        d = os.path.join(work, f"mix-{i}")
        make_model(d, arch="llama", size="tiny", seed=i)
        with open(os.path.join(d, "serving.properties"), "w") as f:
            f.write(kv)
        mix.append(d)
    return {"safetensors": base, "load cache": cached}, mix


# -- part 1: a cold model's first request ----------------------------------------------------------
def cold_once(server: MmeServer, name: str, model_dir: str, args, cache_dir: str) -> dict:
    if not args.keep_page_cache:
        drop_page_cache(files_under(model_dir, cache_dir))
    offset = server.log_size()
    others = other_cpu()
    started = time.perf_counter()
    server.register(name, model_dir)
    registered = time.perf_counter()
    first, status, _ = predict(server.url, name, args.new_tokens)
    if status != 200:
        raise RuntimeError(f"first request to {name}: {status}; see {server.log_path}")
    total = time.perf_counter() - started
    warm = [predict(server.url, name, args.new_tokens)[0] for _ in range(args.warm_requests)]
    others = other_cpu_since(others)
    log = server.log_since(offset)
    phases = {k: float(v) for k, v in PHASE.findall(log)}
    server.unregister(name)
    return {"register_s": registered - started, "first_request_s": first, "total_s": total,
            "warm_s": statistics.median(warm), "engine_weight_load_s": phases.get("weight_load"),
            "engine_ready_s": phases.get("ready"), "read_load_cache": bool(CACHE_READ.search(log)),
            "other_cpu_s": others}


def run_cold(args, work: str, variants: dict[str, str]) -> dict:
    cache_dir = os.path.join(work, "load-cache")
    server = MmeServer("mme-cold", work, 2, args.need_mb)
    try:
        print("cold: writing the load cache (one load, not measured) ...", file=sys.stderr)
        server.register("prime", variants["load cache"])
        predict(server.url, "prime", args.new_tokens)
        server.unregister("prime")
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for r in range(args.cold_rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for variant in order:
                run = cold_once(server, f"cold-{r}-{variant.replace(' ', '-')}", variants[variant], args, cache_dir)
                runs[variant].append(run)
                print(f"  round {r + 1} {variant:<12} register {run['register_s']:6.2f} s + first request "
                      f"{run['first_request_s']:5.3f} s (engine: weights {run['engine_weight_load_s']} s, ready "
                      f"{run['engine_ready_s']} s, cache read: {run['read_load_cache']}; other processes' CPU "
                      f"{run['other_cpu_s']:.1f} s)", file=sys.stderr)
    finally:
        server.close(args.logs)
    notes = server.notes
    keys = ("register_s", "first_request_s", "total_s", "warm_s", "engine_weight_load_s", "engine_ready_s",
            "other_cpu_s")
    med = {v: {k: statistics.median(x[k] for x in rs if x[k] is not None) if any(x[k] is not None for x in rs)
               else None for k in keys} | {"read_load_cache": [x["read_load_cache"] for x in rs]}
           for v, rs in runs.items()}
    st, lc = med["safetensors"], med["load cache"]
    return {"model": args.cold_size, "page_cache_dropped": not args.keep_page_cache, "runs": runs, "medians": med,
            "ratio_total": st["total_s"] / lc["total_s"],
            "ratio_weight_load": (st["engine_weight_load_s"] / lc["engine_weight_load_s"]
                                  if st["engine_weight_load_s"] and lc["engine_weight_load_s"] else None),
            "log_notes": notes}


# -- part 2: a skewed mix over several models ------------------------------------------------------
def zipf_sequence(n_models: int, s: float, count: int, seed: int) -> tuple[list[int], list[float]]:
    weights = [1 / (k + 1) ** s for k in range(n_models)]
    total = sum(weights)
    rng = random.Random(f"mme {seed}")
    return rng.choices(range(n_models), weights=weights, k=count), [w / total for w in weights]


def mix_round(server: MmeServer, names: list[str], sequence: list[int], args) -> dict:
    before = server.counters()
    shots: list[tuple[float, int, int]] = [(0.0, 0, 0)] * len(sequence)
    lock, nxt, refusals = threading.Lock(), [0], []

    def client() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(sequence):
                return
            shots[i] = predict(server.url, names[sequence[i]], args.new_tokens, args.retries, refusals)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    after = server.counters()
    delta = {kind: sum(after[kind].get(n, 0) - before[kind].get(n, 0) for n in names) for kind in after}
    ok = [s for s, status, _ in shots if status == 200]
    return {"wall_s": wall, "requests": len(sequence), "ok": len(ok), "failed": len(sequence) - len(ok),
            "retried_503": sum(r for _, _, r in shots), "req_per_s": len(ok) / wall,
            "p50_s": pct(ok, 50), "p90_s": pct(ok, 90), "loads": delta["loads"], "evictions": delta["evictions"],
            "hit_rate": 1 - delta["loads"] / len(sequence),
            "fast_share": sum(x <= args.fast_s for x in ok) / len(sequence), "latencies_s": [s for s, _, _ in shots],
            "statuses": [status for _, status, _ in shots],
            "refusals": {text: refusals.count(text) for text in sorted(set(refusals))}}


def run_mix(args, work: str, dirs: list[str]) -> dict:
    sequence, popularity = zipf_sequence(args.models, args.zipf, args.requests, args.seed)
    names = [f"m{i}" for i in range(args.models)]
    configs = {f"holds all {args.models}": args.models, f"holds {args.hold}": args.hold}
    servers: dict[str, MmeServer] = {}
    try:
        for label, hold in configs.items():
            servers[label] = MmeServer(f"mme-{hold}", work, hold, args.need_mb)
            for i in reversed(range(args.models)):  # the least popular first: the most popular stay loaded
                servers[label].register(names[i], dirs[i])
            print(f"mix: {label}: registered {servers[label].listing()}", file=sys.stderr)
        rounds: dict[str, list[dict]] = {label: [] for label in configs}
        for r in range(args.rounds):
            for label, server in servers.items():
                run = mix_round(server, names, sequence, args)
                rounds[label].append(run)
                print(f"  round {r + 1} {label:<12} {run['req_per_s']:6.2f} req/s, p50 {run['p50_s']:.3f} s, "
                      f"p90 {run['p90_s']:.3f} s, hit rate {run['hit_rate']:.2f}, evictions {run['evictions']:.0f}, "
                      f"503s retried {run['retried_503']}, failed {run['failed']}", file=sys.stderr)
    finally:
        for server in servers.values():
            server.close(args.logs)
    keys = ("req_per_s", "p50_s", "p90_s", "hit_rate", "fast_share", "loads", "evictions", "retried_503", "failed",
            "wall_s")
    med = {label: {k: statistics.median(x[k] for x in rs) for k in keys} for label, rs in rounds.items()}
    full, tight = (med[label] for label in configs)
    refusals = {label: {} for label in configs}
    for label, rs in rounds.items():
        for r in rs:
            for text, n in r["refusals"].items():
                refusals[label][text] = refusals[label].get(text, 0) + n
    return {"popularity": popularity, "sequence": sequence, "requests_per_model": [sequence.count(i) for i in
                                                                                   range(args.models)],
            "holds": configs, "rounds": rounds, "medians": med,
            "throughput_ratio": full["req_per_s"] / tight["req_per_s"] if tight["req_per_s"] else None,
            "p90_ratio": tight["p90_s"] / full["p90_s"] if full["p90_s"] else None,
            "refusals": refusals,
            "log_notes": [n for s in servers.values() for n in s.notes]}


# -- report ----------------------------------------------------------------------------------------
def markdown(head: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_cold(part: dict, args) -> None:
    print(f"\n## cold model: register + first request ({part['model']} llama, {args.new_tokens} new tokens, "
          f"option.kv_cache_memory={args.kv_cache_memory}; page cache "
          f"{'dropped' if part['page_cache_dropped'] else 'kept'} before each load); medians of "
          f"{args.cold_rounds} interleaved rounds\n")
    rows = []
    for variant, m in part["medians"].items():
        rows.append([variant, fmt(m["register_s"]), fmt(m["first_request_s"]), fmt(m["total_s"]),
                     fmt(m["engine_weight_load_s"]), fmt(m["engine_ready_s"]), fmt(1e3 * m["warm_s"], ".1f"),
                     f"{sum(m['read_load_cache'])}/{len(m['read_load_cache'])}", fmt(m["other_cpu_s"], ".1f")])
    markdown(["load from", "register s", "first request s", "total s", "engine weight load s", "engine ready s",
              "warm request ms", "read the cache", "others' CPU s"], rows)
    print(f"\ncold first request (register + first request): safetensors / load cache = {part['ratio_total']:.2f}x; "
          f"engine weight load alone: {fmt(part['ratio_weight_load'], '.2f')}x")


def print_mix(part: dict, args) -> None:
    pop = ", ".join(f"{p:.2f}" for p in part["popularity"])
    print(f"\n## {args.models} tiny models, Zipf s={args.zipf} popularity ({pop}; requests per model "
          f"{part['requests_per_model']}), {args.requests} requests from {args.clients} concurrent clients, "
          f"{args.new_tokens} new tokens each; each model {args.need_mb} MiB of the budget; medians of "
          f"{args.rounds} interleaved rounds\n")
    rows = []
    for label, m in part["medians"].items():
        rows.append([label, fmt(m["req_per_s"], ".2f"), fmt(m["p50_s"]), fmt(m["p90_s"]), fmt(m["hit_rate"], ".2f"),
                     fmt(m["fast_share"], ".2f"), fmt(m["loads"], ".0f"), fmt(m["evictions"], ".0f"),
                     fmt(m["retried_503"], ".0f"), fmt(m["failed"], ".0f")])
    markdown(["budget", "req/s", "p50 s", "p90 s", "hit rate", f"share ≤ {args.fast_s:g} s", "loads", "evictions",
              "503s retried", "failed"], rows)
    for label, refusals in part["refusals"].items():
        for text, n in refusals.items():
            print(f"{label}: {n} answer(s) over {args.rounds} round(s) were {text}")
    print(f"\nreq/s: all hits / with evictions = {fmt(part['throughput_ratio'], '.2f')}x; p90 latency: with evictions "
          f"/ all hits = {fmt(part['p90_ratio'], '.1f')}x")


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    cold = result.get("cold", {})
    if "medians" in cold:
        variants = list(cold["medians"])
        for i, v in enumerate(variants):
            m = cold["medians"][v]
            axes[0].bar(i - 0.2, m["register_s"], 0.4, color="C0", label="register (load)" if i == 0 else None)
            axes[0].bar(i - 0.2, m["first_request_s"], 0.4, bottom=m["register_s"], color="C1",
                        label="first request" if i == 0 else None)
            axes[0].bar(i + 0.2, m["warm_s"], 0.4, color="C2", label="warm request" if i == 0 else None)
            axes[0].scatter([i - 0.2] * len(cold["runs"][v]), [x["total_s"] for x in cold["runs"][v]], color="k",
                            s=12, zorder=3, label="each round" if i == 0 else None)
        axes[0].set_xticks(range(len(variants)), variants)
        axes[0].set(ylabel="seconds", title=f"cold {cold['model']} model: register + first request "
                                            f"({cold['ratio_total']:.2f}x)")
        axes[0].legend(fontsize=8)
    mix = result.get("mix", {})
    if "medians" in mix:
        for label, rounds in mix["rounds"].items():
            values = sorted(s for r in rounds for s, status in zip(r["latencies_s"], r["statuses"]) if status == 200)
            axes[1].step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
        axes[1].set(xscale="log", xlabel="request latency (s)", ylabel="fraction of requests",
                    title="latency, Zipf mix over the models (every round)")
        axes[1].legend(fontsize=8)
        labels = list(mix["medians"])
        bars = axes[2].bar(labels, [mix["medians"][x]["req_per_s"] for x in labels], color=["C0", "C3"])
        for bar, x in zip(bars, labels):
            m = mix["medians"][x]
            text = f"{m['req_per_s']:.2f} req/s\nhit rate {m['hit_rate']:.2f}\nevictions {m['evictions']:.0f}"
            axes[2].annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                             fontsize=8)
        axes[2].set(ylabel="requests/s", title=f"throughput ({mix['throughput_ratio']:.1f}x)")
        axes[2].margins(y=0.2)
    fig.suptitle(f"lmi-serve multi-model mode; {result['host_line']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- main ------------------------------------------------------------------------------------------
def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mme", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="cold,mix")
    p.add_argument("--cold-size", default="small", choices=("tiny", "small", "mini"),
                   help="the cold part's model (container/model_maker.py's sizes)")
    p.add_argument("--cold-rounds", type=int, default=3)
    p.add_argument("--warm-requests", type=int, default=3, help="after each cold first request (their median)")
    p.add_argument("--keep-page-cache", action="store_true", help="do not drop the model's pages before a load")
    p.add_argument("--models", type=int, default=4)
    p.add_argument("--hold", type=int, default=2, help="the models the tight budget holds")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--requests", type=int, default=60, help="per round, per server")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="mix rounds, the two servers interleaved")
    p.add_argument("--fast-s", type=float, default=0.5,
                   help="a request answered within this counts as not having waited for a load (the share reported)")
    p.add_argument("--retries", type=int, default=3, help="a 503 retried at once, this many times")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--need-mb", type=int, default=1000, help="required_memory_mb of every model")
    p.add_argument("--kv-cache-memory", default="64MiB", help="every model's option.kv_cache_memory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", help="copy every server's log to this directory (they are removed otherwise)")
    p.add_argument("--out", default="benchmarks/results/mme.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    parts = args.parts.split(",")
    info = cpu_info()
    result: dict = {"host": host() | {"cpuinfo_flags": info["flags"]}, "host_line": cpu_line(), "args": vars(args)}
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="lmi-mme-")
    try:
        variants, mix_dirs = make_models(work, args)
        for name, run in (("cold", lambda: run_cold(args, work, variants)), ("mix", lambda: run_mix(args, work,
                                                                                                    mix_dirs))):
            if name not in parts:
                continue
            print(f"{name} ...", file=sys.stderr)
            load, others = os.getloadavg()[0], other_cpu()
            try:
                result[name] = run()
            except Exception as exc:  # the part says why; the other still runs
                result[name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"  {name} failed: {exc}", file=sys.stderr)
            result[name]["load_average"] = [load, os.getloadavg()[0]]
            result[name]["other_cpu_s"] = other_cpu_since(others)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["wall_s"] = time.monotonic() - started
    print(f"\n{result['host_line']}")
    print(f"cpu flags (/proc/cpuinfo): {' '.join(info['flags'])}")
    for name, printer in (("cold", print_cold), ("mix", print_mix)):
        if name not in parts:
            continue
        if "error" in result[name]:
            print(f"\n## {name}: not measured: {result[name]['error']}")
        else:
            printer(result[name], args)
        before, after = result[name]["load_average"]
        print(f"(other processes on the host used {result[name]['other_cpu_s']:.1f} CPU s during the part; load "
              f"average {before:.1f} at its start, {after:.1f} at its end, "
              f"{os.cpu_count()} cores)")
    notes = [n for name in parts for n in result.get(name, {}).get("log_notes", [])]
    print(f"\nserver logs: {len(notes)} warning/error line(s)" + "".join(f"\n  {n}" for n in notes[:20]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(result, png)
    print(f"\nwall {result['wall_s']:.0f} s; wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
