"""Prompt log-probs (TGI's decoder_input_details, OpenAI's echo + logprobs) from the engines
themselves, checked against the HF model's own log-softmax over the prompt."""

from __future__ import annotations

import pytest
import torch

from engines.config import ENGINE_PAGED, ENGINE_ROLLING, LmiConfig, ModelConfig, SchedulerConfig
from engines.dist import SingleProcess
from engines.protocol import Add
from engines.sampling_params import SamplingParams

LONG = [1] + [(7 * i) % 200 + 3 for i in range(37)]  # 38 tokens: several chunks and blocks
SHORT = [1, 40, 41, 42, 43]


def expected(hf, prompt: list[int], top_n: int = 0):
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    chosen = [None] + [lp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    if not top_n:
        return chosen, None
    values, ids = lp[:-1].topk(top_n, dim=-1)
    return chosen, [[]] + [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def run(engine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    outputs: dict[str, list] = {}
    engine.publish = lambda outs: [outputs.setdefault(o.request_id, []).append(o) for o in outs]
    for rid, prompt, sp in requests:
        engine.add(Add(rid, prompt, sp))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 500
    return outputs


def make(kind: str, tiny_model, kv_cache_memory: str = "4MiB", **sched):
    if kind == ENGINE_PAGED:
        from engines.loop.paged_engine import PagedEngine as cls
    else:
        from engines.loop.rolling_engine import RollingEngine as cls
    config = LmiConfig(model=ModelConfig(local_dir=str(tiny_model), dtype="fp32"),
                       scheduler=SchedulerConfig(engine_kind=kind, kv_cache_memory=kv_cache_memory, **sched))
    engine = cls(config, lambda outs: None, SingleProcess())
    engine.load()
    return engine


def close(got, want, tol=1e-4):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None) and (g is None or abs(g - w) < tol), (got, want)


@pytest.mark.parametrize("kind,sched", [
    (ENGINE_PAGED, {"max_num_batched_tokens": 16, "enable_prefix_caching": True}),  # chunked prefill
    (ENGINE_PAGED, {}),
    (ENGINE_ROLLING, {}),
])
def test_prompt_log_probs_equal_the_models_own(tiny_model, hf, kind, sched):
    engine = make(kind, tiny_model, **sched)
    greedy = SamplingParams(max_new_tokens=4, prompt_logprobs=True)
    plain = SamplingParams(max_new_tokens=4)
    # the same long prompt first without, then with prompt log-probs: with prefix caching on, the
    # second would hit the first's blocks, but its prompt is computed whole
    run(engine, [("warm", LONG, plain)])
    outs = run(engine, [("long", LONG, greedy), ("short", SHORT, SamplingParams(max_new_tokens=4, top_n_tokens=3,
                                                                              prompt_logprobs=True)),
                        ("none", SHORT, plain)])
    close(outs["long"][0].prompt_log_probs, expected(hf, LONG)[0])
    assert outs["long"][0].prompt_top_tokens is None
    assert all(o.prompt_log_probs is None for o in outs["long"][1:])  # once, with the first token
    want_lp, want_top = expected(hf, SHORT, 3)
    close(outs["short"][0].prompt_log_probs, want_lp)
    got_top = outs["short"][0].prompt_top_tokens
    assert got_top[0] == [] and [[t for t, _ in row] for row in got_top[1:]] == [[t for t, _ in row] for row in want_top[1:]]
    assert all(o.prompt_log_probs is None for o in outs["none"])
    # the generated tokens are unchanged by asking
    ids = lambda rid: [t for o in outs[rid] for t in o.token_ids]  # noqa: E731
    assert ids("long") == hf(LONG, 4) and ids("short") == ids("none") == hf(SHORT, 4)


def test_a_preempted_request_reports_its_prompt_log_probs_once(tiny_model, hf):
    # 7 blocks of 16 tokens (512 bytes a token in fp32): a 38- and a 30-token prompt, each
    # generating 40 tokens, cannot both stay
    engine = make(ENGINE_PAGED, tiny_model, kv_cache_memory=str(7 * 16 * 512))
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True, prompt_logprobs=True)
    outs = run(engine, [("a", LONG, sp), ("b", LONG[:30], sp)])
    assert engine.scheduler.num_preemptions >= 1
    for rid, prompt in (("a", LONG), ("b", LONG[:30])):
        with_lp = [o for o in outs[rid] if o.prompt_log_probs is not None]
        assert len(with_lp) == 1 and with_lp[0] is outs[rid][0]
        close(with_lp[0].prompt_log_probs, expected(hf, prompt)[0])
