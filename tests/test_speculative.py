"""Fewer forwards per token and no idle device in the paged engine: speculative decoding (n-gram
prompt lookup, a draft model), multi-step decode and async scheduling. Greedy output equals HF
`generate` for every proposer, k, step count and scheduling mode, with requests arriving
mid-flight, chunked prefill and preemption; every KV block (the model's and the draft's) is free
after each run; seeded sampling with speculation reproduces itself, and its tokens follow the
model's distribution (chi-square against sampling without speculation)."""

from __future__ import annotations

import pytest
import torch

from engines.protocol import Add, Output
from engines.sampling_params import SamplingParams
from engines.loop.paged_engine import PagedEngine
from engines.worker.sampler import Sampler
from tests.support import paged_engine as make_engine
from tests.support import drive_engine, output_tokens

# repetitive prompts (prompt lookup finds matches) of several lengths, and plain ones
PROMPTS = [[1] + [5, 6, 7, 8, 9] * 3 + list(range(20, 20 + 3 * i)) for i in range(4)] + \
          [[1] + list(range(40 + 7 * i, 60 + 9 * i)) for i in range(3)]
KV_TOKEN_BYTES = 512  # the tiny model in fp32: 2 layers x K and V x 2 heads x 16 dims x 4 bytes


@pytest.fixture(scope="module")
def drafts(tiny_model, tmp_path_factory):
    """A 1-layer draft cut from the tiny model (agrees often), and an unrelated tiny model (rarely)."""
    from container.model_maker import make_draft, make_model

    root = tmp_path_factory.mktemp("drafts")
    make_draft(str(tiny_model), str(root / "derived"), num_layers=1)
    make_model(str(root / "unrelated"), arch="llama", size="tiny", seed=7)
    return {"derived": str(root / "derived"), "unrelated": str(root / "unrelated"), "self": str(tiny_model)}


def drive(engine: PagedEngine, requests, join_every: int = 2) -> dict[str, list[Output]]:
    """drive_engine, then: every block of the model's cache, and of the draft's, is free."""
    outputs = drive_engine(engine, requests, join_every)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.scheduler.check_invariants()
    draft = getattr(engine.proposer, "blocks", None)
    if draft is not None:
        assert draft.num_free_blocks == draft.num_blocks and not engine.proposer._seqs
    return outputs


tokens = output_tokens


def greedy_requests(max_new: int = 24):
    return [(f"g{i}", p, SamplingParams(max_new_tokens=max_new)) for i, p in enumerate(PROMPTS)]


def check_greedy(engine: PagedEngine, hf, **kw) -> dict[str, list[Output]]:
    outs = drive(engine, greedy_requests(), **kw)
    for i, p in enumerate(PROMPTS):
        assert tokens(outs[f"g{i}"]) == hf(p, 24), i
        assert all(len(o.token_ids) == len(o.log_probs) for o in outs[f"g{i}"])
    return outs


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_speculation_gives_hf_greedy_tokens(tiny_model, hf, k):
    engine = make_engine(tiny_model, speculative_method="ngram", num_speculative_tokens=k)
    assert not engine.mode.pipelined and engine.mode.name == "speculative (ngram)"  # the guesses need the host's tokens
    check_greedy(engine, hf)
    m = engine.metrics()
    assert m["spec_proposed_tokens"] > 0 and 0 < m["spec_accepted_tokens"] <= m["spec_proposed_tokens"]
    assert m["spec_acceptance_rate"] == m["spec_accepted_tokens"] / m["spec_proposed_tokens"]
    assert 1.0 < m["spec_mean_accepted_length"] <= k + 1


@pytest.mark.parametrize("draft,k", [("derived", 1), ("derived", 3), ("derived", 5), ("unrelated", 3), ("self", 5)])
def test_draft_model_speculation_gives_hf_greedy_tokens(tiny_model, hf, drafts, draft, k):
    engine = make_engine(tiny_model, speculative_method="draft", speculative_model=drafts[draft],
                         num_speculative_tokens=k)
    check_greedy(engine, hf)
    m = engine.metrics()
    assert m["spec_proposed_tokens"] > 0
    if draft == "self":  # the model as its own draft: every greedy guess is right
        assert m["spec_acceptance_rate"] == 1.0
        assert engine.num_steps < 24 * len(PROMPTS) / 3


@pytest.mark.parametrize("n", [1, 4, 8])
def test_multi_step_decode_gives_hf_greedy_tokens(tiny_model, hf, n):
    engine = make_engine(tiny_model, num_scheduler_steps=n)
    assert engine.mode.pipelined == (n == 1)  # a multi-step engine schedules synchronously
    outs = check_greedy(engine, hf, join_every=5)
    assert (engine.num_multi_steps > 0) == (n > 1)
    if n > 1:
        assert max(len(o.token_ids) for rid in outs for o in outs[rid]) > 1


def test_speculation_and_multi_step_under_chunked_prefill_and_preemption(tiny_model, hf, drafts):
    # 12 blocks of 16 tokens for 4 requests of up to 66 tokens: preemptions; 16-token steps: chunked prompts
    small = dict(kv_cache_memory=str(12 * 16 * KV_TOKEN_BYTES), max_num_batched_tokens=16)
    for sched in (dict(speculative_method="ngram", num_speculative_tokens=5),
                  dict(speculative_method="draft", speculative_model=drafts["derived"], num_speculative_tokens=3),
                  dict(num_scheduler_steps=8), dict(async_scheduling=True), dict(async_scheduling=False)):
        engine = make_engine(tiny_model, **small, **sched)
        outs = drive(engine, [(f"g{i}", p, SamplingParams(max_new_tokens=40, ignore_eos=True))
                              for i, p in enumerate(PROMPTS[:4])], join_every=1)
        assert engine.scheduler.num_preemptions > 0, sched
        for i, p in enumerate(PROMPTS[:4]):
            assert tokens(outs[f"g{i}"]) == hf(p, 40)[:40], (sched, i)


def test_multi_step_cuts_tokens_past_a_stop_and_an_arrival_ends_the_run(tiny_model, hf):
    engine = make_engine(tiny_model, num_scheduler_steps=8)
    want = hf(PROMPTS[5], 12)
    stop = want[4]  # the fifth token as a stop token: the run's later tokens are cut
    outs = drive(engine, [("s", PROMPTS[5], SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))])
    assert tokens(outs["s"]) == want[:want.index(stop) + 1] and outs["s"][-1].finish_reason == "eos_token"
    # a request arriving during a run: rank 0 ends the run after the step it sees it in
    engine.add(Add("a", PROMPTS[0], SamplingParams(max_new_tokens=20)))
    engine.step()  # its prefill: the first token
    assert engine.scheduler.requests["a"].num_generated_tokens == 1
    engine.submit(Add("b", PROMPTS[1], SamplingParams(max_new_tokens=3)))
    engine.publish = lambda outs: None
    engine.step()
    assert engine.scheduler.requests["a"].num_generated_tokens == 2  # one step of the run, not eight
    assert engine.num_multi_steps == 2
    engine._take_messages(block=False)
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("pipelined", [True, False])
def test_async_scheduling_gives_hf_greedy_tokens_and_schedules_ahead(tiny_model, hf, caplog, pipelined):
    import logging

    caplog.set_level(logging.INFO)
    engine = make_engine(tiny_model, async_scheduling=pipelined)
    assert any(f"scheduling: {'async' if pipelined else 'sync'}" in r.getMessage() for r in caplog.records)
    order = []  # ("schedule" | "update", plan id)
    schedule, update = engine.scheduler.schedule, engine.scheduler.update
    engine.scheduler.schedule = lambda: order.append(("schedule", (plan := schedule()).plan_id)) or plan
    engine.scheduler.update = lambda plan, sampled: order.append(("update", plan.plan_id)) or update(plan, sampled)
    check_greedy(engine, hf, join_every=3)
    num_plans = max(k for _, k in order)
    ahead = [k for k in range(1, num_plans) if order.index(("schedule", k + 1)) < order.index(("update", k))]
    if pipelined:  # plan k + 1 made before plan k's results were applied, for most plans
        assert len(ahead) > num_plans / 2 and sorted(order) == sorted({*order})
    else:
        assert not ahead and order == [(what, k) for k in range(1, num_plans + 1) for what in ("schedule", "update")]
    # a stop token: the step scheduled after it (in flight already) is dropped, not published
    want = hf(PROMPTS[5], 12)
    cut = want[:want.index(want[4]) + 1]
    outs = drive(engine, [("s", PROMPTS[5], SamplingParams(max_new_tokens=12, stop_token_ids=(want[4],)))])
    assert tokens(outs["s"]) == cut and [o.finished for o in outs["s"]] == [False] * (len(cut) - 1) + [True]


def test_seeded_sampling_is_the_same_with_and_without_async_scheduling_and_preemption(tiny_model):
    """Each token is drawn once from the request's generator: with async scheduling a request
    preempted by the plan made while its last step ran keeps that step's tokens."""
    seeded = SamplingParams(max_new_tokens=40, do_sample=True, temperature=1.5, top_k=50, seed=5)
    alone = tokens(drive(make_engine(tiny_model), [("s", PROMPTS[3], seeded)])["s"])
    others = [(f"o{i}", p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])]
    for on in (True, False):
        engine = make_engine(tiny_model, async_scheduling=on, kv_cache_memory=str(12 * 16 * KV_TOKEN_BYTES))
        got = tokens(drive(engine, others + [("s", PROMPTS[3], seeded)], join_every=1)["s"])  # s: the newest
        assert engine.scheduler.num_preemptions > 0
        assert got == alone and len(got) == 40, on


def test_seeded_sampling_with_speculation_reproduces_itself(tiny_model, drafts):
    seeded = SamplingParams(max_new_tokens=16, do_sample=True, temperature=1.5, top_k=50, seed=11)
    for sched in (dict(speculative_method="ngram", num_speculative_tokens=3),
                  dict(speculative_method="draft", speculative_model=drafts["self"], num_speculative_tokens=3)):
        alone = tokens(drive(make_engine(tiny_model, **sched), [("s", PROMPTS[1], seeded)])["s"])
        busy = drive(make_engine(tiny_model, **sched), greedy_requests(12) + [("s", PROMPTS[1], seeded)])
        assert tokens(busy["s"]) == alone and len(alone) == 16


def chi_square_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of homogeneity over the categories with >= 5 expected draws
    (the rest pooled) → p-value (torch's regularised upper incomplete gamma)."""
    cats = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(c), b.count(c)] for c in cats], dtype=torch.float64)
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    small = expected.min(1).values < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
        expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_the_verifier_keeps_the_model_distribution():
    """Sampler.verify against direct draws from p, 20,000 seeded requests each: the first token's
    distribution, and the second's given that the first proposal was accepted."""
    p1 = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    p2 = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    logits = torch.stack([p1, p2]).clamp_min(1e-30).log()
    n = 20_000
    sampler = Sampler(torch.device("cpu"))
    ids = [f"r{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        sampler.add(rid, SamplingParams(do_sample=True, seed=i))
    # the proposal: token 1 (p = 0.25: rejected three times in four)
    out = sampler.verify(logits.repeat(n, 1), ids, [[1]] * n)
    first = [o.token_ids[0] for o in out]
    second = [o.token_ids[1] for o in out if len(o.token_ids) == 2]
    assert all(len(o.token_ids) == 2 for o in out if o.token_ids[0] == 1)
    assert all(len(o.token_ids) == 1 for o in out if o.token_ids[0] != 1)
    g = torch.Generator().manual_seed(0)
    direct1 = torch.multinomial(p1, n, replacement=True, generator=g).tolist()
    direct2 = torch.multinomial(p2, len(second), replacement=True, generator=g).tolist()
    assert chi_square_p(first, direct1) > 1e-3
    assert chi_square_p(second, direct2) > 1e-3
    assert 4 not in second  # a token of probability 0 never comes out
    # and a verifier that ignored rejection would be caught: accepting the proposal always
    assert chi_square_p([1] * n, direct1) < 1e-6


def test_sampling_with_speculation_follows_the_model_distribution(tiny_model, drafts):
    """400 seeded requests sampling 3 tokens at temperature 1, with the model as its own draft (its
    guesses are accepted with probability p(guess): both branches of the verifier run) and without
    speculation: the second and third tokens are distributed alike."""
    params = [SamplingParams(max_new_tokens=3, do_sample=True, seed=1000 + i, ignore_eos=True)
              for i in range(400)]
    runs = {}
    for name, sched in (("plain", {}), ("spec", dict(speculative_method="draft", speculative_model=drafts["self"],
                                                      num_speculative_tokens=2))):
        engine = make_engine(tiny_model, **sched, max_num_seqs=32)
        outs = drive(engine, [(f"s{i}", PROMPTS[2], sp) for i, sp in enumerate(params)], join_every=1)
        runs[name] = [tokens(outs[f"s{i}"]) for i in range(len(params))]
        if sched:
            m = engine.metrics()
            assert 0.1 < m["spec_acceptance_rate"] < 0.95
    for position in (1, 2):
        plain = [t[position] for t in runs["plain"]]
        spec = [t[position] for t in runs["spec"]]
        assert len(set(plain)) > 3  # a spread distribution, not one token
        assert chi_square_p(plain, spec) > 1e-3, position
