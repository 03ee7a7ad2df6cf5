"""What every model of ours shares: the rotary tables, the embedding and LM head, and the forward
over its decoder layers, from token ids to the logits of the rows that sample. A family builds
`layers` (each taking and returning the (sublayer output, residual stream) pair) and `norm` (with
the residual add fused in), then calls `make_head`, and may override `embed` and `finish_logits`.

Under pipeline parallelism (`comm.pipeline`) a model holds only its stage's layers (`held`; the
others are `MissingLayer`s, so that checkpoint names keep their indices): the first stage embeds,
each stage hands its hidden states and residual to the next, and the last stage's logits go to
rank 0. The embedding, final norm and LM head are built and loaded on every stage."""

from __future__ import annotations

import re

import torch
from torch import nn

from engines.dist import Communicator
from engines.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engines.layers.rotary import RotaryEmbedding
from engines.spec import ModelSpec


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds."""


# the index in a checkpoint name of a decoder layer's tensor ("model.layers.3.", "transformer.h.3.")
_LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, comm: Communicator):
        super().__init__()
        self.spec = spec
        self.comm = comm
        self.pipeline = getattr(comm, "pipeline", None)
        self.held = self.pipeline.layers(spec.num_layers) if self.pipeline else range(spec.num_layers)
        self.rotary = RotaryEmbedding(spec.rope, spec.rotary_dim, max(spec.max_model_len, spec.max_position_embeddings
                                                                      or 0), spec.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, comm)
        self.head_dim = spec.head_dim

    def make_layers(self, make) -> nn.ModuleList:
        """make(i) for the layers this stage holds, MissingLayer for the others."""
        return nn.ModuleList(make(i) if i in self.held else MissingLayer() for i in range(self.spec.num_layers))

    @property
    def first_layer(self) -> nn.Module:
        return self.layers[self.held.start]

    def holds(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs here (a decoder layer's: on the stage that holds it)."""
        layer = _LAYER_NAME.search(name)
        return layer is None or int(layer.group(1)) in self.held

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
        pipe = self.pipeline
        if pipe is None or pipe.is_first:
            x, residual = self.embed(input_ids), None
        else:
            x, residual = pipe.recv_forward((*input_ids.shape, self.spec.hidden_size), self.embed_tokens.weight.dtype,
                                            input_ids.device)
        for layer in self.layers[self.held.start:self.held.stop]:
            x, residual = layer(x, residual, positions, backend, meta)
        if pipe is not None and not pipe.is_last:
            pipe.send_forward(x, residual)
            return self._logits_from_last_stage(input_ids, logits_index)
        if logits_index is None:  # the rows that sample only, through the last norm and the LM head
            x, residual = x[:, -1], residual[:, -1]
        else:
            x, residual = x.reshape(-1, x.shape[-1])[logits_index], residual.reshape(-1, x.shape[-1])[logits_index]
        logits = self.lm_head(self.norm(x, residual)[0])
        logits = self.finish_logits(logits).float() if logits is not None else None
        if pipe is not None and logits is not None:  # the last stage's TP rank 0 → rank 0
            pipe.send_logits(logits)
            return None
        return logits

    def _logits_from_last_stage(self, input_ids: torch.Tensor, logits_index: torch.Tensor | None):
        """Rank 0 (the first stage's TP rank 0): the last stage's logits; other ranks: None."""
        if self.pipeline.world_rank:
            return None
        rows = input_ids.shape[0] if logits_index is None else logits_index.numel()
        return self.pipeline.recv_logits((rows, self.spec.vocab_size), input_ids.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's logits → the model's (Gemma-2 caps them)."""
        return logits
