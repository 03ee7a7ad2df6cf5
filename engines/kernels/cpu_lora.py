"""The CPU LoRA kernel (cpu_lora.c: segment-grouped shrink and expand, added in place into the
linear's output), built and cached as the CPU attention kernel is (cpu_attention.cached_build) and
called through ctypes. Its PyTorch twin, the oracle in tests and the path everywhere else (CUDA,
compiled steps, float16), is LoraBank.delta in engines/layers/lora.py.

    add_delta(x, y, A, Bt, step)   # y[dest] += (x[src] A^T) Bt, segment by segment; False: not run
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engines.kernels import cpu_attention


SOURCE = cpu_attention.SOURCE.with_name("cpu_lora.c")
DTYPES = {torch.float32: "lmi_lora_sgmv_f32", torch.bfloat16: "lmi_lora_sgmv_bf16"}


def bind(path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name in DTYPES.values():
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 7 + [ctypes.c_int]
        fn.restype = ctypes.c_int
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel, or None (logged once: the torch form runs) when it cannot be built here."""
    return cpu_attention.load_or_warn(SOURCE, "CPU LoRA kernel", bind, "LoRA deltas run as batched matmuls")


def runs(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the kernel takes this product (eager CPU float32/bf16, rows of unit stride)."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and y.dtype == x.dtype and x.stride(-1) == 1
            and y.stride(-1) == 1 and not torch.compiler.is_compiling() and load() is not None)


def add_delta(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, step,
              lib: ctypes.CDLL | None = None) -> None:
    """x [N, in], y [N, out] (2-D, last dim contiguous: check runs()), a [S, W, in] and bt [S, W, out]
    contiguous, step: the LoraStep (segments lo..hi-1 of `segment` positions, src/dest int64 on CPU);
    lib: another build (tests)."""
    n, k = x.shape
    width, out = bt.shape[1], bt.shape[2]
    segment, src, dest = step.segments(n)
    src, dest = src.contiguous(), dest.contiguous()
    failed = cpu_attention.named_call("lmi::cpu_lora_sgmv", lambda: getattr(lib or load(), DTYPES[x.dtype])(
        x.data_ptr(), x.stride(0), a.data_ptr(), bt.data_ptr(), y.data_ptr(), y.stride(0), src.data_ptr(),
        dest.data_ptr(), step.lo, step.hi, segment, n, k, width, out, torch.get_num_threads()))
    if failed:
        raise MemoryError("the CPU LoRA kernel could not allocate its scratch memory")
