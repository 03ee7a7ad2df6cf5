"""How the paged engine steps: one scheduling mode, chosen once at start from the settings (pure
Python: the launcher checks it before anything loads, the engine builds its stepper from it).

    sync          schedule → run → apply, one plan at a time
    async         plan k + 1 is scheduled, and its inputs prepared, while plan k runs
                  (option.async_scheduling; the default when nothing below is asked for)
    speculative   a proposer guesses tokens before each plan; the step verifies them (sync: the
                  guesses need the last step's tokens on the host)
    multi-step    a plan of n decode steps run back to back, the tokens fed on the device (sync:
                  the run is its own pipeline)

Speculative decoding and multi-step do not compose, and neither is pipelined: asking for one of
them together with `option.async_scheduling=true` is refused here, with the settings to change —
never turned off behind the user's back. Left unset, async scheduling is on wherever it applies.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.config import SchedulerConfig


@dataclass(frozen=True)
class SchedulingMode:
    pipelined: bool  # async scheduling
    speculative_method: str | None  # ngram | draft | None
    num_scheduler_steps: int  # > 1: multi-step decode
    why: str  # the start-up log's reason

    @property
    def name(self) -> str:
        if self.speculative_method:
            return f"speculative ({self.speculative_method})"
        if self.num_scheduler_steps > 1:
            return f"multi-step ({self.num_scheduler_steps})"
        return "async" if self.pipelined else "sync"

    @property
    def step_kind(self) -> str:
        """How the runner runs a plan (engines/worker/step_kinds.py)."""
        return "speculative" if self.speculative_method else "multi-step" if self.num_scheduler_steps > 1 else "one"


def scheduling_mode(sched: SchedulerConfig) -> SchedulingMode:
    """The mode the settings ask for; ValueError (one sentence naming the keys) when they cannot work together."""
    method, steps, wanted = sched.speculative_method, sched.num_scheduler_steps, sched.async_scheduling
    if method and steps > 1:
        raise ValueError(f"option.speculative_method={method} with option.num_scheduler_steps={steps}: speculative "
                         "decoding and multi-step decode do not compose; choose one")
    serial = (f"option.speculative_method={method}" if method
              else f"option.num_scheduler_steps={steps}" if steps > 1 else None)
    if serial and wanted:
        raise ValueError(f"option.async_scheduling=true with {serial}: that mode runs one plan at a time (its next "
                         f"plan needs this one's tokens on the host); set option.async_scheduling=false or drop {serial}")
    if serial:
        why = ("the proposer guesses from the last step's tokens" if method
               else "a run of decode steps is its own pipeline")
        return SchedulingMode(False, method, steps, f"{serial}: {why}")
    if wanted is False:
        return SchedulingMode(False, None, 1, "option.async_scheduling=false")
    return SchedulingMode(True, None, 1, "the next plan is scheduled and prepared while this one runs")
