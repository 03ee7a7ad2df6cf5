"""Tokenization and incremental detokenization in the HTTP workers, on the `tokenizers` library
(no torch, no transformers in the request path)."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# The BPE model caches the merges of each word it has seen, up to 10,000 words by default (~4 MiB:
# a worker's RSS grew by that, 6 % of it, as a soak's prompts brought new words). A smaller cache
# keeps the common words and bounds the growth.
WORD_CACHE_ENTRIES = 2000


class TextTokenizer:
    def __init__(self, model_dir: str):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}: the HTTP workers need a fast tokenizer")
        self._tok = Tokenizer.from_file(path)
        if hasattr(self._tok.model, "_resize_cache"):  # tokenizers >= 0.21 (BPE, WordPiece, ...)
            self._tok.model._resize_cache(WORD_CACHE_ENTRIES)
        self.eos_token_id = self._special_id(model_dir, "eos_token")
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def _special_id(self, model_dir: str, name: str) -> int | None:
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if not os.path.isfile(cfg_path):
            return None
        with open(cfg_path, encoding="utf-8") as f:
            token = json.load(f).get(name)
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not): a long prompt never stalls the worker's
        # other threads, nor the heartbeat that keeps gunicorn from killing the worker
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_with_offsets(self, text: str,
                            add_special_tokens: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of encode() and each token's (start, stop) character offsets into `text` (an added
        special token: (0, 0); the byte-level pieces of one character share its offsets)."""
        encoding = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return encoding.ids, encoding.offsets

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def backend(self) -> Tokenizer:
        return self._tok


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character, on
    `tokenizers`' own DecodeStream (what TGI and vLLM use): it keeps the tokenizer's spacing rules
    by decoding a short window of the previous tokens, and holds a token back (None) while its bytes
    do not yet make a whole character. Against our former window decoder on the same 4,000 tokens:
    the same text, 0.95 µs a token instead of 1.80 (python -m benchmarks.detokenize).

    DecodeStream has no flush: what it still holds at the end (an incomplete character cut off by
    the end of generation) is decoded here from the tokens after its last emission."""

    CONTEXT = 4  # tokens decoded before the held ones at flush, for the spacing rules

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self._emitted = 0  # ids[:_emitted] are in the deltas returned so far

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        delta = self._stream.step(self._tok.backend, token_id)
        if delta is None:
            return ""
        self._emitted = len(self.ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        if self._emitted == len(self.ids):
            return ""
        start = max(0, self._emitted - self.CONTEXT)
        prefix = self._tok.decode(self.ids[start:self._emitted], self._skip)
        full = self._tok.decode(self.ids[start:], self._skip)
        self._emitted = len(self.ids)
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        return full[len(prefix):]
