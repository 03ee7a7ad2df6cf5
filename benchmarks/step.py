"""The paged engine offline (no server): generated tok/s, the decode step against the model's
linears alone, this tree against a baseline commit, interleaved in one run.

    python -m benchmarks.step --model-dir models/small --batch 32,64 --rounds 3 \
        --baseline 0c3b637 --out benchmarks/results/step_small.json
    python -m benchmarks.step --model-dir models/small --batch 32 --rounds 3 --compile \
        --out benchmarks/results/step_compile_small.json      # eager vs option.cpu_compile
    python -m benchmarks.step --model-dir models/small --batch 32 --rounds 3 --quantize int8,int4 \
        --out benchmarks/results/quant_small.json             # bf16 vs option.quantize=int8 / int4

Each measurement runs in a fresh process (`--one`), so the two trees never share a process: the
baseline's is a `git worktree` of `--baseline` in a temporary directory, driven through the same
engine API (`PagedEngine(config, publish)`, `add`, `step`). A measurement: `batch` requests of
`prompt` random tokens and `new` greedy tokens (ignore_eos), all added at once, stepped to the end;
tok/s counts generated tokens over the whole run (prefill included), and the decode step is the
median time of steps that only decode with every request running. The linears alone: every
linear of the model (q/k/v, o, gate/up, down per layer, LM head) at the same batch, eager, median
of 20, in the same process as the tree's measurement. Rounds interleave trees and batch sizes.
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


def measure_one(model_dir: str, batch: int, prompt: int, new: int, dtype: str, compile_cache: str | None = None,
                quantize: str | None = None) -> dict:
    """compile_cache: run with option.cpu_compile (torch.compile'd decode steps, cached there);
    quantize: option.quantize."""
    import random

    from engines.config import ENGINE_PAGED, LmiConfig, ModelConfig, SchedulerConfig
    from engines.protocol import Add
    from engines.sampling_params import SamplingParams
    from engines.loop.paged_engine import PagedEngine

    generated = [0]

    def publish(outputs):
        generated[0] += sum(len(o.token_ids) for o in outputs)

    config = LmiConfig(model=ModelConfig(local_dir=model_dir, dtype=dtype, **({"quantize": quantize} if quantize else {})),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_PAGED, max_num_seqs=batch,
                                                 max_num_batched_tokens=max(1024, batch * prompt),
                                                 kv_cache_memory="512MiB",
                                                 # (a baseline tree may predate these settings)
                                                 **({"cpu_compile": True, "compile_cache_dir": compile_cache}
                                                    if compile_cache else {})))
    engine = PagedEngine(config, publish)
    load_started = time.perf_counter()
    engine.load()
    load_s = time.perf_counter() - load_started
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    for i in range(batch):
        engine.add(Add(f"r{i}", [rng.randrange(3, 1000) for _ in range(prompt)], params))
    wall, steps = run_to_end(engine)
    assert generated[0] == batch * new, (generated[0], batch * new)
    decode_steps = steps[2:-1]  # every request decoding (the first step prefills every prompt)
    linears = linears_alone(engine.runner.model, batch, compiled=compile_cache is not None)
    return {"tok_s": generated[0] / wall, "wall_s": wall, "decode_step_ms": 1e3 * statistics.median(decode_steps),
            "linears_ms": linears, "num_steps": len(steps), "load_s": load_s}


def run_to_end(engine) -> tuple[float, list[float]]:
    """Step the engine until it has no work: (wall seconds, each step's seconds)."""
    steps = []
    started = time.perf_counter()
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return time.perf_counter() - started, steps


def linears_alone(model, batch: int, compiled: bool = False) -> float:
    """Milliseconds for every linear layer's weight at `batch` rows, median of 20, multiplied as the
    engine multiplies them (engines.layers.linear.linear: bf16 upcast to float32 where the engine
    measured that faster), eager or (for the compiled engine) compiled by torch.compile (inductor)."""
    import torch

    try:
        from engines.layers.linear import linear
    except ImportError:  # a baseline tree from before it: plain bf16 products
        linear = torch.nn.functional.linear

    def is_linear(w) -> bool:  # a 2-D weight, or option.quantize's packed one (engines/layers/quant.py)
        return hasattr(w, "method") or isinstance(w, torch.Tensor) and w.dim() == 2

    weights = [(m.weight, m.weight.in_features if hasattr(m.weight, "method") else m.weight.shape[1])
               for m in model.modules() if is_linear(getattr(m, "weight", None))
               and type(m).__name__ != "VocabParallelEmbedding"]
    dtype = model.embed_tokens.weight.dtype  # the linears may be kernels (engines/layers/cpu_linear.py)
    xs = {k: torch.randn(batch, k, dtype=dtype) for _, k in weights}

    def run_all():  # the outputs are returned: a compiled function would drop unused products
        return [linear(xs[k], w) for w, k in weights]

    fn = torch.compile(run_all) if compiled else run_all
    times = []
    with torch.inference_mode():
        for i in range(22):
            t = time.perf_counter()
            fn()
            if i >= 2:
                times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def run_one(tree: str, args, batch: int, compile_cache: str | None = None, quantize: str | None = None) -> dict:
    extra = (["--compile-cache", compile_cache] if compile_cache else []) + (["--quantize", quantize] if quantize else [])
    out = subprocess.run([sys.executable, "-m", "benchmarks.step", "--one", "--model-dir", os.path.abspath(args.model_dir),
                          "--batch", str(batch), "--prompt", str(args.prompt), "--new", str(args.new),
                          "--dtype", args.dtype, *extra], cwd=tree, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"measurement in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--batch", default="32", help="comma-separated batch sizes")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", help="a commit to compare with (run from a temporary git worktree)")
    p.add_argument("--out", default="benchmarks/results/step.json")
    p.add_argument("--compile", action="store_true",
                   help="also this tree with option.cpu_compile (its compile cache is kept across rounds)")
    p.add_argument("--quantize", help="also this tree with option.quantize, each of a comma-separated list (int8,int4)")
    p.add_argument("--compile-cache", help=argparse.SUPPRESS)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    if args.one:
        print(json.dumps(measure_one(args.model_dir, batches[0], args.prompt, args.new, args.dtype, args.compile_cache,
                                     args.quantize)))
        return 0

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this tree": root}
    compile_cache = tempfile.mkdtemp(prefix="lmi-compile-cache-") if args.compile else None
    if args.compile:
        trees["this tree, compiled"] = root
    methods = {f"this tree, {q}": q for q in (args.quantize or "").split(",") if q}
    trees.update(dict.fromkeys(methods, root))
    worktree = None
    if args.baseline:
        worktree = tempfile.mkdtemp(prefix="lmi-baseline-")
        subprocess.run(["git", "worktree", "add", "--detach", "-f", worktree, args.baseline], cwd=root, check=True,
                       capture_output=True)
        os.makedirs(os.path.join(worktree, "benchmarks"), exist_ok=True)
        with open(os.path.join(root, "benchmarks", "step.py")) as src, \
                open(os.path.join(worktree, "benchmarks", "step.py"), "w") as dst:
            dst.write(src.read())  # the same driver against the baseline's engine
        trees[f"baseline {args.baseline}"] = worktree
    runs: dict[tuple[str, int], list[dict]] = {(t, b): [] for t in trees for b in batches}
    try:
        for r in range(args.rounds):
            for b in batches:
                for name, tree in trees.items():
                    res = run_one(tree, args, b, compile_cache if name.endswith("compiled") else None, methods.get(name))
                    runs[(name, b)].append(res)
                    print(f"  round {r + 1} batch {b:>3} {name:<22} {res['tok_s']:7.1f} tok/s  decode step "
                          f"{res['decode_step_ms']:6.1f} ms  linears {res['linears_ms']:6.1f} ms  "
                          f"load {res.get('load_s', float('nan')):5.1f} s", flush=True)
    finally:
        if worktree:
            subprocess.run(["git", "worktree", "remove", "--force", worktree], cwd=root, capture_output=True)

    def med(name, b, key):
        return statistics.median(x[key] for x in runs[(name, b)])

    table = []
    print(f"\n{args.model_dir}, {args.dtype}, {args.prompt} in / {args.new} out, medians of {args.rounds} rounds")
    print(f"  {'tree':<22} {'batch':>5} {'tok/s':>8} {'step ms':>8} {'linears ms':>10} {'step/linears':>12}")
    for b in batches:
        for name in trees:
            row = {"tree": name, "batch": b, "tok_s": med(name, b, "tok_s"), "decode_step_ms": med(name, b, "decode_step_ms"),
                   "linears_ms": med(name, b, "linears_ms"),
                   "load_s": [x.get("load_s") for x in runs[(name, b)]]}
            row["step_over_linears"] = row["decode_step_ms"] / row["linears_ms"]
            table.append(row)
            print(f"  {name:<22} {b:>5} {row['tok_s']:>8.1f} {row['decode_step_ms']:>8.1f} {row['linears_ms']:>10.1f} "
                  f"{row['step_over_linears']:>12.2f}")
        rows = {r["tree"]: r for r in table if r["batch"] == b}
        for name in trees:
            if name != "this tree":
                print(f"  batch {b}: {name} / this tree = {rows[name]['tok_s'] / rows['this tree']['tok_s']:.2f}x tok/s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "table": table, "runs": {f"{t}|{b}": v for (t, b), v in runs.items()}}, f,
                  indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
