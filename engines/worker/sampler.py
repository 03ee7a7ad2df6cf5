"""Vectorised per-row sampling: greedy, temperature, top-k, top-p, repetition, presence and frequency
penalties, logit_bias, min_tokens, bad words, grammars, seeds, with each request's state kept on the
device.

A request is added once (`add`, with its prompt and any tokens it already generated) and sampled
by id; the sampler keeps, per request, what its penalties need as tensors over the vocabulary —
which tokens it has seen (repetition penalty: prompt and output) and how often it generated each
(presence / frequency) — and updates them in place with every sampled token, so a step never
rebuilds prompt + output lists.

Every sampled row has its own torch.Generator, seeded from the request's seed (or at random), and
draws from it exactly once per token, so a seeded request gives the same tokens alone and in any
batch. Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) per vocabulary entry is a
draw from p, and the noise comes from each row's own generator. Only rows with top-k or top-p sort
the vocabulary.

A request with a grammar (SamplingParams.grammar) has its row masked by the grammar's bitmask after
every other setting but before sampling (engines/worker/grammar.py: the masks of step N+1 are
computed while it runs); its emitted tokens advance the grammar, a host read of those rows only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engines.devices import to_device
from engines.sampling_params import SamplingParams
from engines.worker.grammar import Grammars, apply_bitmask


@dataclass
class SampleResult:
    token_ids: list[int]
    log_probs: list[float]
    top_tokens: list[list[tuple[int, float]]]  # per row: top_n (id, log_prob), empty when not asked

    def split_rows(self) -> list[SampleResult]:
        """One SampleResult of B rows (one token each) → B of one token each."""
        return [SampleResult([t], [lp], [top]) for t, lp, top in zip(self.token_ids, self.log_probs, self.top_tokens)]


@dataclass
class PromptLogprobs:
    """Log-probs of prompt tokens `start`, `start + 1`, ... under the model, each given the tokens
    before it (from the logits at the position before), with top_n alternatives when asked."""

    start: int
    log_probs: list[float]
    top_tokens: list[list[tuple[int, float]]]


def prompt_logprobs(logits: torch.Tensor, targets: list[int], start: int, top_n: int) -> PromptLogprobs:
    """logits [n, V] at prompt positions start-1 ... start+n-2 → the log-probs of `targets` (the
    prompt tokens at start ... start+n-1): the model's own distribution, no sampling settings."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = log_probs.gather(1, torch.tensor(targets, device=logits.device).view(-1, 1)).view(-1).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in targets]
    if top_n:
        values, ids = log_probs.topk(top_n, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return PromptLogprobs(start, chosen, top)


class _RequestState:
    __slots__ = ("params", "generator", "seen", "counts", "pending", "num_generated", "bias", "banned", "recent")

    def __init__(self, params: SamplingParams, generator: torch.Generator | None):
        self.params = params
        self.generator = generator
        self.num_generated = 0  # tokens it generated (min_tokens)
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias: (ids, values) on the device
        self.banned: torch.Tensor | None = None  # min_tokens: the ids masked until then (EOS, stop_token_ids)
        self.recent: list[int] | None = None  # bad words: the last generated tokens (as many as the longest needs)
        self.seen: torch.Tensor | None = None  # [V] bool: prompt and output (repetition penalty)
        self.counts: torch.Tensor | None = None  # [V] float: occurrences in the output (presence, frequency)
        self.pending: tuple[list[int], list[int]] | None = None  # (prompt, output) until the vocabulary is known


class Sampler:
    def __init__(self, device: torch.device, eos_token_ids: frozenset[int] = frozenset(),
                 grammars: Grammars | None = None):
        self.device = device
        self.eos_token_ids = eos_token_ids  # what min_tokens masks besides a request's stop_token_ids
        self.grammars = grammars  # None: a request with a grammar is refused before it gets here
        self._states: dict[str, _RequestState] = {}

    def add(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int] = (),
            output_token_ids: list[int] = ()) -> None:
        """Start tracking a request (again after a preemption: its state is kept, nothing changes)."""
        if request_id in self._states:
            return
        g = None
        if params.do_sample:
            g = torch.Generator(device=self.device)
            g.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        state = _RequestState(params, g)
        if params.repetition_penalty != 1.0 or params.has_output_penalties:
            state.pending = (list(prompt_token_ids), list(output_token_ids))
        state.num_generated = len(output_token_ids)
        if params.logit_bias:
            state.bias = (to_device([t for t, _ in params.logit_bias], self.device, torch.long),
                          to_device([b for _, b in params.logit_bias], self.device))
        if params.bad_words_ids:
            state.recent = list(output_token_ids)[-max(len(w) for w in params.bad_words_ids):]
        if params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            state.banned = to_device(sorted(banned), self.device, torch.long) if banned else None
        if params.grammar is not None:
            self.grammars.add(request_id, params.grammar, output_token_ids)
        self._states[request_id] = state

    def remove(self, request_id: str) -> None:
        s = self._states.pop(request_id, None)
        if s is not None and s.params.grammar is not None:
            self.grammars.remove(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, request_ids: list[str]) -> SampleResult:
        """logits: [B, V] float32, row i for request_ids[i] → one token per row; each request's
        penalty state then counts its token."""
        chosen, chosen_lp, top = self.sample_on_device(logits, request_ids)
        return SampleResult(chosen.tolist(), chosen_lp.tolist(), to_top_lists(top, self.top_ns(request_ids)))

    def top_ns(self, request_ids: list[str]) -> list[int]:
        return [self._states[rid].params.top_n_tokens for rid in request_ids]

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, request_ids: list[str]):
        """`sample` without leaving the device: → (token ids [B], their log-probs [B], (top ids, top
        log-probs) [B, n] or None), so that a multi-step decode feeds the tokens to its next step
        with no host round trip."""
        states = [self._states[rid] for rid in request_ids]
        params = [s.params for s in states]
        vocab = logits.shape[1]
        for s in states:
            if s.pending is not None:
                self._materialise(s, vocab)
        raw = logits
        logits = _apply_logit_masks(_apply_penalties(logits, states), states)
        constrained = [i for i, p in enumerate(params) if p.grammar is not None]
        if constrained:
            masks = self.grammars.masks([request_ids[i] for i in constrained]).to(logits.device, non_blocking=True)
            logits = apply_bitmask(logits, to_device(constrained, logits.device, torch.long), masks,
                                   fallback=None if logits is raw else raw)
        sampled_rows = [i for i, p in enumerate(params) if p.do_sample]
        if sampled_rows:
            rows = to_device(sampled_rows, logits.device, torch.long)
            logits = logits.index_copy(0, rows, _warp(logits.index_select(0, rows), [params[i] for i in sampled_rows]))
        log_probs = torch.log_softmax(logits, dim=-1)  # [B, V]
        chosen = log_probs.argmax(dim=-1)
        if sampled_rows:
            drawn = self._race(log_probs.index_select(0, rows).exp(), [states[i].generator for i in sampled_rows])
            chosen = chosen.index_copy(0, rows, drawn)
        chosen_lp = log_probs.gather(1, chosen.view(-1, 1)).view(-1)
        top_n = max(p.top_n_tokens for p in params)
        top = log_probs.topk(top_n, dim=-1) if top_n else None
        if constrained:  # (a host read of those rows)
            self.grammars.advance([request_ids[i] for i in constrained], chosen[constrained].tolist())
        for i, s in enumerate(states):
            s.num_generated += 1
            if s.recent is not None:  # (a host read, for the rows with bad words only)
                s.recent = (s.recent + [int(chosen[i])])[-max(len(w) for w in s.params.bad_words_ids):]
            if s.seen is not None:
                s.seen[chosen[i]] = True
            if s.counts is not None:
                s.counts[chosen[i]] += 1
        return chosen, chosen_lp, (top.indices, top.values) if top is not None else None

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, request_ids: list[str], drafts: list[list[int]]) -> list[SampleResult]:
        """Speculative decoding: logits [sum(len(d) + 1), V], request i's rows at its last token
        and at each of its proposed tokens drafts[i] → per request the tokens it emits (one
        SampleResult each): the accepted proposals and one more.

        Greedy: the longest prefix of the proposal that equals the model's argmax, then the argmax
        after it (the same tokens as decoding one at a time). Sampling: the rejection scheme of
        speculative sampling for a proposal that is one token, not a distribution (prompt lookup,
        a greedy draft model): proposal d at a row with distribution p is accepted with probability
        p(d); on rejection the token is drawn from p without d, renormalised; after k acceptances a
        last token is drawn from p. Each emitted token is then distributed exactly as p, and the
        draws come from the request's own generator (a seed reproduces). No penalties here: the
        engine does not speculate for requests with penalties (Request.can_speculate). A request with a
        grammar has its rows masked at each proposed position (a proposal the grammar refuses is cut
        there) and the grammar rolled back past the rejected tokens."""
        states = [self._states[rid] for rid in request_ids]
        row_params = [s.params for s, d in zip(states, drafts) for _ in range(len(d) + 1)]
        widths = [len(d) + 1 for d in drafts]  # each request's rows
        constrained = [j for j, s in enumerate(states) if s.params.grammar is not None]
        logits, drafts, consumed = self._mask_drafts(logits, request_ids, drafts, widths, constrained)
        sampled_rows = [i for i, p in enumerate(row_params) if p.do_sample]
        if sampled_rows:
            logits = logits.clone()
            logits[sampled_rows] = _warp(logits[sampled_rows], [row_params[i] for i in sampled_rows])
        log_probs = torch.log_softmax(logits, dim=-1)  # [R, V]
        best = log_probs.argmax(dim=-1).tolist()
        results: list[SampleResult] = []
        row = 0
        for q, (s, draft) in enumerate(zip(states, drafts)):
            tokens = self._accept(s, draft, log_probs, best, row)
            rows = log_probs[row:row + len(tokens)]
            index = torch.tensor(tokens, device=self.device).view(-1, 1)
            n = s.params.top_n_tokens
            top = rows.topk(n, dim=-1) if n else None
            results.append(SampleResult(tokens, rows.gather(1, index).view(-1).tolist(),
                                        to_top_lists((top.indices, top.values) if n else None, [n] * len(tokens))))
            if q in consumed:
                self.grammars.settle_draft(request_ids[q], consumed[q], tokens)
            row += widths[q]
        if constrained:
            self.grammars.start([request_ids[j] for j in constrained])
        return results

    def _mask_drafts(self, logits: torch.Tensor, request_ids: list[str], drafts: list[list[int]], widths: list[int],
                     constrained: list[int]) -> tuple[torch.Tensor, list[list[int]], dict[int, int]]:
        """The grammar's masks on the rows of the `constrained` requests, each proposal cut where its
        grammar refuses it → (logits, the drafts as cut, request index → proposed tokens consumed)."""
        drafts, consumed = list(drafts), {}
        if not constrained:
            return logits, drafts, consumed
        firsts = [sum(widths[:j]) for j in range(len(widths))]
        rows, masks = [], []
        for j in constrained:
            k, m = self.grammars.draft_masks(request_ids[j], drafts[j])
            consumed[j], drafts[j] = k, drafts[j][:k]  # rows after the cut go unused
            rows += range(firsts[j], firsts[j] + k + 1)
            masks.append(m)
        logits = apply_bitmask(logits, to_device(rows, logits.device, torch.long),
                               torch.cat(masks).to(logits.device, non_blocking=True))
        return logits, drafts, consumed

    def _accept(self, s, draft: list[int], log_probs: torch.Tensor, best: list[int], row: int) -> list[int]:
        """The tokens one request emits from its rows (starting at `row`): the accepted proposals and one more."""
        tokens: list[int] = []
        if not s.params.do_sample:
            while len(tokens) < len(draft) and draft[len(tokens)] == best[row + len(tokens)]:
                tokens.append(draft[len(tokens)])
            tokens.append(best[row + len(tokens)])
            return tokens
        g = s.generator
        for j, d in enumerate(draft + [None]):
            lp = log_probs[row + j]
            if d is not None and torch.rand((), generator=g, device=self.device) < lp[d].exp():
                tokens.append(d)
                continue
            if d is not None:
                lp = lp.clone()
                lp[d] = float("-inf")
            tokens.append(int(self._race(lp.exp().unsqueeze(0), [g])[0]))
            break
        return tokens

    def _race(self, probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """One draw from each row of `probs` [n, V] (unnormalised): argmax(p / E), E ~ Exp(1) drawn
        from the row's own generator."""
        noise = torch.stack([torch.empty(probs.shape[1], device=self.device).exponential_(generator=g)
                             for g in generators])
        return (probs / noise).argmax(dim=-1)

    def _materialise(self, s: _RequestState, vocab: int) -> None:
        prompt, output = s.pending
        s.pending = None
        if s.params.repetition_penalty != 1.0:
            s.seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            s.seen[torch.tensor(prompt + output, dtype=torch.long, device=self.device)] = True
        if s.params.has_output_penalties:
            s.counts = torch.zeros(vocab, dtype=torch.float32, device=self.device)
            ids = torch.tensor(output, dtype=torch.long, device=self.device)
            s.counts.index_add_(0, ids, torch.ones(len(output), device=self.device))


def to_top_lists(top: tuple[torch.Tensor, torch.Tensor] | None, top_ns: list[int]) -> list[list[tuple[int, float]]]:
    """(ids [B, n], log-probs [B, n]) → per row its first top_ns[row] (id, log-prob) pairs."""
    if top is None:
        return [[] for _ in top_ns]
    ids, values = top[0].tolist(), top[1].tolist()
    return [list(zip(i[:n], v[:n])) for i, v, n in zip(ids, values, top_ns)]


def _apply_penalties(logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
    """The repetition penalty as HF applies it (divide positive logits, multiply negative ones, over
    prompt + output), then OpenAI's presence and frequency penalties as vLLM applies them
    (logit -= frequency_penalty * count + presence_penalty * (count > 0)), all rows at once."""
    rep = [i for i, s in enumerate(states) if s.seen is not None]
    out = [i for i, s in enumerate(states) if s.counts is not None]
    if not rep and not out:
        return logits
    dev = logits.device
    if rep:
        index = to_device(rep, dev, torch.long)
        seen = torch.stack([states[i].seen for i in rep])  # [R, V]
        penalty = to_device([states[i].params.repetition_penalty for i in rep], dev).view(-1, 1)
        rows = logits.index_select(0, index)
        logits = logits.index_copy(0, index, torch.where(seen, torch.where(rows > 0, rows / penalty, rows * penalty),
                                                         rows))
    if out:
        index = to_device(out, dev, torch.long)
        counts = torch.stack([states[i].counts for i in out])  # [R, V]
        freq = to_device([states[i].params.frequency_penalty for i in out], dev).view(-1, 1)
        pres = to_device([states[i].params.presence_penalty for i in out], dev).view(-1, 1)
        logits = logits.index_copy(0, index, logits.index_select(0, index) - freq * counts
                                   - pres * (counts > 0).to(logits.dtype))
    return logits


def _apply_logit_masks(logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
    """logit_bias added (OpenAI's: to the logits, before temperature and the rest); for a request short
    of min_tokens its EOS and stop ids masked; a bad word's last token masked when the generated tokens
    end with the rest of it; rows that ask only."""
    rows = [i for i, s in enumerate(states) if s.bias is not None or s.recent is not None
            or (s.banned is not None and s.num_generated < s.params.min_tokens)]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        s = states[i]
        if s.bias is not None:
            logits[i].index_add_(0, s.bias[0], s.bias[1].to(logits.dtype))
        if s.banned is not None and s.num_generated < s.params.min_tokens:
            logits[i].index_fill_(0, s.banned, float("-inf"))
        if s.recent is not None:
            bad = [w[-1] for w in s.params.bad_words_ids if len(w) == 1 or s.recent[len(s.recent) - len(w) + 1:]
                   == list(w[:-1])]
            if bad:
                logits[i, bad] = float("-inf")
    return logits


def _warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature for every row, then min-p, top-k, top-p and typical-p for the rows that ask ([n, V] →
    [n, V] with -inf outside); only top-k/top-p/typical-p rows sort the vocabulary."""
    dev = logits.device
    logits = logits / to_device([p.temperature for p in params], dev).view(-1, 1)
    vocab = logits.shape[1]
    with_min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if with_min_p:  # after temperature, before top-k/top-p, as vLLM orders them
        index = to_device(with_min_p, dev, torch.long)
        rows = logits.index_select(0, index)
        probs = rows.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * to_device([params[i].min_p for i in with_min_p], dev).view(-1, 1)
        logits = logits.index_copy(0, index, rows.masked_fill(probs < floor, float("-inf")))
    cut = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if not cut:
        return _typical(logits, params)
    index = to_device(cut, dev, torch.long)
    rows = logits.index_select(0, index)
    ks = to_device([params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in cut], dev, torch.long)
    sorted_logits, order = rows.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev).view(1, -1)
    drop = ranks >= ks.view(-1, 1)
    top_ps = to_device([params[i].top_p for i in cut], dev).view(-1, 1)
    if any(params[i].top_p < 1.0 for i in cut):
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop |= before >= top_ps  # keep the smallest prefix whose mass reaches top_p
    drop[:, 0] = False  # the best token always stays (a top_p that rounds to 0 in float32 must not empty a row)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return _typical(logits.index_copy(0, index, torch.empty_like(rows).scatter_(1, order, sorted_logits)), params)


def _typical(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Locally typical sampling as transformers' TypicalLogitsWarper (after top-k / top-p): order the
    tokens by |-log p - H| (H: the row's entropy), keep the smallest prefix whose mass exceeds
    typical_p (at least one token)."""
    rows_asking = [i for i, p in enumerate(params) if p.typical_p < 1.0]
    if not rows_asking:
        return logits
    dev = logits.device
    index = to_device(rows_asking, dev, torch.long)
    rows = logits.index_select(0, index)
    log_p = rows.log_softmax(dim=-1)
    p = log_p.exp()
    entropy = -(log_p * p).nan_to_num().sum(dim=-1, keepdim=True)
    shifted, order = (-log_p - entropy).abs().sort(dim=-1)
    cumulative = rows.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
    mass = to_device([params[i].typical_p for i in rows_asking], dev).view(-1, 1)
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp(max=rows.shape[1] - 1)
    drop_sorted = shifted > shifted.gather(1, last)
    drop_sorted[:, 0] = False  # the most typical token always stays
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return logits.index_copy(0, index, rows.masked_fill(drop, float("-inf")))
