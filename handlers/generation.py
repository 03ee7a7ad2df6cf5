"""Following one request's engine outputs: incremental text, stop strings, disconnects, deadlines.

`Generation.tokens()` yields one token dict per generated token, as the engine produces them. Text
that could be the start of a stop string is held back until it is clearly not one, so the token
texts always concatenate to `generated_text`, streamed or not. When a stop string appears the
request is aborted in the engine and the text is cut before it.

Whatever the token rate, the client, the deadline and the server's state (engine dead, drain over)
are checked at least every POLL_S: a request is never kept alive by its own tokens. With several
model copies, a request whose copy died before any of its output arrived here is re-sent to a copy
that serves (`EnginePool.resend`); one that had output fails, since what was said cannot be taken back.
"""

from __future__ import annotations

import logging
import math
import queue
import select
import socket
import time
from typing import Callable, Iterator

from engines.protocol import FINISH_STOP, Add, Output
from handlers.engine_client import EngineClient
from handlers.errors import HttpError
from handlers.request_metrics import REQUEST_METRICS
from handlers.schemas import GenerationRequest
from handlers.tokenizer import IncrementalDetokenizer, TextTokenizer

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting request checks its client and its deadline


class StopFilter:
    """Feed text deltas; get back what is safe to emit, and whether a stop string was reached."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False):
        self.stops = stops
        self.include_stop = include_stop  # the stop string that ended the text stays in it
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        text = self.pending + delta
        found = [(i, -len(s), s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            cut, _, stop = min(found)  # the first to appear (the longest of those starting there)
            self.pending = ""
            return text[:cut + len(stop)] if self.include_stop else text[:cut], True
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def client_gone(sock: socket.socket | None) -> bool:
    """True when the peer closed the connection (readable, and a peek finds the end of the stream)
    or broke it. A readable socket with nothing to read after all (select(2) may say so spuriously)
    is not gone."""
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True


def finite_or_none(value: float) -> float | None:
    """A log-prob for JSON: NaN and infinities are not JSON numbers."""
    return value if math.isfinite(value) else None


class Generation:
    def __init__(self, client: EngineClient, request_id: str, prompt_ids: list[int], input_text: str,
                 req: GenerationRequest, tokenizer: TextTokenizer,
                 interrupted: Callable[[], HttpError | None] = lambda: None, lora_name: str | None = None,
                 model: str = ""):
        self.client = client
        self.model = model  # the served model's name (request metrics are labelled by it with several models)
        self._interrupted = interrupted
        self.request_id = request_id
        self.input_text = input_text
        self.req = req
        self.num_prompt_tokens = len(prompt_ids)
        self.prompt_ids = prompt_ids
        self.prefill: list[dict] | None = None  # the prompt's tokens with their log-probs, when asked
        self._detok = IncrementalDetokenizer(tokenizer, req.skip_special_tokens)
        self._tokenizer = tokenizer
        self._stops = StopFilter(req.stop_sequences, req.include_stop_str_in_output)
        self._min_tokens = req.sampling.min_tokens
        self.finish_reason: str | None = None
        self.text_parts: list[str] = []
        self.num_generated_tokens = 0
        self.batch_id: int | None = None
        self._closed = False
        self._checked_at = self.started = time.monotonic()
        self.first_token_at: float | None = None
        self._queue = client.add(Add(request_id, prompt_ids, req.sampling, lora_name, req.slo))

    @property
    def generated_text(self) -> str:
        return "".join(self.text_parts)

    def tokens(self, deadline: float, is_gone: Callable[[], bool] = lambda: False) -> Iterator[dict]:
        """Token dicts until the request ends; the last one has `"last": True`. Raises HttpError."""
        try:
            while self.finish_reason is None:
                out = self._next(deadline, is_gone)
                self.batch_id = out.batch_id
                yield from self._tokens_of(out)
        finally:
            self.close()

    def close(self) -> None:
        """Stop following the request; abort it in the engine if it is still going."""
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None:  # the client went away, or another input failed
            self.client.abort(self.request_id)
        self.client.release(self.request_id)
        REQUEST_METRICS.generation_ended(self.started, self.first_token_at, time.monotonic(), self.num_prompt_tokens,
                                         self.num_generated_tokens, self.finish_reason, self.model)

    def _next(self, deadline: float, is_gone: Callable[[], bool]) -> Output:
        while True:
            if time.monotonic() - self._checked_at >= POLL_S:
                self._check(deadline, is_gone)
            try:
                out = self._queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                continue
        if out.error_code is not None:
            self.finish_reason = "error"
            retry = None if out.retry_after_s is None else max(1, math.ceil(out.retry_after_s))
            raise HttpError(out.error_code, out.error or "the model failed during generation", retry_after=retry)
        return out

    def _check(self, deadline: float, is_gone: Callable[[], bool]) -> None:
        """Raise when the request must end now: its client left, the server says so, or time is up."""
        self._checked_at = time.monotonic()
        if is_gone():
            raise ClientGone()
        err = self._interrupted()
        if isinstance(err, CopyDied):
            err = self._move(err)
        if err is not None:
            raise err
        if self._checked_at > deadline:
            raise HttpError(424, "the engine did not answer within option.predict_timeout")

    def _move(self, died: "CopyDied") -> HttpError | None:
        """Re-send the request to a copy that serves when none of its output has arrived (None: it goes on
        there), else the error to fail it with. Output that arrived, streamed or collected for one reply,
        is never re-sent: a second copy could not continue it (sampling), only start again."""
        if self.num_generated_tokens:
            n = self.num_generated_tokens
            return HttpError(424, f"{died.message} (after {n} generated token{'s' * (n != 1)})")
        resent = self.client.resend(self.request_id)
        if resent is None:  # no other copy serves
            return died
        log.info("[%s] model copy %d died before the request's first token: re-sent", self.request_id, died.copy)
        self._queue = resent
        return None

    def _tokens_of(self, out: Output) -> Iterator[dict]:
        if out.prompt_log_probs is not None:
            self.prefill = [self._token(tid, lp, out.prompt_top_tokens[i] if out.prompt_top_tokens else None)
                            for i, (tid, lp) in enumerate(zip(self.prompt_ids, out.prompt_log_probs))]
        n = len(out.token_ids)
        for i, tid in enumerate(out.token_ids):
            if self.num_generated_tokens < self._min_tokens:  # stop strings count from min_tokens on (vLLM)
                text, stopped = self._detok.add(tid), False
            else:
                text, stopped = self._stops.feed(self._detok.add(tid))
            last = stopped or (out.finished and i == n - 1)
            if last and not stopped:
                text += self._stops.feed(self._detok.flush())[0] + self._stops.flush()
            token = {"id": tid, "text": text, "log_prob": finite_or_none(out.log_probs[i]) if out.log_probs else None}
            if out.top_tokens:
                token["top_tokens"] = self._alternatives(out.top_tokens[i])
            self.text_parts.append(text)
            if not self.num_generated_tokens:
                self.first_token_at = time.monotonic()
            self.num_generated_tokens += 1
            if stopped:
                self.finish_reason = FINISH_STOP
                self.client.abort(self.request_id)
            elif last:
                self.finish_reason = out.finish_reason
            yield dict(token, last=last)
            if last:
                return
        if out.finished and self.finish_reason is None:  # ended without a new token
            self.text_parts.append(self._stops.flush())
            self.finish_reason = out.finish_reason


    def _alternatives(self, top: list[tuple[int, float]]) -> list[dict]:
        return [{"id": t, "text": self._tokenizer.decode([t]), "log_prob": finite_or_none(lp)} for t, lp in top]

    def _token(self, tid: int, log_prob: float | None, top: list[tuple[int, float]] | None) -> dict:
        """A prompt token: its own text, its log-prob (None for the first), its alternatives when asked."""
        token = {"id": tid, "text": self._tokenizer.decode([tid]),
                 "log_prob": None if log_prob is None else finite_or_none(log_prob)}
        if top is not None:
            token["top_tokens"] = self._alternatives(top)
        return token


class CopyDied(HttpError):
    """The model copy a request was sent to died (one of several; the engine as a whole serves on)."""

    def __init__(self, copy: int, reason: str):
        super().__init__(424, f"the model failed during generation: model copy {copy}: {reason}")
        self.copy = copy


class ClientGone(Exception):
    """The HTTP client went away: its request is aborted in the engine."""
