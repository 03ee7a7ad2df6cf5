"""The transformers fallback on our KV cache: a checkpoint we do not implement runs transformers'
own model, with its attention through our paged (or padded) backend.

transformers 5 lets a model's attention layers call a registered function (`AttentionInterface`)
instead of its own; architectures whose modeling code goes through that interface declare
`_supports_attention_backend` (registry.attention_interface_supported reads that without importing
anything). We register `lmi` there: each layer's attention gets this step's q/k/v after the
model's own projections and rotation, and `backend.forward(layer, q, k, v, meta)` stores K/V in our
cache and attends over the sequence's context, exactly as for our own model code. So the fallback
gets the paged engine: continuous batching with paged KV, prefix caching, chunked prefill,
speculative decoding; it runs at TP 1 and eagerly (no graphs, no compile).

`HFPagedModel` has our model code's interface (engines/models/llama.py: forward(input_ids,
positions, backend, meta, logits_index)), so both engines drive it as they drive ours. How each
layer attends (scale, sliding window, softcap: the backends' LayerOptions) is what transformers
asks for, read at load from one probing forward; every later call checks that it still asks the
same, so the fallback never attends otherwise than transformers would.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engines.attention.step import LayerOptions

ATTN_IMPLEMENTATION = "lmi"


class _Step:
    """The backend and metadata of the forward in progress (one forward at a time per process)."""

    backend = None
    meta = None
    layers: list | None = None  # the backend's LayerOptions per layer
    probed: dict | None = None  # while probing: layer → the LayerOptions transformers asks for


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
               softcap=None, **kwargs):
    """transformers' attention-function signature: query [B, H, T, D], key/value [B, Hkv, T, D] (this
    step's tokens; the model runs without a transformers cache) → ([B, T, H, D], None)."""
    layer = module.layer_idx
    asked = LayerOptions(float(scaling if scaling is not None else query.shape[-1] ** -0.5), sliding_window or None,
                         softcap or None)
    if _Step.probed is not None:
        _Step.probed[layer] = asked
        return query.new_zeros(query.transpose(1, 2).shape), None
    if _Step.backend is None:
        raise RuntimeError("the lmi attention function was called outside an engine step")
    opts = _Step.layers[layer]
    if not (math.isclose(asked.scale, opts.scale, rel_tol=1e-6) and asked[1:] == opts[1:]):
        raise ValueError(f"layer {layer}: transformers' attention now asks for {asked}, not the {opts} it asked "
                         "for at load")
    out = _Step.backend.forward(layer, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), _Step.meta)
    return out, None


def register() -> None:
    """Make `attn_implementation="lmi"` known to transformers (idempotent): our attention function, and
    no attention mask (the backend masks by its own metadata)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, lambda *args, **kwargs: None)


class HFPagedModel(nn.Module):
    def __init__(self, hf_model: nn.Module, spec):
        super().__init__()
        self.hf = hf_model
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim  # TP 1
        self.layers = self._probe(spec.num_layers)  # LayerOptions per layer, as the backends apply them

    @torch.inference_mode()
    def _probe(self, num_layers: int) -> list[LayerOptions]:
        """One forward of two tokens whose attention only records what each layer asks for."""
        _Step.probed = {}
        try:
            ids = torch.zeros(1, 2, dtype=torch.long, device=self.hf.device)
            self.hf(input_ids=ids, position_ids=torch.arange(2, device=ids.device).view(1, 2), use_cache=False,
                    logits_to_keep=1)
            probed = _Step.probed
        finally:
            _Step.probed = None
        if sorted(probed) != list(range(num_layers)):
            raise ValueError(f"transformers' model called the attention of layers {sorted(probed)}, not each of "
                             f"its {num_layers} layers once")
        return [probed[i] for i in range(num_layers)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend, meta=None,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward: logits of each row's last position [B, V], or of the flattened
        token indices `logits_index` [n, V] (then input_ids is one row)."""
        _Step.backend, _Step.meta, _Step.layers = backend, meta, self.layers
        try:
            keep = 1 if logits_index is None else logits_index
            out = self.hf(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep)
        finally:
            _Step.backend = _Step.meta = None
        logits = out.logits[:, -1] if logits_index is None else out.logits[0]
        return logits.float()
