"""The Llama family (Llama 1-3.x, Mistral, Qwen2/2.5, Qwen3): one implementation, the differences
are the ModelSpec's (rope scaling, sliding windows, head_dim) and two switches here.

    embed → N × [RMSNorm → attention (+res) → RMSNorm → SwiGLU MLP (+res)] → RMSNorm → LM head
Qwen2 adds biases to q/k/v; Qwen3 RMS-normalises each head's q and k before the rotation. Weights
load from HF checkpoint names, each rank taking its shard.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.dist import Communicator
from engines.layers.attention import Attention
from engines.layers.fused import UsesFusedOps
from engines.layers.linear import ColumnParallelLinear, RowParallelLinear, SliceReader
from engines.layers.norm import RMSNorm
from engines.layers.rotary import RotaryEmbedding
from engines.models.base import CausalLM
from engines.spec import ModelSpec


class MLP(UsesFusedOps, nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, comm: Communicator):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], comm)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.fused.silu_and_mul(self.gate_up_proj(x)))  # one GEMM for gate and up

    def load_weight(self, proj: str, which: str, shape: list[int], get: SliceReader) -> bool:
        """gate_proj, up_proj or down_proj (HF names) into this rank's shard; False for other names."""
        if proj in _GATE_UP:
            self.gate_up_proj.load_shard(_GATE_UP[proj], shape[0], get, which)
        elif proj == "down_proj":
            self.down_proj.load_shard(get, which)
        else:
            return False
        return True


class DecoderLayer(nn.Module):
    def __init__(self, idx: int, spec: ModelSpec, rotary: RotaryEmbedding, comm: Communicator,
                 mlp: nn.Module | None = None, *, qkv_bias: bool | None = None):
        """mlp, qkv_bias: another family's feed-forward block (mlp(x) → [.., hidden], all-reduced) and
        q/k/v biases (engines/models/moe.py); by default the Llama family's."""
        super().__init__()
        is_qwen2 = spec.model_type == "qwen2"
        bias = bool(spec.config.get("attention_bias", False))
        self.self_attn = Attention(idx, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, rotary,
                                   comm, qkv_bias=bias or is_qwen2 if qkv_bias is None else qkv_bias,
                                   o_bias=bias and not is_qwen2,
                                   qk_norm_eps=spec.norm_eps if spec.model_type == "qwen3" else None)
        self.mlp = mlp if mlp is not None else MLP(spec.hidden_size, spec.intermediate_size, comm)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)

    def forward(self, x, residual, positions, backend, meta):
        """x: the last sublayer's output, residual: the stream before it (None at layer 0) → the same
        pair for the next layer; each residual add is fused into the norm after it."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, backend, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    gemma_norms = False  # the final norm in Gemma's (1 + weight) form

    def __init__(self, spec: ModelSpec, comm: Communicator):
        super().__init__(spec, comm)
        self.layers = self.make_layers(self.make_layer)
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps, gemma=self.gemma_norms)
        self.make_head()
        self.num_heads = self.first_layer.self_attn.num_heads  # this rank's
        self.num_kv_heads = self.first_layer.self_attn.num_kv_heads

    def make_layer(self, idx: int) -> DecoderLayer:
        return DecoderLayer(idx, self.spec, self.rotary, self.comm)

    # -- loading ---------------------------------------------------------------------------------
    def load_weight(self, name: str, shape: list[int], get: SliceReader) -> bool:
        """Load one checkpoint tensor (HF name) into its shard; False for names we do not use."""
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            self.embed_tokens.load_shard(get)
            if self.spec.tie_word_embeddings:
                self.lm_head.load_shard(get)
            return True
        if name == "lm_head.weight":
            self.lm_head.load_shard(get)
            return True
        if name == "norm.weight":
            self.norm.weight.data.copy_(get((slice(None),)))
            return True
        if not name.startswith("layers."):
            return False
        _, idx, rest = name.split(".", 2)
        return _load_layer_weight(self.layers[int(idx)], rest, shape, get)


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _load_layer_weight(layer: DecoderLayer, rest: str, shape: list[int], get: SliceReader) -> bool:
    module, which = rest.rsplit(".", 1)  # e.g. "self_attn.q_proj", "weight"
    owner, _, proj = module.rpartition(".")
    if owner == "self_attn" and proj == "qkv_proj":  # Phi-3: q, k and v in one tensor
        attn = layer.self_attn
        q_rows, kv_rows = attn.num_heads * attn.head_dim * attn.comm.world_size, attn.kv_size
        attn.qkv_proj.load_fused([q_rows, kv_rows, kv_rows], get, which, [None, attn.kv_rows, attn.kv_rows])
    elif owner == "mlp" and proj == "gate_up_proj":  # Phi-3: gate and up in one tensor
        layer.mlp.gate_up_proj.load_fused([shape[0] // 2] * 2, get, which)
    elif owner == "self_attn" and proj in _QKV:
        attn = layer.self_attn
        part = _QKV[proj]
        attn.qkv_proj.load_shard(part, shape[0], get, which, attn.kv_rows if part else None)
    elif owner == "self_attn" and proj == "o_proj":
        layer.self_attn.o_proj.load_shard(get, which)
    elif owner == "mlp" and isinstance(layer.mlp, MLP):
        return layer.mlp.load_weight(proj, which, shape, get)
    elif module.endswith("layernorm") and isinstance(getattr(layer, module, None), RMSNorm):
        getattr(layer, module).weight.data.copy_(get((slice(None),)))  # Gemma-2's four norms too
    elif owner == "self_attn" and proj in ("q_norm", "k_norm") and layer.self_attn.q_norm is not None:
        getattr(layer.self_attn, proj).weight.data.copy_(get((slice(None),)))
    elif rest.endswith("rotary_emb.inv_freq"):
        return False
    else:
        return False
    return True

