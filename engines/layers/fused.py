"""Which implementation of the fused ops the layers call: the Triton kernels (engines/kernels/
fused_ops.py: residual add + RMSNorm, rotary, SiLU·mul in one kernel each) or their PyTorch twins
(engines/kernels/torch_ops.py, the same numerics in several torch ops). Chosen once per process at
load (`use_triton`): Triton on CUDA when it imports; the twins on CPU, where Triton kernels only run
under its interpreter (the tests turn them on there to check the model end to end).
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
    def is_triton(cls) -> bool:
        return cls.module is not torch_ops


def ops() -> ModuleType:
    """The fused ops in use (both modules have the same functions)."""
    return FusedOps.module
