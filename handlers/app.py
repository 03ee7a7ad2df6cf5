"""The Flask app each gunicorn worker runs: the route families as Blueprints (handlers/routes/: LMI's
/ping, /metrics and /invocations; OpenAI's /v1; TGI's; LoRA adapter management) on one `Service`
(handlers/service.py), which holds the engine client, the tokenizer and the one generation path.

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

from engines.config import LmiConfig
from engines.process.ipc import high_water_mark
from engines.process.rundir import engine_socket_path, write_failure
from handlers import custom
from handlers.chat_template import ChatTemplate
from handlers.engine_client import EngineClient
from handlers.engine_pool import EnginePool
from handlers.errors import HttpError
from handlers.request_metrics import REQUEST_METRICS
from handlers.routes import adapters, lmi, openai, tgi
from handlers.service import Service, current
from handlers.tokenizer import TextTokenizer

log = logging.getLogger("handlers.app")

UNCOUNTED_PATHS = ("/ping", "/health", "/metrics")  # not in the request metrics


def create_app(run_dir: str) -> Flask:
    config = LmiConfig.read(os.path.join(run_dir, "config.json"))
    try:
        tokenizer = template = None
        if config.model.entry_point is None:  # (a custom handler tokenizes for itself, if at all)
            tokenizer = TextTokenizer(config.model.local_dir)
            template = ChatTemplate.load(config.model.local_dir, config.server.chat_template)
    except Exception as exc:  # the launcher reports this sentence as the reason the server did not start
        write_failure(run_dir, "http", f"the HTTP workers could not load the tokenizer or chat template: {exc}")
        raise
    sched = config.scheduler
    hwm = high_water_mark(sched.job_queue_size, sched.max_num_seqs)
    copies = config.parallel.copies
    client = EnginePool(run_dir, copies, hwm) if copies > 1 else \
        EngineClient(engine_socket_path(run_dir), hwm, refresh_health=True)
    REQUEST_METRICS.configure(run_dir)
    return build_app(Service(config, client, tokenizer, run_dir, template))


def build_app(service: Service) -> Flask:
    app = Flask("lmi-serve")
    app.json.sort_keys = False
    app.extensions["lmi_service"] = service
    for family in (lmi, openai, tgi, adapters):
        app.register_blueprint(family.routes)
    app.before_request(_begin)
    app.after_request(_tag)
    app.register_error_handler(HttpError, _http_error)
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
    if current().handler is not None and not custom.serves(request.path):
        raise HttpError(404, custom.ROUTE_REFUSAL)


def _tag(resp: Response) -> Response:
    resp.headers["X-Request-Id"] = g.get("client_request_id") or g.get("request_id", "")
    if g.get("counted"):  # counted when the response is closed: a stream at its end
        route, status = request.url_rule.rule if request.url_rule else "unmatched", resp.status_code
        resp.call_on_close(lambda: REQUEST_METRICS.request_ended(route, status))
    return resp


def _http_error(err: HttpError) -> Response:
    log.info("[%s] %d %s", g.get("log_id"), err.code, err.message)
    return err.response(openai=request.path.startswith("/v1/"), tgi=request.path in tgi.TGI_PATHS or (
        request.path == "/invocations" and current().config.server.tgi_compat))


def _unexpected(err: Exception) -> Response:
    log.exception("[%s] unexpected error", g.get("log_id"))
    return _http_error(HttpError(500, f"internal error: {type(err).__name__}"))
