"""Messages between the HTTP workers and the engine (ZeroMQ frames, msgpack via msgspec).

    worker ──ADD / ABORT / HEALTH / ADAPTER_COMMAND / HANDLER_CALL / ENCODE──►  engine (ROUTER)
    worker ◄──OUTPUT / HEALTH_REPLY / ADAPTER_REPLY / HANDLER_REPLY / ENCODED──  engine

Each worker process holds one DEALER socket; the engine replies to the socket a request came from.
Token ids travel once (in ADD); outputs carry only the new token ids of each step.
"""

from __future__ import annotations

import msgspec

from engines.sampling_params import SamplingParams

# engine states, as /ping shows them
STATE_LOADING = "loading"
STATE_READY = "ready"
STATE_DEAD = "dead"

# finish reasons (LMI names)
FINISH_LENGTH = "length"
FINISH_EOS = "eos_token"
FINISH_STOP = "stop_sequence"
FINISH_ERROR = "error"
FINISH_ABORT = "abort"


class Slo(msgspec.Struct, frozen=True, array_like=True):
    """How a request wants to be scheduled (docs/scheduling.md): its priority (lower is served first,
    as vLLM's), its tenant (option.fair_share_key: fair shares at admission) and how long it may wait
    to start (a request's timeout or option.max_queue_wait_ms: shed with a 503 when it cannot)."""

    priority: int = 0
    tenant: str = ""
    max_wait_ms: float | None = None


class Add(msgspec.Struct, tag="add", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    lora_name: str | None = None  # a LoRA adapter (option.enable_lora), None: the base model
    slo: Slo = Slo()


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_id: str


class Health(msgspec.Struct, tag="health", frozen=True):
    nonce: int = 0


class AdapterCommand(msgspec.Struct, tag="adapter_command", frozen=True):
    """Register (path: its local PEFT directory; src: where the caller said it is) or unregister a LoRA
    adapter at run time; answered with one AdapterReply carrying the same request id."""

    request_id: str
    action: str  # ADAPTER_REGISTER | ADAPTER_UNREGISTER
    name: str
    path: str = ""
    src: str = ""
    pin: bool = False


ADAPTER_REGISTER = "register"
ADAPTER_UNREGISTER = "unregister"


class AdapterReply(msgspec.Struct, tag="adapter_reply", frozen=True):
    request_id: str
    status: int  # an HTTP status: 200, 400 (cannot be served), 404 (no such adapter)
    message: str


class AdapterInfo(msgspec.Struct, frozen=True):
    """A LoRA adapter the engine serves, as /v1/models, the adapter routes and /metrics show it."""

    name: str
    src: str
    rank: int
    slot: int = 0  # its device slot while resident (0: not on the device)
    pinned: bool = False
    unregistering: bool = False  # waiting for its requests to end before it goes
    num_running: int = 0
    num_waiting: int = 0
    requests: int = 0  # finished requests
    prompt_tokens: int = 0
    generated_tokens: int = 0


class HealthReply(msgspec.Struct, tag="health_reply", frozen=True):
    state: str
    nonce: int = 0
    detail: str = ""
    num_waiting: int = 0
    num_running: int = 0
    num_batches: int = 0  # dynamic batches run, or rolling-engine steps
    num_kv_slots: int = 0  # rolling engines: KV token slots held by the running batch
    metrics: dict[str, float] = {}  # engine gauges and counters for /metrics
    startup: dict[str, float] = {}  # start-up phase → seconds (engines/process/startup.py)
    adapters: list[AdapterInfo] = []  # option.enable_lora: the adapters served now


class Output(msgspec.Struct, tag="output", frozen=True):
    """New tokens of one request (a step's worth, or all of them for dynamic batching)."""

    request_id: str
    token_ids: list[int]
    log_probs: list[float] = []
    top_tokens: list[list[tuple[int, float]]] = []  # per new token: top_n_tokens (id, log_prob)
    finished: bool = False
    finish_reason: str | None = None
    # set when the request failed: an HTTP status (424 model error, 503 queue full, 507 OOM)
    error_code: int | None = None
    error: str | None = None
    # id of the engine batch that produced it (dynamic batching: observable batching)
    batch_id: int | None = None
    # with SamplingParams.prompt_logprobs, on the request's first output: per prompt token its
    # log-prob (None for the first, which nothing predicts) and its top_n_tokens alternatives
    prompt_log_probs: list[float | None] | None = None
    prompt_top_tokens: list[list[tuple[int, float]]] | None = None
    # a 503 shed by the scheduler: when it expects to have room (the Retry-After header, seconds)
    retry_after_s: float | None = None


class HandlerCall(msgspec.Struct, tag="handler_call", frozen=True):
    """One HTTP request for a custom handler (engines/custom/handler_engine.py): its headers and body, as DJL's
    Input carries them; answered with one HandlerReply."""

    request_id: str
    properties: dict[str, str]
    content: list[tuple[str, bytes]]


class HandlerReply(msgspec.Struct, tag="handler_reply", frozen=True):
    """The handler's Output: status code and message, properties (headers), content (the body)."""

    request_id: str
    code: int
    message: str
    properties: dict[str, str] = {}
    content: list[tuple[str | None, bytes]] = []


class Encode(msgspec.Struct, tag="encode", frozen=True):
    """Inputs for the pooling engine (engines/pooling/engine.py), already tokenized and truncated: one
    vector each comes back in one Encoded. token_type_ids: BERT's segment ids of a (query, document) pair,
    [] for none. dimensions: embeddings keep their first n values (Matryoshka); normalize: unit length
    (None: as the model does, its Normalize module), applied after the cut."""

    request_id: str
    inputs: list[list[int]]
    token_type_ids: list[list[int]] = []
    dimensions: int | None = None
    normalize: bool | None = None


class Encoded(msgspec.Struct, tag="encoded", frozen=True):
    """One Encode's vectors, in its inputs' order: float32 little-endian bytes each (an embedding, or a
    classifier's logits); or its failure (an HTTP status and a sentence)."""

    request_id: str
    vectors: list[bytes] = []
    error_code: int | None = None
    error: str | None = None


ToEngine = Add | Abort | Health | AdapterCommand | HandlerCall | Encode
FromEngine = Output | HealthReply | AdapterReply | HandlerReply | Encoded

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
