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
import logging
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "flash_attn", "triton", "flex", "cpu", "torch")


class LayerOptions(NamedTuple):
    """How one layer attends, beyond causality: the score scale, a sliding window (keys at most
    window - 1 positions back: transformers' `sliding_window`), a logit softcap (cap * tanh(s / cap),
    Gemma-2)."""

    scale: float
    window: int | None = None
    softcap: float | None = None


def layer_options(num_layers: int, head_dim: int, layers=None) -> list[LayerOptions]:
    """The model's per-layer options, or the plain ones (scale 1/sqrt(head_dim)) for every layer."""
    return list(layers) if layers is not None else [LayerOptions(head_dim ** -0.5)] * num_layers


def token_buckets(max_tokens: int) -> list[int]:
    """Step sizes in tokens: 1, 2, 4, then multiples of 8 to 64, then powers of two and the halfway
    points (96, 128, 192, 256, ...: at most a third of a step is padding), up to max_tokens."""
    sizes = [1, 2, 4] + list(range(8, 65, 8))
    while sizes[-1] < max_tokens:
        size = sizes[-1]
        sizes.append(size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3)
    return sorted({min(s, max_tokens) for s in sizes})


def bucket(sizes: list[int], n: int) -> int:
    """The smallest size >= n (n itself past the largest)."""
    return next((s for s in sizes if s >= n), n)


@dataclass
class SeqChunk:
    """One sequence's part of a forward: positions start .. start + num_tokens - 1."""

    start: int
    num_tokens: int
    block_ids: list[int]  # its block table (covers every position it computes)
    token_ids: list[int]  # host ids of its tokens: num_tokens of them, or one fewer when fed_row >= 0
    fed_row: int = -1  # >= 0: its last token is row fed_row of the previous step's sampled tokens
    speculative: bool = False  # proposed tokens to verify: a backend may attend them as decode rows
    lora_slot: int = 0  # its LoRA adapter's slot (0: the base model)

    @property
    def context_len(self) -> int:
        return self.start + self.num_tokens


@dataclass
class ForwardBatch:
    chunks: list[SeqChunk]
    logits_rows: list[int]  # flattened token indices whose logits are wanted, in output order

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        return bool(self.chunks) and all(c.num_tokens == 1 for c in self.chunks)


@dataclass
class StepView:
    """What one `write` put in the buffers: sizes (host ints), device views, and the host facts that
    eager metadata may use (graph metadata uses none of them)."""

    num_tokens: int  # T, padding included
    num_seqs: int  # S, a decode step's pad sequences included
    num_logits: int  # rows of logits_indices (padded to a decode bucket)
    width: int  # blocks of the longest sequence
    decode_only: bool
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [num_logits] int64
    query_start: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, W_max] int32
    chunks: list[SeqChunk] = field(default_factory=list)


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values as a tensor on the device without a host sync: through pinned memory, copied
    without blocking on CUDA (a plain copy from pageable memory waits for the device's queue); on a
    CPU the tensor itself."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


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
