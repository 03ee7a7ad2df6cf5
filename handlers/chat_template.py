"""Chat templates: the tokenizer's Jinja template rendered in the HTTP workers, without torch.

Rendered as transformers' `apply_chat_template` renders it: a sandboxed, immutable Jinja environment
(`trim_blocks`, `lstrip_blocks`, loop controls) with the helpers real templates call
(`raise_exception`, `strftime_now`, the `tojson` filter) and the tokenizer's special tokens as
variables. Where the template comes from, first match wins:
`option.chat_template` (a file path, or the template itself), `chat_template.jinja` beside the
tokenizer, `chat_template` in `tokenizer_config.json` (a string, or a list of named templates whose
"default" is used).
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from handlers.errors import bad_request

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """The template could not be found or compiled (a start-up error, not a request's)."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = "inline"):
        try:
            self._template = _environment().from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template ({origin}) does not compile: {exc}") from None
        self.special_tokens = special_tokens or {}
        self.origin = origin
        self.uses_tools = "tools" in source  # (TGI's tool_prompt adds the tools' JSON to templates without them)

    @classmethod
    def load(cls, model_dir: str, override: str | None = None) -> "ChatTemplate | None":
        """The model's template (or the override); None when there is none."""
        config = _tokenizer_config(model_dir)
        specials = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS if _token_text(config.get(name))}
        if override:
            if os.path.isfile(override):
                with open(override, encoding="utf-8") as f:
                    return cls(f.read(), specials, f"option.chat_template file {override}")
            if "{{" not in override and "{%" not in override:
                raise ChatTemplateError(f"option.chat_template={override!r} is neither a file nor a Jinja template")
            return cls(override, specials, "option.chat_template")
        path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return cls(f.read(), specials, path)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        return cls(source, specials, "tokenizer_config.json") if isinstance(source, str) and source else None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt text; a template that rejects the conversation (raise_exception) is a 400. `tools`:
        OpenAI's tool list, as transformers' apply_chat_template passes it."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **self.special_tokens)
        except TemplateError as exc:
            raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None


def _tokenizer_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(token) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
