"""HFGenerator: left-padded batches equal single-prompt HF generate; stop ids, ignore_eos, seeds."""

from __future__ import annotations

import msgspec
import pytest
from transformers import AutoTokenizer

from engines.config import ModelConfig
from engines.spec import ModelSpec
from engines.dynamic.generator import HFGenerator
from engines.protocol import Add
from engines.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def gen(tiny_model):
    config = ModelConfig(local_dir=str(tiny_model), dtype="fp32")
    g = HFGenerator(config, ModelSpec.of(config))
    g.load()
    return g


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def adds(tok, prompts, params):
    return [Add(f"r{i}", tok(p).input_ids, params) for i, p in enumerate(prompts)]


def test_a_padded_batch_equals_each_prompt_alone(gen, tok):
    prompts = ["The", "A good recipe for bread needs", "Trains leave the central station every twenty"]
    params = SamplingParams(max_new_tokens=16)
    batched = gen.generate(adds(tok, prompts, params))
    alone = [gen.generate(adds(tok, [p], params))[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert all(len(o.log_probs) == len(o.token_ids) for o in batched)
    assert all(lp <= 0 for o in batched for lp in o.log_probs)


def test_stop_token_ids_end_the_row_with_eos_token_reason(gen, tok):
    params = SamplingParams(max_new_tokens=20)
    (free,) = gen.generate(adds(tok, ["The river"], params))
    stop = free.token_ids[3]
    (stopped,) = gen.generate(adds(tok, ["The river"], SamplingParams(max_new_tokens=20, stop_token_ids=(stop,))))
    first = free.token_ids.index(stop)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "eos_token"


def test_ignore_eos_runs_past_eos_to_max_new_tokens(gen, tok, monkeypatch):
    assert gen.eos_token_ids == [tok.eos_token_id]
    (free,) = gen.generate(adds(tok, ["Hello world!"], SamplingParams(max_new_tokens=20)))
    # pretend the model's EOS is the token it emits third, so that EOS surely comes up
    monkeypatch.setattr(gen, "eos_token_ids", [free.token_ids[2]])
    (stopped,) = gen.generate(adds(tok, ["Hello world!"], SamplingParams(max_new_tokens=20)))
    first = free.token_ids.index(free.token_ids[2])
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "eos_token"
    (ignored,) = gen.generate(adds(tok, ["Hello world!"], SamplingParams(max_new_tokens=20, ignore_eos=True)))
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_a_seeded_sampled_request_repeats(gen, tok):
    params = SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.5, top_k=50, seed=7)
    (a,) = gen.generate(adds(tok, ["Once upon a time"], params))
    (b,) = gen.generate(adds(tok, ["Once upon a time"], params))
    other = msgspec.structs.replace(params, seed=8)
    (c,) = gen.generate(adds(tok, ["Once upon a time"], other))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
