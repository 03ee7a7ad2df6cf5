"""Which implementation of the fused ops the layers call: the Triton kernels (engines/kernels/
fused_ops.py: residual add + RMSNorm, rotary, SiLU·mul in one kernel each), their PyTorch twins
(engines/kernels/torch_ops.py, the same numerics in several torch ops), or on CPU the C kernels
(engines/kernels/cpu_ops.py: the norm and rotary in one call each, the twins for the rest). Chosen
once per process at load (`select`): Triton on CUDA when it imports; the C kernels on CPU when they
build, else the twins. Triton kernels run on CPU only under its interpreter (the tests turn them on
there to check the model end to end).
"""

from __future__ import annotations

from types import ModuleType

from engines.kernels import torch_ops


class FusedOps:
    module: ModuleType = torch_ops

    @classmethod
    def use_triton(cls, enabled: bool) -> None:
        if enabled:
            from engines.kernels import fused_ops

            cls.module = fused_ops
        else:
            cls.module = torch_ops

    @classmethod
    def select(cls, device_type: str, triton: bool) -> str:
        """The implementation for this device (triton: whether Triton runs there) → its name, for the log."""
        from engines.kernels import cpu_ops

        cls.use_triton(device_type == "cuda" and triton)
        if device_type == "cpu" and cpu_ops.load() is not None:
            cls.module = cpu_ops
        return {torch_ops: "PyTorch", cpu_ops: "C kernels for the norm and rotary, PyTorch for the rest"}.get(
            cls.module, "Triton kernels")

    @classmethod
    def is_triton(cls) -> bool:
        from engines.kernels import cpu_ops

        return cls.module not in (torch_ops, cpu_ops)


def ops() -> ModuleType:
    """The fused ops in use (both modules have the same functions)."""
    return FusedOps.module
