"""Constrained decoding (engines/worker/grammar.py) and its request forms (handlers/structured.py).

The oracle is transformers' `generate` with a logits processor that builds a fresh llguidance matcher
at every step from the tokens generated so far (nothing incremental, no thread, no rollback): every
engine's greedy tokens, constrained and free rows mixed in one batch, speculative decoding on, must
equal it."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.torch
import pytest
import torch

from engines.sampling_params import SamplingParams
from engines.worker.grammar import Grammars, allowed_tokens
from engines.worker.sampler import Sampler
from handlers.errors import HttpError
from handlers.structured import compile_grammar, grammar_of
from tests.support import drive_engine, local_engine, output_tokens

CPU = torch.device("cpu")

SCHEMA = {  # the acceptance schema's shape: bounded fields only
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "colour", "tags", "n"],
    "additionalProperties": False,
}


def grammars_of(tiny_model) -> dict[str, str]:
    return {"json": compile_grammar("json", SCHEMA, "t"),
            "regex": compile_grammar("regex", r"(ab|cd)[0-9]{2,4}x", "t"),
            "choice": compile_grammar("choice", ["yes", "no", "maybe so"], "t"),
            "lark": compile_grammar("grammar", 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/', "t")}


class FromScratch:
    """transformers' logits processor: a new matcher per step, fed all the tokens generated so far."""

    def __init__(self, tokenizer, grammar: str, prompt_len: int):
        self.tokenizer, self.grammar, self.prompt_len = tokenizer, grammar, prompt_len

    def __call__(self, input_ids, scores):
        m = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
        assert m.consume_tokens(input_ids[0, self.prompt_len:].tolist())
        mask = llguidance.torch.allocate_token_bitmask(1, scores.shape[1])
        llguidance.torch.fill_next_token_bitmask(m, mask)
        return scores.masked_fill(~allowed_tokens(mask, scores.shape[1]), float("-inf"))


@pytest.fixture(scope="module")
def oracle(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    tokenizer = llguidance.LLTokenizer(str(tiny_model / "tokenizer.json"), eos_token=2)

    def generate(prompt: list[int], grammar: str | None, max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        procs = [FromScratch(tokenizer, grammar, len(prompt))] if grammar else None
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0, logits_processor=procs)
        toks = out[0, len(prompt):].tolist()
        return toks[:toks.index(2) + 1] if 2 in toks else toks

    return generate


def json_prompt(tiny_model) -> list[int]:
    """A prompt that holds JSON like the schema's, so that prompt lookup proposes grammar tokens (some
    accepted, some not: the grammar is rolled back)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    return [1] + tok.encode('{"name":"al","colour":"red","tags":[],"n":0} {"name":"al","colour":"blue"').ids


@pytest.mark.parametrize("kind,sched", [("paged", {}), ("rolling", {}),
                                        ("paged", {"speculative_method": "ngram", "num_speculative_tokens": 4})],
                         ids=["paged", "rolling", "paged-ngram"])
def test_constrained_and_free_rows_in_one_batch_give_the_from_scratch_oracles_tokens(tiny_model, oracle, kind, sched):
    grammars = grammars_of(tiny_model)
    prompts = {"json": json_prompt(tiny_model), "regex": [1, 17, 23, 99], "choice": [1, 5, 6, 7, 8],
               "lark": [1, 40, 41], "free": [1, 17, 23, 99, 5]}
    want = {name: oracle(p, grammars.get(name), 40) for name, p in prompts.items()}
    engine = local_engine(tiny_model, kind, **sched)
    outs = drive_engine(engine, [(name, p, SamplingParams(max_new_tokens=40, grammar=grammars.get(name)))
                                 for name, p in prompts.items()])
    got = {name: output_tokens(outs[name]) for name in prompts}
    assert got == want
    from tokenizers import Tokenizer
    text = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).decode(got["json"])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert outs["json"][-1].finish_reason == "eos_token" and got["json"][-1] == 2
    sampler = engine.paged.sampler if kind == "paged" else engine.sampler
    stats = sampler.grammars.metrics()
    assert stats["grammar_masks"] >= sum(len(got[n]) for n in grammars)
    if sched:  # proposals were checked against the grammar and some rolled back
        assert engine.metrics()["spec_proposed_tokens"] > 0 and stats["grammar_rollbacks"] > 0


def test_dynamic_batching_constrains_every_row_of_a_batch(tiny_model, oracle):
    from engines.config import ModelConfig
    from engines.dynamic.generator import HFGenerator
    from engines.spec import ModelSpec
    from engines.protocol import Add

    config = ModelConfig(local_dir=str(tiny_model), dtype="fp32")
    gen = HFGenerator(config, ModelSpec.of(config))
    gen.load()
    grammar = grammars_of(tiny_model)["json"]
    prompts = [[1, 17, 23, 99], [1, 5, 6, 7, 8, 9, 10]]
    params = SamplingParams(max_new_tokens=40, grammar=grammar)
    outs = gen.generate([Add(f"r{i}", p, params) for i, p in enumerate(prompts)])
    # (left padding changes a row's numbers a little: compare the text's validity, and the unpadded row exactly)
    assert outs[1].token_ids == oracle(prompts[1], grammar, 40)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    for o in outs:
        jsonschema.validate(json.loads(tok.decode(o.token_ids)), SCHEMA)


def test_the_sampler_masks_constrained_rows_only_and_the_grammar_wins_over_min_tokens(tiny_model):
    grammars = Grammars(str(tiny_model), 1024, (2,))
    sampler = Sampler(CPU, frozenset({2}), grammars)
    choice = compile_grammar("choice", ["yes"], "t")
    from tokenizers import Tokenizer
    yes = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).encode("yes", add_special_tokens=False).ids
    sampler.add("c", SamplingParams(grammar=choice, min_tokens=5))  # EOS comes before min_tokens: grammar wins
    sampler.add("free", SamplingParams())
    logits = torch.zeros(2, 1024)
    logits[:, 7] = 5.0
    got = [sampler.sample(logits.clone(), ["c", "free"]).token_ids for _ in range(len(yes) + 1)]
    assert [g[0] for g in got] == yes + [2] and all(g[1] == 7 for g in got)


def test_grammars_are_compiled_once_per_text(tiny_model):
    grammars = Grammars(str(tiny_model), 1024, (2,))
    g = compile_grammar("regex", "a+", "t")
    assert grammars.compiled(g) is grammars.compiled(g)
    with pytest.raises(ValueError, match="does not compile"):
        grammars.compiled('{"grammars": [{"lark_grammar": "start: nope"}]}')


# -- request forms ------------------------------------------------------------------------------------------

def test_each_request_form_gives_the_same_grammar_as_its_guided_twin():
    as_json = grammar_of({"guided_json": SCHEMA}, "")
    assert grammar_of({"guided_json": json.dumps(SCHEMA)}, "") == as_json
    assert grammar_of({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                                   "strict": True}}}, "") == as_json
    assert grammar_of({"grammar": {"type": "json", "value": SCHEMA}}) == as_json  # TGI / LMI parameters
    assert grammar_of({"grammar": {"type": "json_schema", "value": {"name": "x", "schema": SCHEMA}}}) == as_json
    assert grammar_of({"response_format": {"type": "json_object", "value": SCHEMA}}, "") == as_json  # TGI's chat
    assert grammar_of({"structured_outputs": {"json": SCHEMA}}, "") == as_json
    assert grammar_of({"grammar": {"type": "regex", "value": "a+"}}) == grammar_of({"guided_regex": "a+"})
    assert grammar_of({"response_format": {"type": "json_object"}}, "") == grammar_of({"guided_json": {"type": "object"}})
    assert grammar_of({"response_format": {"type": "text"}}, "") is None and grammar_of({}, "") is None
    gbnf = grammar_of({"guided_grammar": 'root ::= "a" | "b"'})
    assert gbnf is not None and grammar_of({"guided_grammar": 'start: "a" | "b"'}) is not None


@pytest.mark.parametrize("params,field,words", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "one structured-output form"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
    ({"guided_regex": "[a-"}, "guided_regex", "cannot be enforced"),
    ({"guided_choice": []}, "guided_choice", "list of 1 to"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_grammar": "start: nope"}, "guided_grammar", "cannot be enforced"),
    ({"grammar": {"type": "xml", "value": "x"}}, "grammar", "\"type\": \"json\" | \"regex\""),
    ({"response_format": {"type": "yaml"}}, "response_format", "not one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "\"schema\""),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "llguidance"),
])
def test_a_malformed_form_is_a_400_naming_its_field(params, field, words):
    with pytest.raises(HttpError) as err:
        grammar_of(params)
    assert err.value.code == 400 and err.value.param == field and words in err.value.message


def test_a_non_strict_schema_ignores_keywords_the_engine_cannot_enforce():
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    assert grammar_of({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": False}}}, "") is not None


def test_tensor_parallel_2_constrains_on_rank_0_and_gives_the_oracles_tokens(tiny_model, oracle, tmp_path):
    """mpirun -np 2: only rank 0 samples (and holds grammars); the others get its tokens."""
    from tests.support import run_tp2_job

    grammars = grammars_of(tiny_model)
    prompts = [json_prompt(tiny_model), [1, 17, 23, 99], [1, 5, 6, 7, 8]]
    chosen = [grammars["json"], None, grammars["choice"]]
    got = run_tp2_job(tmp_path, {"prompts": prompts, "new_tokens": 40, "grammars": chosen}, [str(tiny_model)])
    assert got[str(tiny_model)] == [oracle(p, g, 40) for p, g in zip(prompts, chosen)]
