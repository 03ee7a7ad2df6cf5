"""Fewer forwards per token, no idle device: speculative decoding, multi-step decode and async
scheduling against plain decoding, in one process, interleaved, medians of rounds.

    lmi make-model models/small-copy --size small --copy     # outputs that repeat (random weights never do)
    python -m benchmarks.speculative --model-dir models/small-copy --unrelated-dir models/tiny --rounds 3 \
        --out benchmarks/results/speculative_small_copy.json

The paged engine is driven offline (PagedEngine: add, step). Each configuration runs in a fresh
process (`--one`), the configurations in turn each round, so that the machine's drift hits them
alike; one process per configuration also because torch work on two threads of one process (a
sync engine's on the main thread, an async one's on its step thread) slows both (docs/paged.md).

1. Speculative decoding at concurrency 1 and 4: the prompts repeat a list ("... a; b; c; a; b; c;
   a; b;"), the output is what the model makes of it. Per configuration: generated tok/s (every
   request added at once, timed to the last token), TPOT (median over requests of (last token time
   - first token time) / (tokens - 1)), the acceptance rate and the tokens per verification.
   Configurations: off, n-gram prompt lookup (k = 3), a 2-layer draft cut from the model
   (`lmi make-model --draft-of`, k = 3), an unrelated tiny model as the draft (k = 3: acceptance
   near zero, the overhead), and the model as its own draft (k = 3: every greedy guess right, the
   most verification can give for the price of a draft as large as the model).
2. Multi-step decode and async scheduling at concurrency 32: generated tok/s, and per generated
   token the time the forward does not run ("idle": wall time minus the time inside the runner's
   forward, on whichever thread) and the host work of the engine's own thread (schedule, update,
   publish).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SPEC_CONFIGS = {
    "off": {},
    "ngram k=3": dict(speculative_method="ngram", num_speculative_tokens=3),
    "draft 2-layer k=3": dict(speculative_method="draft", speculative_model="{derived}", num_speculative_tokens=3),
    "draft unrelated k=3": dict(speculative_method="draft", speculative_model="{unrelated}", num_speculative_tokens=3),
    "draft = model k=3": dict(speculative_method="draft", speculative_model="{model}", num_speculative_tokens=3),
}
STEP_CONFIGS = {
    "sync, 1 step": dict(async_scheduling=False),
    "async": dict(async_scheduling=True),
    "multi-step 4": dict(num_scheduler_steps=4),
    "multi-step 8": dict(num_scheduler_steps=8),
}


def list_prompts(model_dir: str, count: int) -> list[list[int]]:
    """'Repeat this list' prompts: eight corpus words, three times and a half."""
    from container.model_maker import corpus_lines
    from handlers.tokenizer import TextTokenizer

    tok = TextTokenizer(model_dir)
    lines = corpus_lines()
    prompts = []
    for i in range(count):
        words = " ".join(lines[10 + i].split()[:8]).split()
        items = "; ".join(words)
        prompts.append(tok.encode(f"Repeat this list: {items}; {items}; {items}; " + "; ".join(words[:4])))
    return prompts


class Timed:
    """Wall time inside the runner's forwards and the engine thread's host work, by patching.
    (Each configuration runs in a process of its own: the patches are dropped with it.)"""

    def __init__(self, engine):
        self.forward = self.host = 0.0
        runner = engine.paged.target
        runner.forward = self.timed(runner.forward, "forward")
        for name in ("schedule", "update"):
            setattr(engine.scheduler, name, self.timed(getattr(engine.scheduler, name), "host"))

    def timed(self, fn, into: str):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, into, getattr(self, into) + time.perf_counter() - started)
        return timed


def make_engine(model_dir: str, concurrency: int, sched: dict):
    from engines.config import ENGINE_PAGED, LmiConfig, ModelConfig, SchedulerConfig
    from engines.loop.paged_engine import PagedEngine

    config = LmiConfig(model=ModelConfig(local_dir=model_dir, dtype="bf16"),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_PAGED, max_num_seqs=concurrency,
                                                 kv_cache_memory="256MiB", **sched))
    engine = PagedEngine(config, lambda outputs: None)
    engine.load()
    return engine


def run_once(engine, prompts: list[list[int]], new: int, timed: Timed) -> dict:
    from engines.protocol import Add
    from engines.sampling_params import SamplingParams

    times: dict[str, list[float]] = {}
    counts: dict[str, int] = {}

    def publish(outputs):
        now = time.perf_counter()
        for o in outputs:
            times.setdefault(o.request_id, []).append(now)
            counts[o.request_id] = counts.get(o.request_id, 0) + len(o.token_ids)

    timed.forward = timed.host = 0.0
    engine.publish = timed.timed(publish, "host")
    spec_before = dict(engine.spec.metrics())
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    started = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add(Add(f"r{i}-{started}", p, params))
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - started
    generated = sum(counts.values())
    assert generated == new * len(prompts), (generated, new * len(prompts))
    # TPOT: a request's later tokens over the time between its first and its last output
    tpot = statistics.median((t[-1] - t[0]) / (counts[rid] - 1) for rid, t in times.items())
    spec = engine.spec.metrics()
    proposed = spec["spec_proposed_tokens"] - spec_before["spec_proposed_tokens"]
    accepted = spec["spec_accepted_tokens"] - spec_before["spec_accepted_tokens"]
    verifications = spec["spec_verifications"] - spec_before["spec_verifications"]
    return {"tok_s": generated / wall, "tpot_ms": 1e3 * tpot, "wall_s": wall,
            "idle_ms_per_token": 1e3 * (wall - timed.forward) / generated,
            "host_ms_per_token": 1e3 * timed.host / generated,
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_verification": (accepted + verifications) / verifications if verifications else None}


def summarise(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    out["rounds"] = runs
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, conc in zip(axes[:2], ("1", "4")):
        rows = results["speculative"][conc]
        names = list(rows)
        ax.bar(range(len(names)), [rows[n]["tok_s"] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"speculative decoding, concurrency {conc}")
        ax.set_ylabel("generated tok/s")
    rows = results["steps"]
    names = list(rows)
    axes[2].bar(range(len(names)), [rows[n]["tok_s"] for n in names])
    axes[2].set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    axes[2].set_title(f"multi-step / async, concurrency {results['step_concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def configurations(args, paths: dict) -> dict[str, tuple[int, dict, int]]:
    """name -> (concurrency, scheduler settings, new tokens)."""
    out = {}
    if args.only != "steps":
        for conc in (1, 4):
            for name, sched in SPEC_CONFIGS.items():
                sched = {k: v.format(**paths) if isinstance(v, str) else v for k, v in sched.items()}
                out[f"speculative|{conc}|{name}"] = (conc, sched, args.new)
    if args.only != "speculative":
        for name, sched in STEP_CONFIGS.items():
            out[f"steps|{name}"] = (args.step_concurrency, sched, args.step_new)
    return out


def measure(model: str, conc: int, sched: dict, new: int) -> dict:
    """One configuration in this process: load, a short warm run (each shape's kernels), the run."""
    engine = make_engine(model, conc, sched)
    prompts = list_prompts(model, conc)
    timed = Timed(engine)
    run_once(engine, prompts, 8, timed)
    result = run_once(engine, prompts, new, timed)
    engine.stop_ranks()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--draft-dir", help="the 2-layer draft (default: MODEL_DIR-draft2, written when missing)")
    p.add_argument("--unrelated-dir", default="models/tiny", help="an unrelated model with the same tokenizer")
    p.add_argument("--new", type=int, default=96, help="tokens generated per request")
    p.add_argument("--step-concurrency", type=int, default=32)
    p.add_argument("--step-new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=("speculative", "steps"))
    p.add_argument("--out", default="benchmarks/results/speculative.json")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    model = os.path.abspath(args.model_dir)
    derived = args.draft_dir or model.rstrip("/") + "-draft2"
    paths = {"model": model, "derived": os.path.abspath(derived), "unrelated": os.path.abspath(args.unrelated_dir)}
    configs = configurations(args, paths)
    if args.one:  # a child: one configuration, its result as the last line
        print(json.dumps(measure(model, *configs[args.one])))
        return 0
    if not os.path.isdir(derived):
        from container.model_maker import make_draft

        make_draft(model, derived, num_layers=2)
    results: dict = {"model": model, "new_tokens": args.new, "rounds": args.rounds,
                     "step_concurrency": args.step_concurrency, "speculative": {}, "steps": {}}
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):  # each configuration in a fresh process, interleaved
        for key in configs:
            child = subprocess.run([sys.executable, "-m", "benchmarks.speculative", *(argv or sys.argv[1:]), "--one", key],
                                   capture_output=True, text=True)
            if child.returncode:
                raise RuntimeError(f"{key} failed:\n{child.stderr[-3000:]}")
            runs.setdefault(key, []).append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {key}: {runs[key][-1]['tok_s']:.1f} tok/s", flush=True)
    for key, rs in runs.items():
        part, *rest = key.split("|")
        if part == "speculative":
            results["speculative"].setdefault(rest[0], {})[rest[1]] = summarise(rs)
        else:
            results["steps"][rest[0]] = summarise(rs)
    report(results, args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    if results["speculative"] and results["steps"]:
        plot(results, os.path.splitext(args.out)[0] + ".png")
    return 0


def report(results: dict, args) -> None:
    for conc, rows in results["speculative"].items():
        base = rows["off"]
        print(f"\nspeculative decoding, concurrency {conc}, {args.new} new tokens, medians of {args.rounds}")
        print(f"{'':22} {'tok/s':>8} {'vs off':>7} {'TPOT ms':>8} {'vs off':>7} {'accept':>7} {'tok/verif':>9}")
        for name, row in rows.items():
            acc = f"{row['acceptance_rate']:.3f}" if row["acceptance_rate"] is not None else "-"
            tpv = f"{row['tokens_per_verification']:.2f}" if row["tokens_per_verification"] is not None else "-"
            print(f"{name:22} {row['tok_s']:8.1f} {row['tok_s'] / base['tok_s']:7.2f} {row['tpot_ms']:8.1f} "
                  f"{row['tpot_ms'] / base['tpot_ms']:7.2f} {acc:>7} {tpv:>9}")
    if results["steps"]:
        rows = results["steps"]
        base = rows["sync, 1 step"]
        print(f"\nmulti-step and async scheduling, concurrency {args.step_concurrency}, {args.step_new} new tokens, "
              f"medians of {args.rounds}")
        print(f"{'':16} {'tok/s':>8} {'vs sync':>8} {'idle ms/tok':>12} {'host ms/tok':>12}")
        for name, row in rows.items():
            print(f"{name:16} {row['tok_s']:8.1f} {row['tok_s'] / base['tok_s']:8.2f} {row['idle_ms_per_token']:12.3f} "
                  f"{row['host_ms_per_token']:12.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
