"""Attention backends of the paged engine: each owns its KV cache layout, its per-step metadata and
its kernel, and is chosen once at start (`option.attention_backend`: auto | torch | flash_attn).

    backend.allocate(num_blocks)                 the per-layer K and V caches, in its layout
    meta = backend.build_metadata(seqs)          index tensors of one step, built once per step
    out = backend.forward(layer, q, k, v, meta)  store this step's K/V, attend (every layer)

A step is one flattened, padding-free batch of tokens (prefill chunks and decodes together), each
sequence described by a SeqSlice:

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]     (three decodes, two prefill chunks)

The metadata travels as an argument, not as backend state, so that a compiled decode step can
build it from its own input buffers.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "flash_attn")


@dataclass
class SeqSlice:
    """One sequence's part of a step."""

    query_start: int  # index of its first token in the flattened batch
    num_query_tokens: int
    context_len: int  # tokens in the cache once this step's are written (computed + scheduled)
    block_ids: list[int]
    # a decode with proposed tokens to verify (speculative decoding): a backend may attend its few
    # query tokens as decode rows (each with its own context length) instead of as a prefill chunk
    speculative: bool = False


class AttentionBackend(abc.ABC):
    name: str

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.num_blocks = 0

    @abc.abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K (and V) cache."""

    def allocate(self, num_blocks: int, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        """The caches: `num_blocks` for requests plus one scratch block for padding tokens; the
        shape buckets for `max_num_seqs` decodes of up to `max_blocks_per_seq` blocks."""
        shape = self.kv_cache_shape(num_blocks + 1)
        with torch.inference_mode(False):  # ordinary tensors: a compiled step may write views of them
            self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.decode_buckets = token_buckets(max_num_seqs)
        self.width_buckets = token_buckets(max_blocks_per_seq)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @abc.abstractmethod
    def build_metadata(self, seqs: list[SeqSlice], num_tokens: int | None = None):
        """The step's index tensors (on the device), shared by every layer; tokens past the
        sequences' up to `num_tokens` are padding (their K/V go to the scratch block)."""

    @abc.abstractmethod
    def build_decode_metadata(self, seqs: list[SeqSlice], num_rows: int, width: int):
        """A decode-only step at a fixed shape (CUDA graphs): `num_rows` rows, the sequences' then
        padding decodes on the scratch block, block tables `width` blocks wide."""

    def warm_up(self, num_heads: int) -> None:
        """Run every kernel shape the backend will meet (nothing by default)."""

    @abc.abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q: [1, N, Hq, D], k/v: [1, N, Hkv, D] for the step's N tokens → [1, N, Hq, D]."""


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


def flash_attn_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend class for `option.attention_backend` on this device (auto: flash-attn on CUDA
    when it imports, else torch)."""
    from engines.attention.torch_backend import TorchPagedBackend

    if name not in BACKENDS:
        raise ValueError(f"option.attention_backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    if name == "torch" or (name == "auto" and not flash_attn_available(device)):
        return TorchPagedBackend
    if not flash_attn_available(device):
        raise ValueError(f"option.attention_backend=flash_attn needs a CUDA device with the flash-attn package "
                         f"installed (the device is {device})")
    from engines.attention.flash_backend import FlashAttnBackend

    return FlashAttnBackend
