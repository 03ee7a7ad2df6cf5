"""What every route of one worker process shares (the `Service`), and the one generation path they
all take:

    gens = service.launch(req, prompts, request_id)      refusals, lengths, one Generation per input
    service.respond(gens, finish)                        collect every token list → finish(tokens) → JSON
    service.respond_stream(lines, mimetype)              the status line waits for the first line

A client that goes away gets a 499 before its first token and an aborted request after; every
generation is closed however the request ends (a failure in one input aborts the others).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import time
from dataclasses import replace
from typing import Callable, Iterator

import msgspec
from flask import Response, g, request

from engines.config import ENGINE_DYNAMIC, ENGINE_PAGED, TASK_GENERATION, LmiConfig
from engines.process.rundir import draining_path, read_failure
from engines.protocol import STATE_READY, AdapterInfo, Slo
from engines.spec import ModelSpec
from handlers.chat_template import ChatTemplate
from handlers.engine_client import EngineClient
from handlers.engine_pool import EnginePool
from handlers.errors import HttpError, bad_request
from handlers.formatters import collect
from handlers.generation import ClientGone, CopyDied, Generation, client_gone
from handlers.pooling import EncoderInputs
from handlers.refusals import refuse_dynamic_sampling, refuse_wrong_task
from handlers.schemas import GenerationRequest, RequestLimits, slo_of
from handlers.tokenizer import TextTokenizer

log = logging.getLogger("handlers.app")

PING_TIMEOUT_S = 1.0  # a health round trip when the snapshot is older than PING_SNAPSHOT_AGE_S
PING_SNAPSHOT_AGE_S = 1.0  # a ready snapshot this fresh answers /ping (a death shows through engine.dead)
BODY_CHUNK = 1 << 16
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds within which the request must start (parameters.timeout)
MAX_TENANT_CHARS = 128  # a tenant's name as /metrics labels it


def _number_or_text(raw: str):
    try:
        return float(raw)
    except ValueError:
        return raw  # (slo_of names the header and what it holds)


class Service:
    """What the routes share in one worker process."""

    def __init__(self, config: LmiConfig, client: EngineClient, tokenizer: TextTokenizer,
                 run_dir: str | None = None, chat_template: ChatTemplate | None = None, drain_dir: str | None = None):
        self.config = config
        self.chat_template = chat_template
        self.started_at = time.time()
        self.run_dir = run_dir  # the model's (its engine's ready and failure files)
        self.drain_dir = drain_dir or run_dir  # the server's (the draining file)
        self.client = client
        self.tokenizer = tokenizer
        self.handler = config.model.entry_point  # a custom handler serves /invocations (handlers/custom.py)
        spec = ModelSpec.of(config.model) if self.handler is None else None
        self.max_model_len = spec.max_model_len if spec else 0
        self.vocab_size = (spec.vocab_size or tokenizer.vocab_size) if spec else 0  # logit_bias ids must be below it
        self.is_dynamic = config.scheduler.engine_kind == ENGINE_DYNAMIC
        self.task = config.model.task
        self.model_name = config.server.served_model_name
        self.limits = RequestLimits(config.server.max_inputs_per_request, config.server.max_input_chars)
        self.engine_ready = False
        self._drain_deadline: float | None = None
        self._encoder_inputs = None

    def encoder_inputs(self):
        """A pooling model's tokenizers (handlers/pooling.py), made on first use."""
        if self._encoder_inputs is None:
            self._encoder_inputs = EncoderInputs(self.config.model.local_dir, self.config.model.pooling.max_input_tokens)
        return self._encoder_inputs

    # -- the engine's state ------------------------------------------------------------------------
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
        if self._drain_deadline is None and self.drain_dir is not None:
            try:
                with open(draining_path(self.drain_dir), encoding="utf-8") as f:
                    self._drain_deadline = float(f.read())
            except (OSError, ValueError):
                return None
        return self._drain_deadline

    def interrupted(self, request_id: str | None = None) -> HttpError | None:
        """Why a request in flight must end now, if it must (with several copies: its copy died, CopyDied)."""
        dead = self.engine_dead()
        if dead:
            return HttpError(424, f"the model failed during generation: {dead}")
        died = self.client.copy_died(request_id) if request_id and isinstance(self.client, EnginePool) else None
        if died:  # its Generation re-sends it to another copy when none of its output has arrived
            return CopyDied(*died)
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

    # -- the generation path ----------------------------------------------------------------------
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
        refuse_wrong_task(self.task, TASK_GENERATION, "text generation")
        if req.bad_words:  # vLLM's: each word as it is and after a space (a word's first token differs)
            ids = {tuple(self.tokenizer.encode(text, add_special_tokens=False))
                   for word in req.bad_words for text in (word.lstrip(), " " + word.lstrip())}
            req = replace(req, sampling=msgspec.structs.replace(req.sampling, bad_words_ids=tuple(sorted(w for w in ids
                                                                                                       if w))))
        refuse_dynamic_sampling(self.is_dynamic, req.sampling)
        req = replace(req, slo=self.service_level(req.slo))
        if req.sampling.logit_bias and req.sampling.logit_bias[-1][0] >= self.vocab_size:
            raise bad_request(f"logit_bias names token {req.sampling.logit_bias[-1][0]}: this model's token ids are "
                              f"0 .. {self.vocab_size - 1}", "logit_bias")
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
                                       req.adapters[i] if req.adapters else None, self.model_name))
        return gens

    def watch(self) -> tuple[float, Callable[[], bool]]:
        """The current request's deadline and its test for a client gone."""
        sock = request.environ.get("gunicorn.socket")
        return time.monotonic() + self.config.scheduler.predict_timeout_s, lambda: client_gone(sock)

    def respond(self, gens: list[Generation], finish: Callable[[list[list[dict]]], Response]) -> Response:
        """Every generation's tokens collected, then finish(token lists) → the response."""
        deadline, is_gone = self.watch()
        try:
            tokens = [collect(gen, deadline, is_gone) for gen in gens]
        except ClientGone:
            log.info("[%s] client disconnected: request aborted", g.log_id)
            return Response(status=499)
        finally:
            for gen in gens:
                gen.close()
        return finish(tokens)

    @staticmethod
    def respond_stream(lines: Iterator[bytes], mimetype: str) -> Response:
        """The status line waits for the first line: a request refused before it gets its real status."""
        try:
            first = next(lines)
        except ClientGone:
            log.info("[%s] client disconnected before the first token: request aborted", g.log_id)
            return Response(status=499)
        return Response(itertools.chain([first], lines), mimetype=mimetype)

    def streams_by_default(self, req: GenerationRequest) -> bool:
        """option.output_formatter=jsonlines|sse streams every one-input request, as DJL does."""
        return self.config.server.output_formatter != "json" and not self.is_dynamic and not req.is_list

    def service_level(self, slo: Slo) -> Slo:
        """The request's Slo with what its headers add: the tenant (option.fair_share_key names the
        header) and X-Request-Timeout (seconds to start, as parameters.timeout); checked against the
        engine: a priority needs option.scheduling_policy=priority, a deadline the paged engine."""
        sched = self.config.scheduler
        timeout = request.headers.get(TIMEOUT_HEADER)
        if timeout is not None:
            seconds = slo_of({"timeout": _number_or_text(timeout)}, where=f"header {TIMEOUT_HEADER}: ").max_wait_ms
            slo = msgspec.structs.replace(slo, max_wait_ms=min(filter(None, (slo.max_wait_ms, seconds))))
        if slo.priority and sched.scheduling_policy != "priority":
            raise bad_request(f"priority {slo.priority} is served with option.scheduling_policy=priority; this server "
                              f"admits requests in arrival order ({sched.scheduling_policy})", "priority")
        if slo.max_wait_ms is not None and sched.engine_kind != ENGINE_PAGED:
            raise bad_request(f"a request timeout is honoured by the paged engine, not the {sched.engine_kind} "
                              "engine this server runs", "timeout")
        key = sched.fair_share_key
        if key and key != "adapter":
            slo = msgspec.structs.replace(slo, tenant=request.headers.get(key, "")[:MAX_TENANT_CHARS])
        return slo

    # -- request bodies -----------------------------------------------------------------------------
    def body(self) -> bytes:
        return read_body(request.environ, request.content_length, self.config.server.max_request_size)


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


def parse_or_400(raw, content_type: str | None, parse):
    """parse(raw, content_type); whatever the body holds, a failure to parse it is the client's: 400."""
    try:
        return parse(raw, content_type)
    except HttpError:
        raise
    except Exception as exc:
        log.warning("[%s] unparsable request: %r", g.log_id, exc)
        raise bad_request(f"the request could not be parsed: {type(exc).__name__}") from None


def json_response(body, status: int = 200) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status=status, mimetype="application/json")


def warn_ignored(req: GenerationRequest) -> None:
    if req.ignored_parameters:
        log.warning("[%s] ignoring unknown parameters: %s", g.log_id, ", ".join(req.ignored_parameters))
