"""Request mixes: prompts of exact token lengths cut from the embedded corpus, fixed output lengths
(`ignore_eos`, so every engine generates the same number of tokens)."""

from __future__ import annotations

import random

from container.model_maker import corpus_lines
from handlers.tokenizer import TextTokenizer

# name -> (prompt tokens, new tokens); None means drawn per request
WORKLOADS = {
    "32x128": (32, 128),  # the Falcon-40B study's first workload
    "256x32": (256, 32),  # and its second
    "mixed": (None, None),  # prompts 16..256 tokens, max_new_tokens 8..256
    "prefix512": (544, 32),  # one shared 512-token prefix + a 32-token suffix of its own
}
SHARED_PREFIX = 512


def prompt_of_length(tok: TextTokenizer, corpus_ids: list[int], n: int, rng: random.Random) -> str:
    """Text that encodes to exactly `n` tokens (with <s>), cut from the corpus at a random place."""
    start = rng.randrange(0, len(corpus_ids) - n)
    take = n - 1
    for _ in range(20):
        text = tok.decode(corpus_ids[start:start + take])
        got = len(tok.encode(text))
        if got == n:
            return text
        take += n - got
    return text


def build_requests(workload: str, model_dir: str, count: int, seed: int) -> list[dict]:
    tok = TextTokenizer(model_dir)
    corpus_ids = tok.encode(" ".join(corpus_lines() * 8))[1:]
    rng = random.Random(seed)
    prompt_len, new_tokens = WORKLOADS[workload]
    prefix = prompt_of_length(tok, corpus_ids, SHARED_PREFIX, random.Random(12345)) if workload == "prefix512" else ""
    bodies = []
    for _ in range(count):
        n_out = new_tokens or rng.randint(8, 256)
        if prefix:
            text = prefix + " " + prompt_of_length(tok, corpus_ids, prompt_len - SHARED_PREFIX, rng)
        else:
            text = prompt_of_length(tok, corpus_ids, prompt_len or rng.randint(16, 256), rng)
        bodies.append({"inputs": text, "parameters": {"max_new_tokens": n_out, "ignore_eos": True, "details": True}})
    return bodies
