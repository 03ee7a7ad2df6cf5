"""Which checkpoints run on our model code, and why the rest run on the transformers fallback.

`fallback_reason(spec)` is the one decision: the launcher picks the engine with it (the fallback
runs in the padded engine, never the paged one), the model runner picks the model code with it, and
the start log and `lmi plan` print it. Pure Python: the launcher imports no torch. Each native
architecture names its code and the settings that code honours (`Native.check`); an architecture
we implement that meets a setting our code cannot honour falls back by name, never runs wrong.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from typing import Callable, NamedTuple

from engines.spec import ModelSpec

ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def activation(spec: ModelSpec, default: str = "silu") -> str:
    return spec.config.get("hidden_act") or spec.config.get("hidden_activation") or default


def _llama(spec: ModelSpec) -> str | None:
    act = activation(spec)
    if act != "silu":
        return f"hidden_act {act!r} (our {spec.architecture} code has SiLU-gated MLPs)"
    if spec.config.get("mlp_bias"):
        return "mlp_bias=true (our MLPs have no biases)"
    if spec.final_logit_softcap:
        return "final_logit_softcapping (not applied by our code for this architecture)"
    return None


def _gemma(spec: ModelSpec) -> str | None:
    act = activation(spec, "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):  # Gemma's "gelu" means the tanh form
        return f"hidden_activation {act!r} (our Gemma code has GeLU(tanh)-gated MLPs)"
    if spec.config.get("use_bidirectional_attention"):
        return "use_bidirectional_attention=true (our attention is causal)"
    return None


# the keys our MoE code reads from config.json without a default
_MOE_KEYS = {"mixtral": ("num_local_experts", "num_experts_per_tok"),
             "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "shared_expert_intermediate_size")}


def _moe(spec: ModelSpec) -> str | None:
    act = activation(spec)
    if act != "silu":
        return f"hidden_act {act!r} (our {spec.architecture} code has SiLU-gated experts)"
    if spec.model_type not in _MOE_KEYS:
        return f"model_type {spec.model_type!r} (our MoE code knows Mixtral's and Qwen2-MoE's layouts)"
    missing = [key for key in _MOE_KEYS[spec.model_type] if spec.config.get(key) is None]
    if missing:
        return f"config.json lacks {', '.join(missing)}"
    if spec.model_type == "qwen2_moe" and spec.config.get("use_sliding_window") and "layer_types" not in spec.config:
        # transformers 5 slides even layers below max_window_layers here, not Qwen2's layers from it on
        return "use_sliding_window=true without layer_types (Qwen2-MoE's own layer rule is not implemented)"
    return None


# the GeLUs of the NeoX and Falcon families → torch's gelu(approximate=...): gelu_new and gelu_fast are
# the tanh form written out (the same function up to rounding)
GELU_APPROXIMATE = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh"}


def _gelu(act: str, spec: ModelSpec) -> str | None:
    return None if act in GELU_APPROXIMATE else f"hidden_act {act!r} (our {spec.architecture} code has GeLU MLPs)"


def _neox(spec: ModelSpec) -> str | None:
    return _gelu(activation(spec, "gelu"), spec)


def _falcon(spec: ModelSpec) -> str | None:
    cfg = spec.config
    if cfg.get("alibi"):
        return "alibi=true (ALiBi position biases: our attention backends have none)"
    if cfg.get("new_decoder_architecture") and cfg.get("parallel_attn") is False:
        return "new_decoder_architecture with parallel_attn=false (a layer transformers' Falcon does not define)"
    return _gelu(cfg.get("activation") or "gelu", spec)


class Native(NamedTuple):
    code: str  # "module:Class" under engines.models, imported when a model is built
    check: Callable[[ModelSpec], str | None]  # a setting of the checkpoint the code does not honour


# config.json `architectures` → our implementation
NATIVE: dict[str, Native] = {
    "LlamaForCausalLM": Native("llama:LlamaForCausalLM", _llama),
    "MistralForCausalLM": Native("llama:LlamaForCausalLM", _llama),
    "Qwen2ForCausalLM": Native("llama:LlamaForCausalLM", _llama),
    "Qwen3ForCausalLM": Native("llama:LlamaForCausalLM", _llama),
    "Phi3ForCausalLM": Native("llama:LlamaForCausalLM", _llama),
    "GemmaForCausalLM": Native("gemma:GemmaForCausalLM", _gemma),
    "Gemma2ForCausalLM": Native("gemma:GemmaForCausalLM", _gemma),
    "MixtralForCausalLM": Native("moe:MoeForCausalLM", _moe),
    "Qwen2MoeForCausalLM": Native("moe:MoeForCausalLM", _moe),
    "GPTNeoXForCausalLM": Native("neox:GPTNeoXForCausalLM", _neox),
    "FalconForCausalLM": Native("falcon:FalconForCausalLM", _falcon),
}


def fallback_reason(spec: ModelSpec) -> str | None:
    """Why the checkpoint cannot run natively (None: it can)."""
    native = NATIVE.get(spec.architecture)
    if native is None:
        return f"no native implementation of {spec.architecture}"
    reason = native.check(spec)
    if reason:
        return reason
    for rope in filter(None, (spec.rope, spec.local_rope)):
        if rope.kind not in ROPE_KINDS:
            return f"rope_type {rope.kind!r} is not implemented natively"
        if rope.kind == "dynamic" and spec.max_model_len > (spec.max_position_embeddings or 0):
            return (f"rope_type 'dynamic' past max_position_embeddings={spec.max_position_embeddings} (max_model_len "
                    f"{spec.max_model_len}): transformers rescales its base with each sequence's length")
    return None


@functools.lru_cache(maxsize=None)
def attention_interface_supported(model_type: str) -> bool:
    """Whether transformers' model code for `model_type` routes its attention through transformers'
    attention interface (its PreTrainedModel declares `_supports_attention_backend = True`): then the
    fallback runs with our KV cache in the paged engine (engines/worker/hf_paged.py). Read from the
    installed transformers' source, so the launcher imports neither transformers nor torch."""
    found = importlib.util.find_spec("transformers")
    if found is None or not found.submodule_search_locations or not model_type:
        return False
    name = model_type.replace("-", "_")
    path = os.path.join(found.submodule_search_locations[0], "models", name, f"modeling_{name}.py")
    try:
        with open(path, encoding="utf-8") as f:
            return "_supports_attention_backend = True" in f.read()
    except OSError:
        return False


def paged_fallback(spec: ModelSpec) -> bool:
    """A checkpoint on the fallback runs transformers' model on our paged KV cache when its attention
    goes through transformers' attention interface; otherwise transformers' own cache, padded."""
    return fallback_reason(spec) is not None and attention_interface_supported(spec.model_type)


def model_class(spec: ModelSpec):
    """Our implementation of the checkpoint, or None when it runs on the fallback."""
    if fallback_reason(spec) is not None:
        return None
    module, name = NATIVE[spec.architecture].code.split(":")
    return getattr(importlib.import_module(f"engines.models.{module}"), name)
