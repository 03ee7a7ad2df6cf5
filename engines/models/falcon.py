"""Falcon: the GPT-NeoX decoder (engines/models/neox.py) under Falcon's names and options.

    Falcon-7B            multi-query (one KV head), parallel attention and MLP on one LayerNorm
    Falcon-40B/180B      new_decoder_architecture: grouped KV heads, parallel, ln_attn and ln_mlp
                         (one input_layernorm for both where num_ln_in_parallel_attn = 1, Falcon-11B)
    parallel_attn=false  sequential: input_layernorm → attention (+res) → post_attention_layernorm → MLP (+res)
Biases on every linear, or none (`bias`); nn.GELU() by default (`activation`); full rotary. ALiBi
checkpoints (Falcon-RW) run on the fallback (engines/models/registry.py).
"""

from __future__ import annotations

from engines.models.neox import GPTNeoXForCausalLM
from engines.spec import ModelSpec

# checkpoint module ("*": the layer index) → ours, under the model or under layers[i]
FALCON_NAMES = {
    "transformer.word_embeddings": "embed_tokens",
    "transformer.ln_f": "norm",
    "lm_head": "lm_head",
    "transformer.h.*.input_layernorm": "attn_norm",
    "transformer.h.*.ln_attn": "attn_norm",
    "transformer.h.*.ln_mlp": "mlp_norm",
    "transformer.h.*.post_attention_layernorm": "mlp_norm",
    "transformer.h.*.self_attention.query_key_value": "attn.qkv_proj",
    "transformer.h.*.self_attention.dense": "attn.o_proj",
    "transformer.h.*.mlp.dense_h_to_4h": "mlp.up_proj",
    "transformer.h.*.mlp.dense_4h_to_h": "mlp.down_proj",
}


class FalconForCausalLM(GPTNeoXForCausalLM):
    NAMES = FALCON_NAMES

    @staticmethod
    def block_options(spec: ModelSpec) -> dict:
        cfg = spec.config
        new_decoder = bool(cfg.get("new_decoder_architecture"))
        parallel = new_decoder or cfg.get("parallel_attn", True)  # the new decoder is always parallel
        two_norms = new_decoder and (cfg.get("num_ln_in_parallel_attn") or 2) == 2
        bias = bool(cfg.get("bias", False))
        return {"parallel": parallel, "mlp_norm": two_norms or not parallel, "attn_bias": bias, "mlp_bias": bias,
                "act": cfg.get("activation") or "gelu"}
