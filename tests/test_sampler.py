"""Sampler: greedy, warping, log-probs, repetition penalty (as HF), per-request seeds, frequencies."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from engines.sampling_params import SamplingParams
from engines.worker.sampler import Sampler

CPU = torch.device("cpu")
GREEDY = SamplingParams()


def rand_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def make(params: list[SamplingParams], ids: list[str] | None = None, prompts: list[list[int]] | None = None,
         outputs: list[list[int]] | None = None) -> tuple[Sampler, list[str]]:
    s = Sampler(CPU)
    ids = ids or [f"r{i}" for i in range(len(params))]
    for i, (rid, p) in enumerate(zip(ids, params)):
        s.add(rid, p, prompts[i] if prompts else [], outputs[i] if outputs else [])
    return s, ids


def test_greedy_rows_are_the_argmax_with_their_log_probs():
    logits = rand_logits(5, 50, seed=0)
    params = [GREEDY] * 5
    s, ids = make(params)
    out = s.sample(logits, ids)
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1).view(-1, 1)).view(-1)
    assert out.log_probs == pytest.approx(expected.tolist(), abs=1e-6)
    assert out.top_tokens == [[] for _ in params]


def test_greedy_ignores_temperature_top_k_top_p_when_do_sample_is_off():
    logits = rand_logits(3, 40, seed=1)
    params = [SamplingParams(temperature=0.3, top_k=2, top_p=0.5, seed=i) for i in range(3)]
    s, ids = make(params)
    out = s.sample(logits, ids)
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values  # untouched distribution
    assert out.log_probs == pytest.approx(expected.tolist(), abs=1e-6)


def warped_log_softmax(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    x = logits / temperature
    if top_k:
        kth = x.topk(top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    return torch.log_softmax(x, -1)


def test_sampled_log_probs_are_those_of_the_warped_distribution_at_the_chosen_ids():
    logits = rand_logits(4, 30, seed=2)
    params = [SamplingParams(do_sample=True, temperature=0.7, top_k=5, seed=10),
              SamplingParams(do_sample=True, temperature=1.5, seed=11),
              GREEDY,
              SamplingParams(do_sample=True, temperature=1.0, top_k=3, seed=12)]
    s, ids = make(params)
    out = s.sample(logits, ids)
    for i, p in enumerate(params):
        ref = warped_log_softmax(logits[i], p.temperature if p.do_sample else 1.0, p.top_k if p.do_sample else 0)
        tok = out.token_ids[i]
        assert ref[tok] > float("-inf")
        assert out.log_probs[i] == pytest.approx(float(ref[tok]), abs=1e-5)
    assert out.token_ids[2] == int(logits[2].argmax())


def test_top_k_1_always_gives_the_argmax():
    logits = rand_logits(64, 100, seed=3, scale=0.5)  # flat-ish: plain sampling would wander
    params = [SamplingParams(do_sample=True, top_k=1, temperature=2.0, seed=i) for i in range(64)]
    s, ids = make(params)
    out = s.sample(logits, ids)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.log_probs == pytest.approx([0.0] * 64, abs=1e-6)


def test_tiny_top_p_gives_the_argmax():
    logits = rand_logits(64, 100, seed=4, scale=0.5)
    params = [SamplingParams(do_sample=True, top_p=1e-6, temperature=2.0, seed=i) for i in range(64)]
    s, ids = make(params)
    out = s.sample(logits, ids)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(400, 4).contiguous()
    params = [SamplingParams(do_sample=True, top_p=0.7, seed=i) for i in range(400)]
    s, ids = make(params)
    out = s.sample(logits, ids)
    assert set(out.token_ids) == {0, 1}
    lp = {0: torch.tensor(0.5 / 0.8).log().item(), 1: torch.tensor(0.3 / 0.8).log().item()}
    assert all(v == pytest.approx(lp[t], abs=1e-5) for t, v in zip(out.token_ids, out.log_probs))


def test_top_k_3_never_samples_outside_the_top_3():
    n = 500
    base = rand_logits(1, 60, seed=5, scale=0.3)[0]  # nearly flat: every token is plausible
    logits = base.expand(n, 60).contiguous()
    params = [SamplingParams(do_sample=True, top_k=3, seed=1000 + i) for i in range(n)]
    s, ids = make(params)
    out = s.sample(logits, ids)
    top3 = set(base.topk(3).indices.tolist())
    assert set(out.token_ids) == top3  # inside the top 3, and all three occur over 500 draws


def test_min_p_keeps_exactly_the_tokens_hf_min_p_keeps():
    from transformers import MinPLogitsWarper

    n = 400
    base = rand_logits(1, 60, seed=8, scale=1.5)[0]
    logits = base.expand(n, 60).contiguous()
    params = [SamplingParams(do_sample=True, min_p=0.3, temperature=0.8, seed=3000 + i) for i in range(n)]
    s, ids = make(params)
    out = s.sample(logits, ids)
    warped = MinPLogitsWarper(0.3)(None, (base / 0.8).view(1, -1))[0]
    allowed = set(torch.isfinite(warped).nonzero().view(-1).tolist())
    assert 2 <= len(allowed) < 60 and set(out.token_ids) == allowed  # inside, and every kept one drawn


def test_repetition_penalty_matches_hf_processor():
    vocab = 40
    logits = rand_logits(3, vocab, seed=6)
    logits[0, 3] = 0.0  # a zero logit among the seen ones
    seen = [[3, 5, 7, 5, 1, 30, 30], [0, 39, 12, 13], [4, 4, 4]]
    penalties = [1.3, 0.8, 1.0]
    params = [SamplingParams(repetition_penalty=p, top_n_tokens=vocab) for p in penalties]
    s, ids = make(params, prompts=seen)
    out = s.sample(logits.clone(), ids)
    for i, p in enumerate(penalties):
        hf = RepetitionPenaltyLogitsProcessor(penalty=p) if p != 1.0 else None
        scores = logits[i:i + 1].clone()
        if hf is not None:
            scores = hf(torch.tensor([seen[i]]), scores)
        ref = torch.log_softmax(scores[0], -1)
        assert out.token_ids[i] == int(scores[0].argmax())
        assert out.log_probs[i] == pytest.approx(float(ref.max()), abs=1e-5)
        full = torch.full((vocab,), float("nan"))
        for tok, lp in out.top_tokens[i]:
            full[tok] = lp
        torch.testing.assert_close(full, ref, rtol=0, atol=1e-5)
        if p != 1.0:  # the penalty changed the distribution (else the test proves nothing)
            assert not torch.allclose(full, torch.log_softmax(logits[i], -1), atol=1e-3)


def test_repetition_penalty_does_not_modify_the_callers_logits():
    logits = rand_logits(1, 20, seed=7)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=2.0)]
    s, ids = make(params, prompts=[[1, 2, 3]])
    s.sample(logits, ids)
    assert torch.equal(logits, before)


def test_repetition_penalty_can_change_the_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    s, ids = make([SamplingParams(repetition_penalty=1.5)], prompts=[[0]])
    assert s.sample(logits, ids).token_ids == [1]
    s, ids = make([GREEDY], prompts=[[0]])
    assert s.sample(logits, ids).token_ids == [0]


def run_steps(sampler: Sampler, step_logits: list[torch.Tensor], ids: list[str]) -> list[list[int]]:
    """Sample several steps; returns per row the tokens it got (the sampler's state counts them)."""
    got = [[] for _ in ids]
    for logits in step_logits:
        for i, t in enumerate(sampler.sample(logits, ids).token_ids):
            got[i].append(t)
    return got


def test_a_seeded_row_gives_the_same_tokens_alone_and_in_any_batch():
    vocab, steps = 80, 8
    target = SamplingParams(do_sample=True, temperature=1.2, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=42)
    logits = [rand_logits(1, vocab, seed=100 + t, scale=1.0) for t in range(steps)]

    s, _ = make([target], ["target"], prompts=[[1, 2, 3]])
    alone = run_steps(s, logits, ["target"])[0]

    batch_params = [SamplingParams(do_sample=True, temperature=0.8, seed=7),  # another seeded row
                    GREEDY,
                    target,
                    SamplingParams(do_sample=True, top_k=5),  # unseeded
                    SamplingParams(repetition_penalty=1.3, top_n_tokens=3)]  # greedy with extras
    batch_ids = ["other", "greedy", "target", "unseeded", "greedy2"]
    s, _ = make(batch_params, batch_ids, prompts=[[9], [8], [1, 2, 3], [], [4, 5]])
    batch_logits = []
    for t in range(steps):
        rows = rand_logits(5, vocab, seed=200 + t, scale=1.0)
        rows[2] = logits[t][0]
        batch_logits.append(rows)
    in_batch = run_steps(s, batch_logits, batch_ids)
    assert in_batch[2] == alone
    assert len(set(alone)) > 1  # it really sampled

    # and again in another position, after the other rows leave
    s, _ = make([GREEDY, target], ["g", "target"], prompts=[[], [1, 2, 3]])
    two = [torch.cat([rand_logits(1, vocab, seed=300 + t), logits[t]]) for t in range(steps)]
    assert run_steps(s, two, ["g", "target"])[1] == alone


def test_the_same_seed_repeats_and_different_seeds_differ():
    vocab, steps = 100, 12
    logits = [rand_logits(1, vocab, seed=400 + t, scale=0.5) for t in range(steps)]

    def tokens(seed):
        p = SamplingParams(do_sample=True, seed=seed)
        s, _ = make([p], ["x"])
        return run_steps(s, logits, ["x"])[0]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    assert tokens(2) != tokens(3)


def test_removed_request_is_reseeded_when_added_again():
    p = SamplingParams(do_sample=True, seed=5)
    logits = [rand_logits(1, 100, seed=500 + t, scale=0.5) for t in range(6)]
    s, _ = make([p], ["x"])
    first = run_steps(s, logits, ["x"])[0]
    s.remove("x")
    s.add("x", p)
    assert run_steps(s, logits, ["x"])[0] == first


def test_empirical_frequencies_match_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = (probs.log() + 1.7).expand(n, 4).contiguous()  # a shift does not change the softmax
    params = [SamplingParams(do_sample=True, seed=i) for i in range(n)]
    s, ids = make(params)
    out = s.sample(logits, ids)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    assert freq.shape == (4,)
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.025)


def test_empirical_frequencies_with_temperature():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    t = 0.5  # p^(1/t) renormalised: 0.01, 0.04, 0.09, 0.16 over 0.30
    expected = probs ** 2 / (probs ** 2).sum()
    logits = probs.log().expand(n, 4).contiguous()
    params = [SamplingParams(do_sample=True, temperature=t, seed=10_000 + i) for i in range(n)]
    s, ids = make(params)
    out = s.sample(logits, ids)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.025)


def test_top_n_returns_sorted_alternatives_per_row():
    logits = rand_logits(3, 50, seed=8)
    params = [SamplingParams(top_n_tokens=4), SamplingParams(), SamplingParams(top_n_tokens=2)]
    s, ids = make(params)
    out = s.sample(logits, ids)
    lsm = torch.log_softmax(logits, -1)
    assert out.top_tokens[1] == []
    for i, n in ((0, 4), (2, 2)):
        top = out.top_tokens[i]
        assert len(top) == n
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        ref = lsm[i].topk(n)
        assert [t for t, _ in top] == ref.indices.tolist()
        assert values == pytest.approx(ref.values.tolist(), abs=1e-6)
        assert top[0][0] == out.token_ids[i]
        assert top[0][1] == pytest.approx(out.log_probs[i], abs=1e-6)
        assert all(isinstance(t, int) and isinstance(lp, float) for t, lp in top)


def test_two_requests_with_the_same_seed_in_one_batch_draw_independently_the_same():
    p = SamplingParams(do_sample=True, seed=99)
    row = rand_logits(1, 100, seed=9, scale=0.5)
    logits = torch.cat([row, rand_logits(1, 100, seed=10), row])
    params = [p, SamplingParams(do_sample=True, seed=3), p]
    s, ids = make(params, ["a", "b", "c"])
    first = [s.sample(logits, ids).token_ids for _ in range(5)]
    assert all(t[0] == t[2] for t in first)
    assert len({t[0] for t in first}) > 1


def test_presence_and_frequency_penalties_match_the_openai_formula():
    """logit[t] -= frequency * count(t in output) + presence * (count > 0), per row, prompt excluded."""
    vocab = 30
    logits = rand_logits(3, vocab, seed=11)
    outputs = [[4, 4, 9, 4], [2, 7], [5, 5]]
    prompts = [[1, 2, 3], [8], [0]]  # the prompt never counts
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, top_n_tokens=vocab),
              SamplingParams(presence_penalty=-1.0, top_n_tokens=vocab),
              SamplingParams(top_n_tokens=vocab)]  # no penalty: untouched
    s, ids = make(params, prompts=prompts, outputs=outputs)
    out = s.sample(logits.clone(), ids)
    for i, p in enumerate(params):
        expected = logits[i].clone()
        for tok in set(outputs[i]):
            n = outputs[i].count(tok)
            expected[tok] -= p.frequency_penalty * n + p.presence_penalty
        ref = torch.log_softmax(expected, -1)
        full = torch.full((vocab,), float("nan"))
        for tok, lp in out.top_tokens[i]:
            full[tok] = lp
        torch.testing.assert_close(full, ref, rtol=0, atol=1e-5)
        assert out.token_ids[i] == int(expected.argmax())


def test_a_frequency_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.5]])
    params = [SamplingParams(frequency_penalty=0.3)]
    s, ids = make(params, outputs=[[1, 1]])
    assert s.sample(logits.clone(), ids).token_ids == [2]  # 3.0 - 0.6 < 2.5
    s, ids = make(params, outputs=[[1]])
    assert s.sample(logits.clone(), ids).token_ids == [1]  # 3.0 - 0.3 > 2.5


def test_penalty_state_updated_in_place_equals_rebuilding_it_from_the_tokens_each_step():
    """The sampler counts each sampled token itself: step by step, a request sampled with its kept
    state gets the tokens of a fresh sampler given the whole prompt + output so far every step."""
    vocab = 12
    p = SamplingParams(repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4, top_n_tokens=vocab)
    prompt = [3, 3, 5]
    kept, _ = make([p], ["x"], prompts=[prompt])
    output: list[int] = []
    for t in range(10):
        logits = rand_logits(1, vocab, seed=600 + t, scale=0.4)
        fresh, _ = make([p], ["x"], prompts=[prompt], outputs=[list(output)])
        a, b = kept.sample(logits, ["x"]), fresh.sample(logits, ["x"])
        assert a.token_ids == b.token_ids and a.top_tokens == b.top_tokens
        output.append(a.token_ids[0])
    assert len(set(output)) > 3  # the penalties pushed it around


def test_adding_a_known_request_again_keeps_its_state():
    """A preempted request comes back to the paged runner as new: its generator and counts go on."""
    p = SamplingParams(do_sample=True, seed=8, frequency_penalty=0.5)
    logits = [rand_logits(1, 50, seed=700 + t, scale=0.5) for t in range(8)]
    s, _ = make([p], ["x"])
    straight = run_steps(s, logits, ["x"])[0]
    s, _ = make([p], ["x"])
    first = run_steps(s, logits[:4], ["x"])[0]
    s.add("x", p, [], first)  # no reset
    assert first + run_steps(s, logits[4:], ["x"])[0] == straight


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9])
def test_typical_p_keeps_exactly_the_tokens_hf_typical_keeps(mass):
    from transformers import TypicalLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(3, 40) * 2
    want = TypicalLogitsWarper(mass)(None, logits.clone()).isfinite()
    from engines.worker.sampler import _warp

    got = _warp(logits.clone(), [SamplingParams(do_sample=True, typical_p=mass)] * 3).isfinite()
    assert torch.equal(got, want)
    sampler = Sampler(torch.device("cpu"))
    sampler.add("t", SamplingParams(do_sample=True, typical_p=mass, seed=3))
    drawn = {sampler.sample(logits[:1].clone(), ["t"]).token_ids[0] for _ in range(50)}
    assert drawn <= set(want[0].nonzero().view(-1).tolist())
