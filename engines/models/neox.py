"""GPT-NeoX and Pythia, and the decoder Falcon shares with them (engines/models/falcon.py).

    embed → N × block → LayerNorm → LM head
    parallel block:    x + attn(ln_attn(x)) + mlp(ln_mlp(x))    (Falcon-7B: ln_mlp is ln_attn)
    sequential block:  h = x + attn(ln_attn(x));  h + mlp(ln_mlp(h))
LayerNorms with biases; attention rotates the leading `spec.rotary_dim` dims of each head (NeoX's
rotary_pct, a quarter in Pythia); the MLP is a GeLU between two linears. q, k and v come fused in one
checkpoint tensor grouped by KV head (split_qkv); each rank takes its rows of each. A family is its
checkpoint names (a dict: checkpoint module → ours) and its block options.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engines.dist import Communicator
from engines.layers.attention import Attention
from engines.layers.embedding import VocabParallelEmbedding
from engines.layers.linear import ColumnParallelLinear, RowParallelLinear, SliceReader
from engines.layers.norm import LayerNorm
from engines.layers.rotary import RotaryEmbedding
from engines.models.registry import GELU_APPROXIMATE
from engines.models.base import CausalLM
from engines.spec import ModelSpec

# checkpoint module ("*": the layer index) → ours, under the model or under layers[i]
NEOX_NAMES = {
    "gpt_neox.embed_in": "embed_tokens",
    "gpt_neox.final_layer_norm": "norm",
    "embed_out": "lm_head",
    "lm_head": "lm_head",  # as transformers 5 names it
    "gpt_neox.layers.*.input_layernorm": "attn_norm",
    "gpt_neox.layers.*.post_attention_layernorm": "mlp_norm",
    "gpt_neox.layers.*.attention.query_key_value": "attn.qkv_proj",
    "gpt_neox.layers.*.attention.dense": "attn.o_proj",
    "gpt_neox.layers.*.mlp.dense_h_to_4h": "mlp.up_proj",
    "gpt_neox.layers.*.mlp.dense_4h_to_h": "mlp.down_proj",
}


class GeluMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, comm: Communicator, *, bias: bool, act: str):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, [intermediate_size], comm, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, comm, bias=bias)
        self.approximate = GELU_APPROXIMATE[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.gelu(self.up_proj(x), approximate=self.approximate))


class DecoderBlock(nn.Module):
    """One layer. `parallel`: attention and MLP read the same stream; `mlp_norm`: the MLP has a
    LayerNorm of its own (without one it reads the attention's; a sequential block needs one)."""

    def __init__(self, idx: int, spec: ModelSpec, rotary: RotaryEmbedding, comm: Communicator, *, parallel: bool,
                 mlp_norm: bool, attn_bias: bool, mlp_bias: bool, act: str):
        super().__init__()
        assert parallel or mlp_norm, "a sequential block normalises the MLP's input"
        self.attn = Attention(idx, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, rotary, comm,
                              qkv_bias=attn_bias, o_bias=attn_bias)
        self.mlp = GeluMLP(spec.hidden_size, spec.intermediate_size, comm, bias=mlp_bias, act=act)
        self.attn_norm = LayerNorm(spec.hidden_size, spec.norm_eps)
        self.mlp_norm = LayerNorm(spec.hidden_size, spec.norm_eps) if mlp_norm else None
        self.parallel = parallel

    def forward(self, x, residual, positions, backend, meta):
        """x: the last block's output, residual: the stream before it (None at layer 0) → the same pair
        for the next block; each residual add is the norm's after it. The sums run in the reference's
        order: (mlp + attn) + stream."""
        h, residual = add_norm(self.attn_norm, x, residual)
        attn = self.attn(h, positions, backend, meta)
        if not self.parallel:
            h, residual = self.mlp_norm(attn, residual)
            return self.mlp(h), residual
        if self.mlp_norm is not None:
            h = self.mlp_norm(residual)
        return self.mlp(h) + attn, residual


def add_norm(norm: LayerNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); at layer 0 (no residual yet) (norm(x), x)."""
    return (norm(x), x) if residual is None else norm(x, residual)


def split_qkv(fused: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """A fused query_key_value weight [rows, in] or bias [rows] → q [heads * D, ...], k, v [kv_heads * D, ...].
    Every layout of the two families is one, grouped by KV head:

        [kv_heads, q_per_kv + 2, D]: the group's query heads, then its key head, then its value head
    NeoX and Falcon with multi_query=false: kv_heads = heads, [q | k | v] per head; Falcon-7B: one group
    (every query head, then k, then v); Falcon-40B/180B (new decoder): num_kv_heads groups."""
    rest = fused.shape[1:]
    groups = fused.reshape(num_kv_heads, -1, head_dim, *rest)
    return tuple(part.reshape(-1, *rest) for part in (groups[:, :-2], groups[:, -2], groups[:, -1]))


class GPTNeoXForCausalLM(CausalLM):
    NAMES = NEOX_NAMES

    def __init__(self, spec: ModelSpec, comm: Communicator):
        super().__init__(spec, comm)
        options = self.block_options(spec)
        self.layers = self.make_layers(lambda i: DecoderBlock(i, spec, self.rotary, comm, **options))
        self.norm = LayerNorm(spec.hidden_size, spec.norm_eps)
        self.make_head()
        self.num_heads = self.first_layer.attn.num_heads  # this rank's
        self.num_kv_heads = self.first_layer.attn.num_kv_heads

    @staticmethod
    def block_options(spec: ModelSpec) -> dict:
        cfg = spec.config
        return {"parallel": cfg.get("use_parallel_residual", True), "mlp_norm": True,
                "attn_bias": cfg.get("attention_bias", True), "mlp_bias": True, "act": cfg.get("hidden_act") or "gelu"}

    # -- loading ---------------------------------------------------------------------------------
    def load_weight(self, name: str, shape: list[int], get: SliceReader) -> bool:
        """Load one checkpoint tensor (HF name) into its shard; False for names we do not use."""
        module, _, which = name.rpartition(".")  # e.g. "gpt_neox.layers.3.attention.dense", "weight"
        layer = re.search(r"\.(\d+)\.", module)
        ours = self.NAMES.get(re.sub(r"\.\d+\.", ".*.", module, count=1) if layer else module)
        if ours is None or which not in ("weight", "bias"):
            return False
        owner = self.layers[int(layer.group(1))] if layer else self
        target = owner.get_submodule(ours)
        if ours == "attn.qkv_proj":
            self._load_qkv(owner.attn, which, get)
        elif isinstance(target, VocabParallelEmbedding):  # the LM head too
            target.load_shard(get)
            if target is self.embed_tokens and self.spec.tie_word_embeddings:
                self.lm_head.load_shard(get)
        elif isinstance(target, LayerNorm):
            getattr(target, which).data.copy_(get((slice(None),)))
        elif isinstance(target, ColumnParallelLinear):
            target.load_shard(0, shape[0], get, which)
        else:
            target.load_shard(get, which)
        return True

    def _load_qkv(self, attn: Attention, which: str, get: SliceReader) -> None:
        """The fused tensor, read whole (its layout interleaves heads), split; each rank copies its rows
        of q, k and v (with KV heads replicated over the ranks, the one head its query heads use)."""
        parts = split_qkv(get((slice(None),)), self.spec.num_kv_heads, self.head_dim)
        for i, full in enumerate(parts):
            attn.qkv_proj.load_shard(i, full.shape[0], lambda index, full=full: full[index], which,
                                     attn.kv_rows if i else None)
