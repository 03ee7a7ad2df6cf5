"""Admission by projected padded-KV weight (peak_slots, admit, fits_alone) and Request bookkeeping."""

from __future__ import annotations

from collections import deque

import pytest

from engines.core.admission import AdmissionLimits, admit, fits_alone, peak_slots
from engines.core.request import Request, Status
from engines.protocol import FINISH_ABORT, FINISH_EOS, FINISH_LENGTH
from engines.sampling_params import SamplingParams

EOS = frozenset({2})
_arrivals = iter(range(10**9))


def req(prompt_len: int, max_new: int, rid: str | None = None, **sampling) -> Request:
    n = next(_arrivals)
    return Request(rid or f"r{n}", list(range(10, 10 + prompt_len)), SamplingParams(max_new_tokens=max_new, **sampling),
                   EOS, n)


def running(prompt_len: int, max_new: int, generated: int) -> Request:
    r = req(prompt_len, max_new)
    r.status = Status.RUNNING
    for _ in range(generated):
        r.append_token(5)
    assert not r.is_finished
    return r


def limits(seqs=32, tokens=10_000, kv=10**9) -> AdmissionLimits:
    return AdmissionLimits(max_num_seqs=seqs, max_num_batched_tokens=tokens, max_kv_tokens=kv)


def brute_peak(rows: list[tuple[int, int]]) -> int:
    """Step by step: at step t the rows with r >= t are alive, width = max(n) + t over them."""
    peak = 0
    for t in range(max((r for _, r in rows), default=0) + 1):
        alive = [n for n, r in rows if r >= t]
        if alive:
            peak = max(peak, len(alive) * (max(alive) + t))
    return peak


# -- peak_slots -----------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,expected", [
    ([], 0),
    ([(10, 5)], 15),
    ([(10, 5), (2, 20)], 30),  # max(2 x (10 + 5), 1 x (2 + 20))
    ([(10, 0)], 10),
    ([(4, 1), (4, 1), (4, 1)], 15),  # 3 x 5
    ([(100, 1), (1, 50)], 202),  # 2 x 101 beats 1 x 51
    ([(1, 50), (100, 1)], 202),  # order does not matter
    ([(3, 10), (3, 10), (50, 2)], 156),  # h=2: 3 x 52 = 156; h=10: 2 x 13 = 26
    ([(5, 100), (5, 1)], 105),  # h=1: 2 x 6 = 12; h=100: 1 x 105
])
def test_peak_slots_hand_computed(rows, expected):
    assert peak_slots(rows) == expected
    assert brute_peak(rows) == expected


def test_peak_slots_equals_step_by_step_projection():
    import random

    rnd = random.Random(0)
    for _ in range(300):
        rows = [(rnd.randint(1, 40), rnd.randint(0, 40)) for _ in range(rnd.randint(1, 6))]
        assert peak_slots(rows) == brute_peak(rows), rows


# -- admit ------------------------------------------------------------------------------------------
def test_empty_queue_admits_nothing():
    waiting: deque[Request] = deque()
    assert admit(waiting, [], limits()) == []
    assert admit(waiting, [running(4, 10, 2)], limits()) == []


def test_admit_respects_max_num_seqs_in_fifo_order():
    queue = [req(4, 4) for _ in range(5)]
    waiting = deque(queue)
    got = admit(waiting, [running(3, 5, 1)], limits(seqs=3))
    assert got == queue[:2]
    assert list(waiting) == queue[2:]
    assert admit(deque(queue), [running(3, 5, 1) for _ in range(3)], limits(seqs=3)) == []


def test_admit_everything_when_nothing_binds():
    queue = [req(4, 4) for _ in range(3)]
    waiting = deque(queue)
    assert admit(waiting, [], limits()) == queue
    assert not waiting


def test_batched_token_budget_stops_at_the_first_request_that_exceeds_what_is_left():
    queue = [req(4, 1), req(6, 1), req(1, 1)]  # 4 + 6 = 10 fills the budget exactly
    waiting = deque(queue)
    assert admit(waiting, [], limits(tokens=10)) == queue[:2]
    assert list(waiting) == [queue[2]]

    queue = [req(4, 1), req(7, 1), req(1, 1)]  # 7 > 6 left: it waits, and the 1 behind it too
    waiting = deque(queue)
    assert admit(waiting, [], limits(tokens=10)) == queue[:1]
    assert list(waiting) == queue[1:]


def test_first_request_is_admitted_even_when_its_prompt_alone_exceeds_the_token_budget():
    queue = [req(50, 1), req(1, 1)]
    waiting = deque(queue)
    assert admit(waiting, [], limits(tokens=10)) == queue[:1]
    assert list(waiting) == queue[1:]
    # also when a batch is already running
    waiting = deque(queue)
    assert admit(waiting, [running(5, 5, 1)], limits(tokens=10)) == queue[:1]


def test_kv_budget_admits_up_to_the_projected_peak_exactly():
    # running: 10 tokens now, 5 to go -> peak 15; joining (2, 20) -> max(2 x 15, 1 x 22) = 30
    head = req(2, 20)
    waiting = deque([head])
    assert admit(waiting, [running(8, 7, 2)], limits(kv=30)) == [head]
    assert not waiting


def test_kv_budget_head_that_does_not_fit_blocks_the_queue():
    head, small = req(2, 20), req(1, 1)
    # with the running row alone (10, 5): small joins at max(2 x 10, 2 x 11, 1 x 15) = 22 <= 29,
    # but the head (peak 30 > 29) is first: nobody jumps it
    assert peak_slots([(10, 5), (1, 1)]) == 22
    waiting = deque([head, small])
    assert admit(waiting, [running(8, 7, 2)], limits(kv=29)) == []
    assert list(waiting) == [head, small]


def test_kv_budget_uses_the_rows_admitted_earlier_in_the_same_step():
    a, b, c = req(10, 10), req(10, 10), req(10, 10)  # each alone 20; two 40; three 60
    waiting = deque([a, b, c])
    assert admit(waiting, [], limits(kv=45)) == [a, b]
    assert list(waiting) == [c]


def test_kv_budget_projects_running_rows_from_their_current_length_and_remaining_tokens():
    # prompt 30, 10 of 15 generated: (40, 5); newcomer (2, 1) -> max(2 x 41, 1 x 45) = 82.
    # (Counting the running row as (prompt 30, max_new 15) would give max(2 x 31, 45) = 62.)
    assert admit(deque([req(2, 1)]), [running(30, 15, 10)], limits(kv=82)) != []
    assert admit(deque([req(2, 1)]), [running(30, 15, 10)], limits(kv=81)) == []
    # prompt 4, 6 of 100 generated: (10, 94); newcomer (1, 1) -> max(2 x 11, 1 x 104) = 104.
    # (Counting it as (10 tokens, max_new 100) would give 110.)
    assert admit(deque([req(1, 1)]), [running(4, 100, 6)], limits(kv=104)) != []
    assert admit(deque([req(1, 1)]), [running(4, 100, 6)], limits(kv=103)) == []


def test_admit_with_every_limit_at_once():
    queue = [req(3, 3), req(3, 3), req(3, 3), req(3, 3)]
    # seqs allow 3, tokens allow 2 (3 + 3 <= 7 < 9), kv allows 3 (3 x 6 = 18)
    waiting = deque(queue)
    assert admit(waiting, [], limits(seqs=3, tokens=7, kv=18)) == queue[:2]
    waiting = deque(queue)
    assert admit(waiting, [], limits(seqs=3, tokens=100, kv=17)) == queue[:2]  # 3 x 6 = 18 > 17
    waiting = deque(queue)
    assert admit(waiting, [], limits(seqs=3, tokens=100, kv=100)) == queue[:3]


# -- fits_alone -----------------------------------------------------------------------------------
def test_fits_alone():
    r = req(10, 5)
    assert fits_alone(r, limits(kv=15))
    assert fits_alone(r, limits(kv=16))
    assert not fits_alone(r, limits(kv=14))
    # independent of the other limits
    assert fits_alone(r, limits(seqs=1, tokens=1, kv=15))


def test_a_request_that_does_not_fit_alone_is_never_admitted():
    r = req(10, 5)
    assert admit(deque([r]), [], limits(kv=14)) == []


# -- Request.append_token -------------------------------------------------------------------------
def test_request_counts():
    r = req(6, 4)
    assert (r.num_prompt_tokens, r.num_generated_tokens, r.num_tokens) == (6, 0, 6)
    assert r.max_num_tokens == 10
    assert r.num_remaining_tokens == 4
    assert r.status is Status.WAITING
    r.append_token(7)
    assert (r.num_generated_tokens, r.num_tokens, r.num_remaining_tokens) == (1, 7, 3)
    assert r.output_token_ids == [7]


def test_request_finishes_on_eos():
    r = req(3, 10)
    r.append_token(7)
    assert not r.is_finished and r.finish_reason is None
    r.append_token(2)
    assert r.is_finished
    assert r.status is Status.FINISHED
    assert r.finish_reason == FINISH_EOS
    assert r.output_token_ids == [7, 2]


def test_request_finishes_on_stop_token_ids():
    r = req(3, 10, stop_token_ids=(9, 11))
    r.append_token(7)
    r.append_token(8)
    assert not r.is_finished
    r.append_token(11)
    assert r.is_finished and r.finish_reason == FINISH_EOS


def test_request_finishes_on_max_new_tokens():
    r = req(3, 3)
    r.append_token(7)
    r.append_token(8)
    assert not r.is_finished
    r.append_token(9)
    assert r.is_finished and r.finish_reason == FINISH_LENGTH
    assert r.num_remaining_tokens == 0


def test_eos_as_the_last_allowed_token_is_reported_as_eos():
    r = req(3, 2)
    r.append_token(7)
    r.append_token(2)
    assert r.is_finished and r.finish_reason == FINISH_EOS


def test_ignore_eos_generates_through_eos_but_still_stops_on_stop_ids_and_length():
    r = req(3, 4, ignore_eos=True, stop_token_ids=(9,))
    r.append_token(2)
    r.append_token(2)
    assert not r.is_finished
    r.append_token(9)
    assert r.is_finished and r.finish_reason == FINISH_EOS

    r = req(3, 2, ignore_eos=True)
    r.append_token(2)
    assert not r.is_finished
    r.append_token(2)
    assert r.is_finished and r.finish_reason == FINISH_LENGTH


def test_eos_set_of_several_ids():
    r = Request("x", [1, 2, 3], SamplingParams(max_new_tokens=10), frozenset({2, 50}), 0)
    r.append_token(50)
    assert r.is_finished and r.finish_reason == FINISH_EOS


def test_abort():
    r = req(3, 3)
    r.abort()
    assert r.is_finished and r.finish_reason == FINISH_ABORT
