"""DynamicBatcher on a fake clock: when batches close, how parameters split them, the queue bound."""

from __future__ import annotations

import threading

import pytest

from engines.dynamic.batcher import DynamicBatcher
from engines.protocol import Add
from engines.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=8)
OTHER = SamplingParams(max_new_tokens=9)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def req(i: int, params: SamplingParams = GREEDY) -> Add:
    return Add(f"r{i}", [1, 2, 3], params)


@pytest.fixture
def clock():
    return Clock()


def make(clock, batch_size=4, delay=0.1, queue=100) -> DynamicBatcher:
    return DynamicBatcher(batch_size, delay, queue, clock=clock)


def ids(batch) -> list[str]:
    return [r.request_id for r in batch]


def test_a_full_batch_closes_at_once(clock):
    b = make(clock)
    for i in range(4):
        assert b.add(req(i))
    assert ids(b.next_batch(timeout=0)) == ["r0", "r1", "r2", "r3"]
    assert b.num_waiting == 0


def test_a_partial_batch_waits_for_the_delay_from_the_first_request(clock):
    b = make(clock, delay=0.1)
    b.add(req(0))
    clock.now += 0.05
    b.add(req(1))
    assert b.next_batch(timeout=0) is None
    clock.now += 0.05  # 0.1 s after the first request, not the second
    assert ids(b.next_batch(timeout=0)) == ["r0", "r1"]


def test_different_parameters_make_different_batches(clock):
    b = make(clock, batch_size=2)
    b.add(req(0, GREEDY))
    b.add(req(1, OTHER))
    b.add(req(2, GREEDY))
    assert ids(b.next_batch(timeout=0)) == ["r0", "r2"]
    assert b.next_batch(timeout=0) is None
    clock.now += 0.1
    assert ids(b.next_batch(timeout=0)) == ["r1"]


def test_an_overfull_group_is_split_in_arrival_order(clock):
    b = make(clock, batch_size=2)
    for i in range(5):
        b.add(req(i))
    assert ids(b.next_batch(timeout=0)) == ["r0", "r1"]
    assert ids(b.next_batch(timeout=0)) == ["r2", "r3"]
    assert b.next_batch(timeout=0) is None  # r4 keeps the group's deadline
    clock.now += 0.1
    assert ids(b.next_batch(timeout=0)) == ["r4"]


def test_the_oldest_due_group_goes_first(clock):
    b = make(clock, batch_size=8)
    b.add(req(0, OTHER))
    clock.now += 0.01
    b.add(req(1, GREEDY))
    clock.now += 0.2
    assert ids(b.next_batch(timeout=0)) == ["r0"]
    assert ids(b.next_batch(timeout=0)) == ["r1"]


def test_the_queue_bound_refuses_beyond_job_queue_size(clock):
    b = make(clock, batch_size=8, queue=3)
    assert all(b.add(req(i)) for i in range(3))
    assert not b.add(req(3))
    clock.now += 1
    assert len(b.next_batch(timeout=0)) == 3
    assert b.add(req(4))


def test_abort_removes_a_waiting_request(clock):
    b = make(clock)
    b.add(req(0))
    b.add(req(1))
    assert b.abort("r0") and not b.abort("r9")
    clock.now += 1
    assert ids(b.next_batch(timeout=0)) == ["r1"]


def test_next_batch_wakes_up_when_the_batch_fills():
    b = DynamicBatcher(2, 60.0, 10)  # real clock: only a full batch can close in time
    got = []
    t = threading.Thread(target=lambda: got.append(b.next_batch(timeout=10)))
    t.start()
    b.add(req(0))
    b.add(req(1))
    t.join(timeout=5)
    assert not t.is_alive() and ids(got[0]) == ["r0", "r1"]
