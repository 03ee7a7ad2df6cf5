"""HF `generate` over a left-padded batch of prompts that share their sampling parameters."""

from __future__ import annotations

import logging
import time

import torch
from transformers import AutoModelForCausalLM

from engines.config import ModelConfig
from engines.weights.loader import parameter_bytes, torch_dtype
from engines.spec import ModelSpec
from engines.process.startup import TIMELINE, throughput
from engines.protocol import FINISH_EOS, FINISH_LENGTH, Add, Output
from engines.sampling_params import SamplingParams
from engines.worker.grammar import Grammars, apply_bitmask, bitmask_width, fill_row

log = logging.getLogger(__name__)

class HFGenerator:
    def __init__(self, config: ModelConfig, spec: ModelSpec):
        self.config = config
        self.spec = spec
        self.model = None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def load(self) -> None:
        started = time.perf_counter()
        dtype = torch_dtype(self.config.dtype, self.spec.checkpoint_dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.config.local_dir, dtype=dtype, trust_remote_code=self.config.trust_remote_code,
            use_safetensors=True).to(self.device).eval()
        self.eos_token_ids = list(self.spec.eos_token_ids)
        self.grammars = Grammars(self.config.local_dir, self.spec.vocab_size, self.spec.eos_token_ids)
        pad = self.spec.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        elapsed = time.perf_counter() - started
        log.info("loaded %s (%s) in %.1f s on %s", type(self.model).__name__, dtype, elapsed, self.device)
        TIMELINE.record("weight_load", elapsed, throughput(parameter_bytes(self.model), elapsed))

    @torch.inference_mode()
    def generate(self, batch: list[Add]) -> list[Output]:
        params = batch[0].sampling
        prompts = [r.prompt_token_ids for r in batch]
        width = max(len(p) for p in prompts)
        # left padding: [batch, width], real tokens right-aligned
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p):] = 1
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        processors = [GrammarProcessor(self.grammars, params.grammar, len(batch), width)] if params.grammar else None
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
            generation_config=self._generation_config(params, stop_ids), logits_processor=processors)
        new_ids = out.sequences[:, width:]  # [batch, steps]
        # log-probability of each chosen token under the (processed) distribution it was drawn from
        scores = torch.stack(out.scores, dim=1).float()  # [batch, steps, vocab]
        log_probs = torch.log_softmax(scores, dim=-1).gather(-1, new_ids.unsqueeze(-1)).squeeze(-1)
        return [_to_output(req.request_id, ids, lps, set(stop_ids))
                for req, ids, lps in zip(batch, new_ids.tolist(), log_probs.tolist())]

    def _generation_config(self, params: SamplingParams, stop_ids: list[int]):
        from transformers import GenerationConfig

        sampling = dict(temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p,
                        min_p=params.min_p or None, typical_p=params.typical_p) if params.do_sample else {}
        return GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=params.do_sample,
            repetition_penalty=params.repetition_penalty, pad_token_id=self.pad_token_id,
            eos_token_id=stop_ids or None, bos_token_id=self.model.generation_config.bos_token_id,
            return_dict_in_generate=True, output_scores=True, **sampling)


class GrammarProcessor:
    """HF generate's logits processor for a batch sharing one grammar: each row's matcher consumes the
    token the row emitted last and masks the next; a row HF goes on padding after its end (the grammar
    refuses the pad token) is left free (its tokens after the stop are cut)."""

    def __init__(self, grammars: Grammars, grammar: str, batch_size: int, prompt_width: int):
        compiled = grammars.compiled(grammar)
        self.matchers = [compiled.deep_copy() for _ in range(batch_size)]
        self.free = [False] * batch_size
        self.prompt_width = prompt_width
        self.bitmask = torch.full((batch_size, bitmask_width(grammars.vocab_size)), -1, dtype=torch.int32)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        last = input_ids[:, -1].tolist() if input_ids.shape[1] > self.prompt_width else None
        for i, m in enumerate(self.matchers):
            if last is not None and not self.free[i] and not m.consume_token(last[i]):
                self.free[i] = True
            if self.free[i]:
                self.bitmask[i] = -1
            else:
                fill_row(m, self.bitmask, i)
        rows = torch.arange(len(self.matchers), device=scores.device)
        return apply_bitmask(scores, rows, self.bitmask.to(scores.device))


def _to_output(request_id: str, ids: list[int], log_probs: list[float], stop_ids: set[int]) -> Output:
    """Cut a generated row after its first stop token (HF pads finished rows after it)."""
    for n, tok in enumerate(ids):
        if tok in stop_ids:
            return Output(request_id, ids[: n + 1], log_probs[: n + 1], finished=True, finish_reason=FINISH_EOS)
    return Output(request_id, ids, log_probs, finished=True, finish_reason=FINISH_LENGTH)

