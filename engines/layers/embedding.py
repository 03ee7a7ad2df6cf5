"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.

The vocabulary is padded up to a multiple of the world size; padded rows never win (their logits
are cut off after the gather).
"""

from __future__ import annotations

import torch
from torch import nn

from engines.dist import Communicator
from engines.layers.linear import SliceReader, linear


def _local_range(vocab_size: int, comm: Communicator) -> tuple[int, int, int]:
    padded = -(-vocab_size // comm.world_size) * comm.world_size
    part = padded // comm.world_size
    return comm.rank * part, (comm.rank + 1) * part, part


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, comm: Communicator):
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab_size
        self.lo, self.hi, part = _local_range(vocab_size, comm)
        self.weight = nn.Parameter(torch.zeros(part, hidden_size), requires_grad=False)

    def load_shard(self, get: SliceReader) -> None:
        hi = max(min(self.hi, self.vocab_size), self.lo)
        if hi > self.lo:
            self.weight.data[: hi - self.lo].copy_(get((slice(self.lo, hi),)))
        self.weight.data[hi - self.lo:].zero_()  # padding rows past the real vocabulary

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.lo
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over this rank's vocabulary slice, gathered to the full vocabulary on rank 0,
    which alone samples (other ranks get None: no all-gather of logits nobody reads)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = linear(hidden, self.weight)  # [..., vocab / world]
        if self.comm.world_size > 1:
            logits = self.comm.gather(logits, dim=-1)
            if logits is None:
                return None
        return logits[..., : self.vocab_size]
