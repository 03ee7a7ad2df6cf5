"""OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) → a GenerationRequest plus the
OpenAI-only options (n, logprobs, echo, usage in streams).

Field checks reuse the LMI schema's helpers, so a bad value is the same 400 naming the field. A field
we do not implement (tools, response_format, suffix, ...) or do not know is a 400 naming
it, unless its value is null (clients send null for "not used"); a silent 200 that ignored it would
answer a different question than was asked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import msgspec

from handlers.errors import bad_request
from handlers.structured import STRUCTURED_FIELDS
from handlers.tools import Tools, parse_tools
from handlers.schemas import (
    INT32_MAX, MAX_TOP_N_TOKENS, GenerationRequest, RequestLimits, _bool, _check_text, _int, _number, _stop_sequences,
    _type_name, sampling_params, slo_of, text_options,
)

COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
    "presence_penalty", "frequency_penalty", "user", "logit_bias",
    # vLLM's extra sampling parameters
    "ignore_eos", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "min_tokens",
    "include_stop_str_in_output", "skip_special_tokens", "bad_words", "priority"}) | STRUCTURED_FIELDS
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls", "tool_prompt"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions (vLLM's too)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the completions `logprobs` integer
WHERE = ""  # OpenAI fields live at the top level of the body


@dataclass(frozen=True)
class OpenAIRequest:
    gen: GenerationRequest  # chat: inputs are filled in once the template has rendered the messages
    n: int = 1  # choices per prompt
    best_of: int = 0  # completions: generated per prompt, the n of highest cumulative log-prob returned (0: n)
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    include_usage: bool = False
    model: str | None = None
    user: str | None = None
    messages: tuple[dict, ...] = ()
    prompt_ids: tuple[tuple[int, ...], ...] = ()  # completions sent as token ids
    tools: Tools | None = None  # chat: tools and tool_choice (handlers/tools.py)
    tool_parser: str | None = None  # option.tool_call_parser (tool_choice auto)

    @property
    def reads_tool_calls(self) -> bool:
        return self.tools is not None and self.tools.parses

    @property
    def num_choices(self) -> int:
        return self.n * max(len(self.gen.inputs), len(self.prompt_ids), 1)


def check_fields(body: dict, allowed: frozenset[str]) -> None:
    for name in sorted(body):
        if name not in allowed and body[name] is not None:
            raise bad_request(f"unsupported parameter \"{name}\": lmi-serve does not implement it "
                              "(see docs/api.md for what is supported)", name)


def parse_chat(body: dict, *, default_max_tokens: int, limits: RequestLimits,
               tool_parser: str | None = None) -> OpenAIRequest:
    check_fields(body, CHAT_FIELDS)
    messages = _messages(body.get("messages"), limits)
    tools = parse_tools(body, tool_parser)
    _bool(body, "parallel_tool_calls", True, where=WHERE)  # (several calls are read whenever the model writes them)
    max_tokens = _int(body, "max_completion_tokens", None, minimum=1, where=WHERE)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", default_max_tokens, minimum=1, where=WHERE)
    logprobs = _bool(body, "logprobs", False, where=WHERE)
    top = _int(body, "top_logprobs", 0, minimum=0, maximum=MAX_TOP_N_TOKENS, where=WHERE)
    if top and not logprobs:
        raise bad_request("\"top_logprobs\" needs \"logprobs\": true", "top_logprobs")
    gen = _generation(body, [], False, max_tokens, top)
    constraint = tools.grammar() if tools is not None else None
    if constraint is not None:  # tool_choice required or named: the reply is constrained to the calls
        if gen.sampling.grammar is not None:
            raise bad_request(f"\"tool_choice\": {json.dumps(body['tool_choice'])} constrains the reply to tool calls: "
                              "it cannot be combined with response_format or guided_*", "tool_choice")
        gen = replace(gen, sampling=msgspec.structs.replace(gen.sampling, grammar=constraint))
    if tools is not None and tools.choice == "auto" and tool_parser == "mistral":
        gen = replace(gen, skip_special_tokens=False)  # [TOOL_CALLS] is a special token
    return _options(body, gen, logprobs=logprobs, top_logprobs=top, messages=tuple(messages), tools=tools,
                    tool_parser=tool_parser)


def parse_completion(body: dict, *, limits: RequestLimits, vocab_size: int) -> OpenAIRequest:
    check_fields(body, COMPLETION_FIELDS)
    texts, ids = _prompts(body.get("prompt"), limits, vocab_size)
    logprobs = _int(body, "logprobs", None, minimum=0, maximum=MAX_COMPLETION_LOGPROBS, where=WHERE)
    echo = _bool(body, "echo", False, where=WHERE)
    max_tokens = _int(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, minimum=1, where=WHERE)
    # echo + logprobs: the echoed prompt's tokens come with their log-probs too
    gen = _generation(body, texts, True, max_tokens, logprobs or 0, prompt_logprobs=echo and logprobs is not None)
    req = _options(body, gen, logprobs=logprobs is not None, top_logprobs=logprobs or 0, echo=echo,
                   prompt_ids=tuple(tuple(p) for p in ids))
    best_of = _int(body, "best_of", None, minimum=1, maximum=128, where=WHERE)
    if best_of is not None and best_of < req.n:
        raise bad_request(f"\"best_of\" ({best_of}) must be at least \"n\" ({req.n})", "best_of")
    if best_of is not None and best_of > req.n and req.gen.stream:
        raise bad_request("\"best_of\" greater than \"n\" cannot stream: the best choices are known at the end",
                          "best_of")
    return replace(req, best_of=best_of) if best_of and best_of > req.n else req


def _generation(body: dict, inputs: list[str], is_list: bool, max_tokens: int, top_n: int,
                prompt_logprobs: bool = False) -> GenerationRequest:
    _number(body, "temperature", 1.0, minimum=0.0, maximum=2.0, where=WHERE)  # OpenAI's range
    sampling = sampling_params(  # OpenAI samples by default (temperature 1.0); temperature 0 is greedy
        body, do_sample=True, max_new_tokens=max_tokens, top_n_tokens=top_n, where=WHERE,
        ignore_eos=_bool(body, "ignore_eos", False, where=WHERE), prompt_logprobs=prompt_logprobs)
    return GenerationRequest(inputs=inputs, is_list=is_list, sampling=sampling,
                             stream=_bool(body, "stream", False, where=WHERE),
                             stop_sequences=_stop_sequences(body, "stop", where=WHERE),
                             slo=slo_of(body, where=WHERE, timeout=False), **text_options(body, where=WHERE))


def _options(body: dict, gen: GenerationRequest, **kwargs) -> OpenAIRequest:
    options = body.get("stream_options")
    if options is not None and not gen.stream:
        raise bad_request("\"stream_options\" is only allowed with \"stream\": true", "stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad_request("\"stream_options\" must be an object with only \"include_usage\"", "stream_options")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"\"user\" must be a string, not {_type_name(user)}", "user")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"\"model\" must be a string, not {_type_name(model)}", "model")
    return OpenAIRequest(gen=gen, n=_int(body, "n", 1, minimum=1, maximum=128, where=WHERE),
                         include_usage=_bool(options or {}, "include_usage", False, where="stream_options."),
                         model=model, user=user, **kwargs)


def _messages(value, limits: RequestLimits) -> list[dict]:
    """Each message with its content as text (text parts joined by newlines, as vLLM does)."""
    if not isinstance(value, list) or not value:
        raise bad_request("\"messages\" must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    if len(value) > limits.max_inputs:
        raise bad_request(f"\"messages\" holds {len(value)} messages: at most {limits.max_inputs} are allowed "
                          "(max_inputs_per_request)", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"\"{where}\" must be an object with a string \"role\"", "messages")
        content = _content(message.get("content"), where)
        _check_text(content, f"\"{where}.content\"", limits)
        message = dict(message, content=content)
        if message.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(message["tool_calls"], where)
        out.append(message)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, their arguments as objects (chat templates read them so,
    as transformers and vLLM hand them over); OpenAI sends the arguments as JSON text."""
    if not isinstance(calls, list):
        raise bad_request(f"\"{where}.tool_calls\" must be a list", "messages")
    out = []
    for i, call in enumerate(calls):
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad_request(f"\"{where}.tool_calls\"[{i}] must be {{\"type\": \"function\", \"function\": "
                              "{\"name\", \"arguments\"}}", "messages")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad_request(f"\"{where}.tool_calls\"[{i}].function.arguments is not valid JSON",
                                  "messages") from None
        out.append(dict(call, function=dict(f, arguments=args)))
    return out


def _content(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"\"{where}.content\" must be a string or a list of parts", "messages")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else _type_name(part)
            raise bad_request(f"\"{where}.content\" has a part of type {kind!r}: only text parts are supported "
                              "(the served models take text only)", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompts(value, limits: RequestLimits, vocab_size: int) -> tuple[list[str], list[list[int]]]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request("\"prompt\" must be a string, a list of strings or (lists of) token ids", "prompt")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = [value]
    if len(value) > limits.max_inputs:
        raise bad_request(f"\"prompt\" holds {len(value)} prompts: at most {limits.max_inputs} are allowed "
                          "(max_inputs_per_request)", "prompt")
    if all(isinstance(v, str) for v in value):
        for i, text in enumerate(value):
            _check_text(text, f"\"prompt\"[{i}]", limits)
        return list(value), []
    for i, ids in enumerate(value):
        if not isinstance(ids, list) or not ids or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < min(vocab_size, INT32_MAX) for t in ids):
            raise bad_request(f"\"prompt\"[{i}] must be a non-empty list of token ids in [0, {vocab_size})", "prompt")
    return [], [list(ids) for ids in value]


def with_inputs(req: OpenAIRequest, inputs: list[str]) -> OpenAIRequest:
    return replace(req, gen=replace(req.gen, inputs=inputs))
