"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, and the model's reply read as tool calls.

- The tools go to the chat template as transformers passes them (`tools=[{"type": "function",
  "function": {...}}, ...]`); with tool_choice "none" they are left out, and the reply is content.
- tool_choice "required": the reply is constrained (a grammar) to a JSON array of
  `{"name": <a tool's name>, "parameters": <its parameters' schema>}`, at least one; a named function:
  to that function's parameters (vLLM's forms). Read as JSON whatever the parser.
- tool_choice "auto": the model writes what it wants, read by `option.tool_call_parser`:
  `llama3_json` (a reply that is one JSON object, or several joined by ";", with "name" and
  "parameters" or "arguments", optionally after `<|python_tag|>`), `hermes` (`<tool_call>{...}</tool_call>`
  blocks, text around them is content), `mistral` (`[TOOL_CALLS]` then a JSON list of calls).
  A reply that does not parse as calls is content.

Every reader is incremental (`feed` text as it streams, then `finish`), giving events: ("content",
text), ("call", index, id, name) when a call starts, ("args", index, text) for its arguments. A
stream sends them as OpenAI's deltas (tool_calls[index] with id and name first, then argument
pieces), which the OpenAI SDK accumulates; a whole reply is the same events gathered.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from handlers.errors import bad_request
from handlers.structured import json_schema_grammar

PARSERS = ("llama3_json", "hermes", "mistral")
MAX_TOOLS = 128


@dataclass(frozen=True)
class Tools:
    tools: tuple[dict, ...]  # OpenAI's form, validated
    choice: str  # auto | none | required | named
    name: str | None = None  # the named function
    prompt: str | None = None  # TGI's tool_prompt

    def with_prompt(self, messages: list[dict], template_uses_tools: bool) -> list[dict]:
        """TGI's tool_prompt: appended to the last message after "\n---\n", with the tools' JSON when the
        chat template does not show them itself (TGI's way of telling a model without a tools template)."""
        if self.prompt is None or self.choice == "none" or not messages:
            return messages
        extra = "\n---\n" + self.prompt
        if not template_uses_tools:
            extra += "\n" + json.dumps([t["function"] for t in self.tools], ensure_ascii=False)
        return messages[:-1] + [dict(messages[-1], content=(messages[-1].get("content") or "") + extra)]

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def template_tools(self) -> list[dict] | None:
        return [dict(t) for t in self.tools] if self.choice != "none" else None

    def function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    def grammar(self) -> str | None:
        """The constraint of required / named (None for auto and none)."""
        if self.choice == "named":
            return json_schema_grammar(self.function(self.name).get("parameters") or {"type": "object"})
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                        "parameters": t["function"].get("parameters")
                                                        or {"type": "object"}},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            return json_schema_grammar({"type": "array", "minItems": 1, "items": {"anyOf": calls}})
        return None

    def reader(self, parser: str | None):
        if self.choice == "named":
            return NamedReader(self.name)
        if self.choice == "required":
            return ArrayReader()
        return {"llama3_json": Llama3JsonReader, "hermes": HermesReader, "mistral": MistralReader}[parser]()


def parse_tools(body: dict, parser: str | None) -> Tools | None:
    """`tools` / `tool_choice` of a chat body (None: no tools); 400s name the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("\"tool_choice\" needs \"tools\"", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise bad_request(f"\"tools\" must be a list of 1 to {MAX_TOOLS} tools", "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) or \
                not isinstance(f.get("name"), str) or not f["name"]:
            raise bad_request(f"\"tools\"[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                              "\"description\", \"parameters\"}}}}", "tools")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise bad_request(f"\"tools\"[{i}].function.parameters must be a JSON schema (an object)", "tools")
        names.append(f["name"])
    if len(set(names)) != len(names):
        raise bad_request("\"tools\" names a function twice", "tools")
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, str) and choice not in ("none", "auto", "required"):  # TGI's: a function's name
        choice = {"type": "function", "function": {"name": choice}}
    if isinstance(choice, dict):
        f = choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):  # (TGI omits the type)
            raise bad_request("\"tool_choice\" must be none, auto, required or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}", "tool_choice")
        if name not in names:
            raise bad_request(f"\"tool_choice\" names function {name!r}, which is not in \"tools\" "
                              f"({', '.join(names)})", "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"\"tool_choice\" must be none, auto, required or a named function, not {json.dumps(choice)}",
                          "tool_choice")
    prompt = body.get("tool_prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise bad_request("\"tool_prompt\" must be a string", "tool_prompt")
    if choice == "auto" and parser is None:
        raise bad_request("\"tool_choice\": \"auto\" needs the server's option.tool_call_parser (llama3_json, hermes "
                          "or mistral) to read calls from the model's reply; \"required\" and a named function work "
                          "without it", "tool_choice")
    return Tools(tuple(tools), choice, name, prompt or None)


def new_call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex


def _call_events(index: int, name: str, arguments) -> list[tuple]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return [("call", index, new_call_id(), name), ("args", index, args)]


def _as_call(obj) -> tuple[str, object] | None:
    """{"name", "parameters" | "arguments"} → (name, arguments); None if it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(args, str):  # (some models write the arguments as a JSON string)
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


class NamedReader:
    """A named function: the whole reply is its arguments (streamed as they come)."""

    def __init__(self, name: str):
        self.name, self.started = name, False

    def feed(self, text: str) -> list[tuple]:
        events = [] if self.started else [("call", 0, new_call_id(), self.name)]
        self.started = True
        return events + ([("args", 0, text)] if text else [])

    def finish(self) -> list[tuple]:
        return [] if self.started else self.feed("")


class ArrayReader:
    """tool_choice required: a JSON array of calls; each call is sent when its object is complete."""

    def __init__(self):
        self.text, self.pos, self.count = "", None, 0

    def feed(self, text: str) -> list[tuple]:
        self.text += text
        events = []
        if self.pos is None:
            start = self.text.find("[")
            if start < 0:
                return []
            self.pos = start + 1
        decoder = json.JSONDecoder()
        while True:
            i = self.pos
            while i < len(self.text) and self.text[i] in " \t\r\n,":
                i += 1
            if i >= len(self.text) or self.text[i] != "{":
                return events
            try:
                obj, end = decoder.raw_decode(self.text, i)
            except ValueError:
                return events  # not complete yet
            call = _as_call(obj)
            if call is not None:
                events += _call_events(self.count, *call)
                self.count += 1
            self.pos = end

    def finish(self) -> list[tuple]:
        return []


class HermesReader:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen 2.5 / 3); text around
    them is content, and text that may be the start of a block is held back."""

    marker, end = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.pending = ""  # content held back (it may start the marker)
        self.inside = False
        self.body = ""  # after the marker
        self.count = 0

    def _content(self, text: str) -> tuple[list[tuple], str | None]:
        """→ (content events, the text after the marker, or None if no marker yet)."""
        text = self.pending + text
        at = text.find(self.marker)
        if at >= 0:
            self.pending = ""
            return ([("content", text[:at])] if text[:at] else []), text[at + len(self.marker):]
        keep = next((n for n in range(min(len(self.marker) - 1, len(text)), 0, -1)
                     if self.marker.startswith(text[-n:])), 0)
        self.pending = text[len(text) - keep:]
        out = text[:len(text) - keep]
        return ([("content", out)] if out else []), None

    def feed(self, text: str) -> list[tuple]:
        events = []
        while True:
            if not self.inside:
                content, rest = self._content(text)
                events += content
                if rest is None:
                    return events
                self.inside, text = True, rest
            self.body += text
            at = self.body.find(self.end)
            if at < 0:
                return events
            block, text = self.body[:at], self.body[at + len(self.end):]
            self.body, self.inside = "", False
            events += self._block(block)

    def _block(self, block: str) -> list[tuple]:
        try:
            call = _as_call(json.loads(block))
        except ValueError:
            call = None
        if call is None:
            return [("content", self.marker + block + self.end)]
        events = _call_events(self.count, *call)
        self.count += 1
        return events

    def finish(self) -> list[tuple]:
        if self.inside:  # a block never closed (max_tokens): as content
            return [("content", self.marker + self.body)]
        return [("content", self.pending)] if self.pending else []


class _WholeReplyReader:
    """Replies that are calls only when they start a certain way: held back from then to the end."""

    def __init__(self):
        self.held: str | None = None  # the reply, once it looks like calls
        self.lead = ""  # the start, until it decides
        self.content = False  # decided: content

    def starts_calls(self, text: str) -> bool | None:
        """True / False once the reply's start decides; None while it cannot yet."""
        raise NotImplementedError

    def feed(self, text: str) -> list[tuple]:
        if self.held is not None:
            self.held += text
            return []
        if self.content:
            return [("content", text)] if text else []
        self.lead += text
        decided = self.starts_calls(self.lead.lstrip())
        if decided is None:
            return []
        if decided:
            self.held, self.lead = self.lead, ""
            return []
        self.content, out, self.lead = True, self.lead, ""
        return [("content", out)]

    def finish(self) -> list[tuple]:
        if self.held is None:
            return [("content", self.lead)] if self.lead else []
        calls = self.calls(self.held.strip())
        if calls is None:
            return [("content", self.held)]
        return [e for i, c in enumerate(calls) for e in _call_events(i, *c)]

    def calls(self, text: str) -> list[tuple[str, object]] | None:
        raise NotImplementedError


class Llama3JsonReader(_WholeReplyReader):
    """Llama 3.x's JSON tool calls: `{"name": ..., "parameters": {...}}` (several joined by "; ")."""

    TAG = "<|python_tag|>"

    def starts_calls(self, text: str) -> bool | None:
        if not text:
            return None
        if text[0] == "{":
            return True
        if self.TAG.startswith(text[:len(self.TAG)]):
            return True if text.startswith(self.TAG) else None
        return False

    def calls(self, text: str) -> list[tuple[str, object]] | None:
        text = text.removeprefix(self.TAG).strip()
        decoder, out, i = json.JSONDecoder(), [], 0
        while i < len(text):
            try:
                obj, i = decoder.raw_decode(text, i)
            except ValueError:
                return None
            call = _as_call(obj)
            if call is None:
                return None
            out.append(call)
            while i < len(text) and text[i] in " \t\r\n;":
                i += 1
        return out or None


class MistralReader(_WholeReplyReader):
    """Mistral's `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the marker a special token:
    this parser keeps special tokens in the text)."""

    MARKER = "[TOOL_CALLS]"

    def starts_calls(self, text: str) -> bool | None:
        if len(text) < len(self.MARKER):
            return None if self.MARKER.startswith(text) else False
        return text.startswith(self.MARKER)

    def calls(self, text: str) -> list[tuple[str, object]] | None:
        try:
            value = json.loads(text.removeprefix(self.MARKER).strip())
        except ValueError:
            return None
        calls = [_as_call(v) for v in (value if isinstance(value, list) else [value])]
        return calls if calls and all(c is not None for c in calls) else None


def gather(events: list[tuple]) -> tuple[str | None, list[dict]]:
    """Events of a whole reply → (content or None, OpenAI tool_calls)."""
    content, calls = "", {}
    for e in events:
        if e[0] == "content":
            content += e[1]
        elif e[0] == "call":
            calls[e[1]] = {"id": e[2], "type": "function", "function": {"name": e[3], "arguments": ""}}
        else:
            calls[e[1]]["function"]["arguments"] += e[2]
    return (content if content or not calls else None), [calls[k] for k in sorted(calls)]


def delta(events: list[tuple]) -> dict:
    """Events of one streamed piece → an OpenAI chunk's delta (content and/or tool_calls)."""
    out: dict = {}
    calls: dict[int, dict] = {}
    for e in events:
        if e[0] == "content":
            out["content"] = out.get("content", "") + e[1]
        elif e[0] == "call":
            calls[e[1]] = {"index": e[1], "id": e[2], "type": "function", "function": {"name": e[3], "arguments": ""}}
        else:
            entry = calls.setdefault(e[1], {"index": e[1], "function": {"arguments": ""}})
            entry["function"]["arguments"] += e[2]
    if calls:
        out["tool_calls"] = [calls[k] for k in sorted(calls)]
    return out
