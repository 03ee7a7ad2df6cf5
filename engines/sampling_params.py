"""Per-request generation settings, as the engine receives them (already validated by the handler)."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True):
    max_new_tokens: int = 30
    do_sample: bool = False  # False: greedy, whatever temperature/top_k/top_p say
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI/vLLM: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # OpenAI/vLLM: subtracted per occurrence in the generated tokens
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    top_n_tokens: int = 0

    @property
    def has_output_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample
