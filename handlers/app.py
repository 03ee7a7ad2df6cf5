"""The Flask app each gunicorn worker runs: `/ping`, `/invocations`, `/predictions/<model>`.

Workers are thin: validate, tokenize, send token ids to the engine, wait, detokenize, format.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from engines.config import ENGINE_DYNAMIC, LmiConfig, model_max_len
from engines.protocol import STATE_READY, engine_dead_path, engine_socket_path
from handlers.engine_client import EngineClient
from handlers.errors import HttpError, bad_request
from handlers.formatters import JSONLINES, SSE, collect, response_body, stream_lines
from handlers.generation import ClientGone, Generation, client_gone
from handlers.metrics import render as render_metrics
from handlers.schemas import GenerationRequest, parse_body, parse_request
from handlers.tokenizer import TextTokenizer

log = logging.getLogger("handlers.app")

PING_TIMEOUT_S = 1.0
PING_TRIES = 5


class Service:
    """What the routes share in one worker process."""

    def __init__(self, config: LmiConfig, client: EngineClient, tokenizer: TextTokenizer,
                 dead_path: str | None = None):
        self.config = config
        self.dead_path = dead_path
        self.client = client
        self.tokenizer = tokenizer
        self.max_model_len = model_max_len(config.model.local_dir, config.model.max_model_len)
        self.is_dynamic = config.scheduler.engine_kind == ENGINE_DYNAMIC
        self.engine_ready = False

    def engine_dead(self) -> str | None:
        """Why the engine died, once the launcher has said so."""
        if self.dead_path is None or not os.path.exists(self.dead_path):
            return None
        with open(self.dead_path, encoding="utf-8") as f:
            return f.read().strip() or "the engine died"

    def require_ready(self) -> None:
        if self.engine_dead():
            raise HttpError(503, f"the model is not available: {self.engine_dead()}")
        if self.engine_ready:
            return
        reply = self.client.health(PING_TIMEOUT_S)
        if reply is None or reply.state != STATE_READY:
            state = reply.state if reply else "not responding"
            raise HttpError(503, f"the model is not ready (engine {state}); retry later")
        self.engine_ready = True

    def start(self, req: GenerationRequest, request_id: str) -> list[Generation]:
        """Tokenize, check lengths, and send every input to the engine."""
        prompts = [self.tokenizer.encode(text) for text in req.inputs]
        for i, ids in enumerate(prompts):
            total = len(ids) + req.sampling.max_new_tokens
            if total > self.max_model_len:
                where = f"input {i}" if req.is_list else "the input"
                raise bad_request(f"{where} has {len(ids)} tokens and max_new_tokens is "
                                  f"{req.sampling.max_new_tokens}: {total} exceeds the model's maximum "
                                  f"length of {self.max_model_len} tokens")
        return [Generation(self.client, f"{request_id}-{i}", ids, text, req, self.tokenizer, self.engine_dead)
                for i, (ids, text) in enumerate(zip(prompts, req.inputs))]

    def deadline(self) -> float:
        return time.monotonic() + self.config.scheduler.predict_timeout_s


def create_app(run_dir: str) -> Flask:
    config = LmiConfig.read(os.path.join(run_dir, "config.json"))
    service = Service(config, EngineClient(engine_socket_path(run_dir)), TextTokenizer(config.model.local_dir),
                      engine_dead_path(run_dir))
    return build_app(service)


def build_app(service: Service) -> Flask:
    app = Flask("lmi-serve")
    app.config["MAX_CONTENT_LENGTH"] = service.config.server.max_request_size
    app.json.sort_keys = False

    @app.before_request
    def _request_id():
        g.request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex

    @app.after_request
    def _tag(resp: Response):
        resp.headers["X-Request-Id"] = g.get("request_id", "")
        return resp

    @app.errorhandler(HttpError)
    def _http_error(err: HttpError):
        log.info("[%s] %d %s", g.get("request_id"), err.code, err.message)
        return err.response()

    @app.errorhandler(HTTPException)
    def _werkzeug_error(err: HTTPException):
        code = err.code or 500
        if code == 413:
            message = f"the request body exceeds max_request_size ({service.config.server.max_request_size} bytes)"
        else:
            message = err.description or err.name
        return _http_error(HttpError(code, message))

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        log.exception("[%s] unexpected error", g.get("request_id"))
        return _http_error(HttpError(500, f"internal error: {type(err).__name__}"))

    @app.get("/ping")
    @app.get("/health")
    def ping():
        reply = None
        for _ in range(PING_TRIES):  # short waits, so that a death the launcher reports shows at once
            dead = service.engine_dead()
            if dead:
                service.engine_ready = False
                return _json({"status": "unhealthy", "engine": "dead", "detail": dead}, 503)
            reply = service.client.health(PING_TIMEOUT_S / PING_TRIES)
            if reply is not None:
                break
        if reply is None:
            service.engine_ready = False
            return _json({"status": "unhealthy", "engine": "not responding"}, 503)
        service.engine_ready = reply.state == STATE_READY
        body = {"status": "healthy" if service.engine_ready else reply.state, "engine": reply.state,
                "engine_kind": service.config.scheduler.engine_kind,
                "waiting": reply.num_waiting, "running": reply.num_running, "batches": reply.num_batches,
                "kv_slots": reply.num_kv_slots}
        if reply.detail:
            body["detail"] = reply.detail
        if reply.metrics:
            body["metrics"] = reply.metrics
        return _json(body, 200 if service.engine_ready else 503)

    @app.get("/metrics")
    def metrics():
        reply = service.client.health(PING_TIMEOUT_S)
        if reply is None:
            raise HttpError(503, "the engine is not responding")
        return Response(render_metrics(reply, service.config.scheduler.engine_kind),
                        mimetype="text/plain; version=0.0.4")

    @app.post("/invocations")
    @app.post("/predictions/<model_name>")
    def invocations(model_name: str | None = None):
        body = parse_body(request.get_data(), request.content_type)
        req = parse_request(body, default_max_new_tokens=service.config.server.default_max_new_tokens)
        if req.stream and service.is_dynamic:
            raise bad_request("streaming is not supported with dynamic batching (batch_size>1 or "
                              "option.rolling_batch=disable); send \"stream\": false")
        if req.stream and req.is_list:
            raise bad_request("streaming takes one input: send \"inputs\" as a string")
        service.require_ready()
        gens = service.start(req, g.request_id)
        if req.stream:
            sse = service.config.server.output_formatter == "sse" or \
                "text/event-stream" in request.headers.get("Accept", "")
            return Response(stream_lines(gens[0], req, service.deadline(), sse),
                            mimetype=SSE if sse else JSONLINES)
        sock = request.environ.get("gunicorn.socket")
        deadline = service.deadline()
        try:
            bodies = [response_body(gen, collect(gen, deadline, lambda: client_gone(sock)), req) for gen in gens]
        except ClientGone:
            log.info("[%s] client disconnected: request aborted", g.request_id)
            return Response(status=499)
        finally:
            for gen in gens:  # a failure in one input aborts the others
                gen.close()
        log.info("[%s] %d input(s), %s tokens", g.request_id, len(gens), [gen.num_generated_tokens for gen in gens])
        return _json(bodies if service.is_dynamic or req.is_list else bodies[0], 200)

    return app


def _json(body, status: int) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status=status, mimetype="application/json")
