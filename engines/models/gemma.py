"""Gemma and Gemma-2: the Llama layout with Gemma's differences, the rest shared with llama.py.

    embed × sqrt(hidden) → N × [norm → attention → (norm) (+res) → norm → GeGLU MLP → (norm) (+res)]
    → norm → LM head (→ cap · tanh(logits / cap))
Every norm is Gemma's RMSNorm (float32, scaled by 1 + weight); the MLP gate is GeLU (tanh). Gemma-2
adds the bracketed norms on each sublayer's output (before the residual add), alternates sliding and
global layers, scales scores by 1/sqrt(query_pre_attn_scalar) and softcaps attention scores and the
final logits: those three arrive as the spec's per-layer LayerOptions and `final_logit_softcap`.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.dist import Communicator
from engines.layers.attention import Attention
from engines.layers.norm import RMSNorm
from engines.layers.rotary import RotaryEmbedding
from engines.models.llama import MLP, LlamaForCausalLM
from engines.spec import ModelSpec


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.fused.gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, idx: int, spec: ModelSpec, rotary: RotaryEmbedding, comm: Communicator):
        super().__init__()
        bias = bool(spec.config.get("attention_bias", False))
        self.self_attn = Attention(idx, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, rotary,
                                   comm, qkv_bias=bias, o_bias=bias)
        self.mlp = GemmaMLP(spec.hidden_size, spec.intermediate_size, comm)
        norms = ["input_layernorm", "post_attention_layernorm"]
        self.sandwich = spec.model_type != "gemma"  # Gemma-2: a norm after each sublayer too
        if self.sandwich:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for name in norms:
            setattr(self, name, RMSNorm(spec.hidden_size, spec.norm_eps, gemma=True))

    def forward(self, x, residual, positions, backend, meta):
        """The (sublayer output, residual stream) pair of llama.DecoderLayer.forward."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, backend, meta)
        if self.sandwich:
            x = self.post_attention_layernorm(x)
            x, residual = self.pre_feedforward_layernorm(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class GemmaForCausalLM(LlamaForCausalLM):
    gemma_norms = True

    def make_layer(self, idx: int) -> GemmaDecoderLayer:
        return GemmaDecoderLayer(idx, self.spec, self.rotary, self.comm)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # the scale rounded to the embedding's dtype first, as the reference multiplies
        return x * torch.tensor(self.spec.hidden_size ** 0.5, dtype=x.dtype)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.spec.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits
