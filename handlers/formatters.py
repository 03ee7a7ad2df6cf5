"""From engine outputs to LMI response bodies."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

from engines.protocol import FINISH_STOP, Output
from handlers.errors import HttpError
from handlers.schemas import GenerationRequest
from handlers.tokenizer import IncrementalDetokenizer, TextTokenizer


@dataclass
class GenerationResult:
    input_text: str
    generated_text: str
    tokens: list[dict]  # {"id", "text", "log_prob"} per generated token
    finish_reason: str
    num_prompt_tokens: int
    batch_id: int | None = None

    @property
    def num_generated_tokens(self) -> int:
        return len(self.tokens)


def collect(q: "queue.SimpleQueue[Output]", deadline: float) -> tuple[list[int], list[float], Output]:
    """All token ids (and log-probs) of one request and its final output; engine errors raise."""
    token_ids: list[int] = []
    log_probs: list[float] = []
    while True:
        remaining = deadline - time.monotonic()
        try:
            out = q.get(timeout=max(remaining, 0.0))
        except queue.Empty:
            raise HttpError(424, "the engine did not answer within option.predict_timeout") from None
        if out.error_code is not None:
            raise HttpError(out.error_code, out.error or "the model failed during generation")
        token_ids.extend(out.token_ids)
        log_probs.extend(out.log_probs)
        if out.finished:
            return token_ids, log_probs, out


def trim_at_stop(text: str, stop_sequences: tuple[str, ...]) -> tuple[str, bool]:
    """Text up to the earliest stop sequence, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop_sequences) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def generation_result(q, deadline: float, tokenizer: TextTokenizer, input_text: str,
                      req: GenerationRequest, num_prompt_tokens: int) -> GenerationResult:
    token_ids, log_probs, last = collect(q, deadline)
    detok = IncrementalDetokenizer(tokenizer)
    tokens = [{"id": tid, "text": detok.add(tid), "log_prob": lp}
              for tid, lp in zip(token_ids, log_probs or [None] * len(token_ids))]
    if tokens:
        tokens[-1]["text"] += detok.flush()
    full = "".join(t["text"] for t in tokens)
    text, stopped = trim_at_stop(full, req.stop_sequences)
    if stopped:
        tokens = _tokens_covering(tokens, len(text))
    return GenerationResult(input_text, text, tokens, FINISH_STOP if stopped else last.finish_reason,
                            num_prompt_tokens, last.batch_id)


def _tokens_covering(tokens: list[dict], length: int) -> list[dict]:
    """The shortest prefix of `tokens` whose texts reach `length` characters (the stop's token)."""
    kept, seen = [], 0
    for tok in tokens:
        if seen >= length and kept:
            break
        kept.append(tok)
        seen += len(tok["text"])
    return kept


def _one(result: GenerationResult, req: GenerationRequest) -> dict:
    text = result.input_text + result.generated_text if req.return_full_text else result.generated_text
    body: dict = {"generated_text": text}
    if req.details:
        body["details"] = {"finish_reason": result.finish_reason, "generated_tokens": result.num_generated_tokens,
                           "inputs": result.input_text, "tokens": result.tokens}
    return body


def format_response(results: list[GenerationResult], req: GenerationRequest, *, list_shape: bool):
    """DJL's shapes: dynamic batching (and list inputs) answer a list, one object per input."""
    bodies = [_one(r, req) for r in results]
    return bodies if list_shape else bodies[0]
