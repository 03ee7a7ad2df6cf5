"""Vectorised per-row sampling: greedy, temperature, top-k, top-p, repetition, presence and frequency
penalties, seeds.

Every row has its own torch.Generator, seeded from the request's seed (or at random), and draws
from it exactly once per token, so a seeded request gives the same tokens alone and in any batch.
Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) per vocabulary entry is a draw
from p, and the noise comes from each row's own generator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engines.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    log_probs: list[float]
    top_tokens: list[list[tuple[int, float]]]  # per row: top_n (id, log_prob), empty when not asked


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        if params.do_sample:
            g = torch.Generator(device=self.device)
            g.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
            self._generators[request_id] = g

    def remove(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample_requests(self, logits: torch.Tensor, requests) -> SampleResult:
        """One token for each request (engines.core Request objects, rows of `logits` in order)."""
        seen = [r.prompt_token_ids + r.output_token_ids if r.sampling.repetition_penalty != 1.0 else []
                for r in requests]
        outputs = [r.output_token_ids if r.sampling.has_output_penalties else [] for r in requests]
        return self.sample(logits, [r.request_id for r in requests], [r.sampling for r in requests], seen, outputs)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
               seen_tokens: list[list[int]], output_tokens: list[list[int]] | None = None) -> SampleResult:
        """logits: [B, V] float32 → one token per row. `seen_tokens` (prompt + output) feed the
        repetition penalty, `output_tokens` the presence and frequency penalties."""
        logits = _apply_repetition_penalty(logits, params, seen_tokens)
        if output_tokens is not None:
            logits = _apply_output_penalties(logits, params, output_tokens)
        sampled_rows = [i for i, p in enumerate(params) if p.do_sample]
        if sampled_rows:
            logits = logits.clone()
            logits[sampled_rows] = _warp(logits[sampled_rows], [params[i] for i in sampled_rows])
        log_probs = torch.log_softmax(logits, dim=-1)  # [B, V]
        chosen = log_probs.argmax(dim=-1)
        if sampled_rows:
            probs = log_probs[sampled_rows].exp()
            noise = torch.stack([torch.empty(probs.shape[1], device=self.device)
                                 .exponential_(generator=self._generators[request_ids[i]]) for i in sampled_rows])
            chosen[sampled_rows] = (probs / noise).argmax(dim=-1)
        chosen_lp = log_probs.gather(1, chosen.view(-1, 1)).view(-1)
        top_n = max(p.top_n_tokens for p in params)
        top: list[list[tuple[int, float]]] = [[] for _ in params]
        if top_n:
            values, ids = log_probs.topk(top_n, dim=-1)
            for i, p in enumerate(params):
                n = p.top_n_tokens
                top[i] = list(zip(ids[i, :n].tolist(), values[i, :n].tolist()))
        return SampleResult(chosen.tolist(), chosen_lp.tolist(), top)


def _apply_repetition_penalty(logits: torch.Tensor, params: list[SamplingParams],
                              seen_tokens: list[list[int]]) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:  # as HF: divide positive logits, multiply negative ones, over prompt + output
        idx = torch.tensor(sorted(set(seen_tokens[i])), dtype=torch.long, device=logits.device)
        vals = logits[i, idx]
        penalty = params[i].repetition_penalty
        logits[i, idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def _apply_output_penalties(logits: torch.Tensor, params: list[SamplingParams],
                            output_tokens: list[list[int]]) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over the generated tokens, as vLLM applies them:
    logit -= frequency_penalty * count + presence_penalty * (count > 0), for all rows at once."""
    rows = [i for i, p in enumerate(params) if p.has_output_penalties and output_tokens[i]]
    if not rows:
        return logits
    width = max(len(output_tokens[i]) for i in rows)
    ids = torch.tensor([output_tokens[i] + [0] * (width - len(output_tokens[i])) for i in rows],
                       dtype=torch.long, device=logits.device)  # [R, L], padded with token 0 ...
    ones = torch.tensor([[1.0] * len(output_tokens[i]) + [0.0] * (width - len(output_tokens[i])) for i in rows],
                        dtype=logits.dtype, device=logits.device)  # ... that counts 0 times
    counts = torch.zeros(len(rows), logits.shape[1], dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, ids, ones)  # [R, V]: occurrences of each token in the output
    freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=logits.dtype, device=logits.device)
    pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=logits.dtype, device=logits.device)
    logits = logits.clone()
    logits[rows] -= freq.view(-1, 1) * counts + pres.view(-1, 1) * (counts > 0).to(logits.dtype)
    return logits


def _warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p, per row ([n, V] → [n, V] with -inf outside)."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device).view(-1, 1)
    logits = logits / temps
    vocab = logits.shape[1]
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).view(1, -1)
    drop = ranks >= ks.view(-1, 1)
    top_ps = torch.tensor([p.top_p for p in params], device=logits.device).view(-1, 1)
    if (top_ps < 1.0).any():
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop |= before >= top_ps  # keep the smallest prefix whose mass reaches top_p
    drop[:, 0] = False  # the best token always stays (a top_p that rounds to 0 in float32 must not empty a row)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)

