"""Tokenization and incremental detokenization in the HTTP workers, on the `tokenizers` library
(no torch, no transformers in the request path)."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer

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

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

        ids:  ... [prefix_offset ....... read_offset ....... len(ids)]
                   └ decoded already ──┘ └ new tokens ──────┘
    Decoding a window that starts a few tokens back keeps the spacing rules of the tokenizer;
    a delta ending in U+FFFD (an incomplete UTF-8 sequence) waits for the next token.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._tok.decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._tok.decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self._tok.decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._tok.decode(self.ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self.ids)
        return full[len(prefix):]
