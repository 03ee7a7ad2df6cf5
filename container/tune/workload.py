"""`lmi tune`'s workload: request bodies whose prompts encode to the asked number of tokens and
whose outputs run to the asked length (`ignore_eos`), from length distributions or a trace file.

A trace is JSON lines, each either {"prompt_tokens": N, "output_tokens": M} (a prompt of that
length is cut from the embedded corpus) or an LMI request {"inputs": ..., "parameters": {...}}
(sent as it is; its output length is its max_new_tokens).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from container.model_maker import corpus_lines
from handlers.tokenizer import TextTokenizer

POOL_SIZE = 256  # distinct request bodies the clients cycle through


@dataclass(frozen=True)
class Lengths:
    """A prompt and an output length drawn uniformly within mean * (1 -/+ spread)."""

    prompt_tokens: int
    output_tokens: int
    spread: float = 0.0

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return _around(self.prompt_tokens, self.spread, rng), _around(self.output_tokens, self.spread, rng)

    @property
    def longest(self) -> tuple[int, int]:
        return (round(self.prompt_tokens * (1 + self.spread)), round(self.output_tokens * (1 + self.spread)))


def _around(mean: int, spread: float, rng: random.Random) -> int:
    lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return rng.randint(lo, hi)


def read_trace(path: str) -> list[dict]:
    """The trace's rows, each {"prompt_tokens", "output_tokens"} or {"inputs", "parameters"}."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not (isinstance(row, dict) and ({"prompt_tokens", "output_tokens"} <= set(row) or "inputs" in row)):
                raise ValueError(f"{path}:{lineno}: expected {{prompt_tokens, output_tokens}} or "
                                 "{inputs, parameters}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


class PromptMaker:
    """Text that encodes to exactly n tokens (the tokenizer's own BOS included), cut from the corpus."""

    def __init__(self, model_dir: str):
        self.tok = TextTokenizer(model_dir)
        self.corpus_ids = self.tok.encode(" ".join(corpus_lines() * 8), add_special_tokens=False)
        self.num_special = len(self.tok.encode(""))  # BOS and the like, added to every prompt

    def prompt(self, n: int, rng: random.Random) -> str:
        take = max(n - self.num_special, 1)
        start = rng.randrange(0, max(len(self.corpus_ids) - 4 * n, 1))
        text = self.tok.decode(self.corpus_ids[start:start + take])
        for _ in range(20):  # a cut can merge or split tokens at its ends: adjust until it is exact
            got = len(self.tok.encode(text))
            if got == n:
                break
            take = max(take + n - got, 1)
            text = self.tok.decode(self.corpus_ids[start:start + take])
        return text


def body(text: str, max_new_tokens: int, parameters: dict | None = None) -> dict:
    """An LMI request streaming its tokens, run to its full length."""
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True, **(parameters or {})}
    return {"inputs": text, "parameters": params, "stream": True}


def build_bodies(model_dir: str, *, lengths: Lengths | None = None, trace: list[dict] | None = None,
                 count: int = POOL_SIZE, seed: int = 0) -> list[dict]:
    """`count` bodies drawn from the lengths (or a trace's rows, cycled in order)."""
    rng = random.Random(seed)
    maker = PromptMaker(model_dir)
    bodies = []
    for i in range(count):
        if lengths is not None:
            prompt, output = lengths.draw(rng)
            bodies.append(body(maker.prompt(prompt, rng), output))
            continue
        row = trace[i % len(trace)]
        if "inputs" in row:
            params = dict(row.get("parameters") or {})
            bodies.append(body(row["inputs"], int(params.pop("max_new_tokens", 30)), params))
        else:
            bodies.append(body(maker.prompt(int(row["prompt_tokens"]), rng), int(row["output_tokens"])))
    return bodies


def longest_sequence(bodies: list[dict], model_dir: str) -> tuple[int, int]:
    """(the longest prompt in tokens, the longest output) of the bodies: what the memory plan checks."""
    tok = TextTokenizer(model_dir)
    prompt = max(len(tok.encode(b["inputs"])) for b in bodies)
    return prompt, max(b["parameters"]["max_new_tokens"] for b in bodies)
