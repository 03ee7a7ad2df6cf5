"""`lmi tune`: the search with a synthetic evaluator on a fake clock (budget, halving, targets,
frontier, the grid), the search space and its pruning, the workload, the load driver against a
fake streaming server, the outputs, the arguments, and one real run on the tiny model."""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from container import cli
from container.tune import command as tune, space as tune_space
from container.properties import parse_properties, read_properties
from container.tune.load import LoadShape, Record, measure, percentile, summarise
from container.tune.search import (Budget, Measurement, Overhead, Targets, Trial, best, first_window, frontier,
                                   grid_search, plan_cost, rank_key, rung_counts, successive_halving)
from container.tune.server import write_properties
from container.tune.space import Candidate, Checker, Host, candidates, knobs, label, prune
from container.tune.verify import decide, median_of
from container.tune.workload import Lengths, PromptMaker, build_bodies, read_trace
from engines.weights.memory_plan import Machine

TARGETS = Targets(ttft_p90=1.0, tpot_p90=0.150)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Cand:
    name: str
    tps: float  # the true throughput
    ttft: float = 0.5
    tpot: float = 0.1


class Synthetic:
    """A trial costs `overhead + window` fake seconds; the throughput read is the true one off by
    `noise / window` (relative), alternately up and down, so longer windows read truer."""

    def __init__(self, clock: FakeClock, overhead: float = 10.0, noise: float = 0.0):
        self.clock, self.overhead, self.noise = clock, overhead, noise
        self.calls: list[tuple[str, float, int]] = []

    def __call__(self, cand: Cand, window: float, rung: int) -> Trial:
        self.clock.now += self.overhead + window
        sign = 1 if len(self.calls) % 2 else -1
        self.calls.append((cand.name, window, rung))
        m = Measurement(cand.tps * (1 + sign * self.noise / window), cand.ttft / 2, cand.ttft, cand.tpot,
                        num_requests=10, errors=0, window_s=window)
        return Trial(cand.name, {}, rung, window, m, cost_s=self.overhead + window)


def measurement(tps: float, ttft: float = 0.5, tpot: float = 0.1, errors: int = 0) -> Measurement:
    return Measurement(tps, ttft / 2, ttft, tpot, num_requests=10, errors=errors, window_s=10)


# --- the search -------------------------------------------------------------------------------------

def test_rungs_keep_one_in_three_until_two_or_three_are_left():
    assert rung_counts(27) == [27, 9, 3]
    assert rung_counts(10) == [10, 4, 2]
    assert rung_counts(9) == [9, 3]
    assert rung_counts(4) == [4, 2]
    assert rung_counts(2) == [2]
    assert rung_counts(1) == [1]
    # 9 x (20 + 10) + 3 x (20 + 30)
    assert plan_cost(9, 10, 20) == 420
    # (300 - 12 x 10) / (9 x 1 + 3 x 3)
    assert first_window([9, 3], 300, 10, 1, 100) == 10
    assert first_window([9, 3], 300, 10, 15, 100) == 15  # clamped up
    assert first_window([9, 3], 300, 10, 1, 8) == 8  # and down


def test_halving_spends_the_budget_exactly_and_keeps_the_best():
    clock = FakeClock()
    cands = [Cand(f"c{i}", tps=100 + 10 * i) for i in range(9)]
    cands[4] = Cand("c4", tps=500, ttft=2.0)  # the fastest misses the TTFT target
    ev = Synthetic(clock, overhead=10)
    trials = successive_halving(cands, ev, Budget(300, clock), TARGETS, overhead=Overhead(10), min_window_s=1,
                                max_window_s=100)
    # rung 0: a 1 s probe, then (300 - 12 x 10) / (9 + 3 x 3) = 10 s windows: 11 + 8 x 20 = 171 s; rung 1: the 3
    # best meeting the targets, (300 - 171 - 3 x 10) / 3 = 33 s each
    assert ev.calls == [("c0", 1, 0)] + [(f"c{i}", 10, 0) for i in range(1, 9)] + [("c8", 33, 1), ("c7", 33, 1),
                                                                                  ("c6", 33, 1)]
    assert clock.now == 300
    assert best(trials, TARGETS).name == "c8"


@pytest.mark.parametrize("seconds", [20, 45, 100, 333, 900, 3600])
def test_halving_never_passes_the_deadline(seconds):
    clock = FakeClock()
    cands = [Cand(f"c{i}", tps=i) for i in range(40)]
    ev = Synthetic(clock, overhead=20, noise=2.0)
    trials = successive_halving(cands, ev, Budget(seconds, clock), TARGETS, overhead=Overhead(20), min_window_s=8,
                                max_window_s=60)
    assert clock.now <= seconds
    assert all(8 <= t.window_s <= 60 for t in trials)
    assert sum(t.cost_s for t in trials) == clock.now
    if seconds < 28:
        assert trials == []


def test_halving_with_noise_still_finds_the_best_feasible():
    """Rung 0's 22 s windows read +-9 %: the true best (c20, 200 tok/s) ranks fourth there, below
    c19, c17 and c15 read high; rung 1 (68 s, +-3 %) keeps it, rung 2 (200 s, +-1 %) picks it."""
    clock = FakeClock()
    cands = [Cand(f"c{i}", tps=100 + 5 * i, tpot=0.1 if i <= 20 else 0.2) for i in range(27)]
    trials = successive_halving(cands, Synthetic(clock, overhead=5, noise=2.0), Budget(2000, clock), TARGETS,
                                overhead=Overhead(5), min_window_s=10, max_window_s=200)
    assert [sum(t.rung == r for t in trials) for r in range(3)] == [27, 9, 3]
    assert best(trials, TARGETS).name == "c20"
    assert all(t.name != "c26" for t in trials if t.rung > 0)  # the fastest misses TPOT: never promoted


def test_ranking_meets_first_by_throughput_then_misses_by_how_far():
    def trial(name, m):
        return Trial(name, {}, 0, 10, m)

    trials = [trial("slow ok", measurement(100)), trial("fast ok", measurement(200)),
              trial("miss 2x", measurement(900, ttft=2.0)), trial("miss 1.2x", measurement(50, tpot=0.18)),
              trial("errors", measurement(999, errors=1)), trial("no server", None)]
    order = sorted(trials, key=lambda t: rank_key(t, TARGETS))
    assert [t.name for t in order] == ["fast ok", "slow ok", "miss 1.2x", "miss 2x", "errors", "no server"]


def test_violation_is_the_worst_ratio():
    assert TARGETS.violation(measurement(1, ttft=1.5, tpot=0.075)) == 1.5
    assert TARGETS.violation(measurement(1, ttft=0.5, tpot=0.3)) == 2.0
    assert TARGETS.violation(measurement(1, tpot=math.nan)) == math.inf
    assert TARGETS.violation(None) == math.inf
    assert Targets().violation(measurement(1, ttft=100)) == 0.0


def test_frontier_keeps_what_nothing_beats_on_both():
    pts = {"a": (100, 1.0), "b": (150, 2.0), "c": (120, 2.5), "d": (90, 0.5), "e": (80, 0.9), "f": (150, 3.0)}
    trials = [Trial(n, {}, 0, 10, measurement(tps, ttft=lat)) for n, (tps, lat) in pts.items()]
    trials.append(Trial("failed", {}, 0, 10, None))
    front = frontier(trials, lambda m: m.ttft_p90)
    assert [t.name for t in front] == ["d", "a", "b"]


def test_grid_measures_every_cell_the_same_until_the_budget_ends():
    clock = FakeClock()
    cells = [Cand(f"g{i}", tps=i) for i in range(20)]
    ev = Synthetic(clock, overhead=10)
    trials = grid_search(cells, ev, Budget(300, clock), overhead=Overhead(10), min_window_s=2)
    assert [t.window_s for t in trials] == [5] * 20 and clock.now == 300
    clock2 = FakeClock()
    ev2 = Synthetic(clock2, overhead=10)
    trials = grid_search(cells, ev2, Budget(150, clock2), overhead=Overhead(10), min_window_s=2)
    # the shortest window (2 s) costs 12 s a cell: 12 cells, then 6 s left is less than 10 + 2
    assert len(trials) == 12 and clock2.now == 144


def test_overhead_is_the_prior_then_the_largest_seen():
    o = Overhead(20)
    assert o.estimate() == 20
    o.observe(Trial("a", {}, 0, 10, measurement(1), cost_s=17))
    o.observe(Trial("b", {}, 0, 10, measurement(1), cost_s=15))
    o.observe(Trial("c", {}, 0, 10, None, cost_s=90))  # a failed start says nothing of a trial's cost
    assert o.estimate() == 7


# --- the final comparison's verdict -------------------------------------------------------------------

def test_verdicts():
    ok, fast_ok, miss = measurement(100), measurement(150), measurement(300, ttft=3.0)
    v = decide(ok, fast_ok, "seqs=8", TARGETS)
    assert (v.chosen, v.defaults_meet, v.ratio) == ("seqs=8", True, 1.5)
    assert v.text == "seqs=8: 1.50x the defaults' generated tokens/s; both meet the targets"
    v = decide(miss, ok, "seqs=8", TARGETS)
    assert (v.chosen, v.defaults_meet) == ("seqs=8", False) and "the defaults miss the targets" in v.text
    v = decide(fast_ok, ok, "seqs=8", TARGETS)
    assert v.chosen == "defaults" and v.text.startswith("the defaults are best") and "no faster" in v.text
    v = decide(ok, miss, "seqs=8", TARGETS)
    assert v.chosen == "defaults" and "misses the targets measured fresh" in v.text
    v = decide(measurement(1, ttft=5.0), measurement(1, ttft=2.0), "seqs=8", TARGETS)
    assert v.chosen == "seqs=8" and v.text.startswith("no configuration meets the targets")
    v = decide(ok, None, "defaults", TARGETS)
    assert (v.chosen, v.defaults_meet, v.ratio) == ("defaults", True, 1.0)


def test_median_of_rounds():
    trials = [Trial("x", {}, -1, 10, measurement(t, ttft=f)) for t, f in ((100, 0.5), (300, 0.9), (200, 0.1))]
    m = median_of(trials)
    assert (m.throughput, m.ttft_p90, m.num_requests, m.window_s) == (200, 0.5, 30, 30)
    assert median_of([Trial("x", {}, -1, 10, None)]) is None


def test_the_first_start_replaces_the_prior_and_rung_0_grows():
    clock = FakeClock()
    cands = [Cand(f"c{i}", tps=i) for i in range(9)]
    ev = Synthetic(clock, overhead=10)
    trials = successive_halving(cands, ev, Budget(300, clock), TARGETS, overhead=Overhead(40), min_window_s=1,
                                max_window_s=100)
    # the probe (the shortest window) shows 10 s a start, not 40: 9 candidates at (300 - 12 x 10) / 18 = 10 s
    assert [c for c in ev.calls if c[2] == 0] == [("c0", 1, 0)] + [(f"c{i}", 10, 0) for i in range(1, 9)]
    assert [c[0] for c in ev.calls if c[2] == 1] == ["c8", "c7", "c6"]
    assert clock.now <= 300 and len(trials) == 12


# --- the search space -----------------------------------------------------------------------------------

CPU = Host(num_gpus=0, num_cpus=2, cpu_flags=frozenset({"avx2", "avx512_bf16", "avx512_vnni"}))


def test_knobs_of_a_small_cpu_host(monkeypatch):
    monkeypatch.setitem(tune_space.KEYS_BY_NAME, tune_space.TARGET_TPOT_KEY, object())
    k = knobs(CPU, concurrency=16, tpot_target_s=0.150)
    assert list(k) == ["max_num_seqs", "max_num_batched_tokens", "scheduling", "quantize", "dtype", "target_tpot"]
    # more rows than clients cannot fill: 16 stands for 32 and 64
    assert k["max_num_seqs"] == [{}] + [{"option.max_rolling_batch_size": v} for v in ("4", "8", "16")]
    assert k["quantize"] == [{}] + [{"option.quantize": q} for q in ("int8", "int4", "int8_dynamic")]
    assert k["target_tpot"] == [{}, {"option.target_tpot_ms": "90"}, {"option.target_tpot_ms": "120"}]
    assert "layout" not in k  # two cores: no copies
    assert list(tune_space.not_searched(CPU, 0.150)) == ["layout"]
    assert tune_space.not_searched(CPU, None)["target_tpot"] == "no --tpot-p90 to derive it from"
    assert len(knobs(CPU, concurrency=None, tpot_target_s=None)["max_num_seqs"]) == 6  # --rate: all of them


def test_knobs_without_the_target_tpot_key_or_with_gpus(monkeypatch):
    monkeypatch.delitem(tune_space.KEYS_BY_NAME, tune_space.TARGET_TPOT_KEY, raising=False)
    assert "target_tpot" not in knobs(CPU, concurrency=16, tpot_target_s=0.150)
    gpus = knobs(Host(4, 32, frozenset(), gpu_capability=9.0), concurrency=16, tpot_target_s=None)
    assert gpus["layout"] == [{}, *({"option.tensor_parallel_degree": tp, "maxWorkers": c}
                                    for tp, c in (("1", "4"), ("2", "2"), ("4", "1")))]
    assert gpus["quantize"][-1] == {"option.quantize": "fp8"} and gpus["dtype"][-1] == {"option.dtype": "fp16"}
    assert list(knobs(CPU, concurrency=4, tpot_target_s=None, only=["dtype"])) == ["dtype"]
    with pytest.raises(ValueError, match="--knobs layout: not a knob on this host"):
        knobs(CPU, concurrency=4, tpot_target_s=None, only=["layout"])


def test_candidates_base_first_then_one_factor_at_a_time_between_mixes():
    settings = {"a": [{}, {"x": "1"}, {"x": "2"}], "b": [{}, {"y": "1"}]}
    cands = candidates(settings, seed=0)
    names = [c.name for c in cands]
    assert len(set(names)) == 6 and names[0] == "defaults"
    assert names[1::2] == ["x=1", "y=1", "x=2"]  # round robin over the knobs: every first alternative first
    assert sorted(names[2::2]) == ["x=1 y=1", "x=2 y=1"]
    said = label({"option.async_scheduling": "false", "option.speculative_method": "ngram",
                  "option.num_speculative_tokens": "3", "option.max_rolling_batch_size": "8"})
    assert said == "sync spec=ngram seqs=8"


def test_prune_refuses_what_cannot_start_and_merges_the_same_configuration(tiny_model):
    checker = Checker({}, str(tiny_model), {}, CPU, prompt_tokens=40, output_tokens=20)
    cands = [Candidate("defaults", ()), Candidate("dtype=bf16", (("option.dtype", "bf16"),)),
             Candidate("dtype=fp32", (("option.dtype", "fp32"),)),
             Candidate("steps=4 dynamic", (("option.num_scheduler_steps", "4"), ("option.rolling_batch", "disable")))]
    kept, pruned = prune(cands, checker)
    assert [c.name for c in kept] == ["defaults", "dtype=fp32"]
    assert [(p.candidate.name, p.reason.split(":")[0]) for p in pruned] == [
        ("dtype=bf16", "the same configuration as defaults"), ("steps=4 dynamic", "refused by the configuration check")]
    checker.machine = Machine("a 1 MiB machine", 0, 2**20)
    kept, pruned = prune(cands[:1], checker)
    assert kept == [] and pruned[0].reason.startswith("the memory plan: does not fit: the weights need")


def test_the_same_configuration_keeps_the_shorter_name(tiny_model):
    checker = Checker({}, str(tiny_model), {}, CPU, prompt_tokens=40, output_tokens=20)
    long = Candidate("tokens=1024 dtype=fp32", (("option.max_rolling_batch_prefill_tokens", "1024"),
                                                 ("option.dtype", "fp32")))
    kept, pruned = prune([long, Candidate("dtype=fp32", (("option.dtype", "fp32"),))], checker)
    assert [c.name for c in kept] == ["dtype=fp32"]
    assert pruned[0].candidate is long and pruned[0].reason == "the same configuration as dtype=fp32"


# --- the workload ----------------------------------------------------------------------------------------

def test_prompts_encode_to_the_asked_length(tiny_model):
    maker = PromptMaker(str(tiny_model))
    rng = __import__("random").Random(0)
    for n in range(2, 300, 23):
        assert len(maker.tok.encode(maker.prompt(n, rng))) == n


def test_lengths_and_traces(tiny_model, tmp_path):
    bodies = build_bodies(str(tiny_model), lengths=Lengths(100, 10, 0.5), count=50, seed=1)
    outs = [b["parameters"]["max_new_tokens"] for b in bodies]
    assert min(outs) >= 5 and max(outs) <= 15 and len(set(outs)) > 3
    assert bodies[0]["stream"] is True and bodies[0]["parameters"]["ignore_eos"] is True
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_tokens": 12, "output_tokens": 3}\n\n'
                     '{"inputs": "hello", "parameters": {"max_new_tokens": 7, "temperature": 0.5}}\n')
    bodies = build_bodies(str(tiny_model), trace=read_trace(str(trace)), count=3)
    assert [b["parameters"]["max_new_tokens"] for b in bodies] == [3, 7, 3]
    assert bodies[1] == {"inputs": "hello", "stream": True,
                         "parameters": {"max_new_tokens": 7, "ignore_eos": True, "temperature": 0.5}}
    trace.write_text('{"prompt_tokens": 12}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: expected"):
        read_trace(str(trace))


# --- the load driver ---------------------------------------------------------------------------------------

def test_summary_of_a_window():
    counted = [Record(started=10.0, max_new_tokens=4, first=10.2, last=10.5, num_tokens=4, in_window=4, done=True),
               Record(started=11.0, max_new_tokens=4, first=11.5, last=11.6, num_tokens=2, in_window=2),
               Record(started=12.0, max_new_tokens=4),  # no first token by the end: waited 3 s at least
               Record(started=12.5, max_new_tokens=4, error="HTTP 503")]
    early = Record(started=9.0, max_new_tokens=4, first=9.1, last=10.9, num_tokens=4, in_window=2, done=True)
    m = summarise(counted, [early, *counted], window_s=4.0, ended=15.0)
    assert m.throughput == (4 + 2 + 2) / 4.0
    assert (m.ttft_p50, m.ttft_p90) == (pytest.approx(0.5), 3.0)  # nearest rank of 0.2, 0.5, 3.0
    assert m.tpot_p90 == pytest.approx(0.1)  # of 0.3 / 3 and 0.1 / 1
    assert (m.num_requests, m.errors, m.num_censored) == (4, 1, 1)
    assert percentile([], 90) != percentile([], 90)  # nan
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 90) == 4.0


class FakeLmi(BaseHTTPRequestHandler):
    """/invocations streaming `max_new_tokens` JSON lines, one per TOKEN_GAP s (a simulated decode
    step); a prompt "fail" answers 424, "break" ends its stream with an error line."""

    TOKEN_GAP = 0.02
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["inputs"] == "fail":
            self.send_response(424)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/jsonlines")
        self.end_headers()
        try:
            for i in range(body["parameters"]["max_new_tokens"]):
                time.sleep(self.TOKEN_GAP)
                line = {"code": 424, "error": "boom"} if body["inputs"] == "break" and i == 1 else {"token": {"id": i}}
                self.wfile.write((json.dumps(line) + "\n").encode())
                self.wfile.flush()
        except OSError:  # the client shut the connection: the driver's stop
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_lmi():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeLmi)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_the_driver_measures_a_streaming_server(fake_lmi):
    bodies = [{"inputs": "hi", "parameters": {"max_new_tokens": 5}, "stream": True}]
    started = time.monotonic()
    m, error = measure("127.0.0.1", fake_lmi, bodies, LoadShape(concurrency=2, warmup_s=0.2), window_s=0.6)
    assert error is None and m.errors == 0 and m.num_censored == 0
    # 2 clients, a token each per 20 ms (plus the client's own time): at most 100 tokens/s
    assert 40 < m.throughput <= 100
    assert FakeLmi.TOKEN_GAP <= m.ttft_p50 < 0.1 and FakeLmi.TOKEN_GAP <= m.tpot_p90 < 0.1
    assert m.num_requests >= 4
    assert time.monotonic() - started < 2.0  # warm-up + window + a drain of one request at most


def test_the_driver_counts_failures(fake_lmi):
    for prompt, said in (("fail", "HTTP 424"), ("break", "stream error: boom")):
        bodies = [{"inputs": prompt, "parameters": {"max_new_tokens": 5}, "stream": True}]
        m, error = measure("127.0.0.1", fake_lmi, bodies, LoadShape(concurrency=1, warmup_s=0.0), window_s=0.3)
        assert m.errors >= 1 and error.startswith(said)
        assert TARGETS.violation(m) == math.inf


# --- the outputs and the arguments -------------------------------------------------------------------------

def test_written_properties_parse_back(tmp_path):
    props = {"option.max_rolling_batch_size": "8", "option.async_scheduling": "false", "option.target_tpot_ms": "90",
             "option.quantize": "int8", "option.model_id": "C:\\models\\x",
             "option.chat_template": "{{ a }}\n\t{{ b }}",
             "odd key=:#": "v"}
    path = tmp_path / "serving.properties"
    write_properties(str(path), props, "lmi tune: seqs=8 sync\nsecond line: 1.50x the defaults")
    assert read_properties(str(path)) == props
    assert path.read_text().splitlines()[:2] == ["# lmi tune: seqs=8 sync", "# second line: 1.50x the defaults"]


def test_durations():
    assert [tune.parse_duration(t) for t in ("90s", "15m", "1h30m", "600", "2.5m", " 1h ")] == [
        90, 900, 5400, 600, 150, 3600]
    for bad in ("", "abc", "5x", "m"):
        with pytest.raises(argparse.ArgumentTypeError):
            tune.parse_duration(bad)


def test_the_tune_command_line(capsys):
    args = cli.parser().parse_args(["tune", "--model-dir", "m", "--concurrency", "16", "--ttft-p90", "1",
                                    "--tpot-p90", "0.150", "--budget", "15m"])
    assert args.fn is cli.cmd_tune
    assert (args.budget, args.concurrency, args.rate, args.ttft_p90, args.tpot_p90) == (900, 16, None, 1.0, 0.15)
    assert (args.prompt_tokens, args.output_tokens, args.spread) == (128, 64, 0.25)
    assert args.out == "tuned/serving.properties"
    for wrong in (["--concurrency", "4", "--rate", "2"], ["--budget", "soon"]):
        with pytest.raises(SystemExit):
            cli.parser().parse_args(["tune", "--model-dir", "m", *wrong])
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["tune"])
    assert "--model-dir" in capsys.readouterr().err


# --- one real run ---------------------------------------------------------------------------------------------

def test_lmi_tune_on_the_tiny_model(tiny_model, tmp_path, monkeypatch, capsys):
    """One candidate (the defaults: 2 clients make max_num_seqs 2 the only other, and the budget has room
    for one start), served for real, measured, written; no final comparison (--verify-rounds 0)."""
    monkeypatch.setattr(tune, "DEFAULT_OVERHEAD_S", 6.0)
    out = tmp_path / "tuned" / "serving.properties"
    rc = cli.main(["tune", "--model-dir", str(tiny_model), "--knobs", "max_num_seqs", "--concurrency", "2",
                   "--prompt-tokens", "8", "--output-tokens", "4", "--spread", "0", "--ttft-p90", "30",
                   "--tpot-p90", "5", "--budget", "9s", "--warmup", "0.5", "--min-window", "2", "--max-window", "2",
                   "--verify-rounds", "0", "--no-progress", "--out", str(out)])
    said = capsys.readouterr().out
    record = json.loads((out.parent / "tune.json").read_text())
    assert [t["name"] for t in record["trials"]] == ["defaults"], said
    m = record["trials"][0]["measurement"]
    assert m["num_requests"] > 0 and m["errors"] == 0 and m["throughput"] > 0
    assert record["verdict"]["text"] == ("no time was left for the fresh comparison: defaults is the search's best "
                                         "by its own measurements")
    assert parse_properties(out.read_text()) == {}  # the defaults: nothing to change
    assert "| defaults |" in (out.parent / "tune.md").read_text()
    try:  # (matplotlib is the bench extra's, not a dependency: without it the run says so instead)
        import matplotlib  # noqa: F401
        assert (out.parent / "frontier.png").stat().st_size > 0
    except ImportError:
        assert not (out.parent / "frontier.png").exists() and "matplotlib is not installed" in said
    assert "verdict: no time was left" in said and rc == 1  # not measured fresh: not known to meet the targets
