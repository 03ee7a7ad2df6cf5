"""The OpenAI-compatible routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`,
and DJL's chat mode (`"messages"` on `/invocations`).

They run on the rolling engines (as DJL's chat needs rolling batch): a dynamic-batching server
answers both POST routes with a 400. Errors on `/v1/...` are OpenAI-shaped (see handlers/errors.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from flask import Blueprint, Response, g, request

from engines.config import TASK_GENERATION
from handlers.errors import HttpError, bad_request
from handlers.formatters import JSONLINES, SSE
from handlers.openai_formatters import CHAT, COMPLETION, response, stream
from handlers.openai_schemas import OpenAIRequest, parse_chat, parse_completion
from handlers.refusals import refuse_on_dynamic, refuse_wrong_task
from handlers.schemas import parse_body
from handlers.models import TARGET_MODEL_HEADER, current, invocation_model, models as served, pick
from handlers.service import Service, json_response

log = logging.getLogger("handlers.openai")
TGI_CLIENT_MODEL = "tgi"  # what TGI's client sends as the model, always (TGI ignores it): the base model here

routes = Blueprint("openai", __name__)


@routes.get("/v1/models")
def list_models():
    data = []
    for _, service in served().loaded():
        if service.handler is not None:
            continue
        name, created = service.model_name, int(service.started_at)
        data.append({"id": name, "object": "model", "created": created, "owned_by": "lmi-serve", "root": name})
        data += [{"id": a.name, "object": "model", "created": created, "owned_by": "lmi-serve", "root": a.src,
                  "parent": name} for a in service.adapter_infos(fresh=True)]  # LoRA adapters, as vLLM lists them
    return json_response({"object": "list", "data": data}, 200)


@routes.post("/v1/chat/completions")
def chat_completions():
    body, service = model_body()
    req = parse_chat(body, default_max_tokens=service.config.server.default_max_new_tokens,
                     limits=service.limits, tool_parser=service.config.server.tool_call_parser)
    return run(service, CHAT, req, render(service, req), sse=True)


@routes.post("/v1/completions")
def completions():
    body, service = model_body()
    req = parse_completion(body, limits=service.limits, vocab_size=service.tokenizer.vocab_size)
    prompts = [(list(ids), service.tokenizer.decode(list(ids))) for ids in req.prompt_ids] or \
              [(service.tokenizer.encode(text), text) for text in req.gen.inputs]
    return run(service, COMPLETION, req, prompts, sse=True)


def djl_chat(service: Service, body: dict) -> Response:
    """DJL's chat mode on /invocations: the OpenAI chat shapes (`json_chat`), streamed as jsonlines
    chunks (`jsonlines_chat`) rather than SSE; `model` is ignored as DJL ignores it."""
    refuse_on_dynamic(service.is_dynamic, "chat")
    body = {k: v for k, v in body.items() if k != "model"}
    req = parse_chat(body, default_max_tokens=service.config.server.default_max_new_tokens, limits=service.limits,
                     tool_parser=service.config.server.tool_call_parser)
    return run(service, CHAT, req, render(service, req), sse=False)


def best_choices(gens: list, tokens: list[list[dict]], best_of: int, n: int) -> tuple[list, list[list[dict]]]:
    """best_of generations per prompt → its n of highest cumulative log-prob (vLLM's ranking), best first."""
    def score(k: int) -> float:
        return sum(t["log_prob"] if t.get("log_prob") is not None else float("-inf") for t in tokens[k])

    keep = [k for start in range(0, len(gens), best_of)
            for k in sorted(range(start, start + best_of), key=lambda k: -score(k))[:n]]
    return [gens[k] for k in keep], [tokens[k] for k in keep]


def model_body() -> tuple[dict, Service]:
    """The body, and the model it names (`model`: one of the served models, else the one model, whose
    LoRA adapters it may name; with several models an unknown name is a 404 naming them)."""
    body = parse_body(served().body(), "application/json")
    name = body.get("model") if isinstance(body, dict) else None
    if name is None:  # (TEI's routes name none: DJL's model_name, SageMaker's target-model header)
        name = invocation_model()
    names = served().names
    if isinstance(name, str) and name in names:
        service = pick(name)
    elif len(names) > 1 and name != TGI_CLIENT_MODEL:
        shown = ", ".join(f"`{n}`" for n in names)
        if name is None:
            raise bad_request(f"this server serves several models ({shown}): name one in \"model\" (or the "
                              f"{TARGET_MODEL_HEADER} header)", "model")
        raise HttpError(404, f"The model `{name}` does not exist; this server serves {shown}", param="model",
                        openai_code="model_not_found")
    else:
        service = current()
    refuse_on_dynamic(service.is_dynamic, "openai_routes")
    return body, service


def render(service: Service, req: OpenAIRequest) -> list[tuple[list[int], str]]:
    """The conversation through the chat template, tokenized without added special tokens (the
    template writes them), as transformers' apply_chat_template and vLLM do."""
    refuse_wrong_task(service.task, TASK_GENERATION, "chat")  # (an embedding model has no template either)
    text = render_text(service, list(req.messages), req.tools)
    return [(service.tokenizer.encode(text, add_special_tokens=False), text)]


def render_text(service: Service, messages: list[dict], tools, add_generation_prompt: bool = True) -> str:
    """Messages (and the request's tools: handlers/tools.py) as the chat template writes them; the chat
    routes and /tokenize's chat form render through here."""
    if service.chat_template is None:
        raise bad_request("this model has no chat template (no chat_template in tokenizer_config.json, no "
                          "chat_template.jinja): set option.chat_template, or use /v1/completions", "messages")
    template_tools = None
    if tools is not None:
        messages = tools.with_prompt(messages, service.chat_template.uses_tools)
        template_tools = tools.template_tools()
    return service.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=template_tools)


def start(service: Service, req: OpenAIRequest, prompts: list[tuple[list[int], str]]) -> tuple[list, str | None]:
    """An OpenAI request's generations, launched, and the LoRA adapter its `model` names (None: the base)."""
    adapter = adapter_named(service, req.model)
    if req.user:
        log.info("[%s] user=%r", g.log_id, req.user)
    service.require_ready()
    gen = replace(req.gen, adapters=(adapter,) * len(prompts)) if adapter else req.gen
    return service.launch(gen, prompts, g.request_id, copies=req.best_of or req.n), adapter


def run(service: Service, kind: str, req: OpenAIRequest, prompts: list[tuple[list[int], str]], sse: bool) -> Response:
    gens, adapter = start(service, req, prompts)
    decode, model = service.tokenizer.decode, adapter or service.model_name
    if req.gen.stream:
        deadline, is_gone = service.watch()
        lines = stream(kind, req, gens, model, decode, deadline, is_gone, sse=sse)
        return service.respond_stream(lines, SSE if sse else JSONLINES)

    def finish(tokens: list[list[dict]]) -> Response:
        log.info("[%s] %s: %d choice(s), %s tokens%s", g.log_id, kind, len(gens),
                 [gen.num_generated_tokens for gen in gens], f", LoRA adapter {adapter}" if adapter else "")
        chosen, chosen_tokens = best_choices(gens, tokens, req.best_of, req.n) if req.best_of else (gens, tokens)
        return json_response(response(kind, req, chosen, chosen_tokens, model, decode), 200)

    return service.respond(gens, finish)


def adapter_named(service: Service, model: str | None) -> str | None:
    """`model` naming a LoRA adapter (vLLM's convention) → its name; the base model (or, off the /v1
    routes, a name the server does not know) → None; on /v1 an unknown name is a 404."""
    if model is None or model == service.model_name:
        return None
    names = [a.name for a in service.adapter_infos()]
    if model not in names and service.config.model.enable_lora:
        names = [a.name for a in service.adapter_infos(fresh=True)]  # registered a moment ago?
    if model in names:
        return model
    if request.path.startswith("/v1/") and model != TGI_CLIENT_MODEL:
        served = ", ".join(f"`{n}`" for n in [service.model_name] + names)
        raise HttpError(404, f"The model `{model}` does not exist; this server serves {served}",
                        param="model", openai_code="model_not_found")
    return None
