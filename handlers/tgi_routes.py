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
from typing import Callable

from flask import Flask, Response, g, request

from handlers.errors import HttpError, bad_request
from handlers.formatters import SSE, collect
from handlers.generation import ClientGone, Generation, client_gone
from handlers.schemas import GenerationRequest, parse_body, parse_request

log = logging.getLogger("handlers.tgi")

TGI_PATHS = ("/generate", "/generate_stream", "/")  # errors there carry TGI's error_type


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


def register(app: Flask, service, read_body: Callable[[], bytes], to_json):
    special = service.tokenizer.special_ids if service.tokenizer is not None else frozenset()  # (custom handler: none)

    @app.get("/info")
    def info():
        return to_json({"model_id": service.config.server.served_model_name, "model_sha": None,
                        "model_dtype": service.config.model.dtype, "model_device_type": "lmi-serve",
                        "max_input_tokens": service.max_model_len - 1, "max_total_tokens": service.max_model_len,
                        "max_best_of": 1, "max_stop_sequences": None,
                        "max_concurrent_requests": service.config.scheduler.job_queue_size,
                        "router": "lmi-serve", "version": "0.1.0"}, 200)

    @app.post("/generate")
    def generate():
        return _generate(_request(stream=False))

    @app.post("/generate_stream")
    def generate_stream():
        return _generate_stream(_request(stream=True))

    @app.post("/")
    def compat():
        return compat_generate(parse_body(read_body(), "application/json"))

    def compat_generate(body) -> Response:
        """TGI's `POST /`: a stream when the body says `"stream": true`, else `[generate's body]`."""
        req = _request(stream=False, body=body)
        if req.stream:
            return _generate_stream(req)
        resp = _generate(req)
        if resp.status_code == 200:
            resp.set_data(b"[" + resp.get_data() + b"]")
        return resp

    def _generate(req: GenerationRequest) -> Response:
        gen, deadline, is_gone = _launch(req)
        try:
            tokens = collect(gen, deadline, is_gone)
        except ClientGone:
            return Response(status=499)
        finally:
            gen.close()
        text = gen.input_text + gen.generated_text if req.return_full_text else gen.generated_text
        body = {"generated_text": text}
        if req.details:
            body["details"] = tgi_details(gen, tokens, special)
        return to_json(body, 200)

    def _generate_stream(req: GenerationRequest) -> Response:
        if req.decoder_input_details:  # as TGI: the prompt's details come with the whole answer only
            raise bad_request("\"parameters.decoder_input_details\" cannot be used with streaming",
                              "decoder_input_details")
        gen, deadline, is_gone = _launch(req)
        events = _events(gen, req, deadline, is_gone)
        try:
            first = next(events)
        except ClientGone:
            return Response(status=499)
        return Response(_chain(first, events), mimetype=SSE)

    def _request(stream: bool, body=None) -> GenerationRequest:
        if service.is_dynamic:
            raise bad_request("the TGI routes need a rolling-batch engine; this server runs dynamic batching: "
                              "use /invocations")
        if body is None:
            body = parse_body(read_body(), "application/json")
        req = parse_request(body, limits=service.limits,
                            default_max_new_tokens=service.config.server.default_max_new_tokens,
                            lora=service.config.model.enable_lora)
        if req.is_list:
            raise bad_request("\"inputs\" must be one string on the TGI routes", "inputs")
        if req.ignored_parameters:
            log.warning("[%s] ignoring unknown parameters: %s", g.log_id, ", ".join(req.ignored_parameters))
        return req

    def _launch(req: GenerationRequest):
        service.require_ready()
        (gen,) = service.start(req, g.request_id)
        sock = request.environ.get("gunicorn.socket")
        return gen, service.deadline(), lambda: client_gone(sock)

    def _events(gen: Generation, req: GenerationRequest, deadline: float, is_gone):
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

    return compat_generate


def _chain(first: bytes, rest):
    yield first
    yield from rest
