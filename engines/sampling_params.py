"""Per-request generation settings, as the engine receives them (already validated by the handler)."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True):
    max_new_tokens: int = 30
    do_sample: bool = False  # False: greedy, whatever temperature/top_k/top_p say
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0  # vLLM's: drop tokens less likely than min_p × the most likely one's probability
    typical_p: float = 1.0  # TGI's / HF's locally typical sampling: the tokens nearest the entropy, this mass
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI/vLLM: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # OpenAI/vLLM: subtracted per occurrence in the generated tokens
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    top_n_tokens: int = 0
    # the prompt's own log-probs (each token given the ones before it; TGI's decoder_input_details,
    # OpenAI's echo + logprobs), with top_n_tokens alternatives each. A prompt asking for them is
    # computed whole, not taken from the prefix cache.
    prompt_logprobs: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) before any sampling setting
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated (vLLM's)
    # vLLM's bad_words as token sequences: a sequence's last token is masked whenever the generated
    # tokens end with the rest of it (a one-token sequence: always)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # constrained decoding: llguidance's grammar text (made and validated by the HTTP worker from
    # response_format, guided_*, TGI's grammar or tools; engines/worker/grammar.py), None: free
    grammar: str | None = None

    @property
    def has_output_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_logit_masks(self) -> bool:
        """Logits changed per request before sampling (logit_bias, min_tokens, bad_words)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words_ids)

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample
