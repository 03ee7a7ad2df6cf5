"""Weight-only quantisation of the linear layers, on the fly after loading (`option.quantize`).

    int8: W ≈ q · s               q int8 [out, in]; s [out]: one symmetric scale per output row
    int4: W ≈ (q − 8) · s + z     q in 0..15 [out, in]; s, z [in / g, out]: per group of g inputs

Activations stay in the model dtype (bf16, fp16 or fp32); PyTorch's packed kernels multiply:
`_weight_int8pack_mm` (CPU and CUDA) and `_weight_int4pack_mm_for_cpu` / `_weight_int4pack_mm`
(CUDA, bf16 only), each on the weight layout its converter writes.

Each rank quantises its own shard once it is loaded, so tensor parallelism needs nothing more: a
column-parallel shard holds whole output rows with their scales; a row-parallel shard's rows are
quantised over its own input columns, and each rank's partial product is dequantised (in the
kernel) before the all-reduce sums them. The embeddings, the LM head, the norms, the MoE router and
the MoE experts' stacked [E, ...] weights stay in the model dtype.
"""

from __future__ import annotations

import copy
import logging
import warnings

import torch
from torch import nn

from engines.kernels import cpu_qlinear
from engines.devices import cpu_flags
from engines.layers.linear import ColumnParallelLinear, RowParallelLinear

log = logging.getLogger(__name__)

METHODS = ("int8", "int4", "int8_dynamic", "fp8")
FP8_MAX = 448.0  # the largest float8_e4m3fn value
INT4_GROUP_SIZE = 32  # inputs per int4 scale and zero point
INT4_ROWS_MULTIPLE = 16  # the CPU int4 converter packs 16 output rows at a time (CUDA: 8)


def int8_quantize(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] → (q int8 [out, in], scales [out] in `dtype`), W ≈ q · scales[:, None]. The
    scales are rounded to `dtype` before dividing, so the kernel's dequantisation is this one."""
    w = weight.float()
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def int4_quantize(weight: torch.Tensor, group_size: int, dtype: torch.dtype) \
        -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] → (q int32 in 0..15 [out, in], scales [in / g, out], zeros [in / g, out]),
    asymmetric per group of g inputs: W ≈ (q − 8) · s + z, z = min + 8 s (the kernels' convention)."""
    out, k = weight.shape
    w = weight.float().reshape(out, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, in / g]
    scales = ((hi - lo).clamp(min=1e-6) / 15).to(dtype)
    zeros = (lo + 8 * scales.float()).to(dtype)
    q = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp(0, 15)
    return q.reshape(out, k).to(torch.int32), scales.t().contiguous(), zeros.t().contiguous()


def int4_dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 W [out, in] that int4_quantize's output stands for."""
    out, k = q.shape
    groups = (q.float().reshape(out, k // group_size, group_size) - 8) * scales.float().t()[..., None]
    return (groups + zeros.float().t()[..., None]).reshape(out, k)


def _int4_pack_cuda(q: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """CUDA's converter takes two 4-bit values per byte, the even input first: [out, in / 2] uint8."""
    return torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), inner_k_tiles)


# device type → (pack q [out, in] int32, multiply); the CUDA entries are the same call on CUDA's layout
INT4_KERNELS = {
    "cpu": (lambda q, tiles: torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles),
            torch.ops.aten._weight_int4pack_mm_for_cpu),
    "cuda": (_int4_pack_cuda, torch.ops.aten._weight_int4pack_mm),
}


class Int8Weight(nn.Module):
    """A linear layer's weight as int8 rows and their scales; called with x [..., in] → [..., out]."""

    method = "int8"

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scales = int8_quantize(weight, weight.dtype)
        self.qweight = nn.Parameter(q, requires_grad=False)  # [out, in] int8
        self.scales = nn.Parameter(scales, requires_grad=False)  # [out]

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scales: torch.Tensor) -> "Int8Weight":
        """Already-quantised rows (a pre-quantised checkpoint's): q int8 [out, in], scales [out] in the
        model dtype, W = q · scales[:, None]."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features = q.shape
        self.qweight = nn.Parameter(q.to(torch.int8).contiguous(), requires_grad=False)
        self.scales = nn.Parameter(scales.contiguous(), requires_grad=False)
        return self

    def compute_in(self, dtype: torch.dtype) -> "Int8Weight":
        """This weight multiplying activations cast to `dtype` (engines/layers/cpu_linear.py: PyTorch's
        CPU kernel is fast on bf16 activations only); the same int8 rows, shared."""
        return _computing_in(self, dtype, "scales")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.scales.dtype).contiguous()  # the kernel takes 2-D rows
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])


class Int4Weight(nn.Module):
    """A linear layer's weight as packed int4 groups with their scales and zero points."""

    method = "int4"

    def __init__(self, weight: torch.Tensor, group_size: int | None = None):
        super().__init__()
        self.out_features, self.in_features = out, k = weight.shape
        self.group_size = group_size = group_size or INT4_GROUP_SIZE
        q, scales, zeros = int4_quantize(weight, group_size, weight.dtype)
        tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
        pack, self._mm = INT4_KERNELS[weight.device.type]
        self.packed = nn.Parameter(pack(q, tiles), requires_grad=False)  # the kernel's layout
        self.scales_zeros = nn.Parameter(torch.stack([scales, zeros], dim=-1), requires_grad=False)  # [in/g, out, 2]
        self._keep_w4a8(q, scales, zeros)

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) \
            -> "Int4Weight":
        """Already-quantised groups (a pre-quantised checkpoint's) in the kernels' convention: q in
        0..15 [out, in], scales and zeros [in / g, out] in the model dtype, W = (q − 8) · s + z."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features = out, k = q.shape
        self.group_size = group_size
        tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
        pack, self._mm = INT4_KERNELS[q.device.type]
        self.packed = nn.Parameter(pack(q.to(torch.int32).contiguous(), tiles), requires_grad=False)
        self.scales_zeros = nn.Parameter(torch.stack([scales, zeros], dim=-1).contiguous(), requires_grad=False)
        self._keep_w4a8(q, scales, zeros)
        return self

    def _keep_w4a8(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """On CPUs with AVX-512 VNNI, the same groups also in cpu_qlinear's W4A8 layout (`w4a8`), for
        engines/layers/cpu_linear.py to measure against PyTorch's kernel; the layout not chosen is dropped
        then (drop_w4a8)."""
        self.w4a8 = cpu_qlinear.pack_int4(q, scales, zeros) if q.device.type == "cpu" and cpu_qlinear.vnni_here() \
            else None

    def drop_w4a8(self) -> None:
        self.w4a8 = None

    def compute_in(self, dtype: torch.dtype) -> "Int4Weight":
        """As Int8Weight.compute_in: the same packed groups, scales and zero points in `dtype`."""
        return _computing_in(self, dtype, "scales_zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.scales_zeros.dtype).contiguous()
        y = self._mm(flat, self.packed, self.group_size, self.scales_zeros)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Int4A8Weight(nn.Module):
    """An int4 weight multiplied by int8 activations (one scale per row) in cpu_qlinear's W4A8 kernel:
    llama.cpp's Q4_0 x Q8 arithmetic, chosen for option.quantize=int4 on CPUs where it measures faster
    than PyTorch's weight-only kernel (engines/layers/cpu_linear.py). Eager CPU only."""

    method = "int4"
    activations = "int8 per token"

    def __init__(self, weight: Int4Weight):
        super().__init__()
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.packed_groups = weight.w4a8  # a cpu_qlinear.PackedInt4 (plain tensors: no parameters)
        self.packed_bytes = sum(t.numel() * t.element_size() for t in
                                (self.packed_groups.nibbles, self.packed_groups.s, self.packed_groups.c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_qlinear.w4a8(x.reshape(-1, x.shape[-1]), self.packed_groups)
        return y.view(*x.shape[:-1], self.out_features)


def _computing_in(weight: nn.Module, dtype: torch.dtype, scales: str) -> nn.Module:
    """A copy of a weight-only module sharing its packed values, its `scales` parameter in `dtype`
    (itself when they already are)."""
    if getattr(weight, scales).dtype == dtype:
        return weight
    out = copy.copy(weight)
    out._parameters = dict(weight._parameters)  # the copy's own table: the original keeps its scales
    setattr(out, scales, nn.Parameter(getattr(weight, scales).data.to(dtype), requires_grad=False))
    return out


def cpu_has_vnni() -> bool:
    """Whether this x86 CPU sums u8 x s8 products in int32 (AVX-512 VNNI, AVX-VNNI). Without, the int8
    GEMMs use vpmaddubsw, whose 16-bit pair sums saturate on 8-bit activations: PyTorch's answer is to
    quantise activations to 7 bits (`reduce_range`). Not known (no /proc/cpuinfo): False, the range that
    cannot saturate."""
    flags = cpu_flags()
    return "avx512_vnni" in flags or "avx_vnni" in flags


class Int8DynamicWeight(nn.Module):
    """int8 weights and int8 activations (`option.quantize=int8_dynamic`, CPU). The weight rows are
    quantised as Int8Weight's (symmetric, one scale per output row); each call quantises its activations
    and multiplies in int8 with int32 sums, on one of two paths:

      per row (x86 with VNNI): each activation row (token) to int8 with its own symmetric scale,
          `torch._int_mm` (oneDNN's s8 x s8 GEMM) — one scale per token, as llama.cpp's Q8 activations
          have one per 32 values, where one outlier token would otherwise coarsen every other row's
      per tensor (no VNNI): PyTorch's dynamic quantised linear (prepacked once), the whole [rows, in]
          input to uint8 with one scale and zero point, 7-bit (0..127, `reduce_range`): without VNNI
          the GEMM's vpmaddubsw sums pairs in 16 bits, and 8 bits (or signed int8 moved to uint8)
          would saturate them (errors of 4.8 on outputs of 28 measured on an AVX2-only EPYC)

    and returns float32, cast back to the model dtype."""

    method = "int8_dynamic"

    def __init__(self, weight: torch.Tensor, reduce_range: bool | None = None, per_row: bool | None = None):
        """per_row: per-token activation scales (None: where the CPU has VNNI); reduce_range: 7-bit
        activations on the per-tensor path (None: where the CPU lacks VNNI)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        vnni = cpu_has_vnni()
        self.per_row = vnni if per_row is None else per_row
        self.reduce_range = not vnni if reduce_range is None else reduce_range
        q, scales = int8_quantize(weight, torch.float32)
        self.packed_bytes = q.numel() + 4 * scales.numel()  # held outside parameters: what the weight costs
        self.kernel_rows = 0  # calls of at most this many rows run cpu_qlinear's kernel (with_kernel)
        if self.per_row:
            self._rows = cpu_qlinear.pack(q)  # the rows padded to 64 bytes, for the kernel and _int_mm alike
            self._qweight_t, self._scales = self._rows.rows[:, :self.in_features].t(), scales.contiguous()
            return
        with warnings.catch_warnings():  # PyTorch deprecates quantized tensors; its int8 linear still takes them
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(q, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0)
        self._packed = torch.ops.quantized.linear_prepack(qw, None)

    @property
    def activations(self) -> str:
        """How this weight quantises its inputs, for the start log."""
        return "int8 per token" if self.per_row else "7-bit per tensor" if self.reduce_range else "uint8 per tensor"

    def with_kernel(self, max_rows: int) -> "Int8DynamicWeight":
        """A copy sharing the packed rows whose calls of at most `max_rows` rows run cpu_qlinear's kernel
        (the same arithmetic as torch._int_mm's path, bit for bit; faster at few rows)."""
        if not self.per_row:
            raise ValueError("the int8 kernel takes per-row activation scales (a CPU with VNNI)")
        out = copy.copy(self)
        out.kernel_rows = max_rows
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= self.kernel_rows and x.dtype in cpu_qlinear.DTYPES and not torch.compiler.is_compiling():
            return cpu_qlinear.linear(flat, self._rows, self._scales).view(*x.shape[:-1], self.out_features)
        flat = flat.float()
        if self.per_row:
            step = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127  # [rows, 1]
            xq = torch.round(flat / step).to(torch.int8)
            y = torch._int_mm(xq, self._qweight_t).float().mul_(step).mul_(self._scales)
        else:
            y = torch.ops.quantized.linear_dynamic(flat, self._packed, self.reduce_range)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Fp8Policy:
    """Where the fp8 kernel may run. CUDA devices of compute capability 8.9 and up (fp8 tensor cores:
    L4, L40S, H100, H200) in bf16; tests let it run on CPU, where PyTorch's `_scaled_mm` computes the
    same product (slowly), so that the code a GPU runs is the code the CPU suite runs."""

    allow_cpu = False


def fp8_kernel_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why fp8 weights cannot be multiplied as fp8 here (None: they can)."""
    if device.type == "cpu":
        return None if Fp8Policy.allow_cpu else "no fp8 GEMM on CPU"
    if device.type != "cuda":
        return f"no fp8 GEMM on {device.type}"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return (f"fp8 tensor cores need compute capability 8.9+, and this GPU has "
                f"{torch.cuda.get_device_capability(device)}")
    if dtype != torch.bfloat16:
        return f"the fp8 GEMM with row-wise scales writes bf16, and the model runs in {dtype}"
    return None


def fp8_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] → (q float8_e4m3fn [out, in], s float32 [out]) with W ≈ q · s per output row."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scales[:, None]).to(torch.float8_e4m3fn), scales


class Fp8Weight(nn.Module):
    """fp8 weights and fp8 activations (`option.quantize=fp8`, and fp8 checkpoints with per-tensor or
    per-channel scales): W ≈ q · s, q float8_e4m3fn [out, in], s [out]; each call quantises its
    activations to e4m3 with one scale per row (amax / 448) and multiplies with `torch._scaled_mm`,
    both scales applied to the float32 sums. A fused q/k/v weight keeps each part's scale per row."""

    method = "fp8"

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self._set(*fp8_quantize(weight))

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scales: torch.Tensor) -> "Fp8Weight":
        """A checkpoint's fp8 rows q [out, in] and their scales [out]."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._set(q.to(torch.float8_e4m3fn), scales.float())
        return self

    def _set(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        self.out_features, self.in_features = q.shape
        self.qweight = nn.Parameter(q.contiguous(), requires_grad=False)
        self.scales = nn.Parameter(scales.reshape(1, -1).contiguous(), requires_grad=False)  # [1, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if flat.is_cuda and rows % 16:  # the CUDA kernel takes rows in multiples of 16
            flat = torch.nn.functional.pad(flat, (0, 0, 0, 16 - rows % 16))
        x_scales = (flat.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [rows, 1]
        xq = (flat.float() / x_scales).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.qweight.t(), scale_a=x_scales, scale_b=self.scales, out_dtype=x.dtype)
        return y[:rows].view(*x.shape[:-1], self.out_features)


def check_quantizable(method: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, naming what runs instead, a method this device cannot run in this dtype."""
    if method not in METHODS:
        raise ValueError(f"option.quantize={method}: int8, int4, int8_dynamic and fp8 quantise at load; "
                         f"use one of {', '.join(METHODS)} or unset it")
    if method == "int4" and device.type == "cuda" and dtype != torch.bfloat16:
        raise ValueError(f"option.quantize=int4 on CUDA runs in bf16 only (PyTorch's int4 kernel), not {dtype}; "
                         "set option.dtype=bf16 or use option.quantize=int8")
    if method == "int8_dynamic" and device.type != "cpu":
        raise ValueError("option.quantize=int8_dynamic runs on CPU (PyTorch's x86 int8 GEMM); on CUDA use "
                         "option.quantize=int8 (weight-only) or an fp8 checkpoint")
    if method == "int8_dynamic" and torch.backends.quantized.engine not in ("x86", "fbgemm", "onednn"):
        raise ValueError(f"option.quantize=int8_dynamic needs PyTorch's x86 quantized engine, and this CPU has "
                         f"{torch.backends.quantized.engine}; use option.quantize=int8")
    problem = fp8_kernel_problem(device, dtype) if method == "fp8" else None
    if problem:
        instead = "int8_dynamic (the fastest here) or int8" if device.type == "cpu" else "int8 or int4"
        raise ValueError(f"option.quantize=fp8 runs on CUDA GPUs with fp8 tensor cores (compute capability 8.9+: "
                         f"L4, L40S, H100, H200) in bf16 ({problem}); use option.quantize={instead}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"option.quantize={method} runs on CPU and CUDA, not {device.type}")


def _int4_shape_problem(weight: torch.Tensor) -> str | None:
    out, k = weight.shape
    rows = INT4_ROWS_MULTIPLE if weight.device.type == "cpu" else 8
    if out % rows or k % INT4_GROUP_SIZE:
        return f"a [{out}, {k}] shard: int4 needs outputs a multiple of {rows} and inputs of {INT4_GROUP_SIZE}"
    return None


def quantize_linears(model: nn.Module, method: str) -> dict[str, int]:
    """Replace every column- and row-parallel linear weight of `model` (this rank's shard) by its
    packed form, in place; `engines.layers.linear.linear` calls it. → {"linears", "skipped_params"}:
    how many were quantised, and how many parameters of stacked MoE experts stay in the model dtype."""
    check_quantizable(method, next(model.parameters()).dtype, next(model.parameters()).device)
    pack = {"int8": Int8Weight, "int4": Int4Weight, "int8_dynamic": Int8DynamicWeight, "fp8": Fp8Weight}[method]
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    if method == "int4":
        for name, m in linears:
            problem = _int4_shape_problem(m.weight)
            if problem:
                raise ValueError(f"option.quantize=int4 cannot pack {name} ({problem}); use option.quantize=int8")
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3)  # stacked [E, ...] experts
    for _, m in linears:
        weight = m.weight
        del m.weight
        m.weight = pack(weight.data)
        del weight
    if experts:
        log.info("option.quantize=%s: %d parameters of stacked MoE experts stay in the model dtype", method, experts)
    if method == "int8_dynamic" and linears:
        log.info("option.quantize=int8_dynamic: activations quantised to %s%s", linears[0][1].weight.activations,
                 "" if cpu_has_vnni() else " (this CPU has no VNNI: 8 bits would saturate its int8 GEMM's sums); "
                 "option.quantize=int8 keeps them in the model dtype")
    return {"linears": len(linears), "skipped_params": experts}
