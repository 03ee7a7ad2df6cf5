"""Attention backends of the paged engine: each owns its KV cache layout, its per-step metadata and
its kernel, and is chosen once at start (`option.attention_backend`: auto | flash_attn | triton |
flex | torch).

    backend.allocate(num_blocks)                   the per-layer K and V caches, in its layout
    meta = backend.metadata(view, static=False)    index tensors of one step, shared by every layer
    out = backend.forward(layer, q, k, v, meta)    store this step's K/V, attend (every layer)

A step is one flattened batch of tokens (prefill chunks, decodes and proposed tokens together) in
the persistent step buffers (engines/worker/step_buffers.py); its metadata is built from views of
those buffers. `static=True` asks for metadata that holds for any decode step of the view's size,
whatever the buffers hold (a captured CUDA graph replays it): views only, no host facts, block
tables at their full width. The metadata travels as an argument, not as backend state, so that a
compiled or captured step reads it from its own inputs.
"""

from __future__ import annotations

import abc
from typing import Sequence

import torch

from engines.attention.step import LayerOptions, StepView, layer_options


KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """option.kv_cache_dtype → the dtype K/V are stored in: auto, the model's; fp8 (= fp8_e4m3, range
    ±448) or fp8_e5m2 (±57344, fewer mantissa bits), stored unscaled (vLLM's default scale of 1.0)."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"option.kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    return KV_CACHE_DTYPES[name]


class AttentionBackend(abc.ABC):
    """K/V are stored in `kv_dtype` (option.kv_cache_dtype; the model dtype by default). A backend
    that reads fp8 caches says so (`stores_fp8`): it writes K/V rounded to fp8 and reads them back in
    the model dtype before attending."""

    name: str
    block_dim: int  # the axis of kv_cache_shape that counts blocks (the KV tiers copy whole blocks)
    preferred_block_size: int | None = None  # a block size the kernels need (flash-attn: 256)
    stores_fp8 = False

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, layers: Sequence[LayerOptions] | None = None,
                 kv_dtype: torch.dtype | None = None, held: range | None = None):
        """held: the layers whose caches this rank keeps (its pipeline stage's; None: all)."""
        self.num_layers = num_layers
        self.held = held if held is not None else range(num_layers)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        if self.kv_dtype.itemsize == 1 and not self.stores_fp8:
            raise ValueError(f"option.kv_cache_dtype={self.kv_dtype} needs the torch attention backend "
                             f"(option.attention_backend=torch or auto), not {self.name}")
        self.device = device
        self.layers = layer_options(num_layers, head_dim, layers)  # scale, window, softcap of each layer
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.num_blocks = 0

    @abc.abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K (and V) cache."""

    def allocate(self, num_blocks: int) -> None:
        """The caches: `num_blocks` for requests plus one scratch block (`scratch_block`) that
        padding tokens write to and pad sequences read."""
        shape = self.kv_cache_shape(num_blocks + 1)
        with torch.inference_mode(False):  # ordinary tensors: a compiled step may write views of them
            self.keys = [torch.zeros(shape if i in self.held else (0,), dtype=self.kv_dtype, device=self.device)
                         for i in range(self.num_layers)]
            self.values = [torch.zeros(shape if i in self.held else (0,), dtype=self.kv_dtype, device=self.device)
                           for i in range(self.num_layers)]
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @abc.abstractmethod
    def metadata(self, view: StepView, static: bool = False):
        """The step's metadata over the view's buffers (static: for a captured decode step)."""

    def warm_up(self, num_heads: int, decode_buckets: list[int], width_buckets: list[int]) -> None:
        """Run every kernel shape the backend will meet (nothing by default)."""

    @abc.abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q: [1, N, Hq, D], k/v: [1, N, Hkv, D] for the step's N tokens → [1, N, Hq, D]."""
