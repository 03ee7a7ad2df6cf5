"""Executes the scheduler's plan on the paged KV cache: one flattened token batch per step.

The runner keeps its own copy of what it needs per request (token ids, block table, computed
count), updated from the plan's diffs, so that the same plan can drive ranks that have no
scheduler (tensor parallelism).

Static shapes: a step's token count is padded up to one of a few buckets (token_buckets), and
every decode bucket runs once before the engine is ready. Padding tokens write their K/V to a
scratch block that no request owns. Each new matrix shape costs the CPU's oneDNN kernels a new
primitive (~0.4 MiB each, cached up to 1024): with free token counts the engine's memory crept up
by tens of MiB under load as new counts appeared; with buckets there are a few dozen shapes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engines.attention.base import AttentionBackend, SeqSlice, bucket, select_backend, token_buckets
from engines.core.scheduler import SchedulerOutput
from engines.worker.cuda_graphs import DecodeGraphs
from engines.worker.model_runner import ModelRunner
from engines.worker.sampler import PromptLogprobs, SampleResult, Sampler, prompt_logprobs, to_top_lists


# how a decode-only step runs (the engine chooses; docs/paged.md)
DECODE_EAGER = "eager"
DECODE_INDUCTOR = "inductor"  # CPU with option.cpu_compile: torch.compile
DECODE_CUDA_GRAPHS = "cuda_graphs"  # CUDA at TP 1 unless option.enforce_eager


@dataclass
class _SeqState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    prompt_top_n: int | None = None  # the prompt's log-probs are asked for, with this many alternatives


@dataclass
class StepResult:
    """What a step produced on rank 0: per request whose chunk reached its end the tokens it emits
    (one, or more with speculative decoding and multi-step decode), and the log-probs of the prompt
    tokens this step's chunks predicted, for requests that ask."""

    request_ids: list[str]
    samples: list[SampleResult]  # per request: its tokens, their log-probs and top tokens
    prompt: dict[str, PromptLogprobs] = field(default_factory=dict)
    num_steps: int = 1  # forwards run (multi-step: fewer than planned when an arrival ended the run)


def split_rows(sample: SampleResult) -> list[SampleResult]:
    """One SampleResult of B rows → B of one token each."""
    return [SampleResult([t], [lp], [top]) for t, lp, top in zip(sample.token_ids, sample.log_probs, sample.top_tokens)]


class PagedRunner:
    """Every public method is a step operation (rank 0 mirrors it to the other ranks)."""

    def __init__(self, runner: ModelRunner):
        if not runner.is_native:
            raise ValueError("the paged engine needs a natively implemented architecture (Llama, Mistral, Qwen2); "
                             "use option.rolling_batch=scheduler for others")
        self.runner = runner
        self.backend: AttentionBackend | None = None
        self.states: dict[str, _SeqState] = {}
        self.samples = runner.comm.rank == 0  # the logits land on rank 0 only
        self.sampler = Sampler(runner.device)
        self.decode_mode = DECODE_EAGER
        self._decode_model = runner.model  # what runs a decode-only step (compiled with DECODE_INDUCTOR)
        self._graphs: DecodeGraphs | None = None
        # rank 0: whether a multi-step decode should stop after this step (the engine: a request arrived)
        self.interrupted: Callable[[], bool] = lambda: False

    def allocate(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 attention_backend: str = "auto", decode_mode: str = DECODE_EAGER,
                 compile_cache_dir: str | None = None) -> None:
        """The attention backend and its KV cache (rank 0 sizes it and tells the others), and how
        decode steps run (decode_mode, chosen by the engine: docs/paged.md)."""
        r = self.runner
        cls = select_backend(attention_backend, r.device)
        self.backend = cls(r.num_layers, r.num_kv_heads, r.head_dim, block_size, r.dtype, r.device)
        max_blocks = -(-r.max_model_len // block_size)
        self.backend.allocate(num_blocks, max_num_seqs, max_blocks)
        self.buckets = token_buckets(max_num_batched_tokens)
        self.decode_mode = decode_mode
        if decode_mode == DECODE_INDUCTOR:
            if compile_cache_dir:  # read when inductor first compiles: a restart finds its code there
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir
            # the forward without its inference_mode decorator (the step already runs in inference
            # mode; traced with it, the in-place KV writes fail to compile), with automatic dynamic
            # shapes: the first bucket compiles static, the next makes batch size and block-table
            # width symbolic, so that every bucket shares one or two graphs
            forward = type(r.model).forward
            self._decode_model = torch.compile(functools.partial(getattr(forward, "__wrapped__", forward), r.model),
                                               dynamic=None)
        elif decode_mode == DECODE_CUDA_GRAPHS:
            self._graphs = DecodeGraphs(r.model, self.backend, self.backend.decode_buckets, max_blocks, r.device)

    @torch.inference_mode()
    def warm_up_buckets(self) -> None:
        """The shapes of every decode step, before serving: a forward of padding at each step size up
        to max_num_seqs (with logits for as many sampled rows) and the backend's attention shapes.
        The few larger step sizes (prefill chunks) are made on first use: running them all up front
        costs a forward of thousands of tokens, minutes for a 1 B model on a CPU."""
        decode = self.backend.decode_buckets
        for size in sorted({b for b in self.buckets if b <= decode[-1]} | set(decode)):
            self._forward([], [], [], list(range(size)), size)
            if self.decode_mode == DECODE_INDUCTOR and size in decode:  # compile every decode bucket now
                self._forward([], [], [], list(range(size)), size, decode_only=True)
        self.backend.warm_up(self.runner.model.num_heads)
        if self._graphs is not None:
            self._graphs.capture()

    def warm_up(self, num_tokens: int) -> int:
        return self.runner.warm_up(num_tokens)

    def apply_plan(self, plan: SchedulerOutput) -> None:
        """Take in what changed: finished/preempted requests, new ones, new blocks. (The tokens each
        step emits reach every rank's lists within the step: `_append`.)"""
        for rid in plan.finished_ids:
            self.states.pop(rid, None)
            self.sampler.remove(rid)
        for rid in plan.preempted_ids:  # back later as new; its sampler state (seed, counts) goes on
            self.states.pop(rid, None)
        for new in plan.new_requests:
            sp = new.sampling
            self.states[new.request_id] = _SeqState(list(new.token_ids), list(new.block_ids), new.num_computed_tokens,
                                                    new.num_prompt_tokens,
                                                    sp.top_n_tokens if sp.prompt_logprobs else None)
            if self.samples:
                self.sampler.add(new.request_id, new.sampling, new.token_ids[:new.num_prompt_tokens],
                                 new.token_ids[new.num_prompt_tokens:])
        for cached in plan.cached_requests:
            st = self.states[cached.request_id]
            st.block_ids[cached.first_block:] = cached.new_block_ids
            st.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult | None:
        """Run the step and sample (rank 0) or verify proposed tokens; every rank appends the
        emitted tokens to its lists. → on rank 0 what the step produced (None on other ranks, or
        when nothing was sampled)."""
        self.apply_plan(plan)
        if plan.num_steps > 1:
            return self._multi_step(plan)
        seqs: list[SeqSlice] = []
        ids: list[int] = []
        positions: list[int] = []
        logits_index: list[int] = []
        sampling_ids: list[str] = []
        prompt_index: list[int] = []  # rows whose logits predict a prompt token, for requests that ask
        prompt_rows: list[tuple[str, int, int]] = []  # (request, first predicted position, count)
        spec_index: list[int] = []  # rows of the speculating requests: their last token and each proposal
        spec_ids: list[str] = []
        drafts: list[list[int]] = []
        for rid, n in plan.num_scheduled_tokens.items():
            st = self.states[rid]
            start = st.num_computed_tokens
            draft = plan.spec_token_ids.get(rid, [])
            if st.prompt_top_n is not None:  # position p's logits predict prompt token p + 1
                end = min(start + n, st.num_prompt_tokens - 1)
                if end > start:
                    prompt_index += range(len(ids), len(ids) + end - start)
                    prompt_rows.append((rid, start + 1, end - start))
            seqs.append(SeqSlice(len(ids), n, start + n, st.block_ids, speculative=bool(draft)))
            if draft:
                spec_index += range(len(ids), len(ids) + n)
                spec_ids.append(rid)
                drafts.append(draft)
            ids += st.token_ids[start:start + n - len(draft)] + draft
            positions += range(start, start + n)
            if start + n == len(st.token_ids):  # the chunk reaches the end: it yields a token
                logits_index.append(len(ids) - 1)
                sampling_ids.append(rid)
            st.num_computed_tokens = start + n
        if not ids:
            return None
        logits = self.run_tokens(seqs, ids, positions, logits_index + prompt_index + spec_index)
        emitting = sampling_ids + spec_ids
        if logits is None:  # ranks > 0: the tokens come from rank 0
            self._append(emitting, self._share(emitting, [1] * len(sampling_ids) + [len(d) + 1 for d in drafts]))
            return None
        prompt, row = {}, len(logits_index)
        for rid, first, count in prompt_rows:
            st = self.states[rid]
            prompt[rid] = prompt_logprobs(logits[row:row + count], st.token_ids[first:first + count], first,
                                          st.prompt_top_n)
            row += count
        samples = split_rows(self.sampler.sample(logits[:len(logits_index)], sampling_ids)) if sampling_ids else []
        if spec_ids:
            samples += self.sampler.verify(logits[row:], spec_ids, drafts)
        if not (emitting or prompt):
            return None
        self._append(emitting, self._share(emitting, [1] * len(sampling_ids) + [len(d) + 1 for d in drafts],
                                           [s.token_ids for s in samples]))
        return StepResult(emitting, samples, prompt)

    def _multi_step(self, plan: SchedulerOutput) -> StepResult | None:
        """plan.num_steps decode steps of every scheduled request, each step's sampled tokens fed to
        the next on the device; the slots for all of them are allocated. Rank 0 ends the run early
        when `interrupted()` (an arrival: its prefill should not wait), and tells the other ranks
        with the tokens."""
        rids = list(plan.num_scheduled_tokens)
        states = [self.states[rid] for rid in rids]
        device = self.runner.device
        tokens = torch.tensor([st.token_ids[st.num_computed_tokens] for st in states], dtype=torch.long,
                              device=device)
        steps: list[tuple] = []  # rank 0: per step (token ids, log-probs, top) on the device
        for j in range(plan.num_steps):
            seqs = [SeqSlice(i, 1, st.num_computed_tokens + 1, st.block_ids) for i, st in enumerate(states)]
            positions = [st.num_computed_tokens for st in states]
            logits = self.run_tokens(seqs, tokens, positions, list(range(len(rids))))
            for st in states:
                st.num_computed_tokens += 1
            go_on = j + 1 < plan.num_steps
            if logits is not None:
                steps.append(self.sampler.sample_on_device(logits, rids))
                tokens = steps[-1][0]
                go_on = go_on and not self.interrupted()
            if self.runner.comm.world_size > 1:
                tokens, go_on = self._share_step(tokens, go_on)
                if logits is None:
                    self._append(rids, [[t] for t in tokens.tolist()])
            if not go_on:
                break
        num_steps = j + 1
        if not steps:  # ranks > 0 appended as they went
            return None
        token_ids = torch.stack([s[0] for s in steps], dim=1).tolist()  # [B, steps]: the one host sync
        log_probs = torch.stack([s[1] for s in steps], dim=1).tolist()
        top_ns = self.sampler.top_ns(rids)
        tops = [to_top_lists(s[2], top_ns) for s in steps]
        samples = [SampleResult(token_ids[i], log_probs[i], [t[i] for t in tops]) for i in range(len(rids))]
        self._append(rids, token_ids)
        return StepResult(rids, samples, num_steps=num_steps)

    def _share_step(self, tokens: torch.Tensor, go_on: bool) -> tuple[torch.Tensor, bool]:
        """A multi-step decode at TP > 1: rank 0's sampled tokens and whether to go on, to every rank."""
        comm = self.runner.comm
        buf = torch.cat([tokens.view(-1), torch.tensor([int(go_on)], device=tokens.device)]) if comm.rank == 0 \
            else torch.empty(tokens.numel() + 1, dtype=torch.long, device=tokens.device)
        buf = comm.broadcast(buf)
        return buf[:-1], bool(buf[-1])

    def _share(self, rids: list[str], max_counts: list[int], token_ids: list[list[int]] | None = None) -> list[list[int]]:
        """Rank 0's emitted tokens (up to max_counts[i] for rids[i]) → on every rank."""
        comm = self.runner.comm
        if comm.world_size == 1 or not rids:
            return token_ids or []
        buf = torch.full((sum(max_counts),), -1, dtype=torch.long, device=self.runner.device)
        if comm.rank == 0:
            flat = [t for toks, m in zip(token_ids, max_counts) for t in toks + [-1] * (m - len(toks))]
            buf = torch.tensor(flat, dtype=torch.long, device=self.runner.device)
        values, out, i = comm.broadcast(buf).tolist(), [], 0
        for m in max_counts:
            out.append([t for t in values[i:i + m] if t >= 0])
            i += m
        return out

    def _append(self, rids: list[str], token_ids: list[list[int]]) -> None:
        for rid, toks in zip(rids, token_ids):
            self.states[rid].token_ids += toks

    def run_tokens(self, seqs: list[SeqSlice], ids: list[int] | torch.Tensor, positions: list[int],
                   logits_index: list[int]) -> torch.Tensor | None:
        """A forward over one flattened batch (a step's, or the draft proposer's) → the logits of
        the `logits_index` tokens (None on ranks > 0). Padded to a step-size bucket; a whole decode
        step replays its captured graph when there is one, else runs eagerly (or compiled)."""
        decode_only = len(ids) == len(seqs)
        size = bucket(self.backend.decode_buckets if decode_only else self.buckets, len(ids))
        if decode_only and self._graphs is not None and self._graphs.can_run(size):
            # the graph gives every token's logits; keep the rows the eager path would (a one-token
            # chunk inside a prompt samples nothing)
            rows = torch.tensor(logits_index, dtype=torch.long, device=self.runner.device)
            return self._graphs.run(seqs, ids, positions, size).index_select(0, rows)
        return self._forward(seqs, ids, positions, logits_index, size, decode_only)

    def _forward(self, seqs: list[SeqSlice], ids: list[int] | torch.Tensor, positions: list[int],
                 logits_index: list[int], size: int, decode_only: bool = False) -> torch.Tensor:
        """The model over `ids` padded to `size` tokens → logits of the `logits_index` tokens (their
        count padded to a decode bucket too: the LM head's shapes are static as well). A decode-only
        step runs the decode model (compiled with DECODE_INDUCTOR)."""
        device = self.runner.device
        ids = torch.as_tensor(ids, dtype=torch.long, device=device)
        ids = torch.nn.functional.pad(ids, (0, size - ids.numel()))
        positions = positions + [0] * (size - len(positions))
        n = len(logits_index)
        rows = bucket(self.backend.decode_buckets, n)
        meta = self.backend.build_metadata(seqs, size)
        model = self._decode_model if decode_only else self.runner.model
        logits = model(ids.view(1, -1), torch.tensor([positions], device=device), self.backend, meta,
                       torch.tensor(logits_index + [0] * (rows - n), dtype=torch.long, device=device))
        return logits[:n] if logits is not None else None
