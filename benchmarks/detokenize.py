"""Incremental detokenization: `tokenizers`' DecodeStream (what the HTTP workers use) vs the window
decoder lmi-serve had before (decode a window of the previous tokens twice per token), on the same
token ids: equal text, cost per token.

    python -m benchmarks.detokenize --model-dir models/small --tokens 4000 --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from handlers.tokenizer import IncrementalDetokenizer, TextTokenizer

TEXTS = ["The river ran quietly past the old mill.", "Café crème, naïve façade — ünïcödé ✓",
         "emoji 🚀🔥 and 中文字符 mixed in", "numbers 12, 256, 1024 and 3.14", "  leading and  double  spaces"]


class WindowDetokenizer:
    """The former decoder (vLLM's older scheme): prefix and read offsets, two decodes per token."""

    def __init__(self, tok: TextTokenizer):
        self._tok, self.ids, self._prefix, self._read = tok, [], 0, 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._tok.decode(self.ids[self._prefix:self._read])
        full = self._tok.decode(self.ids[self._prefix:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        prefix = self._tok.decode(self.ids[self._prefix:self._read])
        return self._tok.decode(self.ids[self._prefix:])[len(prefix):]


def run(cls, tok: TextTokenizer, ids: list[int]) -> tuple[float, str]:
    started = time.perf_counter()
    detok = cls(tok)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    return (time.perf_counter() - started) / len(ids), text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.detokenize")
    p.add_argument("--model-dir", default="models/small")
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    tok = TextTokenizer(args.model_dir)
    rng = random.Random(0)
    ids = tok.encode(" ".join(rng.choice(TEXTS) for _ in range(args.tokens)))[1:][:args.tokens]
    times: dict[str, list[float]] = {"DecodeStream": [], "window (former)": []}
    for _ in range(args.rounds):  # interleaved
        for name, cls in (("DecodeStream", IncrementalDetokenizer), ("window (former)", WindowDetokenizer)):
            per_token, text = run(cls, tok, ids)
            assert text == tok.decode(ids), name
            times[name].append(per_token)
    print(f"{len(ids)} tokens of {args.model_dir}'s tokenizer, medians of {args.rounds} interleaved rounds")
    for name, values in times.items():
        print(f"  {name:<16} {statistics.median(values) * 1e6:6.2f} µs/token")
    ratio = statistics.median(times["window (former)"]) / statistics.median(times["DecodeStream"])
    print(f"  DecodeStream is {ratio:.2f}x faster; both decode to the same text")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
