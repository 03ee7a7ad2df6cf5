"""The running padded batch of one rank, as step operations that every rank can mirror."""

from __future__ import annotations

import torch

from engines.worker.model_runner import ModelRunner
from engines.worker.padded_cache import PaddedKVCache
from engines.worker.sampler import PromptLogprobs, prompt_logprobs


class PaddedBatch:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.running: PaddedKVCache | None = None
        self._new: PaddedKVCache | None = None
        self.lora_slots: list[int] = []  # each running row's LoRA slot (0: the base model)
        self._new_slots: list[int] = []

    def prefill(self, prompts: list[list[int]], prompt_top_n: list[int | None] = (), lora_slots: list[int] = ()) \
            -> tuple[torch.Tensor | None, dict[int, PromptLogprobs]]:
        """A new batch from prompts, kept aside until `merge`; → (last-token logits [n, V], the prompt
        log-probs of each row whose `prompt_top_n` is not None). Rank 0 only: (None, {}) elsewhere."""
        rows = [i for i, top in enumerate(prompt_top_n) if top is not None]
        self._new_slots = list(lora_slots) or [0] * len(prompts)
        logits, self._new = self.runner.prefill(prompts, rows, self._new_slots)
        if logits is None:
            return None, {}
        prompt, at = {}, len(prompts)
        for i in rows:
            count = len(prompts[i]) - 1
            prompt[i] = prompt_logprobs(logits[at:at + count], prompts[i][1:], 1, prompt_top_n[i])
            at += count
        return logits[:len(prompts)], prompt

    def warm_up(self, num_tokens: int) -> int:
        return self.runner.warm_up(num_tokens)

    def merge(self, keep: list[int]) -> None:
        """Join rows `keep` of the prefilled batch to the running one (the others finished at once)."""
        new, self._new = self._new, None
        if not keep:
            return
        if len(keep) < new.batch_size:
            new = new.filter(keep)
        self.running = new if self.running is None else self.running.concatenate(new)
        self.lora_slots += [self._new_slots[i] for i in keep]

    def decode(self, last_tokens: list[int]) -> torch.Tensor:
        return self.runner.decode(self.running, last_tokens, self.lora_slots)

    def retire(self, keep: list[int]) -> None:
        """Keep only rows `keep`; an empty batch holds no KV memory."""
        self.running = self.running.filter(keep) if keep else None
        self.lora_slots = [self.lora_slots[i] for i in keep]

    def reset(self) -> None:
        self.running = self._new = None
        self.lora_slots = []

    def num_kv_slots(self) -> int:
        running = self.running
        return running.num_tokens() if running is not None else 0
