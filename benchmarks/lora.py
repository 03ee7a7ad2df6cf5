"""LoRA adapters in the paged engine, offline (no server): generated tok/s and the decode step with the
base model only, against the same batch spread evenly over 1, 4 and 8 adapters, interleaved rounds,
each measurement in a fresh process.

    python -m benchmarks.lora --model-dir models/small --rounds 3 --out benchmarks/results/lora_small.json

The adapters (rank 16 on q/k/v/o/gate/up/down, random A and B, written by peft) go into a copy of the
model directory's adapters/ once. A measurement: `batch` requests of `prompt` random tokens and
`new` greedy tokens (ignore_eos), all added at once, stepped to the end: tok/s over the whole run,
the decode step the median of steps that only decode. "base, LoRA on" serves the same requests
with option.enable_lora and no request naming an adapter (the cost of the hooks alone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CONFIGS = {"base only": 0, "base, LoRA on": -1, "1 adapter": 1, "4 adapters": 4, "8 adapters": 8}


def write_adapters(model_dir: str, out: str, count: int, rank: int) -> None:
    """A copy of model_dir (linked files) with `count` adapters under adapters/."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(model_dir):
        if not os.path.exists(os.path.join(out, name)) and name != "adapters":
            os.symlink(os.path.abspath(os.path.join(model_dir, name)), os.path.join(out, name))
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for i in range(count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                                          init_lora_weights=False))
        model.save_pretrained(os.path.join(out, "adapters", f"a{i}"))


def measure_one(model_dir: str, batch: int, prompt: int, new: int, dtype: str, adapters: int, max_loras: int,
                rank: int) -> dict:
    import random

    from engines.config import ENGINE_PAGED, LmiConfig, ModelConfig, SchedulerConfig
    from engines.protocol import Add
    from engines.sampling_params import SamplingParams
    from benchmarks.step import run_to_end
    from engines.loop.paged_engine import PagedEngine

    generated = [0]

    def publish(outputs):
        generated[0] += sum(len(o.token_ids) for o in outputs)

    lora = {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": rank, "max_cpu_loras": max_loras} \
        if adapters else {}
    config = LmiConfig(model=ModelConfig(local_dir=model_dir, dtype=dtype, **lora),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_PAGED, max_num_seqs=batch,
                                                 max_num_batched_tokens=max(1024, batch * prompt),
                                                 kv_cache_memory="512MiB"))
    engine = PagedEngine(config, publish)
    engine.load()
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    for i in range(batch):
        name = f"a{i % adapters}" if adapters > 0 else None  # evenly over the adapters
        engine.add(Add(f"r{i}", [rng.randrange(3, 1000) for _ in range(prompt)], params, name))
    wall, steps = run_to_end(engine)
    assert generated[0] == batch * new, (generated[0], batch * new)
    return {"tok_s": generated[0] / wall, "decode_step_ms": 1e3 * statistics.median(steps[2:-1])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/lora.json")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # adapters of one measurement (-1: LoRA on, none)
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure_one(args.model_dir, args.batch, args.prompt, args.new, args.dtype, args.one,
                                     max(CONFIGS.values()), args.rank)))
        return 0
    work = tempfile.mkdtemp(prefix="lmi-lora-bench-")
    try:
        model = os.path.join(work, "model")
        write_adapters(args.model_dir, model, max(CONFIGS.values()), args.rank)
        runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
        for r in range(args.rounds):
            for name, count in CONFIGS.items():
                out = subprocess.run([sys.executable, "-m", "benchmarks.lora", "--one", str(count), "--model-dir",
                                      model if count else args.model_dir, "--batch", str(args.batch), "--prompt",
                                      str(args.prompt), "--new", str(args.new), "--dtype", args.dtype, "--rank",
                                      str(args.rank)], capture_output=True, text=True)
                if out.returncode:
                    raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                runs[name].append(res)
                print(f"  round {r + 1} {name:<14} {res['tok_s']:7.1f} tok/s  decode step {res['decode_step_ms']:6.1f} ms",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = {k: statistics.median(x[k] for x in runs["base only"]) for k in ("tok_s", "decode_step_ms")}
    table = []
    print(f"\n{args.model_dir}, {args.dtype}, {args.batch} requests, {args.prompt} in / {args.new} out, adapters of "
          f"rank {args.rank} on q/k/v/o/gate/up/down, medians of {args.rounds} rounds")
    print(f"  {'config':<14} {'tok/s':>8} {'x base':>7} {'step ms':>8} {'step +ms':>9}")
    for name in CONFIGS:
        tok_s = statistics.median(x["tok_s"] for x in runs[name])
        step = statistics.median(x["decode_step_ms"] for x in runs[name])
        table.append({"config": name, "tok_s": tok_s, "vs_base": tok_s / base["tok_s"], "decode_step_ms": step,
                      "step_cost_ms": step - base["decode_step_ms"]})
        print(f"  {name:<14} {tok_s:>8.1f} {tok_s / base['tok_s']:>6.2f}x {step:>8.1f} {step - base['decode_step_ms']:>+9.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "table": table, "runs": runs}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
