"""Which implementation of the fused ops the layers call: the Triton kernels (engines/kernels/
fused_ops.py: residual add + RMSNorm, rotary, SiLU·mul in one kernel each), their PyTorch twins
(engines/kernels/torch_ops.py, the same numerics in several torch ops), or on CPU the C kernels
(engines/kernels/cpu_ops.py: the norm and rotary in one call each, the twins for the rest). Chosen
once per model at load (`select`, then `use_fused_ops`): Triton on CUDA when it imports; the C kernels on CPU when they
build, else the twins. Triton kernels run on CPU only under its interpreter (the tests turn them on
there to check the model end to end).
"""

from __future__ import annotations

from types import ModuleType

from torch import nn

from engines.kernels import torch_ops


class UsesFusedOps:
    """A layer that calls the fused ops: `self.fused` is the implementation its model chose at load
    (`use_fused_ops`, per model: no process-wide state), the PyTorch twins until then."""

    fused: ModuleType = torch_ops


def select(device_type: str, triton: bool) -> ModuleType:
    """The implementation for this device (triton: whether Triton runs there)."""
    from engines.kernels import cpu_ops

    if device_type == "cuda" and triton:
        from engines.kernels import fused_ops

        return fused_ops
    if device_type == "cpu" and cpu_ops.load() is not None:
        return cpu_ops
    return torch_ops


def describe(module: ModuleType) -> str:
    """The implementation's name, for the log."""
    from engines.kernels import cpu_ops

    return {torch_ops: "PyTorch", cpu_ops: "C kernels for the norm and rotary, PyTorch for the rest"}.get(
        module, "Triton kernels")


def is_triton(module: ModuleType) -> bool:
    from engines.kernels import cpu_ops

    return module not in (torch_ops, cpu_ops)


def use_fused_ops(model: nn.Module, module: ModuleType) -> None:
    """Every layer of `model` that calls the fused ops calls `module`'s."""
    for layer in model.modules():
        if isinstance(layer, UsesFusedOps):
            layer.fused = module


def fused_ops_of(model: nn.Module) -> ModuleType:
    """The implementation `model`'s layers call."""
    return next(layer.fused for layer in model.modules() if isinstance(layer, UsesFusedOps))
