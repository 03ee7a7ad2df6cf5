"""LMI's own routes: `/ping` (and `/health`), `/metrics`, and `/invocations` (`/predictions/<model>`),
which takes DJL's `{"inputs", "parameters"}` (a custom handler's body as it is; DJL's chat mode when
the body has `"messages"`; TGI's answers under option.tgi_compat)."""

from __future__ import annotations

import json

from flask import Blueprint, Response, g, request

from engines.config import TASK_GENERATION
from engines.process.models import READY
from engines.protocol import STATE_READY
from handlers import custom
from handlers.engine_pool import EnginePool
from handlers.errors import bad_request
from handlers.formatters import JSONLINES, SSE, response_body, stream_lines
from handlers.metrics import render as render_metrics, render_models
from handlers.models import current, invocation_model, models, pick
from handlers.refusals import refuse_on_dynamic
from handlers.request_metrics import REQUEST_METRICS
from handlers.routes import pooling
from handlers.routes.openai import djl_chat
from handlers.routes.tgi import compat_generate
from handlers.schemas import parse_body, parse_request
from handlers.service import (PING_SNAPSHOT_AGE_S, PING_TIMEOUT_S, json_response, log, parse_or_400,
                              warn_ignored)
from handlers.errors import HttpError

routes = Blueprint("lmi", __name__)


@routes.get("/ping")
@routes.get("/health")
def ping():
    table = models().table()
    if not table.multi and len(table.models) == 1:
        return _ping_one(current())
    draining = models().is_draining()
    states = {m.name: {"status": "Healthy" if m.state == READY else m.state.upper(), "engine_kind": m.engine_kind,
                       **({"detail": m.detail} if m.detail else {})} for m in table.models}
    for record, service in models().loaded():  # a loaded model's engine may have died since
        dead = service.engine_dead()
        if dead:
            states[record.name].update(status="Unhealthy", detail=dead)
    if draining:
        return json_response({"status": "draining", "models": states}, 503)
    return json_response({"status": "healthy", "models": states}, 200)


def _ping_one(service):
    dead = service.engine_dead()
    if dead:
        service.engine_ready = False
        return json_response({"status": "unhealthy", "engine": "dead", "detail": dead}, 503)
    if service.drain_deadline() is not None:
        return json_response({"status": "draining", "engine": "draining"}, 503)
    reply = service.client.health(PING_TIMEOUT_S, max_age=PING_SNAPSHOT_AGE_S)
    if reply is not None and reply.state != STATE_READY:  # not ready in the snapshot: ask now, so that
        reply = service.client.health(PING_TIMEOUT_S)  # readiness shows the moment the engine has it
    if reply is None:
        service.engine_ready = False
        return json_response({"status": "unhealthy", "engine": "not responding"}, 503)
    service.engine_ready = reply.state == STATE_READY
    body = {"status": "healthy" if service.engine_ready else reply.state, "engine": reply.state,
            "engine_kind": service.config.scheduler.engine_kind,
            "waiting": reply.num_waiting, "running": reply.num_running, "batches": reply.num_batches,
            "kv_slots": reply.num_kv_slots}
    if reply.detail:
        body["detail"] = reply.detail
    if reply.metrics:
        body["metrics"] = reply.metrics
    return json_response(body, 200 if service.engine_ready else 503)


@routes.get("/metrics")
def metrics():
    table = models().table()
    if table.multi or len(table.models) != 1:
        return Response(render_models(table, [(r.name, _replies(s)) for r, s in models().loaded()],
                                      lambda: REQUEST_METRICS.families(by_model=True)),
                        mimetype="text/plain; version=0.0.4")
    service = current()
    reply = _replies(service)
    if reply is None:
        raise HttpError(503, "the engine is not responding")
    return Response(render_metrics(reply, service.config.scheduler.engine_kind, REQUEST_METRICS.families),
                    mimetype="text/plain; version=0.0.4")


def _replies(service):
    """The engine's health reply, or each copy's (labelled by copy); None when it does not answer."""
    reply = service.client.health(PING_TIMEOUT_S)
    if reply is not None and isinstance(service.client, EnginePool):
        return service.client.healths(PING_TIMEOUT_S)
    return reply


@routes.post("/invocations")
@routes.post("/predictions/<model_name>")
@routes.post("/predictions/<model_name>/<version>")
def invocations(model_name: str | None = None, version: str | None = None):
    """The model: the path's, else DJL's model_name (query, header), SageMaker's target-model header, or
    (with several models) the body's model_name; else the one model."""
    name = model_name or invocation_model()
    raw = models().body()
    if name is None and len(models().names) > 1:
        name = _body_model_name(raw)
    service = pick(name)
    if service.handler is not None:
        service.require_ready()
        return custom.call(service, raw)
    body = parse_or_400(raw, request.content_type, parse_body)
    if isinstance(body, dict) and name is not None and body.get("model_name") == name:
        del body["model_name"]
    if service.task != TASK_GENERATION:
        return pooling.invocations(service, body)
    if isinstance(body, dict) and "messages" in body:
        return djl_chat(service, body)
    if service.config.server.tgi_compat:
        return compat_generate(service, body)
    req = parse_or_400(body, None, lambda b, _: parse_request(
        b, limits=service.limits, default_max_new_tokens=service.config.server.default_max_new_tokens,
        lora=service.config.model.enable_lora))
    warn_ignored(req)
    if req.stream:
        refuse_on_dynamic(service.is_dynamic, "stream")
    if req.stream and req.is_list:
        raise bad_request("streaming takes one input: send \"inputs\" as a string")
    service.require_ready()
    gens = service.start(req, g.request_id)
    if req.stream or service.streams_by_default(req):
        if req.decoder_input_details:
            for gen in gens:
                gen.close()
            raise bad_request("\"parameters.decoder_input_details\" cannot be used with streaming "
                              "(option.output_formatter streams this request)", "decoder_input_details")
        sse = service.config.server.output_formatter == "sse" or \
            "text/event-stream" in request.headers.get("Accept", "")
        deadline, is_gone = service.watch()
        return service.respond_stream(stream_lines(gens[0], req, deadline, sse, is_gone), SSE if sse else JSONLINES)

    def finish(tokens: list[list[dict]]) -> Response:
        bodies = [response_body(gen, t, req) for gen, t in zip(gens, tokens)]
        log.info("[%s] %d input(s), %s tokens%s", g.log_id, len(gens), [gen.num_generated_tokens for gen in gens],
                 f", LoRA adapters {list(req.adapters)}" if req.adapters else "")
        return json_response(bodies if service.is_dynamic or req.is_list else bodies[0], 200)

    return service.respond(gens, finish)


def _body_model_name(raw: bytes) -> str | None:
    """DJL's last choice: a JSON body's "model_name"."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    name = body.get("model_name") if isinstance(body, dict) else None
    return name if isinstance(name, str) and name else None
