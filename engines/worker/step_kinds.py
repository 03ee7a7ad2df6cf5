"""How the paged runner runs a plan, one kind per scheduling mode (engines/core/modes.py), chosen
once when the engine allocates (`PagedRunner.allocate(step_kind=...)`, mirrored to every rank):

    one           prepare → forward → sample (sync and async scheduling)
    speculative   the same, and a plan's proposals verified against the step's logits (on the host)
    multi-step    a plan of n decode steps run back to back, each step's tokens fed to the next on
                  the device; a plan of one step (a prefill) runs as `one`

A plan a kind cannot run (proposals, or several steps, where they were not asked for) fails its
step loudly: nothing is dropped on the way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engines.attention.step import ForwardBatch, SeqChunk
from engines.core.plan import StepPlan
from engines.worker.sampler import SampleResult
from engines.worker.step_output import HostCopy, PendingStep

if TYPE_CHECKING:
    from engines.worker.paged_runner import PagedRunner, _Prepared


class OneStep:
    name = "one"

    def launch(self, runner: PagedRunner, plan: StepPlan) -> PendingStep:
        if plan.num_steps > 1:
            raise AssertionError(f"a plan of {plan.num_steps} steps, and the runner runs one at a time")
        prep = runner._prepare(plan)
        logits = runner.forward(prep.batch)
        if prep.spec_ids:
            return self.verify(runner, prep, logits)
        return runner._sample(prep, logits)

    def verify(self, runner: PagedRunner, prep: _Prepared, logits: torch.Tensor | None) -> PendingStep:
        raise AssertionError(f"proposals to verify for {prep.spec_ids}, and speculative decoding is off")


class Speculative(OneStep):
    name = "speculative"

    def verify(self, runner: PagedRunner, prep: _Prepared, logits: torch.Tensor | None) -> PendingStep:
        """A step with proposals to verify (sync: decided on the host): the sampling rows as usual,
        the proposals by `Sampler.verify`; the emitted tokens shared as lists."""
        rids = prep.sampling_ids + prep.spec_ids
        counts = [1] * len(prep.sampling_ids) + [len(d) + 1 for d in prep.drafts]
        runner._fed = None
        if logits is None:
            shared = [SampleResult(toks, [], []) for toks in share_lists(runner, counts)]
            return PendingStep(rids, samples=shared, is_rank0=False)
        n = len(prep.sampling_ids)
        samples = runner.sampler.sample(logits[:n], prep.sampling_ids).split_rows() if n else []
        num_prompt = sum(count for _, _, count in prep.prompt_rows)
        samples += runner.sampler.verify(logits[n + num_prompt:], prep.spec_ids, prep.drafts)
        share_lists(runner, counts, [s.token_ids for s in samples])
        return PendingStep(rids, samples=samples, prompt=runner._prompt_logprobs(prep, logits[n:]))


def share_lists(runner: PagedRunner, max_counts: list[int], token_ids: list[list[int]] | None = None) \
        -> list[list[int]]:
    """Rank 0's emitted tokens (up to max_counts[i] each) → on every rank."""
    comm = runner.runner.comm
    if comm.world_size == 1:
        return token_ids or []
    if comm.rank == 0:
        flat = [t for toks, m in zip(token_ids, max_counts) for t in toks + [-1] * (m - len(toks))]
        buf = torch.tensor(flat, dtype=torch.long, device=runner.runner.device)
    else:
        buf = torch.full((sum(max_counts),), -1, dtype=torch.long, device=runner.runner.device)
    values, out, i = comm.broadcast(buf).tolist(), [], 0
    for m in max_counts:
        out.append([t for t in values[i:i + m] if t >= 0])
        i += m
    return out


class MultiStep(OneStep):
    name = "multi-step"

    def launch(self, runner: PagedRunner, plan: StepPlan) -> PendingStep:
        """plan.num_steps decode steps of every scheduled request, each step's sampled tokens fed to
        the next on the device; the slots for all of them are allocated. Rank 0 ends the run early
        when `interrupted()` (an arrival: its prefill should not wait), and tells the other ranks
        with the tokens."""
        if plan.num_steps == 1:
            return super().launch(runner, plan)
        rids = plan.scheduled_ids
        states = [runner.states[rid] for rid in rids]
        rows = {rid: i for i, rid in enumerate(rids)}
        steps: list[tuple] = []  # per step (token ids, log-probs, top) on the device
        for j in range(plan.num_steps):
            # step 0 reads each request's last token from the host, the later ones the tokens just sampled
            chunks = [SeqChunk(st.num_computed_tokens, 1, st.block_ids,
                               [] if j else st.token_ids[st.num_computed_tokens:st.num_computed_tokens + 1],
                               i if j else -1, lora_slot=st.lora_slot) for i, st in enumerate(states)]
            logits = runner.forward(ForwardBatch(chunks, list(range(len(rids)))))
            for st in states:
                st.num_computed_tokens += 1
            go_on = j + 1 < plan.num_steps
            tokens = None
            if runner.samples:
                steps.append(runner.sampler.sample_on_device(logits, rids))
                tokens = steps[-1][0]
                go_on = go_on and not runner.interrupted()
            if runner.runner.comm.world_size > 1:
                tokens, go_on = share_step(runner, tokens, len(rids), go_on)
                if not runner.samples:
                    steps.append((tokens,))
            runner._fed = (tokens, rows)
            if not go_on:
                break
        pending = PendingStep(rids, num_steps=j + 1, is_rank0=runner.samples)
        parts = [torch.stack([s[0] for s in steps], dim=1)]  # [B, steps]
        if runner.samples:
            parts.append(torch.stack([s[1] for s in steps], dim=1))
            if steps[0][2] is not None:
                parts += [torch.stack([s[2][0] for s in steps], dim=1), torch.stack([s[2][1] for s in steps], dim=1)]
            pending.top_ns = runner.sampler.top_ns(rids)
        pending.copy = HostCopy(parts)
        return pending


def share_step(runner: PagedRunner, tokens: torch.Tensor | None, n: int, go_on: bool) -> tuple[torch.Tensor, bool]:
    """A multi-step decode at TP > 1: rank 0's sampled tokens and whether to go on, to every rank."""
    comm, device = runner.runner.comm, runner.runner.device
    if comm.rank == 0:
        buf = torch.cat([tokens.view(-1), torch.tensor([int(go_on)], device=device)])
    else:
        buf = torch.empty(n + 1, dtype=torch.long, device=device)
    buf = comm.broadcast(buf)
    return buf[:-1], bool(buf[-1])


STEP_KINDS = {kind.name: kind for kind in (OneStep, Speculative, MultiStep)}
