"""TGI-compatible routes: `POST /generate`, `POST /generate_stream` (SSE), `POST /` (TGI's compat
route, which the `text-generation` client calls: `"stream"` picks the stream, else the answer is a
one-element array), `GET /info`; with `option.tgi_compat=true`, `/invocations` answers as `POST /`.

The request is TGI's `{"inputs", "parameters"}`, which is the LMI schema, so it goes through the
same parser (TGI's `stop`, `details`, `top_n_tokens`, `truncate`, ... included; `best_of`,
`watermark`, `grammar` are 400s naming them; `decoder_input_details` fills `prefill`). Tokens are
TGI's `{"id", "text", "logprob", "special"}`. Rolling engines only, as streaming needs them.
"""

from __future__ import annotations

import json
import logging

from flask import Blueprint, Response, g

from handlers.errors import HttpError, bad_request
from handlers.formatters import SSE
from handlers.generation import ClientGone, Generation
from handlers.refusals import refuse_on_dynamic
from handlers.schemas import GenerationRequest, parse_body, parse_request
from handlers.models import current, models, pick
from handlers.service import Service, json_response, warn_ignored

log = logging.getLogger("handlers.tgi")

TGI_PATHS = ("/generate", "/generate_stream", "/", "/embed", "/rerank")  # errors there carry TGI's (and TEI's) error_type

routes = Blueprint("tgi", __name__)


def tgi_token(token: dict, special_ids: frozenset[int]) -> dict:
    return {"id": token["id"], "text": token["text"], "logprob": token["log_prob"],
            "special": token["id"] in special_ids}


def tgi_details(gen: Generation, tokens: list[dict] | None, special_ids: frozenset[int]) -> dict:
    details = {"finish_reason": gen.finish_reason, "generated_tokens": gen.num_generated_tokens,
               "seed": gen.req.sampling.seed}
    if tokens is not None:
        details["prefill"] = [{"id": t["id"], "text": t["text"], "logprob": t["log_prob"]}
                              for t in gen.prefill or []]
        details["tokens"] = [tgi_token(t, special_ids) for t in tokens]
        if any("top_tokens" in t for t in tokens):
            details["top_tokens"] = [[tgi_token(a, special_ids) for a in t.get("top_tokens", [])] for t in tokens]
    return details


def special_ids(service: Service) -> frozenset[int]:
    return service.tokenizer.special_ids if service.tokenizer is not None else frozenset()  # (custom handler: none)


@routes.get("/info")
def info():
    service = current()
    return json_response({"model_id": service.model_name, "model_sha": None,
                          "model_dtype": service.config.model.dtype, "model_device_type": "lmi-serve",
                          "max_input_tokens": service.max_model_len - 1, "max_total_tokens": service.max_model_len,
                          "max_best_of": 1, "max_stop_sequences": None,
                          "max_concurrent_requests": service.config.scheduler.job_queue_size,
                          "router": "lmi-serve", "version": "0.1.0"}, 200)


@routes.post("/generate")
@routes.post("/models/<model_name>/generate")
def generate(model_name: str | None = None):
    service, body = _model(model_name)
    return _generate(service, _request(service, stream=False, body=body))


@routes.post("/generate_stream")
@routes.post("/models/<model_name>/generate_stream")
def generate_stream(model_name: str | None = None):
    service, body = _model(model_name)
    return _generate_stream(service, _request(service, stream=True, body=body))


def _model(name: str | None) -> tuple[Service, object]:
    """The model: the path's, else the body's top-level "model" (ours: TGI serves one), else the one model."""
    body = parse_body(models().body(), "application/json")
    if name is None and isinstance(body, dict) and isinstance(body.get("model"), str):
        name = body.pop("model")
    return pick(name), body


@routes.post("/")
def compat():
    service = current()
    return compat_generate(service, parse_body(service.body(), "application/json"))


def compat_generate(service: Service, body) -> Response:
    """TGI's `POST /`: a stream when the body says `"stream": true`, else `[generate's body]`."""
    req = _request(service, stream=False, body=body)
    if req.stream:
        return _generate_stream(service, req)
    resp = _generate(service, req)
    if resp.status_code == 200:
        resp.set_data(b"[" + resp.get_data() + b"]")
    return resp


def _generate(service: Service, req: GenerationRequest) -> Response:
    (gen,) = _launch(service, req)

    def finish(tokens: list[list[dict]]) -> Response:
        text = gen.input_text + gen.generated_text if req.return_full_text else gen.generated_text
        body = {"generated_text": text}
        if req.details:
            body["details"] = tgi_details(gen, tokens[0], special_ids(service))
        return json_response(body, 200)

    return service.respond([gen], finish)


def _generate_stream(service: Service, req: GenerationRequest) -> Response:
    if req.decoder_input_details:  # as TGI: the prompt's details come with the whole answer only
        raise bad_request("\"parameters.decoder_input_details\" cannot be used with streaming",
                          "decoder_input_details")
    (gen,) = _launch(service, req)
    deadline, is_gone = service.watch()
    return service.respond_stream(_events(gen, special_ids(service), deadline, is_gone), SSE)


def _request(service: Service, stream: bool, body=None) -> GenerationRequest:
    refuse_on_dynamic(service.is_dynamic, "tgi_routes")
    if body is None:
        body = parse_body(service.body(), "application/json")
    req = parse_request(body, limits=service.limits,
                        default_max_new_tokens=service.config.server.default_max_new_tokens,
                        lora=service.config.model.enable_lora)
    if req.is_list:
        raise bad_request("\"inputs\" must be one string on the TGI routes", "inputs")
    warn_ignored(req)
    return req


def _launch(service: Service, req: GenerationRequest) -> list[Generation]:
    service.require_ready()
    return service.start(req, g.request_id)


def _events(gen: Generation, special: frozenset[int], deadline: float, is_gone):
    """TGI's SSE events; the last one carries generated_text and details (without tokens)."""
    started = False
    try:
        for token in gen.tokens(deadline, is_gone):
            event = {"index": gen.num_generated_tokens, "token": tgi_token(token, special),
                     "generated_text": None, "details": None}
            if token["last"]:
                event["generated_text"] = gen.generated_text
                event["details"] = tgi_details(gen, None, special)
            started = True
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
    except HttpError as err:
        if not started:
            raise
        yield f"data: {json.dumps({'error': err.message, 'error_type': 'generation'})}\n\n".encode()
    except ClientGone:
        if not started:
            raise
