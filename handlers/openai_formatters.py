"""OpenAI response bodies and server-sent event chunks, from the token dicts of `Generation.tokens()`.

    non-streaming: {"id", "object", "created", "model", "choices": [...], "usage"}
    streaming:     data: {"object": "...chunk", "choices": [{"index", "delta" | "text", ...}]}  ...  data: [DONE]

Choice `i` is generation `i` (prompt-major: prompt p, copy k is choice p * n + k). A stream reads
the choices one after another; the engine runs them all at once, so later choices are already
(partly) generated when their turn comes.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Iterator

from handlers.errors import HttpError
from handlers.generation import ClientGone, Generation
from handlers.openai_schemas import OpenAIRequest
from handlers.tools import delta, gather

CHAT, COMPLETION = "chat.completion", "text_completion"
DONE = b"data: [DONE]\n\n"


def finish_reason(gen: Generation) -> str:
    """OpenAI's reasons: "length" when max_tokens ended it, "stop" for EOS, a stop string or a stop id."""
    return "length" if gen.finish_reason == "length" else "stop"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex


def _token_text(decode: Callable[[list[int]], str], token_id: int) -> str:
    return decode([token_id])


def chat_logprob(token: dict, decode) -> dict:
    """One entry of `logprobs.content`: the token, its log-prob, its UTF-8 bytes and the alternatives."""
    text = _token_text(decode, token["id"])
    alternatives = [{"token": t["text"], "logprob": t["log_prob"], "bytes": list(t["text"].encode())}
                    for t in token.get("top_tokens", [])]
    return {"token": text, "logprob": token["log_prob"], "bytes": list(text.encode()), "top_logprobs": alternatives}


def completion_logprobs(tokens: list[dict], decode, offset: int, prompt: list[dict] | None = None) -> dict:
    """The legacy shape: parallel lists; text_offset indexes the returned text (echoed prompt included).
    With `prompt` (echo + logprobs) the prompt's tokens come first, from offset 0; its first token has
    neither a log-prob nor alternatives (null), as vLLM answers."""
    entries = [(t, i == 0) for i, t in enumerate(prompt or [])] + [(t, False) for t in tokens]
    offsets, at = [], 0 if prompt else offset
    for i, (t, _) in enumerate(entries):
        if prompt and i == len(prompt):
            at = offset  # the generated text starts after the echoed prompt text
        offsets.append(at)
        at += len(t["text"])
    return {"tokens": [_token_text(decode, t["id"]) for t, _ in entries],
            "token_logprobs": [t["log_prob"] for t, _ in entries],
            "top_logprobs": [None if first else {a["text"]: a["log_prob"] for a in t.get("top_tokens", [])}
                             for t, first in entries],
            "text_offset": offsets}


def usage(gens: list[Generation], n: int) -> dict:
    """Prompt tokens count once per prompt (its n copies share it), as OpenAI counts them."""
    prompt = sum(g.num_prompt_tokens for g in gens[::n])
    completion = sum(g.num_generated_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


SYSTEM_FINGERPRINT = "lmi-serve-0.1.0"  # OpenAI's field (TGI's client requires it)


def _envelope(kind: str, rid: str, created: int, model: str, choices: list[dict]) -> dict:
    return {"id": rid, "object": kind, "created": created, "model": model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices}


def response(kind: str, req: OpenAIRequest, gens: list[Generation], tokens: list[list[dict]], model: str,
             decode) -> dict:
    choices = []
    for i, (gen, toks) in enumerate(zip(gens, tokens)):
        if kind == CHAT:
            logprobs = {"content": [chat_logprob(t, decode) for t in toks]} if req.logprobs else None
            message, reason = {"role": "assistant", "content": gen.generated_text}, finish_reason(gen)
            if req.reads_tool_calls:
                reader = req.tools.reader(req.tool_parser)
                content, calls = gather(reader.feed(gen.generated_text) + reader.finish())
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                reason = _tool_reason(req, reason, bool(calls))
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        else:
            prefix = gen.input_text if req.echo else ""
            logprobs = completion_logprobs(toks, decode, len(prefix), gen.prefill) if req.logprobs else None
            choices.append({"index": i, "text": prefix + gen.generated_text, "logprobs": logprobs,
                            "finish_reason": finish_reason(gen)})
    body = _envelope(kind, new_id(kind), int(time.time()), model, choices)
    body["usage"] = usage(gens, req.n)
    return body


def frame(obj: dict, sse: bool) -> bytes:
    data = json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode() if sse else (data + "\n").encode()


def stream(kind: str, req: OpenAIRequest, gens: list[Generation], model: str, decode, deadline: float,
           is_gone, sse: bool = True) -> Iterator[bytes]:
    """Chunks for every choice, then the usage chunk (stream_options.include_usage), then [DONE]
    (SSE; `sse=False` gives DJL's jsonlines_chat: one chunk per line, no [DONE]).
    An error before the first chunk raises (the caller still owns the status line); after it, the
    stream ends with an OpenAI error object (and [DONE])."""
    rid, created, chunk_kind = new_id(kind), int(time.time()), kind + ".chunk" if kind == CHAT else kind
    extra = {"usage": None} if req.include_usage else {}
    done = [DONE] if sse else []

    def event(choices: list[dict]) -> bytes:
        for c in choices:  # the role in every delta (OpenAI sends it in the first; TGI's client needs it in each)
            if "delta" in c:
                c["delta"] = {"role": "assistant", **c["delta"]}
        return frame(dict(_envelope(chunk_kind, rid, created, model, choices), **extra), sse)

    started = False
    try:
        for i, gen in enumerate(gens):
            token = None
            reader = req.tools.reader(req.tool_parser) if req.reads_tool_calls else None
            called = False  # (tool calls read)
            for j, token in enumerate(gen.tokens(deadline, is_gone)):
                if j == 0 and kind == CHAT:
                    yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                started = True
                choice = _chunk_choice(kind, req, i, gen, token, j == 0, decode)
                if reader is not None:  # the text read as content and tool-call deltas
                    events = reader.feed(token["text"]) + (reader.finish() if token["last"] else [])
                    choice["delta"] = delta(events)
                    called = called or "tool_calls" in choice["delta"]
                    if token["last"]:
                        choice["finish_reason"] = _tool_reason(req, choice["finish_reason"], called)
                yield event([choice])
            if token is None or not token["last"]:  # ended without a last token (e.g. at a stop string)
                empty = {"delta": {}} if kind == CHAT else {"text": ""}
                reason = finish_reason(gen)
                if reader is not None:
                    empty["delta"] = delta(reader.finish())
                    reason = _tool_reason(req, reason, called or "tool_calls" in empty["delta"])
                yield event([dict({"index": i}, **empty, logprobs=None, finish_reason=reason)])
        if req.include_usage:
            extra = {"usage": usage(gens, req.n)}
            yield event([])
        yield from done
    except HttpError as err:
        if not started:
            raise
        yield frame(err.openai_body(), sse)
        yield from done
    except ClientGone:
        if not started:
            raise
    finally:
        for gen in gens:
            gen.close()


def _tool_reason(req: OpenAIRequest, reason: str, called: bool) -> str:
    """vLLM's: "tool_calls" when the model chose to call (auto); a forced call (required, named) ends "stop"."""
    return "tool_calls" if called and req.tools.choice == "auto" and reason != "length" else reason


def _chunk_choice(kind: str, req: OpenAIRequest, index: int, gen: Generation, token: dict, is_first: bool,
                  decode) -> dict | None:
    reason = finish_reason(gen) if token["last"] else None
    if kind == CHAT:
        logprobs = {"content": [chat_logprob(token, decode)]} if req.logprobs else None
        return {"index": index, "delta": {"content": token["text"]}, "logprobs": logprobs, "finish_reason": reason}
    prefix = gen.input_text if req.echo and is_first else ""
    offset = len(gen.generated_text) - len(token["text"]) + (len(gen.input_text) if req.echo else 0)
    prompt = gen.prefill if req.echo and is_first else None  # the echoed prompt's log-probs, in the first chunk
    logprobs = completion_logprobs([token], decode, offset, prompt) if req.logprobs else None
    return {"index": index, "text": prefix + token["text"], "logprobs": logprobs, "finish_reason": reason}
