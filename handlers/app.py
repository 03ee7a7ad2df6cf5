"""The Flask app each gunicorn worker runs: `/ping`, `/invocations`, `/predictions/<model>`.

Workers are thin: validate, tokenize, send token ids to the engine, wait, detokenize, format.
Request ids are the server's (a uuid per request, one per input to the engine); a client's
`X-Request-Id` is echoed and logged, never used to route anything.

The other processes talk to the workers through files in the run directory: `engine.failed` (the
engine is gone, written by the engine itself or by the launcher: 503 on /ping, 424 for requests in
flight) and `draining` (SIGTERM: 503 for new requests, and requests still running at the drain
deadline are aborted with a 503).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import time
import uuid
from dataclasses import replace

import msgspec
from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from engines.config import ENGINE_DYNAMIC, LmiConfig
from engines.spec import ModelSpec
from engines.process.ipc import high_water_mark
from engines.protocol import STATE_READY, AdapterInfo
from engines.process.rundir import draining_path, engine_socket_path, read_failure, write_failure
from handlers.engine_client import EngineClient
from handlers.engine_pool import EnginePool
from handlers.errors import HttpError, bad_request
from handlers.formatters import JSONLINES, SSE, collect, response_body, stream_lines
from handlers.generation import ClientGone, Generation, client_gone
from handlers.metrics import render as render_metrics
from handlers.request_metrics import REQUEST_METRICS
from handlers import custom
from handlers.chat_template import ChatTemplate
from handlers.adapter_routes import register as register_adapters
from handlers.openai_routes import djl_chat
from handlers.openai_routes import register as register_openai
from handlers.tgi_routes import TGI_PATHS, register as register_tgi
from handlers.schemas import GenerationRequest, RequestLimits, parse_body, parse_request
from handlers.tokenizer import TextTokenizer

log = logging.getLogger("handlers.app")

PING_TIMEOUT_S = 1.0  # a health round trip when the snapshot is older than PING_SNAPSHOT_AGE_S
PING_SNAPSHOT_AGE_S = 1.0  # a ready snapshot this fresh answers /ping (a death shows through engine.dead)
BODY_CHUNK = 1 << 16
UNCOUNTED_PATHS = ("/ping", "/health", "/metrics")  # not in the request metrics


class Service:
    """What the routes share in one worker process."""

    def __init__(self, config: LmiConfig, client: EngineClient, tokenizer: TextTokenizer,
                 run_dir: str | None = None, chat_template: ChatTemplate | None = None):
        self.config = config
        self.chat_template = chat_template
        self.started_at = time.time()
        self.run_dir = run_dir
        self.client = client
        self.tokenizer = tokenizer
        self.handler = config.model.entry_point  # a custom handler serves /invocations (handlers/custom.py)
        spec = ModelSpec.of(config.model) if self.handler is None else None
        self.max_model_len = spec.max_model_len if spec else 0
        self.vocab_size = (spec.vocab_size or tokenizer.vocab_size) if spec else 0  # logit_bias ids must be below it
        self.is_dynamic = config.scheduler.engine_kind == ENGINE_DYNAMIC
        self.limits = RequestLimits(config.server.max_inputs_per_request, config.server.max_input_chars)
        self.engine_ready = False
        self._drain_deadline: float | None = None

    def adapter_infos(self, fresh: bool = False) -> list[AdapterInfo]:
        """option.enable_lora: the adapters the engine serves (fresh: asked now, not the snapshot)."""
        if not self.config.model.enable_lora:
            return []
        reply = self.client.health(PING_TIMEOUT_S, max_age=0 if fresh else PING_SNAPSHOT_AGE_S)
        if reply is None:
            raise HttpError(503, "the engine is not responding")
        return list(reply.adapters)

    def engine_dead(self) -> str | None:
        """Why the engine died, once the engine itself (a fatal step) or the launcher has said so; with
        several model copies, once every copy has."""
        if self.run_dir is None:
            return None
        if isinstance(self.client, EnginePool):
            reasons = [self.client.dead(i) for i in range(len(self.client.clients))]
            return reasons[0] if all(reasons) else None
        return read_failure(self.run_dir, "engine")

    def drain_deadline(self) -> float | None:
        """The wall-clock time by which requests must end, once the launcher has begun to drain."""
        if self._drain_deadline is None and self.run_dir is not None:
            try:
                with open(draining_path(self.run_dir), encoding="utf-8") as f:
                    self._drain_deadline = float(f.read())
            except (OSError, ValueError):
                return None
        return self._drain_deadline

    def interrupted(self, request_id: str | None = None) -> HttpError | None:
        """Why a request in flight must end now, if it must (with several copies: its copy died)."""
        dead = self.engine_dead()
        if dead is None and request_id is not None and isinstance(self.client, EnginePool):
            index = self.client.copy_of(request_id)
            dead = self.client.dead(index) if index is not None else None
            dead = f"model copy {index}: {dead}" if dead else None
        if dead:
            return HttpError(424, f"the model failed during generation: {dead}")
        deadline = self.drain_deadline()
        if deadline is not None and time.time() > deadline:
            return HttpError(503, "the server is shutting down: the request was aborted at the end of the drain "
                                  f"(drain_timeout={self.config.server.drain_timeout_s:g} s)")
        return None

    def require_ready(self) -> None:
        if self.engine_dead():
            raise HttpError(503, f"the model is not available: {self.engine_dead()}")
        if self.drain_deadline() is not None:
            raise HttpError(503, "the server is shutting down; send the request to another instance")
        if self.engine_ready:
            return
        reply = self.client.health(PING_TIMEOUT_S)
        if reply is None or reply.state != STATE_READY:
            state = reply.state if reply else "not responding"
            raise HttpError(503, f"the model is not ready (engine {state}); retry later")
        self.engine_ready = True

    def start(self, req: GenerationRequest, request_id: str) -> list[Generation]:
        """Tokenize, check lengths, and send every input to the engine."""
        prompts = [(self.tokenizer.encode(text), text) for text in req.inputs]
        if req.truncate:  # TGI: the last `truncate` tokens of each input
            prompts = [(ids[-req.truncate:], text) for ids, text in prompts]
        return self.launch(req, prompts, request_id)

    def launch(self, req: GenerationRequest, prompts: list[tuple[list[int], str]], request_id: str,
               copies: int = 1) -> list[Generation]:
        """Send `copies` generations of every (token ids, text) prompt to the engine, in that order.
        Copies after the first of a seeded request get seed + k, so they differ and still repeat."""
        if self.is_dynamic and req.sampling.has_output_penalties:
            raise bad_request("presence_penalty and frequency_penalty need a rolling-batch engine "
                              "(dynamic batching runs HF generate, which has neither)")
        if self.is_dynamic and req.sampling.top_n_tokens:
            raise bad_request("top_n_tokens needs a rolling-batch engine (dynamic batching runs HF generate, "
                              "which keeps no alternatives per token)", "top_n_tokens")
        if req.bad_words:  # vLLM's: each word as it is and after a space (a word's first token differs)
            ids = {tuple(self.tokenizer.encode(text, add_special_tokens=False))
                   for word in req.bad_words for text in (word.lstrip(), " " + word.lstrip())}
            req = replace(req, sampling=msgspec.structs.replace(req.sampling, bad_words_ids=tuple(sorted(w for w in ids
                                                                                                       if w))))
        if self.is_dynamic and req.sampling.has_logit_masks:
            raise bad_request("logit_bias, min_tokens and bad_words need a rolling-batch engine (dynamic batching "
                              "runs HF generate as it is)", "logit_bias" if req.sampling.logit_bias else
                              "min_tokens" if req.sampling.min_tokens else "bad_words")
        if req.sampling.logit_bias and req.sampling.logit_bias[-1][0] >= self.vocab_size:
            raise bad_request(f"logit_bias names token {req.sampling.logit_bias[-1][0]}: this model's token ids are "
                              f"0 .. {self.vocab_size - 1}", "logit_bias")
        if self.is_dynamic and req.sampling.prompt_logprobs:
            raise bad_request("the prompt's log-probabilities (decoder_input_details, echo with logprobs) need a "
                              "rolling-batch engine", "decoder_input_details")
        for i, (ids, _) in enumerate(prompts):
            total = len(ids) + req.sampling.max_new_tokens
            if total > self.max_model_len:
                where = f"input {i}" if len(prompts) > 1 else "the input"
                raise bad_request(f"{where} has {len(ids)} tokens and max_new_tokens is "
                                  f"{req.sampling.max_new_tokens}: {total} exceeds the model's maximum "
                                  f"length of {self.max_model_len} tokens")
        gens: list[Generation] = []
        for i, (ids, text) in enumerate(prompts):
            for k in range(copies):
                copy = req if k == 0 or req.sampling.seed is None else \
                    replace(req, sampling=msgspec.structs.replace(req.sampling, seed=req.sampling.seed + k))
                rid = f"{request_id}-{len(gens)}"
                gens.append(Generation(self.client, rid, ids, text, copy, self.tokenizer,
                                       functools.partial(self.interrupted, rid),
                                       req.adapters[i] if req.adapters else None))
        return gens

    def streams_by_default(self, req: GenerationRequest) -> bool:
        """option.output_formatter=jsonlines|sse streams every one-input request, as DJL does."""
        return self.config.server.output_formatter != "json" and not self.is_dynamic and not req.is_list

    def deadline(self) -> float:
        return time.monotonic() + self.config.scheduler.predict_timeout_s


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


def read_body(environ: dict, content_length: int | None, limit: int) -> bytes:
    """The whole body, at most `limit` bytes (413 beyond, also for chunked bodies of unknown length);
    a body that cannot be read (a bad chunk, a client gone mid-body) is a 400."""
    if content_length is not None and content_length > limit:
        raise HttpError(413, f"the request body exceeds max_request_size ({limit} bytes)")
    stream = environ["wsgi.input"]
    chunks, total = [], 0
    try:
        while True:
            chunk = stream.read(min(BODY_CHUNK, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise HttpError(413, f"the request body exceeds max_request_size ({limit} bytes)")
    except HttpError:
        raise
    except Exception as exc:
        raise bad_request(f"the request body could not be read: {exc or type(exc).__name__}") from None
    return b"".join(chunks)


def build_app(service: Service) -> Flask:
    app = Flask("lmi-serve")
    app.json.sort_keys = False
    max_body = service.config.server.max_request_size

    @app.before_request
    def _request_id():
        g.request_id = uuid.uuid4().hex  # ours: what the engine and the logs key on
        g.client_request_id = request.headers.get("X-Request-Id")
        g.log_id = g.request_id if not g.client_request_id else f"{g.request_id} client-id={g.client_request_id!r}"
        g.counted = request.path not in UNCOUNTED_PATHS
        if g.counted:
            REQUEST_METRICS.request_started()
        if service.handler is not None and not custom.serves(request.path):
            raise HttpError(404, custom.ROUTE_REFUSAL)

    @app.after_request
    def _tag(resp: Response):
        resp.headers["X-Request-Id"] = g.get("client_request_id") or g.get("request_id", "")
        if g.get("counted"):  # counted when the response is closed: a stream at its end
            route, status = request.url_rule.rule if request.url_rule else "unmatched", resp.status_code
            resp.call_on_close(lambda: REQUEST_METRICS.request_ended(route, status))
        return resp

    @app.errorhandler(HttpError)
    def _http_error(err: HttpError):
        log.info("[%s] %d %s", g.get("log_id"), err.code, err.message)
        return err.response(openai=request.path.startswith("/v1/"), tgi=request.path in TGI_PATHS or (
            request.path == "/invocations" and service.config.server.tgi_compat))

    @app.errorhandler(HTTPException)
    def _werkzeug_error(err: HTTPException):
        return _http_error(HttpError(err.code or 500, err.description or err.name))

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        log.exception("[%s] unexpected error", g.get("log_id"))
        return _http_error(HttpError(500, f"internal error: {type(err).__name__}"))

    @app.get("/ping")
    @app.get("/health")
    def ping():
        dead = service.engine_dead()
        if dead:
            service.engine_ready = False
            return _json({"status": "unhealthy", "engine": "dead", "detail": dead}, 503)
        if service.drain_deadline() is not None:
            return _json({"status": "draining", "engine": "draining"}, 503)
        reply = service.client.health(PING_TIMEOUT_S, max_age=PING_SNAPSHOT_AGE_S)
        if reply is not None and reply.state != STATE_READY:  # not ready in the snapshot: ask now, so that
            reply = service.client.health(PING_TIMEOUT_S)  # readiness shows the moment the engine has it
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
        if isinstance(service.client, EnginePool):  # each copy's own numbers, labelled
            reply = service.client.healths(PING_TIMEOUT_S)
        return Response(render_metrics(reply, service.config.scheduler.engine_kind, REQUEST_METRICS.families),
                        mimetype="text/plain; version=0.0.4")

    @app.post("/invocations")
    @app.post("/predictions/<model_name>")
    def invocations(model_name: str | None = None):
        if service.handler is not None:
            service.require_ready()
            return custom.call(service, read_body(request.environ, request.content_length, max_body))
        body = _parse(read_body(request.environ, request.content_length, max_body), request.content_type, parse_body)
        if isinstance(body, dict) and "messages" in body:
            return djl_chat(run_openai, render_chat, service, body)
        if service.config.server.tgi_compat:
            return tgi_compat(body)
        req = _parse(body, None, lambda b, _: parse_request(
            b, limits=service.limits, default_max_new_tokens=service.config.server.default_max_new_tokens,
            lora=service.config.model.enable_lora))
        if req.ignored_parameters:
            log.warning("[%s] ignoring unknown parameters: %s", g.log_id, ", ".join(req.ignored_parameters))
        if req.stream and service.is_dynamic:
            raise bad_request("streaming is not supported with dynamic batching (batch_size>1 or "
                              "option.rolling_batch=disable); send \"stream\": false")
        if req.stream and req.is_list:
            raise bad_request("streaming takes one input: send \"inputs\" as a string")
        service.require_ready()
        gens = service.start(req, g.request_id)
        sock = request.environ.get("gunicorn.socket")
        is_gone = lambda: client_gone(sock)  # noqa: E731
        deadline = service.deadline()
        if req.stream or service.streams_by_default(req):
            if req.decoder_input_details:
                for gen in gens:
                    gen.close()
                raise bad_request("\"parameters.decoder_input_details\" cannot be used with streaming "
                                  "(option.output_formatter streams this request)", "decoder_input_details")
            return _stream(gens[0], req, deadline, is_gone)
        try:
            bodies = [response_body(gen, collect(gen, deadline, is_gone), req) for gen in gens]
        except ClientGone:
            log.info("[%s] client disconnected: request aborted", g.log_id)
            return Response(status=499)
        finally:
            for gen in gens:  # a failure in one input aborts the others
                gen.close()
        log.info("[%s] %d input(s), %s tokens%s", g.log_id, len(gens), [gen.num_generated_tokens for gen in gens],
                 f", LoRA adapters {list(req.adapters)}" if req.adapters else "")
        return _json(bodies if service.is_dynamic or req.is_list else bodies[0], 200)

    def _parse(raw, content_type: str | None, parse):
        try:
            return parse(raw, content_type)
        except HttpError:
            raise
        except Exception as exc:  # whatever the body holds, a parse failure is the client's: 400
            log.warning("[%s] unparsable request: %r", g.log_id, exc)
            raise bad_request(f"the request could not be parsed: {type(exc).__name__}") from None

    run_openai, render_chat = register_openai(
        app, service, lambda: read_body(request.environ, request.content_length, max_body), _json)
    tgi_compat = register_tgi(app, service, lambda: read_body(request.environ, request.content_length, max_body),
                              _json)
    register_adapters(app, service, lambda: read_body(request.environ, request.content_length, max_body), _json)

    def _stream(gen: Generation, req: GenerationRequest, deadline: float, is_gone) -> Response:
        """The status line waits for the first token: a request refused before it gets its real status."""
        sse = service.config.server.output_formatter == "sse" or \
            "text/event-stream" in request.headers.get("Accept", "")
        lines = stream_lines(gen, req, deadline, sse, is_gone)
        try:
            first = next(lines)
        except ClientGone:
            log.info("[%s] client disconnected before the first token: request aborted", g.log_id)
            return Response(status=499)
        return Response(itertools.chain([first], lines), mimetype=SSE if sse else JSONLINES)

    return app


def _json(body, status: int) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status=status, mimetype="application/json")
