"""What one forward is, for every attention backend and the step buffers: the sequences' chunks
(SeqChunk, ForwardBatch), the buffers' views of a written step (StepView), each layer's options, and
the step-size buckets that captured and compiled steps are made for. No backend here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


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
