"""Request-level metrics of the HTTP workers, summed over all workers for `/metrics`.

Named as vLLM names them where vLLM has the metric (dashboards built for vLLM work unchanged):

    vllm:time_to_first_token_seconds     histogram  request start → first token
    vllm:time_per_output_token_seconds   histogram  (end − first token) / (tokens − 1), per request
    vllm:e2e_request_latency_seconds     histogram  request start → last token
    vllm:prompt_tokens_total             counter
    vllm:generation_tokens_total         counter
    vllm:request_success_total           counter    by finished_reason (stop, length, ...)
    lmi_http_requests_total              counter    by route and status
    lmi_http_requests_in_flight          gauge      HTTP requests being served now

Each gunicorn worker counts its own requests; a thread of its own writes its totals to
`<run dir>/request-metrics/<pid>.json` (atomically) within FLUSH_S of a change, never in a request's
path; `/metrics` writes its own worker's first and sums every worker's file, so any worker answers
for all (another worker's last FLUSH_S may be missing). A worker that exited keeps its file: its counts stay in the totals
(counters never go down), its in-flight gauge does not.
"""

from __future__ import annotations

import json
import os
import threading
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engines.process.rundir import write_atomically

FLUSH_S = 0.25

# vLLM's bucket bounds (seconds)
BUCKETS = {
    "ttft": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    "tpot": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
    "e2e": (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
}
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "time to first token"),
    "tpot": ("vllm:time_per_output_token_seconds", "time per output token after the first"),
    "e2e": ("vllm:e2e_request_latency_seconds", "end-to-end request latency"),
}


def _empty() -> dict:
    """One model's totals ("" for requests that reached none: management, 404s)."""
    return {"hist": {k: {"counts": [0] * (len(b) + 1), "sum": 0.0} for k, b in BUCKETS.items()},
            "prompt_tokens": 0, "generation_tokens": 0, "finished": {}, "http": {}}


def _add(total: dict, d: dict) -> None:
    for k in BUCKETS:
        total["hist"][k]["counts"] = [a + b for a, b in zip(total["hist"][k]["counts"], d["hist"][k]["counts"])]
        total["hist"][k]["sum"] += d["hist"][k]["sum"]
    for k in ("prompt_tokens", "generation_tokens"):
        total[k] += d[k]
    for k in ("finished", "http"):
        for label, n in d[k].items():
            total[k][label] = total[k].get(label, 0) + n


class RequestMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one writer of this worker's file at a time
        self._data = {"models": {}, "in_flight": 0}  # model name → _empty()
        self._dir: str | None = None
        self._dirty = threading.Event()

    def configure(self, run_dir: str) -> None:
        self._dir = os.path.join(run_dir, "request-metrics")
        os.makedirs(self._dir, exist_ok=True)
        threading.Thread(target=self._flush_loop, name="request-metrics", daemon=True).start()

    def _flush_loop(self) -> None:
        while self._dirty.wait():
            time.sleep(FLUSH_S)  # gather a burst of requests into one write
            self._dirty.clear()
            self._write()

    # -- counting (any request thread) --------------------------------------------------------------
    def request_started(self) -> None:
        with self._lock:
            self._data["in_flight"] += 1
        self._dirty.set()

    def _model(self, model: str) -> dict:
        return self._data["models"].setdefault(model, _empty())

    def request_ended(self, route: str, status: int, model: str = "") -> None:
        with self._lock:
            self._data["in_flight"] -= 1
            key = f"{route} {status}"
            http = self._model(model)["http"]
            http[key] = http.get(key, 0) + 1
        self._dirty.set()

    def generation_ended(self, started: float, first_token: float | None, ended: float, num_prompt_tokens: int,
                         num_generated_tokens: int, finish_reason: str | None, model: str = "") -> None:
        with self._lock:
            d = self._model(model)
            d["prompt_tokens"] += num_prompt_tokens
            d["generation_tokens"] += num_generated_tokens
            if finish_reason is not None and finish_reason != "error":
                d["finished"][finish_reason] = d["finished"].get(finish_reason, 0) + 1
                _observe(d, "e2e", ended - started)
            if first_token is not None:
                _observe(d, "ttft", first_token - started)
                if num_generated_tokens > 1:
                    _observe(d, "tpot", (ended - first_token) / (num_generated_tokens - 1))
        self._dirty.set()
    def _write(self) -> None:
        if self._dir is None:
            return
        with self._write_lock:
            with self._lock:
                payload = json.dumps({"pid": os.getpid(), **self._data})
            write_atomically(os.path.join(self._dir, f"{os.getpid()}.json"), payload)

    # -- /metrics -----------------------------------------------------------------------------------
    def families(self, by_model: bool = False):
        """Prometheus metric families of every worker's totals; by_model: each sample labelled model="<name>"
        (several models), else summed (one model: the names as before)."""
        self._write()
        totals: dict[str, dict] = {}
        in_flight = 0
        for name in sorted(os.listdir(self._dir)) if self._dir else []:
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(self._dir, name), encoding="utf-8") as f:
                    d = json.load(f)
            except (OSError, ValueError):
                continue  # being replaced this instant: the next scrape has it
            for model, data in d["models"].items():
                _add(totals.setdefault(model if by_model else "", _empty()), data)
            if _alive(d["pid"]):
                in_flight += d["in_flight"]
        labels = ["model"] if by_model else []
        rows = sorted(totals.items()) or [("", _empty())]

        def key(model: str) -> list[str]:
            return [model] if by_model else []

        for k, (name, doc) in HISTOGRAMS.items():
            family = HistogramMetricFamily(name, doc, labels=labels)
            for model, total in rows:
                h, running, buckets = total["hist"][k], 0, []
                for bound, n in zip(list(BUCKETS[k]) + [float("inf")], h["counts"]):
                    running += n
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
                family.add_metric(key(model), buckets, h["sum"])
            yield family
        prompt = CounterMetricFamily("vllm:prompt_tokens", "prompt tokens of finished requests", labels=labels)
        generated = CounterMetricFamily("vllm:generation_tokens", "generated tokens", labels=labels)
        success = CounterMetricFamily("vllm:request_success", "finished requests", labels=[*labels, "finished_reason"])
        http = CounterMetricFamily("lmi_http_requests", "HTTP requests by route and status",
                                   labels=[*labels, "route", "status"])
        for model, total in rows:
            prompt.add_metric(key(model), total["prompt_tokens"])
            generated.add_metric(key(model), total["generation_tokens"])
            for reason, n in sorted(total["finished"].items()):
                success.add_metric([*key(model), reason], n)
            for k, n in sorted(total["http"].items()):
                route, status = k.rsplit(" ", 1)
                http.add_metric([*key(model), route, status], n)
        yield from (prompt, generated, success, http)
        yield GaugeMetricFamily("lmi_http_requests_in_flight", "HTTP requests being served", value=in_flight)


def _observe(d: dict, name: str, value: float) -> None:
    h = d["hist"][name]
    bounds = BUCKETS[name]
    h["counts"][next((i for i, b in enumerate(bounds) if value <= b), len(bounds))] += 1
    h["sum"] += value


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


REQUEST_METRICS = RequestMetrics()  # one per worker process
