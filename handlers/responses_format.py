"""Responses objects and their stream events, from one generation's tokens.

    output items  {"type": "message", "id": "msg_...", "status", "role": "assistant",
                   "content": [{"type": "output_text", "text", "annotations": [], "logprobs": []}]}
                  {"type": "function_call", "id": "fc_...", "call_id": "call_...", "name", "arguments", "status"}
    the stream    response.created, response.in_progress, then for each item
                  response.output_item.added,
                    message:  response.content_part.added, response.output_text.delta ...,
                              response.output_text.done, response.content_part.done
                    call:     response.function_call_arguments.delta ..., response.function_call_arguments.done
                  response.output_item.done;
                  then response.completed (or response.incomplete) carrying the whole response.

The items are built from the tool readers' events (handlers/tools.py: content, call, args) by one
`Output`, streamed or not, so a streamed reply ends as the same items as a whole one. Text after a
call (a Hermes block) opens a new message item.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator

from handlers.errors import OPENAI_TYPES, HttpError
from handlers.generation import ClientGone, Generation
from handlers.openai_formatters import usage
from handlers.openai_schemas import OpenAIRequest

MESSAGE, CALL = "message", "function_call"
IN_PROGRESS, COMPLETED, INCOMPLETE = "in_progress", "completed", "incomplete"


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class Item:
    kind: str  # MESSAGE | CALL
    index: int  # its output_index
    id: str
    text: str = ""  # a message's text, a call's arguments
    name: str = ""  # a call's
    call_id: str = ""  # a call's
    status: str = IN_PROGRESS

    def body(self) -> dict:
        done = self.status != IN_PROGRESS
        if self.kind == MESSAGE:
            return {"type": MESSAGE, "id": self.id, "status": self.status, "role": "assistant",
                    "content": [text_part(self.text)] if done else []}
        return {"type": CALL, "id": self.id, "call_id": self.call_id, "name": self.name,
                "arguments": self.text if done else "", "status": self.status}


@dataclass
class Output:
    """The output items of one reply, from reader events; `feed` and `finish` return the stream events
    (without sequence numbers) that tell a client what changed."""
    items: list[Item] = field(default_factory=list)
    open: Item | None = None  # the item being written
    calls: dict[int, Item] = field(default_factory=dict)  # the reader's call index → its item

    def feed(self, events: list[tuple]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            if event[0] == "content":
                if not event[1]:
                    continue
                if self.open is None or self.open.kind != MESSAGE:
                    out += self._close(COMPLETED) + self._open(MESSAGE)
                self.open.text += event[1]
                out.append(_event("response.output_text.delta", self.open, content_index=0, delta=event[1],
                                  logprobs=[]))
            elif event[0] == "call":
                out += self._close(COMPLETED) + self._open(CALL, name=event[3])
                self.calls[event[1]] = self.open
            else:  # ("args", index, text)
                item = self.calls[event[1]]
                item.text += event[2]
                out.append(_event("response.function_call_arguments.delta", item, delta=event[2]))
        return out

    def finish(self, cut: bool) -> list[dict]:
        """The last item closed; an empty reply is an empty message. A cut reply leaves its last item
        incomplete when the cut fell inside it: a message's text, or a call's arguments that are not yet
        JSON (calls read whole, as `required` and `auto` read them, are complete when they appear)."""
        opened = self._open(MESSAGE) if not self.items else []
        return opened + self._close(INCOMPLETE if cut and self.open is not None and not _is_whole(self.open)
                                    else COMPLETED)

    def _open(self, kind: str, name: str = "") -> list[dict]:
        key = uuid.uuid4().hex
        item = Item(kind, len(self.items), ("msg_" if kind == MESSAGE else "fc_") + key, name=name,
                    call_id="call_" + key if kind == CALL else "")
        self.items.append(item)
        self.open = item
        events = [{"type": "response.output_item.added", "output_index": item.index, "item": item.body()}]
        if kind == MESSAGE:
            events.append(_event("response.content_part.added", item, content_index=0, part=text_part("")))
        return events

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        if item.kind == MESSAGE:
            events = [_event("response.output_text.done", item, content_index=0, text=item.text, logprobs=[]),
                      _event("response.content_part.done", item, content_index=0, part=text_part(item.text))]
        else:
            events = [_event("response.function_call_arguments.done", item, name=item.name, arguments=item.text)]
        item.status = status
        return events + [{"type": "response.output_item.done", "output_index": item.index, "item": item.body()}]


def _is_whole(item: Item) -> bool:
    if item.kind == MESSAGE:
        return False
    try:
        json.loads(item.text)
    except ValueError:
        return False
    return True


def _event(kind: str, item: Item, **fields) -> dict:
    return {"type": kind, "item_id": item.id, "output_index": item.index, **fields}


@dataclass(frozen=True)
class Head:
    """What every form of one response shares: its id, creation time, model and echoed settings."""
    model: str
    settings: dict
    id: str = field(default_factory=lambda: new_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, output: Output | None = None, gen: Generation | None = None) -> dict:
        """In progress (no generation yet), or finished: completed, or incomplete when cut by length."""
        incomplete = gen is not None and is_cut(gen)
        status = IN_PROGRESS if gen is None else INCOMPLETE if incomplete else COMPLETED
        counts = usage([gen], 1) if gen is not None else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == COMPLETED else None, "model": self.model,
                "output": [item.body() for item in output.items] if output else [], "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": None if counts is None else {
                    "input_tokens": counts["prompt_tokens"],
                    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                    "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": counts["total_tokens"]},
                **self.settings}


def is_cut(gen: Generation) -> bool:
    return gen.finish_reason == "length"


def reader_of(req: OpenAIRequest):
    return req.tools.reader(req.tool_parser) if req.reads_tool_calls else None


def response(req: OpenAIRequest, gen: Generation, head: Head) -> dict:
    """The whole response object, once the generation has ended."""
    reader, output = reader_of(req), Output()
    output.feed(reader.feed(gen.generated_text) + reader.finish() if reader else [("content", gen.generated_text)])
    output.finish(is_cut(gen))
    return head.body(output, gen)


def stream(req: OpenAIRequest, gen: Generation, head: Head, deadline: float, is_gone) -> Iterator[bytes]:
    """SSE events as the tokens arrive. The first waits for the first token, so an error before it
    raises (the caller still owns the status line); after it, the stream ends with an `error` event."""
    numbers = itertools.count()

    def frame(event: dict) -> bytes:
        data = json.dumps(dict(event, sequence_number=next(numbers)), ensure_ascii=False)
        return f"event: {event['type']}\ndata: {data}\n\n".encode()

    def begin() -> Iterator[bytes]:
        yield frame({"type": "response.created", "response": head.body()})
        yield frame({"type": "response.in_progress", "response": head.body()})

    reader, output, started = reader_of(req), Output(), False
    try:
        for token in gen.tokens(deadline, is_gone):
            if not started:
                yield from begin()
            started = True
            yield from map(frame, output.feed(reader.feed(token["text"]) if reader else [("content", token["text"])]))
        if not started:  # (ended without a token)
            yield from begin()
        started = True
        yield from map(frame, output.feed(reader.finish() if reader else []) + output.finish(is_cut(gen)))
        final = head.body(output, gen)
        yield frame({"type": f"response.{final['status']}", "response": final})
    except HttpError as err:
        if not started:
            raise
        yield frame({"type": "error", "code": err.openai_code or OPENAI_TYPES.get(err.code, "server_error"),
                     "message": err.message, "param": err.param})
    except ClientGone:
        if not started:
            raise
    finally:
        gen.close()
