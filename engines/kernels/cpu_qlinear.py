"""The CPU int8 linear kernel (cpu_qlinear.c: int8 activations, one scale per row, times int8 weight
rows, int32 sums with AVX-512 VNNI), built and cached as the CPU attention kernel is
(cpu_attention.cached_build) and called through ctypes. Its arithmetic is the torch path's in
Int8DynamicWeight.forward (engines/layers/quant.py), bit for bit; what it changes is speed: PyTorch's
int8 GEMM (`torch._int_mm`) reads a lone row's weights at about a quarter of the memory's speed.

    packed = pack(q)                     # q [out, in] int8 → PackedInt8 (rows padded to 64 bytes, sums)
    y = linear(x, packed, scales)        # x [rows, in] float32/bf16 → [rows, out] in x's dtype
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from engines.kernels import cpu_attention
from engines.devices import cpu_flags


SOURCE = cpu_attention.SOURCE.with_name("cpu_qlinear.c")
ALIGN = 64  # bytes of K per vpdpbusd step: weight rows are padded to a multiple
DTYPES = (torch.float32, torch.bfloat16)  # the activations it reads and the outputs it writes


def bind(path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.lmi_qlinear_s8
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.lmi_qlinear_w4a8
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def vnni_here() -> bool:
    """Whether this CPU runs the kernels' VNNI loops (AVX-512 VNNI and BW); elsewhere they run plain C
    loops, correct but no candidate for speed."""
    return {"avx512_vnni", "avx512bw"} <= cpu_flags()


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels, or None (logged once: PyTorch's run) when they cannot be built here."""
    return cpu_attention.load_or_warn(SOURCE, "CPU int8 linear kernels", bind,
                                      "int8_dynamic multiplies with torch._int_mm, int4 with PyTorch's kernel")


@dataclass(frozen=True)
class PackedInt8:
    """int8 weight rows [out, kp] (kp: in_features padded with zeros to a multiple of 64) and
    wsum [out] = 128 * each row's sum (the u8 activations' offset, taken back once per output)."""
    rows: torch.Tensor
    wsum: torch.Tensor
    in_features: int


def pack(q: torch.Tensor) -> PackedInt8:
    out_features, in_features = q.shape
    kp = -(-in_features // ALIGN) * ALIGN
    rows = torch.zeros(out_features, kp, dtype=torch.int8)
    rows[:, :in_features] = q
    wsum = (q.to(torch.int32).sum(dim=1) * 128).to(torch.int32).contiguous()
    return PackedInt8(rows, wsum, in_features)


def linear(x: torch.Tensor, packed: PackedInt8, scales: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] (float32 or bf16, last dim contiguous) → [rows, out] in x's dtype; scales [out]
    float32, contiguous; lib: another build (tests)."""
    return _run("lmi_qlinear_s8", x, packed.rows.shape[0], lib, packed.in_features, packed.rows.data_ptr(),
                packed.wsum.data_ptr(), scales.data_ptr(), packed.rows.shape[1])


def _run(name: str, x: torch.Tensor, out_features: int, lib: ctypes.CDLL | None, *weight_args) -> torch.Tensor:
    """One of the kernels on x [rows, in] → a new [rows, out_features] in x's dtype; weight_args: what the
    kernel takes between the activations and the output."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    failed = cpu_attention.named_call(f"lmi::cpu_{name[4:]}", lambda: getattr(lib or load(), name)(
        x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), x.shape[0], *weight_args, out_features,
        y.data_ptr(), out_features, torch.get_num_threads()))
    if failed:
        raise MemoryError(f"the CPU int8 kernel {name} could not allocate its scratch memory")
    return y


@dataclass(frozen=True)
class PackedInt4:
    """int4 groups in the W4A8 kernel's layout (cpu_qlinear.c): nibbles [out, kp / 2] uint8 (kp: in_features
    padded to a multiple of 128), scales s and c = z - 8 s, float32 [out, kp / 32]."""
    nibbles: torch.Tensor
    s: torch.Tensor
    c: torch.Tensor
    in_features: int


W4_BLOCK = 128  # inputs per 64-byte block of nibbles


def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> PackedInt4:
    """q in 0..15 [out, in], scales and zeros [in / 32, out] (engines/layers/quant.py's int4_quantize,
    W = (q - 8) s + z) → the kernel's layout (padding: q 0, s and c 0)."""
    out_features, in_features = q.shape
    kp = -(-in_features // W4_BLOCK) * W4_BLOCK
    padded = torch.zeros(out_features, kp, dtype=torch.uint8)
    padded[:, :in_features] = q
    halves = padded.view(out_features, kp // W4_BLOCK, 2, W4_BLOCK // 2)
    nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out_features, kp // 2).contiguous()
    s = torch.zeros(out_features, kp // 32)
    c = torch.zeros(out_features, kp // 32)
    s[:, :scales.shape[0]] = scales.float().t()
    c[:, :scales.shape[0]] = zeros.float().t() - 8 * scales.float().t()
    return PackedInt4(nibbles, s, c, in_features)


def w4a8(x: torch.Tensor, packed: PackedInt4, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] (float32 or bf16, last dim contiguous) → [rows, out] in x's dtype: the int4 weight times
    x quantised to int8 per row (cpu_qlinear.c); lib: another build (tests)."""
    return _run("lmi_qlinear_w4a8", x, packed.nibbles.shape[0], lib, packed.in_features, packed.nibbles.data_ptr(),
                packed.s.data_ptr(), packed.c.data_ptr(), packed.nibbles.shape[1] * 2)


def w4a8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (float64 sums: its oracle in tests): x [rows, in] → float32 [rows, out]."""
    flat = x.float()
    step = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    xq = torch.round(flat / step).double()
    groups = q.shape[1] // 32
    d = torch.einsum("rgk,ngk->rng", xq.view(-1, groups, 32), q.double().view(q.shape[0], groups, 32))
    xsum = xq.view(-1, groups, 32).sum(-1)  # [rows, groups]
    s, z = scales.double().t(), zeros.double().t()  # [out, groups]
    return ((d * s).sum(-1) + xsum @ (z - 8 * s).t()).mul(step.double()).float()
