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
from dataclasses import dataclass, field

import torch

from engines.attention.base import AttentionBackend, SeqSlice, bucket, select_backend, token_buckets
from engines.core.scheduler import SchedulerOutput
from engines.worker.cuda_graphs import DecodeGraphs
from engines.worker.model_runner import ModelRunner
from engines.worker.sampler import PromptLogprobs, SampleResult, Sampler, prompt_logprobs


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
    """What a step produced on rank 0: one sampled token per request whose chunk reached its end,
    and the log-probs of the prompt tokens this step's chunks predicted, for requests that ask."""

    request_ids: list[str]
    sample: SampleResult | None
    prompt: dict[str, PromptLogprobs] = field(default_factory=dict)


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
        """Take in what changed: the tokens sampled last step, finished/preempted requests, new ones,
        new blocks."""
        for request_id, token_id in plan.sampled_token_ids.items():
            st = self.states.get(request_id)
            if st is not None:
                st.token_ids.append(token_id)
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
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult | None:
        """Run the step and sample; → on rank 0 the sampled tokens (None on other ranks, or when
        nothing was scheduled). They reach every rank's token lists with the next plan."""
        self.apply_plan(plan)
        seqs: list[SeqSlice] = []
        ids: list[int] = []
        positions: list[int] = []
        logits_index: list[int] = []
        sampling_ids: list[str] = []
        prompt_index: list[int] = []  # rows whose logits predict a prompt token, for requests that ask
        prompt_rows: list[tuple[str, int, int]] = []  # (request, first predicted position, count)
        for rid, n in plan.num_scheduled_tokens.items():
            st = self.states[rid]
            start = st.num_computed_tokens
            if st.prompt_top_n is not None:  # position p's logits predict prompt token p + 1
                end = min(start + n, st.num_prompt_tokens - 1)
                if end > start:
                    prompt_index += range(len(ids), len(ids) + end - start)
                    prompt_rows.append((rid, start + 1, end - start))
            seqs.append(SeqSlice(len(ids), n, start + n, st.block_ids))
            ids += st.token_ids[start:start + n]
            positions += range(start, start + n)
            if start + n == len(st.token_ids):  # the chunk reaches the end: it yields a token
                logits_index.append(len(ids) - 1)
                sampling_ids.append(rid)
            st.num_computed_tokens = start + n
        if not ids:
            return None
        decode_only = len(ids) == len(seqs)
        size = bucket(self.backend.decode_buckets if decode_only else self.buckets, len(ids))
        if decode_only and self._graphs is not None and self._graphs.can_run(size):
            # the graph gives every token's logits; keep the rows the eager path would (a one-token
            # chunk inside a prompt samples nothing)
            rows = torch.tensor(logits_index + prompt_index, dtype=torch.long, device=self.runner.device)
            logits = self._graphs.run(seqs, ids, positions, size).index_select(0, rows)
        else:
            logits = self._forward(seqs, ids, positions, logits_index + prompt_index, size, decode_only)
        if logits is None or not (sampling_ids or prompt_rows):
            return None
        prompt, row = {}, len(logits_index)
        for rid, first, count in prompt_rows:
            st = self.states[rid]
            prompt[rid] = prompt_logprobs(logits[row:row + count], st.token_ids[first:first + count], first,
                                          st.prompt_top_n)
            row += count
        sample = self.sampler.sample(logits[:len(logits_index)], sampling_ids) if sampling_ids else None
        return StepResult(sampling_ids, sample, prompt)

    def _forward(self, seqs: list[SeqSlice], ids: list[int], positions: list[int], logits_index: list[int],
                 size: int, decode_only: bool = False) -> torch.Tensor:
        """The model over `ids` padded to `size` tokens → logits of the `logits_index` tokens (their
        count padded to a decode bucket too: the LM head's shapes are static as well). A decode-only
        step runs the decode model (compiled with DECODE_INDUCTOR)."""
        ids = ids + [0] * (size - len(ids))
        positions = positions + [0] * (size - len(positions))
        n = len(logits_index)
        rows = bucket(self.backend.decode_buckets, n)
        device = self.runner.device
        meta = self.backend.build_metadata(seqs, size)
        model = self._decode_model if decode_only else self.runner.model
        logits = model(torch.tensor([ids], device=device), torch.tensor([positions], device=device), self.backend, meta,
                       torch.tensor(logits_index + [0] * (rows - n), dtype=torch.long, device=device))
        return logits[:n] if logits is not None else None
