"""Which attention backend serves (`option.attention_backend`: auto | flash_attn | triton | flex | cpu |
torch), decided once at start from the device, the packages that import and the KV cache dtype. The
backends' modules are imported only when chosen, so that none of them is imported by the interface."""

from __future__ import annotations

import torch

from engines.attention.base import AttentionBackend

BACKENDS = ("auto", "flash_attn", "triton", "flex", "cpu", "torch")


def flash_attn_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def triton_runs(device: torch.device) -> bool:
    """Triton kernels run on CUDA devices, and on CPU tensors under Triton's interpreter (tests)."""
    try:
        import triton
    except ImportError:
        return False
    if device.type == "cuda":
        return True
    knobs = getattr(triton, "knobs", None)
    return device.type == "cpu" and bool(knobs and knobs.runtime.interpret)


def flex_runs(device: torch.device) -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(name: str, device: torch.device, kv_dtype: torch.dtype | None = None,
                   dtype: torch.dtype | None = None) -> type[AttentionBackend]:
    """The backend class for `option.attention_backend` on this device. auto: flash-attn on CUDA when
    it imports, else the Triton kernel on CUDA; on CPU our C kernel (float32 and bf16 models, `dtype`,
    when it builds here), else torch; torch for an fp8 KV cache (kv_dtype)."""
    if name not in BACKENDS:
        raise ValueError(f"option.attention_backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    if name == "auto" and kv_dtype is not None and kv_dtype.itemsize == 1:
        name = "torch"  # the backend that reads fp8 caches
    if name == "auto":
        name = "flash_attn" if flash_attn_available(device) else "triton" if device.type == "cuda" \
            and triton_runs(device) else "cpu" if cpu_kernel_runs(device, dtype) else "torch"
    if name == "flash_attn":
        if not flash_attn_available(device):
            raise ValueError(f"option.attention_backend=flash_attn needs a CUDA device with the flash-attn package "
                             f"installed (the device is {device})")
        from engines.attention.flash_backend import FlashAttnBackend

        return FlashAttnBackend
    if name == "triton":
        if not triton_runs(device):
            raise ValueError(f"option.attention_backend=triton needs a CUDA device with triton installed (the "
                             f"device is {device}; on CPU only under Triton's interpreter, TRITON_INTERPRET=1)")
        from engines.attention.triton_backend import TritonPagedBackend

        return TritonPagedBackend
    if name == "flex":
        if not flex_runs(device):
            raise ValueError("option.attention_backend=flex needs PyTorch's FlexAttention (torch >= 2.5)")
        from engines.attention.flex_backend import FlexPagedBackend

        return FlexPagedBackend
    if name == "cpu":
        from engines.attention.cpu_backend import CpuPagedBackend

        return CpuPagedBackend
    from engines.attention.torch_backend import TorchPagedBackend

    return TorchPagedBackend


def cpu_kernel_runs(device: torch.device, dtype: torch.dtype | None) -> bool:
    """The CPU decode kernel takes this model (float32 or bf16 on a CPU) and builds here (a failed
    build is logged once, by the kernel's loader)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    from engines.kernels import cpu_attention

    return cpu_attention.load() is not None
