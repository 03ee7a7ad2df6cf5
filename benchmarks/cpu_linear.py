"""The CPU linear kernels side by side (engines/layers/cpu_linear.py) as a decode step meets them: every
linear weight of the model (its layers' fused q/k/v, o, fused gate/up and down at TP=1; the LM head
aside), each multiplied once in turn, so that the weights come from memory as they do in a step (one
layer's four weights fit in a large L3 and would measure cache speed instead). Ms per pass over all
of them, at one row (a lone client's decode) and at batches, each kernel and precision, the one
`option.cpu_linear=auto` picks for dense weights, and the host's CPU flags.

    python -m benchmarks.cpu_linear --model-dir models/small --out benchmarks/results/cpu_linear_small.json

Kernels are timed alternately, pass after pass (`--rounds`); the median of each is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings


def shapes(model_dir: str) -> tuple[list[tuple[int, int]], int]:
    """One layer's linear shapes [(out, in)] and the number of layers."""
    from engines.spec import ModelSpec

    s = ModelSpec.read(model_dir, None)
    head = s.head_dim
    return ([((s.num_heads + 2 * s.num_kv_heads) * head, s.hidden_size), (s.hidden_size, s.num_heads * head),
             (2 * s.intermediate_size, s.hidden_size), (s.hidden_size, s.intermediate_size)], s.num_layers)


def kernels_for(weights) -> dict:
    """Every candidate kernel of every weight kind for these dense weights (float32 or bf16) → name →
    [kernel per weight]."""
    import torch

    from engines.layers import cpu_linear
    from engines.layers.quant import Int4Weight, Int8DynamicWeight, Int8Weight

    label = "fp32" if weights[0].dtype == torch.float32 else "bf16"
    out: dict[str, list] = {}
    for c in cpu_linear.candidates(weights[0], weights[0].dtype):
        out[f"{label} {c.name}"] = [c.wrap(w) if c.wrap else w for w in weights]
    for cls in (Int8Weight, Int4Weight):
        packed = [cls(w) for w in weights]
        for c in cpu_linear.candidates(packed[0], weights[0].dtype):
            out[f"{label} {cls.method} {c.name}"] = [c.wrap(q) for q in packed]
    if label == "bf16":
        dyn = [Int8DynamicWeight(w) for w in weights]
        out["int8_dynamic _int_mm"] = dyn
        if cpu_linear.int8_kernel_runs(dyn[0], weights[0].dtype):
            out["int8_dynamic lmi"] = [d.with_kernel(1 << 20) for d in dyn]
    return out


def main(argv=None) -> int:
    import torch

    from engines.layers import cpu_linear
    from engines.layers.linear import linear
    from engines.devices import cpu_flags, describe_cpu

    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_linear")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--rows", default="1,4,32", help="comma-separated row counts")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", default="benchmarks/results/cpu_linear.json")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    rows_list = [int(r) for r in args.rows.split(",")]
    layer, num_layers = shapes(args.model_dir)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(o, i, generator=gen) * 0.02 for _ in range(num_layers) for o, i in layer]
    table: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            kernels = kernels_for([w.to(dtype) for w in base])
            for rows in rows_list:
                xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {i for _, i in layer}}
                ins = [w.shape[1] for w in base]
                times: dict[str, list[float]] = {name: [] for name in kernels}
                for r in range(args.rounds + 1):  # the first round warms every kernel up
                    for name, ks in kernels.items():
                        started = time.perf_counter()
                        for k, n in zip(ks, ins):
                            linear(xs[n], k)
                        if r:
                            times[name].append(time.perf_counter() - started)
                for name, ts in times.items():
                    table.setdefault(name, {})[rows] = 1e3 * statistics.median(ts)
            del kernels
    flags = describe_cpu(cpu_flags())
    print(f"host: {os.cpu_count()} cores, flags: {flags}; ms per pass over the model's {len(base)} linear weights "
          f"({num_layers} layers of {', '.join(f'{o}x{i}' for o, i in layer)}), medians of {args.rounds}")
    print(f"  {'kernel':<24}" + "".join(f"{f'{r} rows':>10}" for r in rows_list))
    for name, per in table.items():
        print(f"  {name:<24}" + "".join(f"{per[r]:>10.2f}" for r in rows_list))
    picks = {}
    for label in ("fp32", "bf16"):
        dense = {k.split()[1]: (v[rows_list[0]], v[rows_list[-1]]) for k, v in table.items()
                 if k.split()[0] == label and len(k.split()) == 2}
        picks[label] = cpu_linear.fastest(dense)
        print(f"  auto's rule on these figures for {label} weights ({rows_list[0]} and {rows_list[-1]} rows): "
              f"{picks[label]}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"host_flags": flags, "cores": os.cpu_count(), "rows": rows_list, "weights": len(base),
                   "ms_per_pass": table, "auto_dense": picks}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
