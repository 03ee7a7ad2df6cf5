"""What a step gives back: its sampled tokens on the way to the host (PendingStep), then on it (StepResult).

A step's sampling ends on the device; the ids, log-probs and top tokens are copied to pinned host
memory without waiting (HostCopy), so that the host can prepare and launch the next step while
this one runs (async scheduling); `resolve` waits for the copy only when the tokens are needed.
On a CPU the copy is the tensors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.worker.sampler import PromptLogprobs, SampleResult, to_top_lists


@dataclass
class StepResult:
    """What a step produced on rank 0: per request that emitted, its tokens (one, more with
    speculative decoding and multi-step decode), and the log-probs of the prompt tokens this step's
    chunks predicted, for requests that ask."""

    request_ids: list[str]
    samples: list[SampleResult]  # per request: its tokens, their log-probs and top tokens
    prompt: dict[str, PromptLogprobs] = field(default_factory=dict)
    num_steps: int = 1  # forwards run (multi-step: fewer than planned when an arrival ended the run)


class HostCopy:
    """Device tensors copied to the host without blocking; `wait` returns the host copies."""

    def __init__(self, tensors: list[torch.Tensor]):
        if not tensors or tensors[0].device.type == "cpu":
            self._host, self._event = tensors, None
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, t in zip(self._host, tensors):
            host.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host


@dataclass
class PendingStep:
    """A launched step. Either its samples are still on the device (`copy` of token ids [n, steps],
    log-probs [n, steps] and, when asked, top ids and log-probs [n, steps, top_n]), or they are on the
    host already (`samples`: speculative verification is decided on the host)."""

    request_ids: list[str]  # the requests that emit, in sample-row order
    copy: HostCopy | None = None
    top_ns: list[int] = field(default_factory=list)
    samples: list[SampleResult] | None = None
    prompt: dict[str, PromptLogprobs] = field(default_factory=dict)
    num_steps: int = 1
    is_rank0: bool = True

    def token_lists(self) -> list[list[int]]:
        """Each request's emitted tokens (waits for the copy)."""
        if self.samples is not None:
            return [s.token_ids for s in self.samples]
        return self.copy.wait()[0].tolist()

    def result(self) -> StepResult | None:
        """Rank 0: the step's StepResult (None when nothing was emitted or asked); other ranks: None."""
        if not self.is_rank0 or not (self.request_ids or self.prompt):
            return None
        if self.samples is None:
            host = self.copy.wait()
            ids, log_probs = host[0].tolist(), host[1].tolist()
            steps = [to_top_lists((host[2][:, j], host[3][:, j]) if len(host) > 2 else None, self.top_ns)
                     for j in range(len(ids[0]) if ids else 0)]
            self.samples = [SampleResult(ids[i], log_probs[i], [top[i] for top in steps])
                            for i in range(len(self.request_ids))]
        return StepResult(self.request_ids, self.samples, self.prompt, self.num_steps)
