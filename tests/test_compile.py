"""option.cpu_compile: the paged engine's decode steps compiled by torch.compile (inductor) on CPU.
Focused tests (compiling costs ~20 s cold for the tiny model): greedy equals HF `generate` with
requests joining mid-flight across every bucket, seeded sampling repeats alone and in a batch, the
compile cache makes a restart warm, and option.enforce_eager turns it off."""

from __future__ import annotations

import logging

import pytest

from engines.config import ENGINE_PAGED, LmiConfig, ModelConfig, SchedulerConfig
from engines.dist import SingleProcess
from engines.sampling_params import SamplingParams
from engines.loop.paged_engine import PagedEngine
from tests.support import drive_engine, output_tokens

PROMPTS = [[1] + list(range(10 + 3 * i, 17 + 5 * i)) for i in range(7)]
SEEDED = SamplingParams(max_new_tokens=10, do_sample=True, temperature=1.2, top_k=40, seed=99)


def engine_with(tiny_model, cache_dir, **sched) -> PagedEngine:
    config = LmiConfig(model=ModelConfig(local_dir=str(tiny_model), dtype="fp32"),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_PAGED, kv_cache_memory="4MiB", max_num_seqs=4,
                                                 compile_cache_dir=str(cache_dir), **sched))
    engine = PagedEngine(config, lambda outs: None, SingleProcess())
    engine.load()
    return engine


def drive(engine: PagedEngine, requests: list[tuple[str, list[int], SamplingParams]], join_every: int = 1) -> dict:
    """Add one request every `join_every` steps (requests join mid-flight), then step to the end."""
    return {rid: output_tokens(outs) for rid, outs in drive_engine(engine, requests, join_every).items()}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="module")
def compiled(tiny_model, cache_dir):
    return engine_with(tiny_model, cache_dir, cpu_compile=True)


def test_the_decode_step_is_compiled_and_greedy_equals_hf(compiled, hf, caplog):
    paged = compiled.paged.target
    assert paged.decode_mode == "inductor" and paged._decode_model is not paged.runner.model
    # 7 requests joining every 3 steps under max_num_seqs=4: decode batches of 1, 2, 3, 4 (buckets 1, 2, 4)
    out = drive(compiled, [(f"g{i}", p, SamplingParams(max_new_tokens=14, ignore_eos=True))
                           for i, p in enumerate(PROMPTS)], join_every=3)
    for i, p in enumerate(PROMPTS):
        assert out[f"g{i}"] == hf(p, 14), i


def test_seeded_sampling_gives_the_same_tokens_alone_and_in_a_busy_batch(compiled):
    alone = drive(compiled, [("s", PROMPTS[2], SEEDED)])["s"]
    busy = drive(compiled, [(f"o{i}", p, SamplingParams(max_new_tokens=12, ignore_eos=True))
                            for i, p in enumerate(PROMPTS[:3])] + [("s", PROMPTS[2], SEEDED)])["s"]
    assert alone == busy and len(alone) == 10


def test_a_restart_finds_the_compiled_code_in_the_cache(tiny_model, cache_dir, compiled, hf, caplog):
    # inductor wrote its generated code where option.compile_cache_dir says (how much faster a warm
    # start is, is measured by benchmarks/step.py --compile, not here)
    assert list(cache_dir.rglob("*.py")), "no compiled code in the compile cache directory"
    caplog.set_level(logging.INFO)
    again = engine_with(tiny_model, cache_dir, cpu_compile=True)
    assert any("decode steps: inductor (option.cpu_compile=true: torch.compile (inductor), cache in "
               f"{cache_dir})" in r.getMessage() for r in caplog.records)
    out = drive(again, [("w", PROMPTS[1], SamplingParams(max_new_tokens=8, ignore_eos=True))])
    assert out["w"] == hf(PROMPTS[1], 8)


def test_enforce_eager_turns_compile_off(tiny_model, cache_dir, caplog):
    caplog.set_level(logging.INFO)
    engine = engine_with(tiny_model, cache_dir, cpu_compile=True, enforce_eager=True)
    assert engine.paged.target.decode_mode == "eager"
    assert engine.paged.target._decode_model is engine.runner.model
    assert any(r.getMessage() == "decode steps: eager (option.enforce_eager=true)" for r in caplog.records)
