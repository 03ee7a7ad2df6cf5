"""/invocations for a custom handler (docs/custom-handlers.md): the request goes to the handler engine
as DJL's Input carries it (headers as properties, the body as content "data"), and its Output comes
back as the response (code, headers from its properties, the body from its content).

Only /invocations, /predictions/<model>, /ping, /health and /metrics are served: the generation
routes (OpenAI, TGI, adapters) belong to lmi-serve's engines.
"""

from __future__ import annotations

import json
import logging

from flask import Response, g, request

from engines.protocol import HandlerCall
from handlers.errors import HttpError

log = logging.getLogger("handlers.custom")

ROUTE_REFUSAL = ("this model is served by a custom handler (option.entryPoint / model.py): send requests to "
                 "/invocations or /predictions/<model>")
BODY_KEYS = ("data", "batch_0.data", None)  # the answer's body: its content under one of these, else the first


def serves(path: str) -> bool:
    return path in ("/ping", "/health", "/metrics", "/invocations") or path.startswith("/predictions/") or \
        path.startswith("/models/") and path.endswith("/invoke")


def call(service, body: bytes) -> Response:
    properties = {name: value for name, value in request.headers.items()}
    timeout = service.config.scheduler.predict_timeout_s
    reply = service.client.command(HandlerCall(g.request_id, properties, [("data", body)]), timeout)
    if reply is None:
        service.client.abort(g.request_id)
        raise HttpError(424, f"the custom handler did not answer within option.predict_timeout ({timeout:g} s)")
    content = dict(reply.content)
    data = next((content[k] for k in BODY_KEYS if k in content), reply.content[0][1] if reply.content else b"")
    code = int(reply.properties.get("batch_0_code", reply.code))
    headers = {k: v for k, v in reply.properties.items() if not k.lower().startswith("batch_")}
    kind = next((v for k, v in headers.items() if k.lower() == "content-type"), None) or _guess_type(data)
    headers = {k: v for k, v in headers.items() if k.lower() not in ("content-type", "content-length")}
    log.info("[%s] custom handler: %d, %d bytes", g.log_id, code, len(data))
    return Response(data, status=code, headers=headers, content_type=kind)


def _guess_type(data: bytes) -> str:
    try:
        json.loads(data)
        return "application/json"
    except ValueError:
        return "application/octet-stream"
