"""Native model code against the transformers fallback, per family, in one run.

    python -m benchmarks.families --rounds 3 --out benchmarks/results/families.json

Each family of container/model_maker.FAMILIES is written at the `mini` shape (hidden 256, 4 layers;
the family's own settings on top: head_dim, windows, softcaps, experts) in bf16. A measurement:
`--batch` requests of `--prompt` random tokens and `--new` greedy tokens (ignore_eos), added at
once and stepped to the end, offline through the engine API; tok/s counts generated tokens over the
whole run (prefill included). Native: the paged engine on our model code (what a family we
implement gets by default). Fallback: the padded rolling engine on transformers' model, which is
what `option.trust_remote_code=true` or an architecture we do not implement gets. Each measurement
runs in a fresh process; rounds interleave native and fallback per family; the table reports
medians and the ratio of medians. Greedy agreement of the two on the first request is checked
(bf16: the two compute in different orders, so a late divergence is reported, not failed).
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


def measure_one(model_dir: str, native: bool, batch: int, prompt: int, new: int) -> dict:
    import random

    from engines.config import ENGINE_PAGED, ENGINE_ROLLING, LmiConfig, ModelConfig, SchedulerConfig
    from engines.protocol import Add
    from engines.sampling_params import SamplingParams
    from engines.serve import build_engine
    from engines.dist import SingleProcess

    tokens: dict[str, list[int]] = {}

    def publish(outputs):
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.token_ids)

    config = LmiConfig(model=ModelConfig(local_dir=model_dir, dtype="bf16", trust_remote_code=not native),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_PAGED if native else ENGINE_ROLLING,
                                                 max_num_seqs=batch, max_num_batched_tokens=max(1024, batch * prompt),
                                                 kv_cache_memory="256MiB"))
    engine = build_engine(config, publish, SingleProcess())
    engine.load()
    assert engine.runner.is_native == native
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    for i in range(batch):
        engine.add(Add(f"r{i}", [rng.randrange(3, 1000) for _ in range(prompt)], params))
    started = time.perf_counter()
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - started
    generated = sum(len(t) for t in tokens.values())
    assert generated == batch * new, (generated, batch * new)
    return {"tok_s": generated / wall, "wall_s": wall, "first": tokens["r0"]}


def run_one(model_dir: str, native: bool, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.families", "--one", model_dir, "--batch", str(args.batch),
           "--prompt", str(args.prompt), "--new", str(args.new)] + (["--native"] if native else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{model_dir} ({'native' if native else 'fallback'}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.families")
    p.add_argument("--families", help="comma-separated (default: every family of container/model_maker)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/families.json")
    p.add_argument("--native", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one, args.native, args.batch, args.prompt, args.new)))
        return 0

    from container.model_maker import FAMILIES, make_model
    from engines.models.registry import fallback_reason
    from engines.models.spec import ModelSpec

    families = args.families.split(",") if args.families else list(FAMILIES)
    root = tempfile.mkdtemp(prefix="lmi-families-")
    dirs, reasons = {}, {}
    for family in families:
        dirs[family] = os.path.join(root, family)
        make_model(dirs[family], arch=family, size="mini", seed=0, dtype="bfloat16", rope_form="legacy")
        reasons[family] = fallback_reason(ModelSpec.read(dirs[family]))
    runs: dict[str, dict[str, list[dict]]] = {f: {"native": [], "fallback": []} for f in families}
    for r in range(args.rounds):
        for family in families:
            for way in ("native", "fallback") if reasons[family] is None else ("fallback",):
                runs[family][way].append(run_one(dirs[family], way == "native", args))
                print(f"round {r + 1} {family:>16} {way:>8}: {runs[family][way][-1]['tok_s']:8.1f} tok/s",
                      file=sys.stderr)
    rows = []
    for family in families:
        med = {way: statistics.median(x["tok_s"] for x in runs[family][way]) if runs[family][way] else None
               for way in ("native", "fallback")}
        same = agreement(runs[family]["native"][0]["first"], runs[family]["fallback"][0]["first"]) \
            if med["native"] else None
        rows.append({"family": family, "architecture": ModelSpec.read(dirs[family]).architecture,
                     "native_tok_s": med["native"], "fallback_tok_s": med["fallback"],
                     "ratio": med["native"] / med["fallback"] if med["native"] else None,
                     "greedy_agreement": same, "fallback_reason": reasons[family],
                     "native_rounds": [x["tok_s"] for x in runs[family]["native"]],
                     "fallback_rounds": [x["tok_s"] for x in runs[family]["fallback"]]})
    print(f"\n{args.batch} requests x {args.prompt} prompt / {args.new} new tokens, bf16, mini shape, "
          f"median of {args.rounds} interleaved rounds\n")
    print(f"{'family':>16} {'architecture':>22} {'native tok/s':>13} {'fallback tok/s':>15} {'ratio':>6} "
          f"{'same tokens':>12}")
    for row in rows:
        native = f"{row['native_tok_s']:.1f}" if row["native_tok_s"] else "-"
        ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
        same = f"{row['greedy_agreement']}/{args.new}" if row["greedy_agreement"] is not None else "-"
        print(f"{row['family']:>16} {row['architecture']:>22} {native:>13} {row['fallback_tok_s']:>15.1f} "
              f"{ratio:>6} {same:>12}" + (f"   fallback only: {row['fallback_reason']}" if row["fallback_reason"]
                                          else ""))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"batch": args.batch, "prompt": args.prompt, "new": args.new, "rounds": args.rounds, "rows": rows},
                  f, indent=2)
    plot(rows, os.path.splitext(args.out)[0] + ".png")
    return 0


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["native_tok_s"] or 0 for r in rows], width=0.4, label="native (paged)")
    ax.bar([x + 0.2 for x in xs], [r["fallback_tok_s"] for r in rows], width=0.4, label="transformers fallback")
    ax.set_xticks(list(xs), [r["family"] for r in rows], rotation=45, ha="right")
    ax.set_ylabel("generated tok/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
