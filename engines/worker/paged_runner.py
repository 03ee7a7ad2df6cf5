"""Executes the scheduler's plans on the paged KV cache, one step as a pipeline:

    apply_plan(plan)   the runner's own state per request (token ids, block table, computed count)
                       from the plan's diffs, so that the same plan drives ranks with no scheduler
    prepare            the plan → a ForwardBatch (each sequence's chunk, the logits rows wanted)
                       → the persistent step buffers (StepBuffers.write)
    forward            the model over the buffers: eagerly, compiled (CPU, option.cpu_compile), or
                       by replaying the bucket's captured graph (decode steps): the same buffers
    postprocess        sample on the device → PendingStep, its tokens copied to the host unawaited
    resolve            wait for them → StepResult; every rank appends them to its token lists

Pipelined (async scheduling), `execute(plan, pipelined=True)` launches a step before resolving the
one before it: the host prepares step k + 1 while the device runs step k, and the token each
request sampled at step k reaches step k + 1's input on the device (`SeqChunk.fed_row`). With
tensor parallelism rank 0 broadcasts the sampled ids on the device each step; ranks > 0 feed and
append them the same way.

Static shapes: a step's tokens are padded to a bucket (step_buffers.py); every decode bucket runs
once before the engine is ready; on CUDA each is then captured as a graph (step_graphs.py).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engines.attention.base import AttentionBackend
from engines.attention.step import ForwardBatch, SeqChunk
from engines.attention.registry import select_backend
from engines.core.plan import BlockRef, StepPlan
from engines.worker.model_runner import ModelRunner
from engines.worker.grammar import Grammars
from engines.worker.kv_tiers import KvTiers, KvTierSettings, model_fingerprint
from engines.worker.sampler import Sampler, prompt_logprobs
from engines.worker.step_buffers import StepBuffers
from engines.worker.step_graphs import StepGraphs
from engines.worker.step_kinds import STEP_KINDS, OneStep
from engines.worker.step_output import HostCopy, PendingStep, StepResult

# how a decode step runs (the engine chooses; docs/paged.md)
DECODE_EAGER = "eager"
DECODE_INDUCTOR = "inductor"  # CPU with option.cpu_compile: torch.compile
DECODE_GRAPHS = "graphs"  # captured CUDA graphs per bucket (on CPU, tests: the same static buffers, eagerly)


@dataclass
class _SeqState:
    token_ids: list[int]  # prompt + the emitted tokens the host has (the newest may be on the device still)
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    prompt_top_n: int | None = None  # the prompt's log-probs are asked for, with this many alternatives
    lora_slot: int = 0  # its LoRA adapter's slot (0: the base model)


@dataclass
class _Prepared:
    batch: ForwardBatch
    sampling_ids: list[str]  # requests whose chunk reaches the end: one token each (logits rows first)
    spec_ids: list[str]  # requests verifying proposals (their rows last)
    drafts: list[list[int]]
    prompt_rows: list[tuple[str, int, int]]  # (request, first predicted position, count), rows in between


class PagedRunner:
    """Every public method is a step operation (rank 0 mirrors it to the other ranks)."""

    def __init__(self, runner: ModelRunner):
        if not runner.owns_kv:
            raise ValueError(f"the paged engine needs our model code or a transformers model whose attention goes "
                             f"through transformers' attention interface, and {runner.spec.architecture} has neither "
                             f"here ({runner.fallback_why}); "
                             "use option.rolling_batch=scheduler")
        self.runner = runner
        self.backend: AttentionBackend | None = None
        self.buffers: StepBuffers | None = None
        self.states: dict[str, _SeqState] = {}
        self.samples = runner.comm.rank == 0  # the logits land on rank 0 only
        self.sampler = Sampler(runner.device, runner.eos_token_ids,
                               Grammars(runner.config.local_dir, runner.spec.vocab_size, runner.eos_token_ids))
        self.decode_mode = DECODE_EAGER
        self.steps: OneStep = OneStep()  # how a plan runs: the engine's scheduling mode (allocate's step_kind)
        self._decode_model = runner.model  # what runs a decode step eagerly (compiled with DECODE_INDUCTOR)
        self.graphs: StepGraphs | None = None
        self.tiers: KvTiers | None = None  # the KV tiers below the pool (option.kv_offload_*)
        self._pending: PendingStep | None = None  # launched, not resolved (pipelined)
        self._fed: tuple[torch.Tensor, dict[str, int]] | None = None  # the last step's sampled ids, rows
        # rank 0: whether a multi-step decode should stop after this step (the engine: a request arrived)
        self.interrupted: Callable[[], bool] = lambda: False

    def allocate(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 attention_backend: str = "auto", decode_mode: str = DECODE_EAGER,
                 compile_cache_dir: str | None = None, step_kind: str = "one",
                 tiers: KvTierSettings | None = None) -> None:
        """The attention backend and its KV cache (rank 0 sizes it and tells the others), the step
        buffers, how decode steps run (decode_mode, chosen by the engine: docs/paged.md), how a
        plan runs (step_kind: the engine's scheduling mode, engines/worker/step_kinds.py), and the
        KV tiers below the cache (tiers: this rank's, docs/kv-tiers.md)."""
        r = self.runner
        self.steps = STEP_KINDS[step_kind]()
        cls = select_backend(attention_backend, r.device, r.kv_dtype, r.dtype)
        self.backend = cls(r.num_layers, r.num_kv_heads, r.head_dim, block_size, r.dtype, r.device, r.layer_options,
                           r.kv_dtype, r.kv_layers)
        self.backend.allocate(num_blocks)
        if tiers is not None:
            self.tiers = KvTiers(tiers, self.backend, self._kv_layout(), r.comm.rank)
        max_blocks = -(-r.max_model_len // block_size)
        self.buffers = StepBuffers(max(max_num_batched_tokens, max_num_seqs), max_num_seqs, max_blocks, block_size,
                                   self.backend.scratch_block, r.device)
        self.decode_mode = decode_mode
        if decode_mode == DECODE_INDUCTOR:
            if len(self.buffers.decode_buckets) > 1:
                # one row decodes as two (a pad row on the scratch block): a size of 1 is always
                # specialised, a graph of its own; without it one graph takes every decode step
                self.buffers.decode_buckets = self.buffers.decode_buckets[1:]
            if compile_cache_dir:  # read when inductor first compiles: a restart finds its code there
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir
            # the forward without its inference_mode decorator (the step already runs in inference
            # mode; traced with it, the in-place KV writes fail to compile); the row count and the
            # block-table width are marked as symbols at each call (mark_symbolic), so that one graph,
            # made by warm_up_buckets, takes every decode step
            forward = type(r.model).forward
            self._decode_model = torch.compile(functools.partial(getattr(forward, "__wrapped__", forward), r.model),
                                               dynamic=None)
        elif decode_mode == DECODE_GRAPHS:
            self.graphs = StepGraphs(functools.partial(self._run_model, static_lora=True), self.backend, self.buffers)
        if r.lora is not None and decode_mode != DECODE_EAGER:  # captured decode steps: LoRA's static form
            r.lora.step.allocate_static(max(self.buffers.decode_buckets), r.device)

    @torch.inference_mode()
    def warm_up_buckets(self) -> None:
        """The shapes of every decode step, before serving: a decode step of each bucket up to
        max_num_seqs (padding on the scratch block, logits for every row), and the backend's kernel
        shapes; then the graphs are captured. Larger step sizes (prefill chunks) are made on first
        use: running them all up front costs a forward of thousands of tokens, minutes for a 1 B
        model on a CPU."""
        b = self.buffers
        # compiled: block tables at least two blocks wide (a size of 1 is always specialised, a
        # graph of its own), so that the one graph made here takes every step: none recompiles
        # while serving
        compiled = self.decode_mode == DECODE_INDUCTOR
        widths = b.width_buckets[1:] if compiled and len(b.width_buckets) > 1 else b.width_buckets
        self.backend.warm_up(self.runner.model.num_heads, b.decode_buckets, widths)
        chunk = SeqChunk((widths[0] - 1) * b.block_size, 1, [self.backend.scratch_block] * widths[0], [0])
        for size in b.decode_buckets:
            self.forward(ForwardBatch([chunk] * size, list(range(size))))
        if self.graphs is not None:
            self.graphs.capture()

    def warm_up(self, num_tokens: int) -> int:
        return self.runner.warm_up(num_tokens)

    def close(self) -> None:
        """Before the process ends: the KV tiers' last files written."""
        if self.tiers is not None:
            self.tiers.finish_writes()

    def _kv_layout(self) -> str:
        """Everything that makes this rank's K/V bytes of a block differ: the KV tiers' namespace."""
        r, b = self.runner, self.backend
        shape = b.keys[b.held[0]].select(b.block_dim, 0).shape
        return (f"{model_fingerprint(r.config.local_dir).hex()}|{r.dtype}|{r.kv_dtype}|{r.config.quantize}|"
                f"block {b.block_size}|tp {r.comm.world_size}|{b.name} {b.block_dim} {tuple(shape)}|"
                f"layers {list(b.held)}")

    @torch.inference_mode()
    def load_blocks(self, saves: list[BlockRef], loads: list[BlockRef]) -> list[str | None]:
        """Write `saves` down the KV tiers, then load `loads` from them into the pool → per block the
        name of the tier rank 0 loaded it from, None unless every rank loaded it (a block one rank
        could not load is recomputed by all)."""
        self.tiers.save(saves)
        source = self.tiers.load(loads)
        failed = self.runner.comm.all_reduce(torch.tensor([int(i < 0) for i in source], device=self.runner.device))
        return [self.tiers.tiers[i].name if f == 0 else None for i, f in zip(source, failed.tolist())]

    def apply_plan(self, plan: StepPlan) -> None:
        """Take in what changed: finished/preempted requests, new ones, new blocks. (The tokens each
        step emits reach every rank's lists when it resolves.)"""
        for rid in plan.finished_ids:
            self.states.pop(rid, None)
            self.sampler.remove(rid)
        for load in plan.lora_loads:  # adapters the scheduler placed in slots (engines/core/lora_slots.py)
            self.runner.lora.activate(load.slot, load.name)
        for rid in plan.preempted_ids:  # back later as new; its sampler state (seed, counts) goes on
            self.states.pop(rid, None)
        for new in plan.new_requests:
            sp = new.sampling
            self.states[new.request_id] = _SeqState(list(new.token_ids), list(new.block_ids), new.num_computed_tokens,
                                                    new.num_prompt_tokens,
                                                    sp.top_n_tokens if sp.prompt_logprobs else None,
                                                    self._lora_slot(new.lora_name))
            if self.samples:
                self.sampler.add(new.request_id, new.sampling, new.token_ids[:new.num_prompt_tokens],
                                 new.token_ids[new.num_prompt_tokens:])
        for cached in plan.cached_requests:
            st = self.states[cached.request_id]
            st.block_ids[cached.first_block:] = cached.new_block_ids
            st.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute(self, plan: StepPlan, pipelined: bool = False) -> StepResult | None:
        """Run the plan's step. Sync: → its result (rank 0; None on other ranks or when nothing was
        emitted). Pipelined: launch it, then → the result of the step launched before it."""
        if plan.kv_saves:  # cached since the last plan: down the tiers before this step may reuse them
            self.tiers.save(plan.kv_saves)
        try:
            launched = self._launch(plan)
            if self.tiers is not None:
                self.tiers.poll()  # (a GPU: the last save's files, once its copy is done)
            if not pipelined:
                return self._resolve(launched)
            previous, self._pending = self._pending, launched
            return self._resolve(previous)
        except BaseException:  # the engine fails the requests of both steps: start clean
            self._pending = self._fed = None
            raise

    @torch.inference_mode()
    def flush(self) -> StepResult | None:
        """Pipelined: → the result of the step still unresolved (the engine has nothing more to run)."""
        previous, self._pending = self._pending, None
        return self._resolve(previous)

    def _resolve(self, pending: PendingStep | None) -> StepResult | None:
        if pending is None:
            return None
        for rid, toks in zip(pending.request_ids, pending.token_lists()):
            state = self.states.get(rid)
            if state is not None:  # (a request preempted meanwhile comes back with the scheduler's tokens)
                state.token_ids += toks
        return pending.result()

    def _launch(self, plan: StepPlan) -> PendingStep | None:
        self.apply_plan(plan)
        if not plan.scheduled:
            return None
        return self.steps.launch(self, plan)

    def _prepare(self, plan: StepPlan) -> _Prepared:
        """The plan's chunks, with the rows whose logits the step needs: first one per request whose
        chunk reaches the end of its tokens (it samples), then the prompt positions of requests that
        ask for the prompt's log-probs, then every row of the requests verifying proposals."""
        chunks: list[SeqChunk] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        spec_rows: list[int] = []
        prep = _Prepared(ForwardBatch(chunks, []), [], [], [], [])
        num_tokens = 0
        fed_rows = self._fed[1] if self._fed is not None else {}
        for seq in plan.scheduled:
            rid, n, draft = seq.request_id, seq.num_tokens, seq.spec_token_ids
            st = self.states[rid]
            start, known = st.num_computed_tokens, len(st.token_ids)
            end = start + n - len(draft)  # the request's own tokens up to here, then the proposals
            fed = fed_rows.get(rid, -1) if end > known else -1
            if end > known + (fed >= 0):
                raise AssertionError(f"{rid}: tokens {start}..{end} scheduled, {known} on the host, "
                                     f"{'one' if fed >= 0 else 'none'} on the device")
            chunks.append(SeqChunk(start, n, st.block_ids, st.token_ids[start:end] + draft, fed, bool(draft),
                                   st.lora_slot))
            if st.prompt_top_n is not None and min(start + n, st.num_prompt_tokens - 1) > start:
                count = min(start + n, st.num_prompt_tokens - 1) - start  # position p predicts prompt token p + 1
                prompt_rows += range(num_tokens, num_tokens + count)
                prep.prompt_rows.append((rid, start + 1, count))
            if draft:
                spec_rows += range(num_tokens, num_tokens + n)
                prep.spec_ids.append(rid)
                prep.drafts.append(draft)
            elif end == known + (fed >= 0):  # the chunk reaches the end: it yields a token
                sample_rows.append(num_tokens + n - 1)
                prep.sampling_ids.append(rid)
            st.num_computed_tokens = start + n
            num_tokens += n
        prep.batch.logits_rows = sample_rows + prompt_rows + spec_rows
        return prep

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The model over one batch (a plan's step, a multi-step run's, the draft proposer's) → the
        logits of its `logits_rows` [n, V] (None on ranks > 0). A decode step replays its bucket's
        graph when there is one; otherwise the model runs eagerly (decode steps: compiled with
        DECODE_INDUCTOR) over the same buffers."""
        fed = self._fed[0] if self._fed is not None else None
        view = self.buffers.write(batch, fed)
        graphed = view.decode_only and self.graphs is not None and self.graphs.can_run(view.num_seqs)
        compiled = view.decode_only and self.decode_mode == DECODE_INDUCTOR
        lora = self.runner.lora
        if lora is not None:  # each token row's adapter slot (padding rows: 0)
            slots = lora_row_slots(view.chunks)
            if graphed or compiled:  # captured shapes: every slot a segment of the bucket's size
                lora.step.write_static(slots or [], view.num_tokens)
            elif slots is not None:
                lora.step.set(slots, view.num_tokens, self.runner.device)
        try:
            if graphed:
                logits = self.graphs.replay(view.num_seqs)
            else:
                model = self._decode_model if view.decode_only else self.runner.model
                logits = self._run_model(view, self.backend.metadata(view), model, static_lora=compiled,
                                         symbolic=compiled)
        finally:
            if lora is not None:
                lora.step.clear()
        return logits[:len(batch.logits_rows)] if logits is not None else None

    def _run_model(self, view, meta, model=None, static_lora: bool = False,
                   symbolic: bool = False) -> torch.Tensor | None:
        """static_lora: the LoRA path in its static form (captured or compiled decode steps), the
        indices written already; symbolic: the step's row count and block-table width are symbols
        to torch.compile (every decode step one graph: warm_up_buckets makes it)."""
        if static_lora and self.runner.lora is not None:
            self.runner.lora.step.use_static()
        model = model or self.runner.model
        ids, positions = view.input_ids.view(1, -1), view.positions.view(1, -1)
        if symbolic:
            mark_symbolic(ids, positions, view.logits_indices, meta)
        return model(ids, positions, self.backend, meta, view.logits_indices)

    def _lora_slot(self, name: str | None) -> int:
        if name is None:
            return 0
        slot = self.runner.lora.slots.get(name) if self.runner.lora is not None else None
        if slot is None:  # the engine refuses unknown names before they are scheduled
            raise AssertionError(f"LoRA adapter {name!r} has no slot on rank {self.runner.comm.rank}")
        return slot

    def _sample(self, prep: _Prepared, logits: torch.Tensor | None) -> PendingStep:
        """Sample on the device (rank 0), share the ids with the other ranks on the device, keep them
        for the next step's input, and start their copy to the host."""
        rids = prep.sampling_ids
        ids = lps = top = None
        if logits is not None and rids:
            ids, lps, top = self.sampler.sample_on_device(logits[:len(rids)], rids)
        ids = self._share_ids(ids, len(rids))
        self._fed = (ids, {rid: i for i, rid in enumerate(rids)}) if ids is not None else None
        pending = PendingStep(rids, is_rank0=self.samples)
        if logits is not None:
            pending.prompt = self._prompt_logprobs(prep, logits[len(rids):])
            parts = [ids.view(-1, 1), lps.view(-1, 1)] if rids else [torch.zeros(0, 1, dtype=torch.long)] * 2
            if top is not None:
                parts += [top[0].unsqueeze(1), top[1].unsqueeze(1)]
            pending.copy, pending.top_ns = HostCopy(parts), self.sampler.top_ns(rids)
        else:
            pending.copy = HostCopy([ids.view(-1, 1) if ids is not None else torch.zeros(0, 1, dtype=torch.long)])
        return pending

    def _share_ids(self, ids: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """Rank 0's sampled ids [n] on every rank (a device broadcast with tensor parallelism)."""
        comm = self.runner.comm
        if comm.world_size == 1 or not n:
            return ids
        if ids is None:
            ids = torch.empty(n, dtype=torch.long, device=self.runner.device)
        return comm.broadcast(ids)

    def _prompt_logprobs(self, prep: _Prepared, logits: torch.Tensor) -> dict:
        out, row = {}, 0
        for rid, first, count in prep.prompt_rows:
            st = self.states[rid]
            out[rid] = prompt_logprobs(logits[row:row + count], st.token_ids[first:first + count], first,
                                       st.prompt_top_n)
            row += count
        return out


def lora_row_slots(chunks) -> list[int] | None:
    """Each token row's LoRA slot (0: the base model) over the step's chunks (padding rows after them
    get nothing), or None when no chunk uses an adapter."""
    if not any(c.lora_slot for c in chunks):
        return None
    slots: list[int] = []
    for c in chunks:
        slots += [c.lora_slot] * c.num_tokens
    return slots


def mark_symbolic(ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, meta) -> None:
    """A compiled decode step's sizes as symbols, not constants: its rows (at least two: decode
    bucket 1 is gone under compile) in every tensor shaped by them, and its block tables' width."""
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(positions, 1)
    torch._dynamo.mark_dynamic(logits_indices, 0)
    for t in meta if isinstance(meta, tuple) else ():
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] > 1:
            torch._dynamo.mark_dynamic(t, 0)
            if t.dim() == 2 and t.shape[1] > 1:
                torch._dynamo.mark_dynamic(t, 1)
