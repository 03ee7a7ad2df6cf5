"""The fused ops for eager CPU (engines/layers/fused.py's third implementation, beside the Triton kernels
and their PyTorch twins): residual add + RMSNorm and rotary embedding as one C call each (cpu_ops.c,
built and cached as the CPU attention kernel is), the rest and every case the C does not take (Gemma's
norm, interleaved or compiled rotary, float16) in engines/kernels/torch_ops.py, whose numerics these
are (rotary bit for bit; the norm up to the order of its sum of squares).

    ops = cpu_ops if cpu_ops.load() else torch_ops
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engines.kernels import cpu_attention, torch_ops
from engines.kernels.torch_ops import gelu_tanh_and_mul, rotary_tables, silu_and_mul  # noqa: F401 (the module's interface)


SOURCE = cpu_attention.SOURCE.with_name("cpu_ops.c")
DTYPES = (torch.float32, torch.bfloat16)
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def bind(path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.lmi_add_rms_norm.argtypes = [_P, _I, _P, _I, _P, ctypes.c_int, _P, _I, _P, _I, _I, _I, _F, ctypes.c_int,
                                     ctypes.c_int]
    lib.lmi_add_rms_norm.restype = None
    lib.lmi_rotary_neox.argtypes = [_P, _I, _P, _I, _I, _I, _P, _I, _I, _I, _P, _P, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.lmi_rotary_neox.restype = None
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels, or None (logged once: the PyTorch twins run) when they cannot be built here."""
    return cpu_attention.load_or_warn(SOURCE, "CPU fused ops", bind, "the norms and rotary run as PyTorch ops",
                                      ("-ffp-contract=off",))


def _eager(*tensors: torch.Tensor) -> bool:
    return not torch.compiler.is_compiling() and all(t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 *, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_ops.add_rms_norm (new y and r; r is x when residual is None)."""
    parts = (x,) if residual is None else (x, residual)
    if gemma or x.dtype not in DTYPES or weight.dtype not in DTYPES or not _eager(*parts, weight) \
            or residual is not None and residual.dtype != x.dtype:
        return torch_ops.add_rms_norm(x, residual, weight, eps, gemma=gemma)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = torch.empty(x.shape, dtype=x.dtype)
    r = x if residual is None else torch.empty(x.shape, dtype=x.dtype)
    res2 = None if residual is None else residual.reshape(-1, n)
    cpu_attention.named_call("lmi::cpu_add_rms_norm", lambda: load().lmi_add_rms_norm(
        x2.data_ptr(), x2.stride(0), 0 if res2 is None else res2.data_ptr(), 0 if res2 is None else res2.stride(0),
        weight.data_ptr(), int(weight.dtype == torch.bfloat16), y.data_ptr(), n, r.data_ptr(), n, x2.shape[0], n, eps,
        int(x.dtype == torch.bfloat16), torch.get_num_threads()))
    return y, r


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, *, rot_dim: int | None = None,
                     interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_ops.rotary_embedding's values, written IN PLACE into q and k (as the Triton kernel does),
    which are returned."""
    rot_dim = cos.shape[-1] if rot_dim is None else rot_dim
    if interleaved or q.dtype not in DTYPES or k.dtype != q.dtype or cos.dtype != torch.float32 \
            or sin.dtype != torch.float32 or cos.stride(0) != sin.stride(0) or not _eager(q, k, cos, sin):
        return torch_ops.rotary_embedding(positions, q, k, cos, sin, rot_dim=rot_dim, interleaved=interleaved)
    positions = positions if positions.dtype == torch.int64 and positions.stride(0) == 1 else positions.long().contiguous()
    cpu_attention.named_call("lmi::cpu_rotary", lambda: load().lmi_rotary_neox(
        positions.data_ptr(), q.shape[0], q.data_ptr(), q.stride(0), q.stride(1), q.shape[1], k.data_ptr(), k.stride(0),
        k.stride(1), k.shape[1], cos.data_ptr(), sin.data_ptr(), cos.stride(0), rot_dim // 2,
        int(q.dtype == torch.bfloat16), torch.get_num_threads()))
    return q, k
