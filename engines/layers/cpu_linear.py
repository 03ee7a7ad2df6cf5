"""The CPU's linear kernels, chosen per host by measurement when a model loads.

Which library path multiplies fastest differs between hosts and precisions (measured: on a Zen 4
with AVX512-BF16, oneDNN's linear on a weight reordered once into its blocked layout ran a
[1, 768] x [768, 6144] fp32 product 3.5x faster than MKL's sgemm behind `F.linear`, and bf16 2.8x
faster than `F.linear`'s unpacked oneDNN call; PyTorch's weight-only int8/int4 kernels ran 20-60x
slower on fp32 activations than on bf16 ones). So nothing is assumed: each candidate below that
can run the model's weights here multiplies the model's widest linear (this rank's shard) at one
row (a lone client's decode) and at `rows` rows (a full batch), and the fastest by the sum of both
times relative to the best at each is used for every linear of the model.

    dense fp32 / bf16 weights
      aten     F.linear as it is (fp32: MKL's sgemm; bf16: oneDNN, the weight reordered each call)
      onednn   the weight reordered once into oneDNN's layout, torch.ops.mkldnn._linear_pointwise
      upcast   bf16 only: the weight converted to float32 as it is used (CPUs without native bf16,
               where oneDNN's bf16 GEMM runs at a third of float32's speed)
      lmi      ours (engines/kernels/cpu_gemm.c): packed once in blocks of 32 output columns
    weight-only int8 / int4 (option.quantize)
      native   PyTorch's packed kernel on activations in the model dtype
      bf16     activations cast to bf16 for the kernel, the result back (the kernels' fast path)
      w4a8     int4 only, ours (engines/kernels/cpu_qlinear.c): activations quantised to int8 per row
    int8_dynamic: ours (cpu_qlinear.c) or torch._int_mm, by row count (the same bits: _choose_int8_rows)

Ours are offered only where their vector instructions are. `option.cpu_linear` names a dense kernel
instead of measuring (`aten` under option.cpu_compile: inductor cannot trace packed opaque weights). Each kernel is a module that takes the
weight's place (`engines.layers.linear.linear` calls it), as option.quantize's packed weights do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from engines.devices import cpu_flags
from engines.kernels import cpu_gemm, cpu_qlinear
from engines.layers.linear import ColumnParallelLinear, RowParallelLinear
from engines.layers.quant import Int4A8Weight

class OneDnnWeight(nn.Module):
    """A dense weight reordered once into oneDNN's blocked layout (an opaque tensor: no Parameter)."""

    method = "onednn"

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.packed_bytes = weight.numel() * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class UpcastWeight(nn.Module):
    """A bf16 weight multiplied in float32: converted as it is used, the product rounded back."""

    method = "upcast"

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.weight.float()).to(x.dtype)


class GemmWeight(nn.Module):
    """A dense weight packed once for our C kernel (engines/kernels/cpu_gemm.c: blocks of 32 output
    columns, memory speed at one row); an opaque layout, as oneDNN's (eager only)."""

    method = "lmi"

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = cpu_gemm.pack(weight)
        self.packed_bytes = self.packed.numel() * self.packed.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_gemm.gemm_packed(x.reshape(-1, self.in_features), self.packed, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)


@dataclass(frozen=True)
class Candidate:
    name: str
    wrap: Callable[[torch.Tensor | nn.Module], nn.Module] | None  # this linear's weight → its kernel (None: as is)


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders a `dtype` weight on this CPU: float32 anywhere; bf16 only with AVX512 BW, VL
    and DQ or AVX-NE-CONVERT (elsewhere, an AVX2-only Zen 2 / 3 for one, the reorder raises)."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    flags = cpu_flags()
    return dtype == torch.float32 or {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


def candidates(weight: torch.Tensor | nn.Module, dtype: torch.dtype) -> list[Candidate]:
    """The kernels that can multiply this kind of weight in `dtype` on this CPU."""
    method = getattr(weight, "method", None)
    if method is None:
        out = [Candidate("aten", None)]
        if onednn_packs(dtype):
            out.append(Candidate("onednn", OneDnnWeight))
        if dtype == torch.bfloat16:
            out.append(Candidate("upcast", UpcastWeight))
        if dtype in cpu_gemm.DTYPES and cpu_gemm.vectorised_here(dtype) and cpu_gemm.load() is not None:
            out.append(Candidate("lmi", GemmWeight))
        return out
    if method in ("int8", "int4"):
        out = [Candidate("native", lambda w: w.compute_in(dtype))]
        if dtype != torch.bfloat16:
            out.append(Candidate("bf16", lambda w: w.compute_in(torch.bfloat16)))
        if getattr(weight, "w4a8", None) is not None and dtype in cpu_qlinear.DTYPES and cpu_qlinear.vnni_here() \
                and cpu_qlinear.load():
            out.append(Candidate("w4a8", Int4A8Weight))
        return out
    return []  # int8_dynamic (chosen by row count: _choose_int8_rows), fp8 (CUDA): one kernel each


def time_kernel(kernel, in_features: int, dtype: torch.dtype, rows: int, repeats: int = 7,
                budget_s: float = 0.2) -> float:
    """The fastest of `repeats` products of `rows` rows after two warm-up calls, in seconds (the minimum:
    other work on the machine only ever adds time); fewer once `budget_s` is spent (a kernel that slow
    loses anyway, and a big model's start should not wait on it)."""
    x = torch.randn(rows, in_features).to(dtype)
    fn = kernel if isinstance(kernel, nn.Module) else (lambda v: nn.functional.linear(v, kernel))
    best, spent = float("inf"), 0.0
    with torch.inference_mode():
        for i in range(repeats + 2):
            started = time.perf_counter()
            fn(x)
            took = time.perf_counter() - started
            spent += took
            if i >= 2:
                best = min(best, took)
                if spent > budget_s:
                    break
    return best


def measure(weight: torch.Tensor | nn.Module, dtype: torch.dtype, rows: int,
            timer=time_kernel) -> dict[str, tuple[float, float]]:
    """Each candidate's (seconds at 1 row, seconds at `rows` rows) on this weight, measured alternately."""
    in_features = weight.in_features if isinstance(weight, nn.Module) else weight.shape[1]
    kernels = {c.name: c.wrap(weight) if c.wrap else weight for c in candidates(weight, dtype)}
    times = {name: [float("inf"), float("inf")] for name in kernels}
    for _ in range(2):  # two passes, interleaved: a burst of other work hits one pass, not one kernel
        for name, kernel in kernels.items():
            for i, n in enumerate((1, rows)):
                times[name][i] = min(times[name][i], timer(kernel, in_features, dtype, n))
    return {name: (t[0], t[1]) for name, t in times.items()}


def fastest(times: dict[str, tuple[float, float]]) -> str:
    """The kernel with the least sum of its times relative to the best at each row count."""
    best = [min(t[i] for t in times.values()) for i in (0, 1)]
    return min(times, key=lambda name: sum(times[name][i] / best[i] for i in (0, 1)))


def linears(model: nn.Module) -> list[nn.Module]:
    """The modules whose `weight` the kernels replace: column/row-parallel linears and the LM head."""
    out = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    head = getattr(model, "lm_head", None)
    return out + ([head] if head is not None and isinstance(head.weight, torch.Tensor) else [])


def choose_cpu_linear(model: nn.Module, dtype: torch.dtype, policy: str = "auto", rows: int = 32,
                      timer=time_kernel) -> list[tuple[str, str, dict[str, tuple[float, float]], tuple[int, int]]]:
    """Put the chosen kernel in place of every linear's weight (the LM head too), one choice for each
    kind of weight (dense; option.quantize's int8 or int4) → per kind (kind, the kernel's name, the
    measured table — {} when the policy names it or there is one candidate —, the measured shape).
    policy: option.cpu_linear (it names a dense kernel; quantised weights keep their own when it is set)."""
    kinds: dict[str, list[nn.Module]] = {}
    for m in linears(model):
        kinds.setdefault(getattr(m.weight, "method", None) or "dense", []).append(m)
    chosen = []
    for kind, mods in kinds.items():
        widest = max(mods, key=lambda m: _numel(m.weight)).weight
        if kind == "int8_dynamic":
            if policy in ("auto", None) and int8_kernel_runs(widest, dtype):
                chosen.append(_choose_int8_rows(mods, widest, dtype, timer))
            continue
        options = {c.name: c for c in candidates(widest, dtype)}
        if not options:
            continue
        times: dict[str, tuple[float, float]] = {}
        if policy not in ("auto", None):
            name = "native" if kind != "dense" else _named(policy, options, widest)
        elif len(options) > 1:
            times = measure(widest, dtype, rows, timer)
            name = fastest(times)
        else:
            name = next(iter(options))
        wrap = options[name].wrap
        for m in mods if wrap else ():  # aten: the weights stay as they are (parameters)
            kernel = wrap(m.weight.data if isinstance(m.weight, torch.Tensor) else m.weight)
            if kernel is not m.weight:  # (a quantised weight already in the chosen dtype is its own kernel)
                del m.weight
                m.weight = kernel
            if hasattr(kernel, "drop_w4a8"):  # int4 in PyTorch's kernel: the W4A8 layout goes
                kernel.drop_w4a8()
        shape = (widest.out_features, widest.in_features) if isinstance(widest, nn.Module) else tuple(widest.shape)
        chosen.append((kind, name, times, shape))
    return chosen


def int8_kernel_runs(weight: nn.Module, dtype: torch.dtype) -> bool:
    """Whether cpu_qlinear's int8 kernel can take this int8_dynamic weight's calls (per-row activation
    scales, float32/bf16 activations, AVX-512 VNNI, the kernel built here)."""
    return weight.per_row and dtype in cpu_qlinear.DTYPES and cpu_qlinear.vnni_here() and cpu_qlinear.load() is not None


def _choose_int8_rows(mods: list[nn.Module], widest: nn.Module, dtype: torch.dtype, timer) \
        -> tuple[str, str, dict[str, tuple[float, ...]], tuple[int, int]]:
    """int8_dynamic: cpu_qlinear's kernel and torch._int_mm compute the same bits, so each call may take
    whichever is faster for its row count. Both are timed on the widest weight at 1, 4, 8, 16 and 32
    rows (alternately, twice); the kernel takes the calls of up to the most rows it won at, every
    count below included, and every int8_dynamic linear gets that limit."""
    kernels = {"lmi": widest.with_kernel(ROW_LADDER[-1]), "int_mm": widest}
    times = {name: [float("inf")] * len(ROW_LADDER) for name in kernels}
    for _ in range(2):
        for name, kernel in kernels.items():
            for i, n in enumerate(ROW_LADDER):
                times[name][i] = min(times[name][i], timer(kernel, widest.in_features, dtype, n))
    max_rows = 0
    for i, n in enumerate(ROW_LADDER):
        if times["lmi"][i] >= times["int_mm"][i]:
            break
        max_rows = n
    for m in mods:
        kernel = m.weight.with_kernel(max_rows)
        del m.weight
        m.weight = kernel
    name = f"lmi up to {max_rows} rows, int_mm above" if max_rows else "int_mm"
    return "int8_dynamic", name, {k: tuple(v) for k, v in times.items()}, (widest.out_features, widest.in_features)


ROW_LADDER = (1, 4, 8, 16, 32)  # the row counts at which int8_dynamic's two kernels are compared


def _named(policy: str, options: dict[str, Candidate], weight: torch.Tensor) -> str:
    if policy not in options:
        raise ValueError(f"option.cpu_linear={policy} cannot multiply {weight.dtype} weights on this CPU; "
                         f"use one of {', '.join(['auto', *options])}")
    return policy


def _numel(weight) -> int:
    return weight.numel() if isinstance(weight, torch.Tensor) else weight.out_features * weight.in_features


def describe(kind: str, name: str, times: dict[str, tuple[float, float]], shape: tuple[int, int],
             rows: int = 32) -> str:
    """One log line: the kernel in use for this kind of weight, and the table that chose it."""
    if not times:
        return f"CPU linear kernel for {kind} weights: {name}"
    counts = ROW_LADDER if kind == "int8_dynamic" else (1, rows)
    cells = ", ".join(f"{n} {' / '.join(f'{1e3 * t:.3f}' for t in ts)} ms" for n, ts in times.items())
    return (f"CPU linear kernel for {kind} weights: {name} (measured on a [{' | '.join(map(str, counts))}, "
            f"{shape[1]}] x [{shape[1]}, {shape[0]}] product: {cells})")
