"""The CPU dense linear kernel (cpu_gemm.c: float32 or bf16 weights as they are, memory-speed at one
row), built and cached as the CPU attention kernel is (cpu_attention.cached_build) and called through
ctypes; one of the candidates engines/layers/cpu_linear.py measures at load.

    y = gemm(x, w)      # x [rows, in], w [out, in] contiguous, both float32 or both bf16 → [rows, out]
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from engines.kernels import cpu_attention
from engines.precision import cpu_flags

log = logging.getLogger(__name__)

SOURCE = cpu_attention.SOURCE.with_name("cpu_gemm.c")
DTYPES = (torch.float32, torch.bfloat16)
_P, _I = ctypes.c_void_p, ctypes.c_int64


def bind(path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.lmi_gemm.argtypes = [_P, _I, _P, _I, _I, _I, _P, _I, ctypes.c_int, ctypes.c_int]
    lib.lmi_gemm.restype = None
    return lib


def vectorised_here(dtype: torch.dtype) -> bool:
    """Whether this CPU runs the kernel's vector loops for `dtype` (float32: AVX-512F, or AVX2 with FMA;
    bf16: AVX512-BF16); elsewhere it runs plain C loops, correct but no candidate for speed."""
    flags = cpu_flags()
    if dtype == torch.bfloat16:
        return "avx512_bf16" in flags
    return dtype == torch.float32 and ("avx512f" in flags or {"avx2", "fma"} <= flags)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel, or None (logged once: PyTorch's kernels only) when it cannot be built here."""
    try:
        return bind(cpu_attention.cached_build(SOURCE, "CPU dense linear kernel"))
    except (cpu_attention.BuildError, OSError) as e:
        log.warning("the CPU dense linear kernel did not build (%s): PyTorch's kernels only", e)
        return None


def gemm(x: torch.Tensor, w: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] (last dim contiguous) times w [out, in] (contiguous, x's dtype) transposed → [rows, out];
    lib: another build (tests)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, out_features = x.shape[0], w.shape[0]
    y = torch.empty(rows, out_features, dtype=x.dtype)
    cpu_attention.named_call("lmi::cpu_gemm", lambda: (lib or load()).lmi_gemm(
        x.data_ptr(), x.stride(0), w.data_ptr(), rows, x.shape[1], out_features, y.data_ptr(), out_features,
        int(x.dtype == torch.bfloat16), torch.get_num_threads()))
    return y
