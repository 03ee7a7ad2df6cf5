"""What every model of ours shares: the forward over its decoder layers, from token ids to the
logits of the rows that sample. A family builds `embed_tokens`, `layers` (each taking and returning
the (sublayer output, residual stream) pair), `norm` (with the residual add fused in) and `lm_head`,
and may override `embed` and `finish_logits`."""

from __future__ import annotations

import torch
from torch import nn


class CausalLM(nn.Module):
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend, meta=None,
                logits_index: torch.Tensor | None = None) -> torch.Tensor | None:
        """input_ids/positions: [B, T] → logits of each row's last position [B, V], or of the flattened
        token indices `logits_index` [n] → [n, V] (the paged engine's one-row batches); None on
        ranks > 0 (rank 0 samples)."""
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, backend, meta)
        if logits_index is None:  # the rows that sample only, through the last norm and the LM head
            x, residual = x[:, -1], residual[:, -1]
        else:
            x, residual = x.reshape(-1, x.shape[-1])[logits_index], residual.reshape(-1, x.shape[-1])[logits_index]
        logits = self.lm_head(self.norm(x, residual)[0])
        return self.finish_logits(logits).float() if logits is not None else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's logits → the model's (Gemma-2 caps them)."""
        return logits
