"""What the pooling routes share: texts (or text pairs) → token ids within the model's limit, one Encode
to the engine, its vectors back (handlers/routes/pooling.py formats them per API).

Truncation: inputs longer than the model's limit (engines/pooling/spec.py max_input_tokens) are cut to it
by default, as sentence-transformers and TEI's --auto-truncate do (pairs: the longer text first, the
tokenizer's longest_first); a caller that sends `truncate: false` gets a 400 naming the input instead.
"""

from __future__ import annotations

import math
import os
import queue
import time

import numpy as np
from tokenizers import Tokenizer

from engines.config import TASK_CLASSIFICATION, PoolingSpec
from engines.protocol import Encode
from handlers.errors import HttpError, bad_request
from handlers.generation import ClientGone

WAIT_SLICE_S = 0.5  # how often a waiting request looks for a dead engine or the drain's end


class EncoderInputs:
    """The model's tokenizer twice: as it is (to count, and refuse), and truncating at the model's limit.
    Both are shared by the worker's threads (a Tokenizer encodes from many threads at once)."""

    def __init__(self, model_dir: str, max_tokens: int):
        path = os.path.join(model_dir, "tokenizer.json")
        self.max_tokens = max_tokens
        self._plain = Tokenizer.from_file(path)
        self._plain.no_truncation()
        self._plain.no_padding()
        self._cut = Tokenizer.from_file(path)
        self._cut.no_padding()
        self._cut.enable_truncation(max_tokens, strategy="longest_first")

    def texts(self, texts: list, truncate: bool, what: str = "input") -> tuple[list[list[int]], list[list[int]]]:
        """Texts (or (text, text_pair) tuples) → (ids, token type ids) per input."""
        encodings = (self._cut if truncate else self._plain).encode_batch(texts)
        for i, enc in enumerate(encodings):
            if len(enc.ids) > self.max_tokens:
                where = f"{what} {i}" if len(texts) > 1 else f"the {what}"
                raise bad_request(f"{where} has {len(enc.ids)} tokens, more than this model's maximum of "
                                  f"{self.max_tokens} (truncate=false refuses longer inputs; leave it unset to cut "
                                  "them to the maximum)", "truncate")
        return [enc.ids for enc in encodings], [enc.type_ids for enc in encodings]


def encode(service, ids: list[list[int]], types: list[list[int]] | None = None, *, dimensions: int | None = None,
           normalize: bool | None = None, request_id: str) -> list[np.ndarray]:
    """Send the inputs to the engine and wait for their vectors (float32, one per input). A client that
    leaves, a dead engine, the drain's end or option.predict_timeout aborts the request in the engine."""
    service.require_ready()
    deadline, is_gone = service.watch()
    q = service.client.add(Encode(request_id, ids, types or [], dimensions, normalize))
    reply = None
    try:
        while reply is None:
            try:
                reply = q.get(timeout=WAIT_SLICE_S)
            except queue.Empty:
                stop = service.interrupted() or (ClientGone() if is_gone() else None) or (
                    HttpError(424, "the model did not answer within option.predict_timeout "
                                   f"({service.config.scheduler.predict_timeout_s:g} s)")
                    if time.monotonic() > deadline else None)
                if stop is not None:
                    raise stop from None
    finally:
        if reply is None:
            service.client.abort(request_id)  # (its inputs still waiting are skipped)
        else:
            service.client.release(request_id)
    if reply.error_code:
        raise HttpError(reply.error_code, reply.error or "the model failed")
    return [np.frombuffer(v, dtype="<f4") for v in reply.vectors]


def check_count(n: int, limit: int, what: str, param: str) -> None:
    if n == 0:
        raise bad_request(f"{param} is empty: send at least one {what}", param)
    if n > limit:
        raise bad_request(f"{param} has {n} {what}s; this server takes at most {limit} per request "
                          "(option.max_client_batch_size)", param)


def check_dimensions(value, spec: PoolingSpec, param: str = "dimensions") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= spec.dimensions:
        raise bad_request(f"{param} must be an integer from 1 to {spec.dimensions} (this model's embedding size), "
                          f"not {value!r}", param)
    return value


def flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, not {value!r}", name)
    return value


def text_list(value, param: str, *, allow_ids: bool = False) -> list:
    """A string or a list of strings (allow_ids: OpenAI's token-id inputs, a list of ints or of int lists,
    returned as lists of ints)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return value
        if allow_ids and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [value]
        if allow_ids and all(isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in v) for v in value):
            return value
    kinds = "a string, a list of strings, a list of token ids or a list of token-id lists" if allow_ids else \
        "a string or a list of strings"
    raise bad_request(f"{param} must be {kinds}", param)


def scores(service, logits: list[np.ndarray], raw: bool) -> list[float]:
    """A cross-encoder's score per pair: its one logit, through a sigmoid unless raw (TEI's raw_scores)."""
    spec = service.config.model.pooling
    if spec.task == TASK_CLASSIFICATION and spec.dimensions != 1:
        raise bad_request(f"scoring needs a cross-encoder with one output; this classifier has {spec.dimensions} "
                          f"labels ({', '.join(spec.labels)}): use /invocations for its labels")
    return [float(v[0]) if raw else sigmoid(float(v[0])) for v in logits]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine similarity of two embeddings (a bi-encoder's score)."""
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / den) if den else 0.0
