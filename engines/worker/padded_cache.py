"""The padded KV cache of the rolling-batch engine, and its batch algebra.

Per layer, K and V are [batch, kv_heads, capacity, head_dim]; rows are left-padded so that every
row's newest token sits in the same column:

    row 0:  .  .  t0 t1 t2 t3 | free ...      pads[0] = 2
    row 1:  t0 t1 t2 t3 t4 t5 | free ...      pads[1] = 0
            ◄──── width ─────►◄ capacity - width ►

A forward of T tokens per row writes columns [width, width + T). `concatenate` aligns two batches
on their right ends (padding the narrower on the left); `filter` keeps some rows and trims the
left padding they all share. Both work layer by layer, so peak memory stays one layer above the
two batches.
"""

from __future__ import annotations

import torch

from engines.attention.step import LayerOptions, layer_options
from engines.layers.attention import attention

GROW = 64  # columns of headroom added whenever the capacity runs out


class PaddedKVCache:
    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], pads: torch.Tensor, width: int,
                 layers: list[LayerOptions] | None = None):
        self.keys = keys  # per layer [B, H, capacity, D]
        self.values = values
        self.pads = pads  # [B] long: left padding of each row
        self.width = width
        self.layers = layer_options(len(keys), keys[0].shape[-1] if keys else 1, layers)  # scale, window, softcap
        self._masks: dict[int | None, torch.Tensor] = {}  # this forward's mask, by window (None: full)
        self._step = 0

    @classmethod
    def empty(cls, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, pads: list[int],
              capacity: int, dtype: torch.dtype, device: torch.device,
              layers: list[LayerOptions] | None = None) -> "PaddedKVCache":
        shape = (batch, num_kv_heads, capacity, head_dim)
        keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys, values, torch.tensor(pads, dtype=torch.long, device=device), 0, layers)

    @property
    def batch_size(self) -> int:
        return int(self.pads.shape[0])

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def num_tokens(self) -> int:
        """Token slots in use, padding included (what the batch costs in memory now)."""
        return self.batch_size * self.width

    def lengths(self) -> torch.Tensor:
        return self.width - self.pads

    # -- one forward ----------------------------------------------------------------------------
    def begin_forward(self, num_tokens: int) -> None:
        """Prepare the mask for `num_tokens` new tokens per row: [B, 1, T, width + T]."""
        if self.width + num_tokens > self.capacity:
            self._grow(self.width + num_tokens + GROW)
        total = self.width + num_tokens
        cols = torch.arange(total, device=self.pads.device)
        query_cols = torch.arange(self.width, total, device=self.pads.device)
        causal = cols.view(1, -1) <= query_cols.view(-1, 1)  # [T, total]
        valid = cols.view(1, -1) >= self.pads.view(-1, 1)  # [B, total]
        mask = causal.unsqueeze(0) & valid.unsqueeze(1)  # [B, T, total]
        itself = cols.view(1, 1, -1) == query_cols.view(1, -1, 1)
        # a padding query attends only to itself, so no row of the mask is empty (no NaN); a row's
        # positions are its columns less its padding, so a window is a distance in columns
        self._masks = {w: ((mask & (cols.view(1, -1) > query_cols.view(-1, 1) - w) if w else mask) | itself)
                       .unsqueeze(1) for w in {o.window for o in self.layers}}
        self._step = num_tokens

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta=None) -> torch.Tensor:
        """q: [B, T, Hq, D], k/v: [B, T, Hkv, D] → [B, T, Hq, D] (the padded cache is its own
        metadata: `meta` is unused)."""
        w, t = self.width, self._step
        self.keys[layer_idx][:, :, w:w + t] = k.transpose(1, 2)
        self.values[layer_idx][:, :, w:w + t] = v.transpose(1, 2)
        keys = self.keys[layer_idx][:, :, : w + t]
        values = self.values[layer_idx][:, :, : w + t]
        opts = self.layers[layer_idx]
        return attention(q.transpose(1, 2), keys, values, self._masks[opts.window], opts).transpose(1, 2)

    def end_forward(self) -> None:
        self.width += self._step
        self._masks = {}
        self._step = 0

    def set_layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a layer's K/V for columns [0, width + T) (the HF fallback hands back whole caches).
        transformers' cache may hold another number of heads than the checkpoint's KV heads
        (Falcon's new decoder keeps K and V repeated for every query head): the layer takes its form."""
        n = keys.shape[2]
        if n > self.capacity:
            self._grow(n + GROW)
        if keys.shape[1] != self.keys[layer_idx].shape[1]:
            shape = (keys.shape[0], keys.shape[1], self.capacity, keys.shape[3])
            self.keys[layer_idx], self.values[layer_idx] = keys.new_empty(shape), values.new_empty(shape)
        self.keys[layer_idx][:, :, :n] = keys
        self.values[layer_idx][:, :, :n] = values

    # -- batch algebra ----------------------------------------------------------------------------
    def concatenate(self, other: "PaddedKVCache") -> "PaddedKVCache":
        """Rows of self then rows of other, right-aligned at the wider width."""
        width = max(self.width, other.width)
        capacity = max(width + GROW, self.capacity, other.capacity)
        for layer in range(len(self.keys)):
            for store in (self.keys, self.values):
                a, b = store[layer], (other.keys if store is self.keys else other.values)[layer]
                merged = a.new_empty((a.shape[0] + b.shape[0], a.shape[1], capacity, a.shape[3]))
                # pad columns are masked, but must hold finite numbers: 0 * NaN would leak through
                merged[: a.shape[0], :, : width - self.width] = 0
                merged[a.shape[0]:, :, : width - other.width] = 0
                merged[: a.shape[0], :, width - self.width: width] = a[:, :, : self.width]
                merged[a.shape[0]:, :, width - other.width: width] = b[:, :, : other.width]
                store[layer] = merged  # the old tensor of this layer is freed here
            other.keys[layer] = other.values[layer] = None
        pads = torch.cat([self.pads + (width - self.width), other.pads + (width - other.width)])
        return PaddedKVCache(self.keys, self.values, pads, width, self.layers)

    def filter(self, keep: list[int]) -> "PaddedKVCache":
        """Only the rows `keep` (in that order), with their common left padding trimmed."""
        index = torch.tensor(keep, dtype=torch.long, device=self.pads.device)
        pads = self.pads[index]
        trim = int(pads.min()) if keep else self.width
        width = self.width - trim
        capacity = width + GROW
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                new = old.new_empty((len(keep), old.shape[1], capacity, old.shape[3]))
                new[:, :, :width] = old[index, :, trim: self.width]
                store[layer] = new
        return PaddedKVCache(self.keys, self.values, pads - trim, width, self.layers)

    def _grow(self, capacity: int) -> None:
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                new = old.new_empty((old.shape[0], old.shape[1], capacity, old.shape[3]))
                new[:, :, : self.width] = old[:, :, : self.width]
                store[layer] = new
