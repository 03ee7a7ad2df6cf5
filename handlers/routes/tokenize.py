"""The tokenizer routes: vLLM's `/tokenize` and `/detokenize`, TGI's `/tokenize`.

    POST /tokenize    {"prompt"} or {"messages"} (vLLM)  → {"count", "max_model_len", "tokens", "token_strs"}
                      {"inputs"} (TGI)                    → [{"id", "text", "start", "stop"}, ...]
    POST /detokenize  {"tokens"} (vLLM)                   → {"prompt"}

The body tells the two /tokenize forms apart. They need only the model's tokenizer (and chat
template), so they answer for every task and engine, while the engine loads too. A chat body is
rendered as /v1/chat/completions renders it (the same message checks, tools and template), so its
ids are the prompt the chat route sends to the engine.
"""

from __future__ import annotations

import json

from flask import Blueprint

from handlers.errors import HttpError, bad_request
from handlers.models import current, models as served, pick
from handlers.openai_schemas import WHERE, _messages, check_fields
from handlers.routes.openai import TGI_CLIENT_MODEL, render_text
from handlers.schemas import _bool, _check_text, _int, _type_name, parse_body
from handlers.service import Service, json_response
from handlers.tools import parse_tools

routes = Blueprint("tokenize", __name__)

COMPLETION_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                         "return_token_strs", "chat_template", "chat_template_kwargs", "tools", "tool_choice",
                         "tool_prompt"})
TGI_FIELDS = frozenset({"model", "inputs", "parameters", "add_special_tokens", "stream"})  # TGI's GenerateRequest
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
FORMS = ("prompt", "messages", "inputs")  # the field that picks the /tokenize form
MAX_NAMED_IDS = 8  # unknown token ids a 400 lists
# tools are only rendered here, no reply is read for calls: the parser parse_tools asks for with
# tool_choice auto is not needed (any name passes its check)
NO_CALLS_READ = "tokenize"


@routes.post("/tokenize")
def tokenize():
    body, service = _body()
    forms = [name for name in FORMS if body.get(name) is not None]
    if not forms:
        raise bad_request("/tokenize needs \"prompt\" (text) or \"messages\" (a chat), as vLLM's, or \"inputs\" "
                          "(text), as TGI's", "prompt")
    if len(forms) > 1:
        shown = " and ".join(f"\"{name}\"" for name in forms)
        raise bad_request(f"the body has {shown}: send one of \"prompt\", \"messages\" (vLLM) or \"inputs\" (TGI)",
                          forms[1])
    if forms[0] == "inputs":
        return json_response(tgi_tokens(service, body))
    return json_response(vllm_tokens(service, body, chat=forms[0] == "messages"))


@routes.post("/detokenize")
def detokenize():
    body, service = _body()
    check_fields(body, DETOKENIZE_FIELDS)
    ids = token_ids(body.get("tokens"))
    unknown = [i for i in ids if i >= service.tokenizer.vocab_size or service.tokenizer.backend.id_to_token(i) is None]
    if unknown:
        named = ", ".join(map(str, unknown[:MAX_NAMED_IDS])) + (", ..." if len(unknown) > MAX_NAMED_IDS else "")
        raise bad_request(f"\"tokens\" holds ids that are not in this model's vocabulary (0 .. "
                          f"{service.tokenizer.vocab_size - 1}): {named}", "tokens")
    # vLLM decodes as the tokenizer does by default: special tokens kept
    return json_response({"prompt": service.tokenizer.decode(ids, skip_special_tokens=False)})


def vllm_tokens(service: Service, body: dict, chat: bool) -> dict:
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    with_strs = _bool(body, "return_token_strs", False, where=WHERE)
    if chat:
        ids = chat_ids(service, body)
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request(f"\"prompt\" must be a string, not {_type_name(prompt)}", "prompt")
        _check_text(prompt, "\"prompt\"", service.limits)
        ids = service.tokenizer.encode(prompt, add_special_tokens=_bool(body, "add_special_tokens", True, where=WHERE))
    strs = [service.tokenizer.backend.id_to_token(i) for i in ids] if with_strs else None
    return {"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids, "token_strs": strs}


def chat_ids(service: Service, body: dict) -> list[int]:
    """The conversation through the chat template as the chat route renders it (handlers/routes/openai.py
    render), with vLLM's add_generation_prompt and continue_final_message; no special tokens added by
    default (the template writes them)."""
    if body.get("chat_template") is not None:  # vLLM refuses them too, unless --trust-request-chat-template
        raise bad_request("\"chat_template\": a request cannot bring its own template; set option.chat_template",
                          "chat_template")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request(f"\"chat_template_kwargs\" must be an object, not {_type_name(kwargs)}",
                          "chat_template_kwargs")
    if kwargs:
        raise bad_request(f"\"chat_template_kwargs\" ({', '.join(sorted(kwargs))}): /v1/chat/completions renders "
                          "the template without extra variables, and so does /tokenize", "chat_template_kwargs")
    messages = _messages(body.get("messages"), service.limits)
    final = _bool(body, "continue_final_message", False, where=WHERE)
    generation = _bool(body, "add_generation_prompt", not final, where=WHERE)
    if final and generation:
        raise bad_request("\"continue_final_message\" and \"add_generation_prompt\" cannot both be true",
                          "continue_final_message")
    text = render_text(service, messages, parse_tools(body, NO_CALLS_READ), add_generation_prompt=generation)
    if final:
        text = open_final_message(text, messages[-1]["content"])
    return service.tokenizer.encode(text, add_special_tokens=_bool(body, "add_special_tokens", False, where=WHERE))


def open_final_message(text: str, final: str) -> str:
    """The rendered conversation cut right after the final message's text, so the model continues it
    (no end-of-turn after it), as transformers' and vLLM's continue_final_message cut it: at the last
    occurrence of the stripped text, keeping the message's trailing whitespace where the template did."""
    stripped = final.strip()
    at = text.rfind(stripped)
    if at < 0:
        raise bad_request("\"continue_final_message\": the final message's text does not appear in the rendered "
                          "conversation (the chat template rewrites it)", "continue_final_message")
    kept = final.lstrip()
    if text[at:at + len(kept)] == final:
        return text[:at + len(kept)]
    return text[:at + len(stripped)]


def tgi_tokens(service: Service, body: dict) -> list[dict]:
    """TGI's: each token with its text, the slice [start, stop) of the characters of "inputs" (an added
    special token: "" at 0, 0); parameters.truncate keeps the last `truncate` tokens, as generation does."""
    unknown = sorted(name for name in body if name not in TGI_FIELDS and body[name] is not None)
    if unknown:
        raise bad_request(f"unsupported field \"{unknown[0]}\" on TGI's /tokenize: it takes \"inputs\", "
                          "\"parameters\" and \"add_special_tokens\"", unknown[0])
    text, params = body["inputs"], body.get("parameters")
    if not isinstance(text, str):
        raise bad_request(f"\"inputs\" must be one string, not {_type_name(text)}", "inputs")
    if not text:
        raise bad_request("\"inputs\" cannot be empty", "inputs")
    _check_text(text, "\"inputs\"", service.limits)
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"\"parameters\" must be an object, not {_type_name(params)}", "parameters")
    truncate = _int(params or {}, "truncate", None, minimum=1)
    ids, offsets = service.tokenizer.encode_with_offsets(text, _bool(body, "add_special_tokens", True, where=WHERE))
    if truncate is not None:
        ids, offsets = ids[-truncate:], offsets[-truncate:]
    return [{"id": i, "text": text[start:stop], "start": start, "stop": stop} for i, (start, stop) in zip(ids, offsets)]


def token_ids(value) -> list[int]:
    """vLLM's "tokens": a list of non-negative integer ids; a 400 names the first that is not (whether
    each is in the vocabulary is /detokenize's to check, naming them all)."""
    if not isinstance(value, list):
        raise bad_request(f"\"tokens\" must be a list of token ids, not {_type_name(value)}", "tokens")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise bad_request(f"\"tokens\"[{i}] must be a non-negative integer token id, not {json.dumps(t)}",
                              "tokens")
    return value


def _body() -> tuple[dict, Service]:
    """The body and the model it names, picked as the OpenAI routes pick it: a served model's name; with
    one model also its name, a LoRA adapter's or none; an unknown name is a 404 naming the served ones."""
    body = parse_body(served().body(), "application/json")
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"\"model\" must be a string, not {_type_name(name)}", "model")
    names = served().names
    if name in names:
        return body, pick(name)
    if name is not None and len(names) > 1:
        raise _unknown_model(name, names)
    service = current()
    if name not in (None, service.model_name, TGI_CLIENT_MODEL) and \
            name not in [a.name for a in service.adapter_infos(fresh=True)]:  # (adapters share the tokenizer)
        raise _unknown_model(name, [service.model_name])
    return body, service


def _unknown_model(name: str, names: list[str]) -> HttpError:
    shown = ", ".join(f"`{n}`" for n in names)
    return HttpError(404, f"The model `{name}` does not exist; this server serves {shown}", param="model",
                     openai_code="model_not_found")
