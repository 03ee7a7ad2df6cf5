"""From a request's tokens to LMI response bodies: JSON, jsonlines and server-sent events."""

from __future__ import annotations

import json
import logging
from typing import Iterator

from handlers.errors import HttpError
from handlers.generation import ClientGone, Generation
from handlers.schemas import GenerationRequest

log = logging.getLogger(__name__)

JSONLINES = "application/jsonlines"
SSE = "text/event-stream"


def _public(token: dict) -> dict:
    return {k: v for k, v in token.items() if k != "last"}


def _text(gen: Generation, req: GenerationRequest) -> str:
    return gen.input_text + gen.generated_text if req.return_full_text else gen.generated_text


def _details(gen: Generation, tokens: list[dict] | None) -> dict:
    details = {"finish_reason": gen.finish_reason, "generated_tokens": gen.num_generated_tokens,
               "inputs": gen.input_text}
    if tokens is not None:
        details["tokens"] = [{k: v for k, v in t.items() if k != "top_tokens"} for t in tokens]
        if any("top_tokens" in t for t in tokens):
            details["top_tokens"] = [t.get("top_tokens", []) for t in tokens]
    if gen.prefill is not None:
        details["prefill"] = [{k: v for k, v in t.items() if k != "top_tokens"} for t in gen.prefill]
    return details


def response_body(gen: Generation, tokens: list[dict], req: GenerationRequest) -> dict:
    body: dict = {"generated_text": _text(gen, req)}
    if req.details:
        body["details"] = _details(gen, tokens)
    return body


def collect(gen: Generation, deadline: float, is_gone) -> list[dict]:
    return [_public(t) for t in gen.tokens(deadline, is_gone)]


def stream_lines(gen: Generation, req: GenerationRequest, deadline: float, sse: bool,
                 is_gone=lambda: False) -> Iterator[bytes]:
    """One JSON line per token; the last also carries generated_text (and details, without tokens).
    An error before the first line raises HttpError (the caller still owns the status line); an error
    after it ends the stream with an error line."""
    def line(obj: dict) -> bytes:
        data = json.dumps(obj, ensure_ascii=False)
        return f"data: {data}\n\n".encode() if sse else (data + "\n").encode()

    ended = started = False
    try:
        for token in gen.tokens(deadline, is_gone):
            obj = {"token": {k: v for k, v in token.items() if k not in ("last", "top_tokens")}}
            if "top_tokens" in token:
                obj["top_tokens"] = token["top_tokens"]
            if token["last"]:
                obj["generated_text"] = _text(gen, req)
                if req.details:
                    obj["details"] = _details(gen, None)
                ended = True
            started = True
            yield line(obj)
        if not ended:
            final = {"token": None, "generated_text": _text(gen, req)}
            if req.details:
                final["details"] = _details(gen, None)
            yield line(final)
    except HttpError as err:
        if not started:
            raise
        log.info("[%s] stream ended after %d tokens: %d %s", gen.request_id, gen.num_generated_tokens, err.code,
                 err.message)
        yield line(err.body())
    except ClientGone:
        if not started:
            raise
        log.info("[%s] client disconnected after %d tokens: stream aborted", gen.request_id, gen.num_generated_tokens)
