"""OpenAI's Responses API (`POST /v1/responses`), stateless: the request is read as the chat request it
asks for (handlers/responses_schema.py), rendered and generated as `/v1/chat/completions` is, and its
reply formatted as a response object or its stream events (handlers/responses_format.py)."""

from __future__ import annotations

import logging

from flask import Blueprint, Response, g

from engines.config import TASK_GENERATION
from handlers.formatters import SSE
from handlers.refusals import refuse_wrong_task
from handlers.responses_format import Head, response, stream
from handlers.responses_schema import parse_responses
from handlers.routes.openai import model_body, render, start
from handlers.service import json_response

log = logging.getLogger("handlers.responses")

routes = Blueprint("responses", __name__)


@routes.post("/v1/responses")
def create_response() -> Response:
    body, service = model_body()
    refuse_wrong_task(service.task, TASK_GENERATION, "text generation")  # (before the chat template is asked for)
    req, settings = parse_responses(body, default_max_tokens=service.config.server.default_max_new_tokens,
                                    limits=service.limits, tool_parser=service.config.server.tool_call_parser)
    gens, adapter = start(service, req, render(service, req))
    (gen,) = gens  # one prompt, one choice
    head = Head(adapter or service.model_name, settings)
    if req.gen.stream:
        deadline, is_gone = service.watch()
        return service.respond_stream(stream(req, gen, head, deadline, is_gone), SSE)

    def finish(tokens: list[list[dict]]) -> Response:
        log.info("[%s] response: %d tokens, %s", g.log_id, gen.num_generated_tokens, gen.finish_reason)
        return json_response(response(req, gen, head), 200)

    return service.respond(gens, finish)
