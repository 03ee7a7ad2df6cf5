"""Architecture names (config.json `architectures`) → our implementations."""

from __future__ import annotations

from engines.config import NATIVE_ARCHITECTURES
from engines.models.llama import LlamaForCausalLM

REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
assert set(REGISTRY) == NATIVE_ARCHITECTURES  # the launcher decides engines from that list


def model_class(architecture: str):
    return REGISTRY.get(architecture)
