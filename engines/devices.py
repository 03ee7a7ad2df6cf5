"""What this host computes natively, the dtype a model runs in (`option.dtype` unset or `auto`), and
host values copied to a device (`to_device`).

No torch at import: the launcher decides the dtype before any engine starts, and `lmi plan` / `lmi
config` say it without loading anything; only to_device, called by the engines, imports it.

    option.dtype unset or auto
      GPU:  the checkpoint's torch_dtype: bf16 stays bf16, fp16 stays fp16, fp32 (or none named) → bf16;
            bf16 → fp16 on a GPU without bf16 (compute capability below 8.0), as vLLM does
      CPU:  bf16 where the CPU multiplies bf16 natively (AVX512-BF16, AMX-BF16; Arm's BF16), else fp32:
            elsewhere bf16 products are emulated at a third of fp32's speed or less
    option.dtype set: that dtype

Why not fp16 by default on GPUs: a model trained in bf16 can overflow fp16's range (activations past
65504); the checkpoint's own dtype is what it was trained or exported in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CHECKPOINT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float": "fp32", "half": "fp16",
                     "fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags, Arm's Features word


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags: /proc/cpuinfo's `flags` (x86) or `Features` (Arm) line; empty where
    there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def has_native_bf16(flags: frozenset[str]) -> bool:
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def describe_cpu(flags: frozenset[str]) -> str:
    """The flags that decide CPU kernels, for logs and benchmark tables: 'avx2 avx512f avx512_bf16 ...'."""
    keys = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
            "asimd", "sve", "bf16", "i8mm")
    return " ".join(k for k in keys if k in flags) or "none of avx2/avx512/amx/neon"


def checkpoint_dtype(name: str | None) -> str:
    """config.json's torch_dtype / dtype → fp32 | fp16 | bf16 (fp32 when it names none)."""
    return CHECKPOINT_DTYPES.get(str(name or "float32").replace("torch.", ""), "fp32")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # fp32 | fp16 | bf16
    why: str  # one sentence for the start log and `lmi plan`

    def __str__(self) -> str:
        return f"{self.dtype} ({self.why})"


def choose_dtype(requested: str | None, checkpoint: str | None, *, num_gpus: int, cpu: frozenset[str],
                 gpu_bf16: bool | None = None) -> DtypeChoice:
    """The dtype to run in. requested: option.dtype (None or auto: the policy above); checkpoint: the
    checkpoint's torch_dtype as config.json names it; cpu: this CPU's flags; gpu_bf16: whether the GPUs
    compute bf16 (None: not known, taken as yes — every GPU since the A100 does)."""
    if requested and requested != "auto":
        return DtypeChoice(requested, f"option.dtype={requested}")
    stored = checkpoint_dtype(checkpoint)
    if num_gpus:
        if stored == "fp16":
            return DtypeChoice("fp16", "the checkpoint's dtype")
        if gpu_bf16 is False:
            return DtypeChoice("fp16", f"the checkpoint is {stored} and this GPU has no bf16 (compute capability "
                                       "below 8.0)")
        return DtypeChoice("bf16", "the checkpoint's dtype" if stored == "bf16" else
                           f"the checkpoint is {stored}: bf16 on GPUs")
    if has_native_bf16(cpu):
        native = " / ".join(f for f in NATIVE_BF16_FLAGS if f in cpu)
        return DtypeChoice("bf16", f"this CPU multiplies bf16 natively ({native})")
    return DtypeChoice("fp32", "this CPU has no native bf16 (no AVX512-BF16 or AMX): bf16 would be emulated, "
                               "slower than fp32")


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values as a tensor on the device without a host sync: through pinned memory, copied
    without blocking on CUDA (a plain copy from pageable memory waits for the device's queue); on a
    CPU the tensor itself."""
    import torch  # (imported already by then: the engines' callers are all torch)

    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)
