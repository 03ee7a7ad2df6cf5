"""LoRA adapters registered, listed and unregistered at run time (option.enable_lora): DJL Serving's
adapter management routes and vLLM's.

    DJL   POST   /models/<model>/adapters?name=a1&src=/opt/ml/a1[&pin=true]   {"status": "Adapter a1 registered"}
          GET    /models/<model>/adapters                   {"adapters": [{"name", "src", ...}, ...]}
          GET    /models/<model>/adapters/<name>            {"name", "src", "rank", "slot", ...}
          DELETE /models/<model>/adapters/<name>            {"status": "Adapter a1 unregistered"}
          (/adapters and /adapters/<name> too: the one model)
    vLLM  POST   /v1/load_lora_adapter    {"lora_name", "lora_path"}   "Success: LoRA adapter 'a1' added successfully."
          POST   /v1/unload_lora_adapter  {"lora_name"}

A source is a local directory, an s3:// prefix or a hub id, fetched here (in the HTTP worker, so that
generation does not wait for a download) as model artifacts are (engines/weights/artifacts.py). The engine
reads and checks the adapter on every rank between steps; unregistering waits until no request
uses the adapter (new ones are refused at once), then answers.
"""

from __future__ import annotations

import uuid

import msgspec
from flask import Blueprint, Response, request

from engines.protocol import ADAPTER_REGISTER, ADAPTER_UNREGISTER, AdapterCommand
from engines.weights.artifacts import ArtifactError, resolve_model
from handlers.errors import HttpError, bad_request
from handlers.models import current, pick
from handlers.service import Service, json_response

REGISTER_TIMEOUT_S = 120.0  # reading an adapter on every rank

routes = Blueprint("adapters", __name__)


@routes.post("/adapters")
@routes.post("/models/<model>/adapters")
def djl_register(model: str | None = None):
    service = pick(model) if model else current()
    args = dict(request.args)
    if request.is_json and request.content_length:
        body = _json_body(service.body())
        args.update({k: str(v).lower() if isinstance(v, bool) else v for k, v in body.items()})
    unknown = sorted(set(args) - {"name", "src", "pin", "preload"})
    if unknown:
        raise bad_request(f"unknown adapter option(s) {', '.join(unknown)}: name, src, pin and preload are "
                          "understood", unknown[0])
    name, src = args.get("name"), args.get("src")
    if not isinstance(name, str) or not name or not isinstance(src, str) or not src:
        raise bad_request("register an adapter with ?name=<adapter name>&src=<its PEFT directory, s3:// prefix "
                          "or hub id>", "name" if not name else "src")
    pin, preload = str(args.get("pin", "false")).lower(), str(args.get("preload", "true")).lower()
    for key, value in (("pin", pin), ("preload", preload)):
        if value not in ("true", "false"):
            raise bad_request(f"{key}={value!r}: expected true or false", key)
    # preload: every adapter is read (and checked) when it is registered, whatever it says
    status, message = _register(service, name, src, pin == "true")
    if status != 200:
        raise HttpError(status, message)
    return json_response({"status": message}, 200)


@routes.get("/adapters")
@routes.get("/models/<model>/adapters")
def djl_list(model: str | None = None):
    service = pick(model) if model else current()
    return json_response({"adapters": [msgspec.structs.asdict(a) for a in service.adapter_infos(fresh=True)]}, 200)


@routes.get("/adapters/<path:name>")
@routes.get("/models/<model>/adapters/<path:name>")
def djl_describe(name: str, model: str | None = None):
    service = pick(model) if model else current()
    for info in service.adapter_infos(fresh=True):
        if info.name == name:
            return json_response(msgspec.structs.asdict(info), 200)
    raise HttpError(404, f"no LoRA adapter named {name!r}")


@routes.delete("/adapters/<path:name>")
@routes.delete("/models/<model>/adapters/<path:name>")
def djl_unregister(name: str, model: str | None = None):
    service = pick(model) if model else current()
    status, message = _unregister(service, name)
    if status not in (200, 202):
        raise HttpError(status, message)
    return json_response({"status": message}, status)


@routes.post("/v1/load_lora_adapter")
def vllm_load():
    service = current()
    body = _json_body(service.body())
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise bad_request("both 'lora_name' and 'lora_path' must be provided", "lora_name")
    status, message = _register(service, name, path, False)
    if status != 200:
        raise HttpError(status, message, param="lora_name")
    return Response(f"Success: LoRA adapter '{name}' added successfully.", 200, mimetype="text/plain")


@routes.post("/v1/unload_lora_adapter")
def vllm_unload():
    service = current()
    body = _json_body(service.body())
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise bad_request("'lora_name' must be provided", "lora_name")
    status, message = _unregister(service, name)
    if status not in (200, 202):
        raise HttpError(status, message, param="lora_name")
    text = f"Success: LoRA adapter '{name}' removed successfully." if status == 200 else message
    return Response(text, status, mimetype="text/plain")


def _register(service: Service, name: str, src: str, pin: bool) -> tuple[int, str]:
    if not service.config.model.enable_lora:
        raise HttpError(404, "LoRA adapters are served with option.enable_lora=true; this server runs without "
                             "them")
    if name == service.model_name:
        raise bad_request(f"{name!r} is the base model's name; give the adapter another", "name")
    service.require_ready()
    try:
        path = resolve_model(src, None, download_dir=service.config.model.download_dir, progress=False)
    except ArtifactError as exc:
        raise bad_request(f"LoRA adapter {name!r}: {exc}", "src") from None
    return _command(service, AdapterCommand(uuid.uuid4().hex, ADAPTER_REGISTER, name, path, src, pin), REGISTER_TIMEOUT_S)


def _unregister(service: Service, name: str) -> tuple[int, str]:
    if not service.config.model.enable_lora:
        raise HttpError(404, f"no LoRA adapter named {name!r}: this server runs without option.enable_lora")
    service.require_ready()
    timeout = service.config.scheduler.predict_timeout_s
    status, message = _command(service, AdapterCommand(uuid.uuid4().hex, ADAPTER_UNREGISTER, name), timeout)
    if status == 504:  # its requests still run: it goes when they end
        return 202, f"Adapter {name} is being unregistered: requests still use it"
    return status, message


def _command(service: Service, cmd: AdapterCommand, timeout: float) -> tuple[int, str]:
    reply = service.client.command(cmd, timeout)
    if reply is None:
        return 504, f"the engine did not answer within {timeout:g} s"
    return reply.status, reply.message


def _json_body(raw: bytes) -> dict:
    try:
        body = msgspec.json.decode(raw) if raw else {}
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body

