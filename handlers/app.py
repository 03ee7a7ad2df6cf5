"""The Flask app each gunicorn worker runs: the route families as Blueprints (handlers/routes/: LMI's
/ping, /metrics and /invocations; OpenAI's /v1; TGI's; LoRA adapter management; model management)
on a `Service` per model (handlers/service.py: the engine client, the tokenizer and the one
generation path), which handlers/models.py keeps in step with the models the launcher serves.

Workers are thin: validate, tokenize, send token ids to the engine, wait, detokenize, format.
Request ids are the server's (a uuid per request, one per input to the engine); a client's
`X-Request-Id` is echoed and logged, never used to route anything.

The other processes talk to the workers through files in the run directory: `engine.failed` (the
engine is gone, written by the engine itself or by the launcher: 503 on /ping, 424 for requests in
flight) and `draining` (SIGTERM: 503 for new requests, and requests still running at the drain
deadline are aborted with a 503).
"""

from __future__ import annotations

import logging
import os
import uuid

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

import msgspec

from engines.config import ServerConfig
from engines.process.models import touch
from engines.process.rundir import write_failure
from handlers.errors import HttpError
from handlers.generation import ClientGone
from handlers.models import Models
from handlers.request_metrics import REQUEST_METRICS
from handlers.routes import adapters, lmi, management, openai, pooling, responses, tgi, tokenize
from handlers.service import Service

log = logging.getLogger("handlers.app")

UNCOUNTED_PATHS = ("/ping", "/health", "/metrics")  # not in the request metrics


def create_app(run_dir: str) -> Flask:
    with open(os.path.join(run_dir, "server.json"), "rb") as f:
        server = msgspec.json.decode(f.read(), type=ServerConfig)
    models = Models(server, run_dir)
    try:
        models.loaded()  # the model the server started with: its tokenizer and chat template now
    except Exception as exc:  # the launcher reports this sentence as the reason the server did not start
        write_failure(run_dir, "http", f"the HTTP workers could not load the tokenizer or chat template: {exc}")
        raise
    REQUEST_METRICS.configure(run_dir)
    return build_app(models)


def build_app(target: Service | Models) -> Flask:
    """The app over the launcher's models, or over one Service (tests of the HTTP layer)."""
    app = Flask("lmi-serve")
    app.json.sort_keys = False
    app.extensions["lmi_models"] = target if isinstance(target, Models) else \
        Models(target.config.server, only=target)
    for family in (pooling, lmi, openai, responses, tgi, tokenize, adapters, management):
        app.register_blueprint(family.routes)
    app.before_request(_begin)
    app.after_request(_tag)
    app.register_error_handler(HttpError, _http_error)
    app.register_error_handler(ClientGone, lambda _: Response(status=499))  # (nobody reads it: for the logs)
    app.register_error_handler(HTTPException, lambda err: _http_error(HttpError(err.code or 500,
                                                                                err.description or err.name)))
    app.register_error_handler(Exception, _unexpected)
    return app


def _begin():
    g.request_id = uuid.uuid4().hex  # ours: what the engine and the logs key on
    g.client_request_id = request.headers.get("X-Request-Id")
    g.log_id = g.request_id if not g.client_request_id else f"{g.request_id} client-id={g.client_request_id!r}"
    g.counted = request.path not in UNCOUNTED_PATHS
    if g.counted:
        REQUEST_METRICS.request_started()


def _tag(resp: Response) -> Response:
    resp.headers["X-Request-Id"] = g.get("client_request_id") or g.get("request_id", "")
    if g.get("counted"):  # counted when the response is closed: a stream at its end
        route, status = request.url_rule.rule if request.url_rule else "unmatched", resp.status_code
        service = g.get("service")
        model = service.model_name if service is not None else ""
        resp.call_on_close(lambda: _ended(route, status, model, service))
    return resp


def _ended(route: str, status: int, model: str, service: Service | None) -> None:
    REQUEST_METRICS.request_ended(route, status, model)
    if service is not None and service.run_dir is not None:  # a long stream keeps its model recently used
        touch(service.run_dir)


def _http_error(err: HttpError) -> Response:
    log.info("[%s] %d %s", g.get("log_id"), err.code, err.message)
    service = g.get("service")
    return err.response(openai=request.path.startswith("/v1/"), tgi=request.path in tgi.TGI_PATHS or (
        request.path == "/invocations" and service is not None and service.config.server.tgi_compat))


def _unexpected(err: Exception) -> Response:
    log.exception("[%s] unexpected error", g.get("log_id"))
    return _http_error(HttpError(500, f"internal error: {type(err).__name__}"))
