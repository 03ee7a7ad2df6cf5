"""JSON-schema-constrained decoding against free decoding in the paged engine, offline (no server):
generated tok/s, the decode step, and the grammar's mask time per step, interleaved rounds, each
measurement in a fresh process.

    python -m benchmarks.structured --model-dir models/small --rounds 3 --out benchmarks/results/structured_small.json

A measurement: `batch` requests (32: as 32 clients each with one request in flight) of `prompt`
random tokens and `new` greedy tokens, all added at once, stepped to the end. "constrained": every
request under the schema below (a JSON object with bounded fields and a long free-text field, so that
the grammar is live for the whole reply; ignore_eos keeps each at `new` tokens: once the object is
complete the grammar allows EOS only, still masked every step). Mask time: what llguidance took to
compute the masks (on the thread, overlapping the forward), and what sampling waited for them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "size": {"type": "integer", "minimum": 0, "maximum": 1000},
        "notes": {"type": "string", "maxLength": 600},
    },
    "required": ["name", "colour", "tags", "size", "notes"],
    "additionalProperties": False,
}
CONFIGS = ("unconstrained", "json schema")


def measure_one(model_dir: str, batch: int, prompt: int, new: int, dtype: str, constrained: bool) -> dict:
    import random

    from benchmarks.step import run_to_end
    from engines.config import ENGINE_PAGED, LmiConfig, ModelConfig, SchedulerConfig
    from engines.protocol import Add
    from engines.sampling_params import SamplingParams
    from engines.loop.paged_engine import PagedEngine
    from handlers.structured import compile_grammar

    generated = [0]

    def publish(outputs):
        generated[0] += sum(len(o.token_ids) for o in outputs)

    config = LmiConfig(model=ModelConfig(local_dir=model_dir, dtype=dtype),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_PAGED, max_num_seqs=batch,
                                                 max_num_batched_tokens=max(1024, batch * prompt),
                                                 kv_cache_memory="512MiB"))
    engine = PagedEngine(config, publish)
    engine.load()
    grammar = compile_grammar("json", SCHEMA, "benchmark") if constrained else None
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, grammar=grammar)
    for i in range(batch):
        engine.add(Add(f"r{i}", [rng.randrange(3, 1000) for _ in range(prompt)], params))
    wall, steps = run_to_end(engine)
    assert generated[0] == batch * new, (generated[0], batch * new)
    g = engine.paged.sampler.grammars.metrics()
    n = len(steps)
    return {"tok_s": generated[0] / wall, "decode_step_ms": 1e3 * statistics.median(steps[2:-1]), "steps": n,
            "mask_ms_per_step": 1e3 * g["grammar_mask_seconds"] / n,
            "wait_ms_per_step": 1e3 * g["grammar_wait_seconds"] / n,
            "masks": g["grammar_masks"], "vocab": engine.runner.spec.vocab_size}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/structured.json")
    p.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure_one(args.model_dir, args.batch, args.prompt, args.new, args.dtype,
                                     args.one == "json schema")))
        return 0
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        for name in CONFIGS:
            out = subprocess.run([sys.executable, "-m", "benchmarks.structured", "--one", name, "--model-dir",
                                  args.model_dir, "--batch", str(args.batch), "--prompt", str(args.prompt), "--new",
                                  str(args.new), "--dtype", args.dtype], capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(res)
            print(f"  round {r + 1} {name:<14} {res['tok_s']:7.1f} tok/s  decode step {res['decode_step_ms']:6.1f} ms"
                  f"  masks {res['mask_ms_per_step']:.2f} ms/step (waited {res['wait_ms_per_step']:.2f})", flush=True)
    free = statistics.median(x["tok_s"] for x in runs["unconstrained"])
    ratios = [c["tok_s"] / u["tok_s"] for u, c in zip(runs["unconstrained"], runs["json schema"])]
    table = []
    print(f"\n{args.model_dir} (vocabulary {runs['unconstrained'][0]['vocab']}), {args.dtype}, {args.batch} requests, "
          f"{args.prompt} in / {args.new} out, medians of {args.rounds} rounds")
    print(f"  {'config':<14} {'tok/s':>8} {'x free':>7} {'step ms':>8} {'mask ms/step':>13} {'waited ms/step':>15}")
    for name in CONFIGS:
        med = {k: statistics.median(x[k] for x in runs[name]) for k in ("tok_s", "decode_step_ms", "mask_ms_per_step",
                                                                        "wait_ms_per_step")}
        table.append(dict(config=name, vs_free=med["tok_s"] / free, **med))
        print(f"  {name:<14} {med['tok_s']:>8.1f} {med['tok_s'] / free:>6.2f}x {med['decode_step_ms']:>8.1f} "
              f"{med['mask_ms_per_step']:>13.2f} {med['wait_ms_per_step']:>15.2f}")
    print(f"  median of per-round ratios: {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "schema": SCHEMA, "table": table, "per_round_ratios": ratios, "runs": runs},
                  f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
