"""logit_bias (OpenAI's, added to the logits before sampling), min_tokens / min_new_tokens (vLLM's
and HF's: EOS and stop_token_ids masked until that many tokens were generated) and bad words
(vLLM's: a token sequence's last token masked after the rest of it): the sampler's rows, then greedy
tokens of both rolling engines equal to transformers' `generate` with its own processors
(`sequence_bias`, `min_new_tokens`, `bad_words_ids`)."""

from __future__ import annotations

import pytest
import torch

from engines.sampling_params import SamplingParams
from engines.worker.sampler import Sampler
from tests.support import drive_engine, local_engine, output_tokens

CPU = torch.device("cpu")


def test_logit_bias_is_added_to_the_rows_that_ask_and_can_force_a_token():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    best = int(logits[1].argmax())
    sampler = Sampler(CPU)
    sampler.add("forced", SamplingParams(logit_bias=((7, 100.0),)))
    sampler.add("banned", SamplingParams(logit_bias=((best, -100.0),)))
    sampler.add("plain", SamplingParams())
    out = sampler.sample(logits.clone(), ["forced", "banned", "plain"])
    second = logits[1].clone()
    second[best] -= 100.0
    assert out.token_ids == [7, int(second.argmax()), int(logits[2].argmax())]
    assert out.log_probs[2] == pytest.approx(float(torch.log_softmax(logits[2], -1).max()))


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.full((1, 10), -5.0)
    logits[0, 2], logits[0, 5], logits[0, 3] = 10.0, 9.0, 8.0  # EOS, a stop id, then 3
    sampler = Sampler(CPU, eos_token_ids=frozenset({2}))
    sampler.add("r", SamplingParams(min_tokens=2, stop_token_ids=(5,)))
    sampler.add("ignore-eos", SamplingParams(min_tokens=2, stop_token_ids=(5,), ignore_eos=True))
    got = [sampler.sample(logits.repeat(2, 1), ["r", "ignore-eos"]).token_ids for _ in range(3)]
    assert got == [[3, 2], [3, 2], [2, 2]]  # with ignore_eos, EOS is no stop: never masked


def test_a_bad_words_last_token_is_masked_after_the_rest_of_it():
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 6], logits[0, 3] = 3.0, 2.0, 1.0  # preference: 4, then 6, then 3
    sampler = Sampler(CPU)
    sampler.add("r", SamplingParams(bad_words_ids=((6,), (4, 4))), output_token_ids=[1])
    got = [sampler.sample(logits.clone(), ["r"]).token_ids[0] for _ in range(3)]
    assert got == [4, 3, 4]  # 6 never; 4 again only after a token that is not 4


@pytest.mark.parametrize("kind", ["paged", "rolling"])
def test_both_engines_give_transformers_tokens_with_its_own_processors(tiny_model, kind):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    prompt = [1, 17, 23, 99, 5, 41]

    def hf(**kw) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, pad_token_id=0, **kw)
        return out[0, len(prompt):].tolist()

    plain = hf()
    stop = plain[0]  # the first token greedy picks, made a stop id: without min_tokens the answer ends there
    want_min = hf(min_new_tokens=4, eos_token_id=[2, stop])
    want_bias = hf(sequence_bias={(plain[1],): 6.0, (plain[2],): -100.0})
    bad = ((plain[5],), (plain[2], plain[3]))  # (transformers also matches across the prompt: not here)
    assert prompt[-1] != plain[2] and plain[1] != plain[2]
    want_bad = hf(bad_words_ids=[list(w) for w in bad])
    assert want_min[0] != stop and len(want_min) >= 4 and want_bias != plain and want_bad != plain
    engine = local_engine(tiny_model, kind)
    outs = drive_engine(engine, [
        ("min", prompt, SamplingParams(max_new_tokens=8, min_tokens=4, stop_token_ids=(stop,))),
        ("stop", prompt, SamplingParams(max_new_tokens=8, stop_token_ids=(stop,))),
        ("bias", prompt, SamplingParams(max_new_tokens=8, logit_bias=((plain[1], 6.0), (plain[2], -100.0)))),
        ("bad", prompt, SamplingParams(max_new_tokens=8, bad_words_ids=bad)),
        ("plain", prompt, SamplingParams(max_new_tokens=8))])
    got = {rid: output_tokens(o) for rid, o in outs.items()}
    assert got == {"min": want_min, "stop": [stop], "bias": want_bias, "bad": want_bad,
                   "plain": plain[:plain.index(2) + 1] if 2 in plain else plain}
