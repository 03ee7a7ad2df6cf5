"""The paged engine's step loop, one strategy per scheduling mode (engines/core/modes.py), chosen
once at start:

    SyncStepper        plan = schedule(); result = run(plan); apply(plan, result)
    PipelinedStepper   plan k + 1 = schedule() with plan k in flight; run(plan k + 1) launches it,
                       then returns plan k's result; apply(plan k, ...)
    SpeculativeStepper guesses = propose(); plan = schedule(guesses); run; apply (sync)

Multi-step decode is the sync stepper over a scheduler that plans runs of decode steps.

Every torch call happens on the engine loop's thread (one torch thread per process: a second one's
OpenMP team made CPU steps 2-3x slower, docs/paged.md). Pipelining needs no thread of its own: on a
GPU a launch returns at once, so the host applies and publishes plan k, schedules plan k + 2 and
prepares it while the device runs plan k + 1; on a CPU the launch is the forward itself.

A step that raises fails the requests of the plans it carried (424, or 507 out of memory) and the
engine goes on serving (engine_loop.py).
"""

from __future__ import annotations

from engines.core.plan import StepPlan


class SyncStepper:
    def __init__(self, engine):
        self.engine = engine

    def step(self) -> None:
        plan = self.engine.scheduler.schedule()
        self._run(plan)

    def _run(self, plan: StepPlan) -> None:
        try:
            result = self.engine.run_plan(plan, pipelined=False)
        except Exception as exc:  # noqa: BLE001 (the step's requests fail, with the reason)
            self.engine.fail_plans([plan], exc)
            return
        self.engine.apply(plan, result)

    def drain(self) -> None:
        """Nothing in flight."""


class SpeculativeStepper(SyncStepper):
    def __init__(self, engine, proposer):
        super().__init__(engine)
        self.proposer = proposer

    def step(self) -> None:
        sched = self.engine.scheduler
        requests = [r for r in sched.running if sched.can_speculate(r)]
        rooms = [min(self.proposer.num_tokens, sched.spec_room(r)) for r in requests]
        plan = sched.schedule(self.proposer.propose(requests, rooms))
        for rid in plan.preempted_ids:
            self.proposer.drop(rid)
        self._run(plan)


class PipelinedStepper:
    def __init__(self, engine):
        self.engine = engine
        self.in_flight: StepPlan | None = None  # launched, its result not applied yet

    def step(self) -> None:
        engine = self.engine
        plan = engine.scheduler.schedule()
        previous, self.in_flight = self.in_flight, plan
        try:
            result = engine.run_plan(plan, pipelined=True)
        except Exception as exc:  # noqa: BLE001 (both plans' requests fail: the runner starts clean)
            self.in_flight = None
            engine.fail_plans([p for p in (previous, plan) if p is not None], exc)
            return
        if previous is not None:
            engine.apply(previous, result)
        if not engine.scheduler.has_unfinished:  # the plan in flight was made for requests now finished
            self.drain()

    def drain(self) -> None:
        plan, self.in_flight = self.in_flight, None
        if plan is None:
            return
        try:
            result = self.engine.flush()
        except Exception as exc:  # noqa: BLE001
            self.engine.fail_plans([plan], exc)
            return
        self.engine.apply(plan, result)
