"""A Responses request (`POST /v1/responses`) → the chat request `parse_chat` reads, plus the settings
the response echoes. One generation path: what chat checks (sampling, tools, structured output) is
checked there, and a 400 from there is renamed to the Responses field it came from.

    input: a string                           → [{"role": "user", "content": it}]
    input: message items                      → messages (developer → system; text parts only)
    input: function_call items                → an assistant message's tool_calls (consecutive calls merged)
    input: function_call_output items         → {"role": "tool", "tool_call_id", "content"}
    instructions                              → a system message first
    tools: {"type": "function", "name", ...}  → {"type": "function", "function": {"name", ...}}
    tool_choice: {"type": "function", "name"} → {"type": "function", "function": {"name"}}
    text.format                               → response_format
    max_output_tokens                         → max_completion_tokens

Stateless: nothing is stored, so `previous_response_id`, `conversation` and `store: true` are 400s
naming the field, as are the fields of features we do not implement (`background: true`, `include`,
`truncation: "auto"`) and built-in tools. Any other field is a 400 naming it unless null, as on chat.
"""

from __future__ import annotations

import json

from handlers.errors import HttpError, bad_request
from handlers.openai_schemas import OpenAIRequest, check_fields, parse_chat
from handlers.schemas import RequestLimits, _int, _type_name

PASSED = frozenset({"model", "temperature", "top_p", "stream", "user", "parallel_tool_calls"})  # chat's, as they are
# vLLM's extra sampling parameters, which its Responses route takes too: passed to chat as they are
EXTRA = frozenset({"seed", "top_k", "min_p", "repetition_penalty", "stop", "ignore_eos"})
STATELESS = "lmi-serve keeps no responses: send the whole conversation in \"input\""
# field → (the values that ask for what we do anyway, why any other value is a 400)
REFUSED = {
    "previous_response_id": ((), STATELESS),
    "conversation": ((), STATELESS),
    "store": ((False,), STATELESS + " (send \"store\": false, or leave it out)"),
    "background": ((False,), "background responses are not served (they are stored, to be polled)"),
    "include": (([],), "no extra output (log-probs, reasoning, search results) is served"),
    "truncation": (("disabled",), "an input longer than the model allows is a 400, not truncated"),
}
FIELDS = PASSED | EXTRA | set(REFUSED) | {"input", "instructions", "tools", "tool_choice", "text",
                                         "max_output_tokens", "metadata"}
FUNCTION_KEYS = {"name": str, "description": str, "parameters": dict, "strict": bool}  # (name required)
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}  # → chat's
TEXT_PARTS = ("input_text", "output_text")
MAX_METADATA = (16, 64, 512)  # OpenAI's: keys, characters per key, characters per value
CHAT_NAMES = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


def parse_responses(body: dict, *, default_max_tokens: int, limits: RequestLimits,
                    tool_parser: str | None) -> tuple[OpenAIRequest, dict]:
    """(the chat request, the settings the response echoes); a 400 names the Responses field."""
    chat = to_chat(body)
    try:
        req = parse_chat(chat, default_max_tokens=default_max_tokens, limits=limits, tool_parser=tool_parser)
    except HttpError as err:
        if err.param in CHAT_NAMES:
            err.message = err.message.replace(f"\"{err.param}", f"\"{CHAT_NAMES[err.param]}")
            err.param = CHAT_NAMES[err.param]
        raise
    return req, echoed(body)


def to_chat(body: dict) -> dict:
    check_fields(body, FIELDS)
    for name, (allowed, why) in REFUSED.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in allowed):
            raise bad_request(f"\"{name}\": {json.dumps(value)} is not supported: {why}", name)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request(f"\"instructions\" must be a string, not {_type_name(instructions)}", "instructions")
    chat = {name: body[name] for name in sorted(PASSED | EXTRA) if body.get(name) is not None}
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + \
        _messages(body.get("input"))
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"))
    if tools:
        chat["tools"] = tools
    if choice is not None and (tools or choice == "required" or isinstance(choice, dict)):
        chat["tool_choice"] = choice  # (auto and none without tools ask for nothing: OpenAI takes them)
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    max_tokens = _int(body, "max_output_tokens", None, minimum=1, where="")
    if max_tokens is not None:
        chat["max_completion_tokens"] = max_tokens
    _check_metadata(body.get("metadata"))
    return chat


def echoed(body: dict) -> dict:
    """The request's settings as a response object carries them (OpenAI's defaults where absent)."""
    text = body.get("text") or {}
    return {"instructions": body.get("instructions"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "temperature": _or(body.get("temperature"), 1.0), "top_p": _or(body.get("top_p"), 1.0),
            "max_output_tokens": body.get("max_output_tokens"),
            "text": {"format": text.get("format") or {"type": "text"}},
            "parallel_tool_calls": _or(body.get("parallel_tool_calls"), True),
            "metadata": body.get("metadata") or {}, "user": body.get("user"), "store": False,
            "previous_response_id": None, "background": False, "truncation": "disabled", "reasoning": None}


def _or(value, default):
    return default if value is None else value


def _messages(value) -> list[dict]:
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("\"input\" must be a non-empty string or a non-empty list of items (messages, "
                          "function_call, function_call_output)", "input")
    messages, calls = [], set()
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text and its calls
                last["tool_calls"] = last.get("tool_calls", []) + [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_call_output(item, where, calls))
        elif not isinstance(item, dict):
            raise bad_request(f"\"{where}\" must be an object (a message or a function_call(_output) item), "
                              f"not {_type_name(item)}", "input")
        else:
            raise bad_request(f"\"{where}.type\" {json.dumps(kind)} is not supported: items are messages, "
                              "function_call and function_call_output (lmi-serve keeps no responses to reference, "
                              "and runs no built-in tools)", "input")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"\"{where}.role\" must be one of {', '.join(ROLES)}, not {json.dumps(role)}", "input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": ROLES[role], "content": content}
    if not isinstance(content, list):
        raise bad_request(f"\"{where}.content\" must be a string or a list of input_text parts", "input")
    return {"role": ROLES[role], "content": _text_parts(content, f"{where}.content")}


def _text_parts(parts: list, where: str) -> list[dict]:
    """Responses' text parts → chat's (joined by newlines there); anything else is a 400."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else _type_name(part)
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"\"{where}[{j}]\" is of type {json.dumps(kind)}: only input_text and output_text "
                              "parts with a string \"text\" are supported (the served models take text only)", "input")
        out.append({"type": "text", "text": part["text"]})
    return out


def _function_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise bad_request(f"\"{where}.{key}\" must be a{' non-empty' if key != 'arguments' else ''} string",
                              "input")
    try:
        json.loads(item["arguments"] or "{}")
    except ValueError:
        raise bad_request(f"\"{where}.arguments\" is not valid JSON", "input") from None
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                    "arguments": item["arguments"]}}


def _call_output(item: dict, where: str, calls: set[str]) -> dict:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or call_id not in calls:
        raise bad_request(f"\"{where}.call_id\" {json.dumps(call_id)} answers no function_call item before it",
                          "input")
    if isinstance(output, list):
        output = _text_parts(output, f"{where}.output")
    elif not isinstance(output, str):
        raise bad_request(f"\"{where}.output\" must be a string or a list of input_text parts", "input")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _tools(value) -> list[dict]:
    """Responses' flat function tools → chat's nested ones; built-in tools are a 400 naming their type."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(f"\"tools\" must be a list of function tools, not {_type_name(value)}", "tools")
    out = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else _type_name(tool)
        if kind != "function":
            raise bad_request(f"\"tools[{i}]\" is of type {json.dumps(kind)}: only function tools are supported "
                              "(built-in tools such as web_search and file_search run on OpenAI's servers)", "tools")
        for key, cls in FUNCTION_KEYS.items():
            value = tool.get(key)
            if (value is not None or key == "name") and (not isinstance(value, cls) or value == "" and key == "name"):
                raise bad_request(f"\"tools[{i}].{key}\" must be {_type_name(cls())}"
                                  f"{' (not empty)' if key == 'name' else ''}", "tools")
        out.append({"type": "function", "function": {key: tool[key] for key in FUNCTION_KEYS
                                                      if tool.get(key) is not None}})
    return out


def _tool_choice(value):
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad_request(f"\"tool_choice\" must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                      f"\"name\": ...}}, not {json.dumps(value)} (built-in tools are not supported)", "tool_choice")


def _response_format(text) -> dict | None:
    """text.format → chat's response_format (None: free text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request(f"\"text\" must be an object with a \"format\", not {_type_name(text)}", "text")
    for key in sorted(text):
        if key != "format" and text[key] is not None:
            raise bad_request(f"unsupported parameter \"text.{key}\": lmi-serve does not implement it", f"text.{key}")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request(f"\"text.format\" must be {{\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}}, "
                          f"not {json.dumps(fmt)}", "text.format")
    if not isinstance(fmt.get("name"), str) or not fmt["name"] or not isinstance(fmt.get("schema"), dict):
        raise bad_request("\"text.format\" of type json_schema needs a \"name\" (a string) and a \"schema\" "
                          "(an object)", "text.format")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise bad_request("\"text.format.strict\" must be true or false", "text.format")
    spec = {key: fmt[key] for key in ("name", "description", "schema", "strict") if fmt.get(key) is not None}
    return {"type": "json_schema", "json_schema": spec}


def _check_metadata(value) -> None:
    keys, key_chars, value_chars = MAX_METADATA
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > keys or not all(
            isinstance(v, str) and len(k) <= key_chars and len(v) <= value_chars for k, v in value.items()):
        raise bad_request(f"\"metadata\" must be an object of at most {keys} string values (keys up to {key_chars} "
                          f"characters, values up to {value_chars})", "metadata")
