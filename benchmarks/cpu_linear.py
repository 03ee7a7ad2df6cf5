"""The CPU linear kernels side by side (engines/layers/cpu_linear.py), on one model's linear shapes, at
one row (a lone client's decode) and at a batch: ms per product, each kernel and precision, the one
`option.cpu_linear=auto` picks, and the host's CPU flags.

    python -m benchmarks.cpu_linear --model-dir models/small --out benchmarks/results/cpu_linear_small.json

Shapes: this model's fused q/k/v, o, fused gate/up and down projections at TP=1. Each product is timed
alternately with the others, the minimum of `--repeats` kept (other work only ever adds time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings


def shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    from engines.models.spec import ModelSpec

    s = ModelSpec.read(model_dir, None)
    head = s.head_dim
    return {"qkv": ((s.num_heads + 2 * s.num_kv_heads) * head, s.hidden_size), "o": (s.hidden_size, s.num_heads * head),
            "gate_up": (2 * s.intermediate_size, s.hidden_size), "down": (s.hidden_size, s.intermediate_size)}


def main(argv=None) -> int:
    import torch

    from engines.layers import cpu_linear
    from engines.layers.quant import Int4Weight, Int8DynamicWeight, Int8Weight
    from engines.precision import cpu_flags, describe_cpu

    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_linear")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default="benchmarks/results/cpu_linear.json")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    table: dict[str, dict[str, list[float]]] = {}
    for name, (out, k) in shapes(args.model_dir).items():
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(out, k).to(dtype)
            label = "fp32" if dtype == torch.float32 else "bf16"
            kernels = {f"{label} {c.name}": c.wrap(w) if c.wrap else w for c in cpu_linear.candidates(w, dtype)}
            for cls in (Int8Weight, Int4Weight):
                q = cls(w)
                kernels |= {f"{label} {q.method} {c.name}": c.wrap(q) for c in cpu_linear.candidates(q, dtype)}
            if dtype == torch.float32:
                kernels["int8_dynamic"] = Int8DynamicWeight(w)
            times = {kname: [float("inf"), float("inf")] for kname in kernels}
            for _ in range(3):  # interleaved passes
                for kname, kern in kernels.items():
                    for i, rows in enumerate((1, args.rows)):
                        times[kname][i] = min(times[kname][i], cpu_linear.time_kernel(kern, k, dtype, rows,
                                                                                     args.repeats // 3 + 1))
            for kname, (a, b) in times.items():
                table.setdefault(kname, {})[name] = [1e3 * a, 1e3 * b]
    flags = describe_cpu(cpu_flags())
    print(f"host: {os.cpu_count()} cores, flags: {flags}; ms per product summed over one layer's linears "
          f"({', '.join(f'{n} {o}x{k}' for n, (o, k) in shapes(args.model_dir).items())})")
    print(f"  {'kernel':<22} {'1 row':>9} {args.rows:>6} rows")
    totals = {kname: [sum(v[i] for v in per.values()) for i in (0, 1)] for kname, per in table.items()}
    for kname, (a, b) in totals.items():
        print(f"  {kname:<22} {a:>9.3f} {b:>11.3f}")
    for label in ("fp32", "bf16"):
        dense = {k: tuple(v) for k, v in totals.items() if k.split()[0] == label and len(k.split()) == 2}
        print(f"  auto picks for {label} weights: {cpu_linear.fastest(dense)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"host_flags": flags, "cores": os.cpu_count(), "rows": args.rows, "ms_per_layer": totals,
                   "ms_per_shape": table}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
