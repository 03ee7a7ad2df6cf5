"""Model management (docs/multi-model.md): DJL Serving's management API and SageMaker's multi-model
container contract, side by side on the same routes; the launcher does the work (container/registry.py),
asked over run_dir/control.sock.

    POST   /models?url=U&model_name=N[&engine=&min_worker=&max_worker=&job_queue_size=&synchronous=]  (DJL)
    POST   /models  {"model_name": N, "url": U}                            (SageMaker: 200, 409, 507)
    GET    /models[?limit=&next_page_token=]   {"models": [{"modelName", "modelUrl", "status"}], "nextPageToken"}
    GET    /models/N                           {"modelName", "modelUrl", "status", "engine", "workers", ...}
    PUT    /models/N?min_worker=&max_worker=   DJL's scale: the model's copies
    DELETE /models/N                           new requests 404 at once; in-flight ones finish; then unloaded
    POST   /models/N/invoke                    SageMaker's invoke (X-Amzn-SageMaker-Target-Model logged)
"""

from __future__ import annotations

import json
import logging

from flask import Blueprint, g, request

from engines.process.models import ModelCommand, ask
from handlers.errors import HttpError, bad_request
from handlers.models import TARGET_MODEL_HEADER, models
from handlers.service import json_response

log = logging.getLogger("handlers.management")

routes = Blueprint("management", __name__)

MAX_PAGE = 100  # DJL's limit: 100 by default and at most
CONTROL_TIMEOUT_S = 5.0  # a command that does not load anything (unregister waits for requests in flight: longer)


def _ask(command: ModelCommand, timeout_s: float):
    run_dir = models().run_dir
    if run_dir is None:
        raise HttpError(404, "model management needs the launcher (lmi serve)")
    reply = ask(run_dir, command, timeout_s)
    if reply is None:
        raise HttpError(503, f"the launcher did not answer {command.op} within {timeout_s:g} s; retry later")
    if reply.code >= 300:
        raise HttpError(reply.code, str(reply.body))
    return json_response(reply.body, reply.code)


@routes.post("/models")
def register():
    args = dict(request.args)
    if request.content_length and (request.is_json or not args):
        try:
            body = json.loads(models().body())
        except ValueError:
            raise bad_request("the body must be a JSON object such as {\"model_name\": ..., \"url\": ...}") from None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object such as {\"model_name\": ..., \"url\": ...}")
        args.update({k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in body.items()})
    url = args.get("url")
    if not url:
        raise bad_request("Parameter url is required.", "url")
    synchronous = args.get("synchronous", "true").lower()
    if synchronous not in ("true", "false"):
        raise bad_request(f"synchronous={synchronous!r}: expected true or false", "synchronous")
    options = {k: v for k, v in args.items() if k not in ("url", "model_name", "synchronous")}
    log.info("[%s] register %s from %s %s", g.log_id, args.get("model_name") or "(named after its url)", url,
             options or "")
    timeout = models().server.model_loading_timeout_s + 60.0
    return _ask(ModelCommand("register", args.get("model_name", ""), url, options, synchronous == "true"), timeout)


@routes.get("/models")
def list_models():
    try:
        limit = int(request.args.get("limit", MAX_PAGE))
        start = int(request.args.get("next_page_token", 0))
    except ValueError:
        raise bad_request("limit and next_page_token are integers", "limit") from None
    limit = min(max(limit, 1), MAX_PAGE)
    records = [m for m in models().table().models if m.state != "unloading" or m.detail != "unregistered"]
    page = records[max(start, 0):max(start, 0) + limit]
    body = {"models": [{"modelName": m.name, "modelUrl": m.url, "status": m.state.upper()} for m in page]}
    if start + limit < len(records):
        body["nextPageToken"] = str(start + limit)
    return json_response(body)


@routes.get("/models/<name>")
def describe(name: str):
    record = models().table().get(name)
    if record is None or name not in models().names:
        raise HttpError(404, f"Model or workflow not found: {name}")
    body = {"modelName": record.name, "modelUrl": record.url, "status": record.state.upper(),
            "engine": record.engine_kind, "loadedAtStartup": record.startup, "workers": record.copies,
            "devices": record.where, "memoryBytes": record.need_bytes, "loads": record.loads,
            "unloads": record.unloads}
    if record.detail:
        body["detail"] = record.detail
    if record.state == "ready":
        service = models().service(name)
        body["queueSize"] = service.config.scheduler.job_queue_size
        if service.config.model.enable_lora:
            body["adapters"] = [a.name for a in service.adapter_infos(fresh=True)]
    return json_response(body)


@routes.put("/models/<name>")
def scale(name: str):
    raw = request.args.get("max_worker") or request.args.get("min_worker")
    try:
        copies = int(raw) if raw is not None else None
    except ValueError:
        copies = None
    if copies is None or copies < 1:
        raise bad_request(f"scale a model with ?min_worker=<n>&max_worker=<n> (n >= 1), not {raw!r}", "max_worker")
    timeout = models().server.model_loading_timeout_s + 300.0
    return _ask(ModelCommand("scale", name, options={"copies": str(copies)}), timeout)


@routes.delete("/models/<name>")
def unregister(name: str):
    log.info("[%s] unregister %s", g.log_id, name)
    return _ask(ModelCommand("unregister", name), 600.0)


@routes.post("/models/<name>/invoke")
def invoke(name: str):
    from handlers.routes.lmi import invocations

    target = request.headers.get(TARGET_MODEL_HEADER)
    if target:
        log.info("[%s] %s: %s", g.log_id, TARGET_MODEL_HEADER, target)
    return invocations(model_name=name)
