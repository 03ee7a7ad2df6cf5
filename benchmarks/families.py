"""Native model code against the transformers fallback, per family, in one run.

    python -m benchmarks.families --rounds 2 --out benchmarks/results/families.json

Each family of container/model_maker.FAMILIES is written at the `--size` shape (default `small`:
hidden 768, 12 layers; the family's own settings on top: head_dim, windows, softcaps, experts) in
bf16. A measurement:
`--batch` requests of `--prompt` random tokens and `--new` greedy tokens (ignore_eos), added at
once and stepped to the end, offline through the engine API; tok/s counts generated tokens over the
whole run (prefill included). Three ways to run a model:

- native: our model code in the paged engine (what a family we implement gets by default);
- hf-paged: transformers' model with its attention on our paged KV cache (`option.model_impl=
  transformers`; what an architecture we do not implement gets when its transformers code goes
  through transformers' attention interface);
- hf-padded: transformers' model with its own cache in the padded engine (what the rest gets, and
  `option.trust_remote_code=true`).

Each measurement runs in a fresh process; rounds interleave the ways per family; the table reports
medians and the ratios of medians to hf-padded. Greedy agreement with hf-padded on the first
request is reported (bf16: the ways compute in different orders, so a late divergence can happen).
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

from benchmarks.plots import pyplot


WAYS = ("native", "hf-paged", "hf-padded")


def measure_one(model_dir: str, way: str, batch: int, prompt: int, new: int) -> dict:
    import random

    from engines.config import ENGINE_PAGED, ENGINE_ROLLING, LmiConfig, ModelConfig, SchedulerConfig
    from engines.protocol import Add
    from engines.sampling_params import SamplingParams
    from engines.process.serve import build_engine
    from engines.dist import SingleProcess

    tokens: dict[str, list[int]] = {}

    def publish(outputs):
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.token_ids)

    config = LmiConfig(model=ModelConfig(local_dir=model_dir, dtype="bf16", trust_remote_code=way == "hf-padded",
                                         model_impl="transformers" if way == "hf-paged" else "native"),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_ROLLING if way == "hf-padded" else ENGINE_PAGED,
                                                 max_num_seqs=batch, max_num_batched_tokens=max(1024, batch * prompt),
                                                 kv_cache_memory="256MiB"))
    engine = build_engine(config, publish, SingleProcess())
    engine.load()
    assert (engine.runner.is_native, engine.runner.owns_kv) == {"native": (True, True), "hf-paged": (False, True),
                                                                "hf-padded": (False, False)}[way]
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


def run_one(model_dir: str, way: str, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.families", "--one", model_dir, "--way", way, "--batch", str(args.batch),
           "--prompt", str(args.prompt), "--new", str(args.new)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{model_dir} ({way}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.families")
    p.add_argument("--families", help="comma-separated (default: every family of container/model_maker)")
    p.add_argument("--size", default="small", help="a container/model_maker size (tiny, mini, small, 1b)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/families.json")
    p.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one, args.way, args.batch, args.prompt, args.new)))
        return 0

    from container.model_maker import FAMILIES, make_model
    from engines.models.registry import attention_interface_supported, fallback_reason
    from engines.spec import ModelSpec

    families = args.families.split(",") if args.families else list(FAMILIES)
    root = tempfile.mkdtemp(prefix="lmi-families-")
    dirs, specs, ways = {}, {}, {}
    for family in families:
        dirs[family] = os.path.join(root, family)
        make_model(dirs[family], arch=family, size=args.size, seed=0, dtype="bfloat16", rope_form="legacy")
        specs[family] = spec = ModelSpec.read(dirs[family])
        ways[family] = [w for w in WAYS if w != "native" or fallback_reason(spec) is None]
        ways[family] = [w for w in ways[family] if w != "hf-paged" or attention_interface_supported(spec.model_type)]
    runs: dict[str, dict[str, list[dict]]] = {f: {w: [] for w in WAYS} for f in families}
    for r in range(args.rounds):
        for family in families:
            for way in ways[family]:
                runs[family][way].append(run_one(dirs[family], way, args))
                print(f"round {r + 1} {family:>16} {way:>9}: {runs[family][way][-1]['tok_s']:8.1f} tok/s",
                      file=sys.stderr)
    rows = []
    for family in families:
        med = {w: statistics.median(x["tok_s"] for x in runs[family][w]) if runs[family][w] else None for w in WAYS}
        base = runs[family]["hf-padded"][0]["first"]
        rows.append({"family": family, "architecture": specs[family].architecture,
                     **{f"{w}_tok_s": med[w] for w in WAYS},
                     **{f"{w}_ratio": med[w] / med["hf-padded"] if med[w] else None for w in WAYS[:2]},
                     **{f"{w}_same_tokens": agreement(runs[family][w][0]["first"], base) if runs[family][w] else None
                        for w in WAYS[:2]},
                     "fallback_reason": fallback_reason(specs[family]),
                     "rounds": {w: [x["tok_s"] for x in runs[family][w]] for w in WAYS}})
    print(f"\n{args.batch} requests x {args.prompt} prompt / {args.new} new tokens, bf16, {args.size} shape, "
          f"median of {args.rounds} interleaved rounds; ratios to hf-padded; same: leading greedy tokens equal to "
          f"hf-padded's (of {args.new})\n")
    print(f"{'family':>15} {'architecture':>20} {'native':>8} {'hf-paged':>9} {'hf-padded':>10} {'native x':>9} "
          f"{'hf-paged x':>11} {'same':>9}")

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for row in rows:
        same = "/".join(fmt(row[f"{w}_same_tokens"], "d") for w in WAYS[:2])
        print(f"{row['family']:>15} {row['architecture']:>20} {fmt(row['native_tok_s'], '.1f'):>8} "
              f"{fmt(row['hf-paged_tok_s'], '.1f'):>9} {row['hf-padded_tok_s']:>10.1f} "
              f"{fmt(row['native_ratio'], '.2f'):>9} {fmt(row['hf-paged_ratio'], '.2f'):>11} {same:>9}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"size": args.size, "batch": args.batch, "prompt": args.prompt, "new": args.new, "rounds": args.rounds, "rows": rows},
                  f, indent=2)
    plot(rows, os.path.splitext(args.out)[0] + ".png")
    return 0


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(11, 4))
    xs = range(len(rows))
    for i, (way, label) in enumerate(zip(WAYS, ("native (paged)", "transformers on our paged KV",
                                                "transformers, own cache (padded)"))):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [r[f"{way}_tok_s"] or 0 for r in rows], width=0.27, label=label)
    ax.set_xticks(list(xs), [r["family"] for r in rows], rotation=45, ha="right")
    ax.set_ylabel("generated tok/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
