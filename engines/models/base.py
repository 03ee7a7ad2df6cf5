"""What every model of ours shares: the rotary tables, the embedding and LM head, and the forward
over its decoder layers, from token ids to the logits of the rows that sample. A family builds
`layers` (each taking and returning the (sublayer output, residual stream) pair) and `norm` (with
the residual add fused in), then calls `make_head`, and may override `embed` and `finish_logits`."""

from __future__ import annotations

import torch
from torch import nn

from engines.dist import Communicator
from engines.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engines.layers.rotary import RotaryEmbedding
from engines.models.spec import ModelSpec


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, comm: Communicator):
        super().__init__()
        self.spec = spec
        self.comm = comm
        self.rotary = RotaryEmbedding(spec.rope, spec.rotary_dim, max(spec.max_model_len, spec.max_position_embeddings
                                                                      or 0), spec.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, comm)
        self.head_dim = spec.head_dim

    def make_head(self) -> None:
        """The LM head, registered after the layers and the norm (the load cache lays the
        parameters out in registration order)."""
        self.lm_head = ParallelLMHead(self.spec.vocab_size, self.spec.hidden_size, self.comm)

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
