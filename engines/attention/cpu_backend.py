"""The CPU attention backend: the torch backend's cache layout, metadata and prefill path, with decode
rows attended by a C kernel (engines/kernels/cpu_attention.c) that reads K/V in place through the
block table instead of gathering every row's blocks into a copy first. Chosen by auto on CPU for
float32 and bf16 caches when the kernel builds (a C compiler is at hand; start-up logs the choice).

A compiled decode step (option.cpu_compile) traces the torch twin, decode_attention: torch.compile
cannot look into a foreign call. Tested against the twin in tests/test_cpu_attention.py.
"""

from __future__ import annotations

import torch

from engines.attention.step import LayerOptions
from engines.attention.torch_backend import TorchPagedBackend, decode_attention
from engines.kernels import cpu_attention


class CpuPagedBackend(TorchPagedBackend):
    name = "cpu"
    stores_fp8 = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.device.type != "cpu" or self.dtype not in cpu_attention.DTYPES:
            raise ValueError(f"option.attention_backend=cpu runs float32 and bf16 models on CPU, not {self.dtype} "
                             f"on {self.device}")
        if cpu_attention.load() is None:
            raise ValueError(f"option.attention_backend=cpu: its kernel did not build ({cpu_attention.why()}); "
                             "option.attention_backend=torch runs without it")

    @staticmethod
    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
               context_lens: torch.Tensor, opts: LayerOptions) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return decode_attention(q, k_cache, v_cache, block_table, context_lens, opts)
        return cpu_attention.paged_decode(q, k_cache, v_cache, block_table, context_lens, opts)

    def warm_up(self, num_heads: int, decode_buckets: list[int], width_buckets: list[int]) -> None:
        """The kernel has no per-shape state: only the buckets are kept (steps are padded to them)."""
        self.decode_buckets, self.width_buckets = list(decode_buckets), list(width_buckets)
