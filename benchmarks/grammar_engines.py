"""Choosing the grammar engine: llguidance against xgrammar, by mask time and schema coverage.

A synthetic byte-level vocabulary of `--vocab` tokens (the 256 bytes, then the most frequent pieces
of Python source and English text on this machine: words with their leading space, punctuation runs,
quotes and braces as JSON needs them) stands in for a real 32 k or 128 k tokenizer, which cannot be
downloaded here. For each engine and each schema: the time to compile the grammar, then a random
walk through it (at each step the mask of allowed tokens is computed, and a random allowed token
consumed, EOS when it is the only one) with the time of every mask; and which of a list of JSON-schema
features each engine compiles. Prints a table; writes benchmarks/results/grammar_engines.json.

    python -m benchmarks.grammar_engines --vocab 32000 --walks 20
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

SCHEMAS = {
    "bounded": {  # the acceptance schema's shape: enums, maxLength, maxItems
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "count": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "colour", "tags", "count", "ok"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "id": {"type": "integer"}, "email": {"type": "string", "format": "email"},
                "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3}},
                "required": ["id", "email", "roles"], "additionalProperties": False},
            "items": {"type": "array", "maxItems": 4, "items": {
                "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                                 "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["sku", "qty"], "additionalProperties": False}},
        },
        "required": ["user", "items"], "additionalProperties": False,
    },
}

FEATURES = {
    "enum": {"enum": ["a", "b", 3]},
    "const": {"const": "x"},
    "pattern": {"type": "string", "pattern": "^[a-z]+[0-9]{2}$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "format uuid": {"type": "string", "format": "uuid"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "number bounds": {"type": "number", "minimum": -1.5, "exclusiveMaximum": 10},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "null"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "string"}}}]},
    "$ref / $defs": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                     "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "type list": {"type": ["string", "null"]},
    "minProperties": {"type": "object", "minProperties": 1},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "if/then": {"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
}


def synthetic_vocab(size: int) -> list[bytes]:
    """The 256 bytes, then the most frequent text pieces (a word with its leading space, a run of
    punctuation, whitespace runs) of the Python files under the standard library and site-packages."""
    counts: collections.Counter = collections.Counter()
    piece = re.compile(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]{1,3}|\s{1,8}")
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    for root in roots:
        for i, f in enumerate(sorted(root.rglob("*.py"))):
            if i >= 1500:
                break
            try:
                counts.update(piece.findall(f.read_text(errors="ignore")))
            except OSError:
                continue
        if len(counts) > 4 * size:
            break
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for text, _ in counts.most_common():
        b = text.encode()
        if b not in seen:
            seen.add(b)
            tokens.append(b)
        if len(tokens) >= size - 1:
            break
    return tokens + [b"</s>"]  # the last id: EOS


class _Greedy:
    """Longest-match tokenizer over the vocabulary (llguidance asks for one)."""

    def __init__(self, tokens: list[bytes], eos: int):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = [eos]
        self.index = {t: i for i, t in enumerate(tokens[:-1])}
        self.longest = max(len(t) for t in tokens)

    def __call__(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(self.longest, len(data) - i), 0, -1):
                if data[i:i + n] in self.index:
                    out.append(self.index[data[i:i + n]])
                    i += n
                    break
        return out


class Llguidance:
    name = "llguidance"

    def __init__(self, tokens: list[bytes]):
        import llguidance
        import llguidance.torch
        self.ll, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Greedy(tokens, len(tokens) - 1)))
        self.vocab = len(tokens)

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m, bitmask):
        self.lt.fill_next_token_bitmask(m, bitmask, 0)

    def accept(self, m, token: int) -> None:
        assert m.consume_token(token), m.get_error()

    def done(self, m) -> bool:
        return m.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokens: list[bytes]):
        import xgrammar
        self.xg = xgrammar
        info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, stop_token_ids=[len(tokens) - 1])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.vocab = len(tokens)

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return self.xg.GrammarMatcher(compiled)

    def mask(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, m, token: int) -> None:
        assert m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


def allowed(bitmask: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask[0].view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[:vocab].nonzero().view(-1).tolist()


def walk(engine, schema: dict, rng: random.Random, max_steps: int = 400) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    m = engine.compile(schema)
    compile_s = time.perf_counter() - t0
    bitmask = torch.full((1, (engine.vocab + 31) // 32), -1, dtype=torch.int32)
    times = []
    for _ in range(max_steps):
        if engine.done(m):
            break
        t0 = time.perf_counter()
        engine.mask(m, bitmask)
        times.append(time.perf_counter() - t0)
        ok = allowed(bitmask, engine.vocab)
        engine.accept(m, rng.choice(ok))
    return compile_s, times


def coverage(engine) -> dict[str, bool]:
    out = {}
    for name, schema in FEATURES.items():
        try:
            engine.compile(schema)
            out[name] = True
        except Exception:  # noqa: BLE001 — an engine's refusal of the feature, whatever its type
            out[name] = False
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--walks", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/grammar_engines.json")
    args = p.parse_args(argv)
    tokens = synthetic_vocab(args.vocab)
    print(f"vocabulary: {len(tokens)} tokens ({len(set(tokens))} distinct)")
    results = {"vocab": len(tokens), "engines": {}}
    engines = [Llguidance(tokens), Xgrammar(tokens)]
    rows = []
    for schema_name, schema in SCHEMAS.items():
        stats = {e.name: ([], []) for e in engines}
        for w in range(args.walks):  # interleaved
            for e in engines:
                c, t = walk(e, schema, random.Random(w))
                stats[e.name][0].append(c)
                stats[e.name][1].extend(t)
        for e in engines:
            comp, masks = stats[e.name]
            masks_sorted = sorted(masks)
            row = {"schema": schema_name, "engine": e.name, "compile_ms_median": 1e3 * statistics.median(comp),
                   "mask_us_median": 1e6 * statistics.median(masks),
                   "mask_us_p99": 1e6 * masks_sorted[int(0.99 * (len(masks_sorted) - 1))],
                   "mask_us_max": 1e6 * masks_sorted[-1], "steps": len(masks)}
            rows.append(row)
    results["walks"] = rows
    results["coverage"] = {e.name: coverage(e) for e in engines}
    print(f"\n{'schema':8} {'engine':11} {'compile ms':>10} {'mask µs p50':>11} {'p99':>8} {'max':>8} {'steps':>6}")
    for r in rows:
        print(f"{r['schema']:8} {r['engine']:11} {r['compile_ms_median']:10.2f} {r['mask_us_median']:11.1f} "
              f"{r['mask_us_p99']:8.1f} {r['mask_us_max']:8.1f} {r['steps']:6d}")
    print(f"\n{'feature':28} " + " ".join(f"{e.name:>11}" for e in engines))
    for f in FEATURES:
        print(f"{f:28} " + " ".join(f"{'yes' if results['coverage'][e.name][f] else 'NO':>11}" for e in engines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
