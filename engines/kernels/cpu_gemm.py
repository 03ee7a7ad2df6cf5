"""The CPU dense linear kernel (cpu_gemm.c: float32 or bf16 weights packed once in blocks of 32 output
columns, memory speed at one row), built and cached as the CPU attention kernel is
(cpu_attention.cached_build) and called through ctypes; one of the candidates engines/layers/cpu_linear.py
measures at load.

    packed = pack(w)                          # w [out, in] float32 or bf16
    y = gemm_packed(x, packed, out_features)  # x [rows, in] in w's dtype → [rows, out]
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engines.kernels import cpu_attention
from engines.devices import cpu_flags


SOURCE = cpu_attention.SOURCE.with_name("cpu_gemm.c")
DTYPES = (torch.float32, torch.bfloat16)
_P, _I = ctypes.c_void_p, ctypes.c_int64


def bind(path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.lmi_pack_bf16.argtypes = [_P, _I, _I, _P]
    lib.lmi_pack_bf16.restype = None
    lib.lmi_gemm_packed_bf16.argtypes = [_P, _I, _P, _I, _I, _I, _P, _I, ctypes.c_int]
    lib.lmi_gemm_packed_bf16.restype = ctypes.c_int
    lib.lmi_pack_f32.argtypes = [_P, _I, _I, _P]
    lib.lmi_pack_f32.restype = None
    lib.lmi_gemm_packed_f32.argtypes = [_P, _I, _P, _I, _I, _I, _P, _I, ctypes.c_int]
    lib.lmi_gemm_packed_f32.restype = ctypes.c_int
    return lib


def vectorised_here(dtype: torch.dtype) -> bool:
    """Whether this CPU has the kernel's instructions for `dtype` (float32: AVX-512F, or AVX2 with FMA;
    bf16: AVX512-BF16); elsewhere it is no candidate."""
    flags = cpu_flags()
    if dtype == torch.bfloat16:
        return "avx512_bf16" in flags
    return dtype == torch.float32 and ("avx512f" in flags or {"avx2", "fma"} <= flags)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel, or None (logged once: PyTorch's kernels only) when it cannot be built here."""
    return cpu_attention.load_or_warn(SOURCE, "CPU dense linear kernel", bind, "PyTorch's kernels only")


PACK_COLS = 32  # output columns per packed block (cpu_gemm.c)


def pack(w: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """w [out, in] (float32 or bf16) → the layout gemm_packed reads, in blocks of 32 output columns:
    float32 [out / 32, in, 32], bf16 [out / 32, in / 2, 32, 2] (input pairs side by side for vdpbf16ps),
    rounded up with zeros."""
    w = w.contiguous()
    n, k = w.shape
    blocks = -(-n // PACK_COLS)
    lib = lib or load()
    if w.dtype == torch.bfloat16:
        packed = torch.empty(blocks, -(-k // 2), PACK_COLS, 2, dtype=torch.bfloat16)
        lib.lmi_pack_bf16(w.data_ptr(), n, k, packed.data_ptr())
    else:
        packed = torch.empty(blocks, k, PACK_COLS, dtype=torch.float32)
        lib.lmi_pack_f32(w.data_ptr(), n, k, packed.data_ptr())
    return packed


def gemm_packed(x: torch.Tensor, packed: torch.Tensor, out_features: int, lib: ctypes.CDLL | None = None) \
        -> torch.Tensor:
    """x [rows, in] (last dim contiguous, the packed weight's dtype) times the packed weight → [rows, out]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, out_features, dtype=x.dtype)
    fn = (lib or load()).lmi_gemm_packed_bf16 if x.dtype == torch.bfloat16 else (lib or load()).lmi_gemm_packed_f32
    failed = cpu_attention.named_call("lmi::cpu_gemm_packed", lambda: fn(
        x.data_ptr(), x.stride(0), packed.data_ptr(), rows, x.shape[1], out_features, y.data_ptr(), out_features,
        torch.get_num_threads()))
    if failed:
        raise RuntimeError(f"the packed {x.dtype} kernel was built without its vector instructions")
    return y
