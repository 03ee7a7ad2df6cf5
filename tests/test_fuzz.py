"""Fuzzing POST /invocations on a real server for each engine: hostile bodies never break the server.

Hypothesis sends mostly-valid LMI bodies with hostile values (huge integers, subnormal floats,
NaN/Infinity tokens, lone surrogates, control characters, wrong types, unknown names), and bodies
that are not LMI at all (not JSON, deeply nested, not an object, wrong content types). On every
response:

- the status is below 500, and a response comes back (no connection error, no timeout);
- no 424 either: the tiny model never fails by itself, so a 424 is a request that passed validation
  and then crashed the engine (it should have been a 400);
- the body, and every streamed line, is strict JSON (NaN and Infinity are not JSON) in UTF-8;
- an error is `{"code", "type", "error"}` with code == status (an error line ending a stream too);
- a 200 has a `generated_text` string for each input (the engine's shape: a list under dynamic
  batching, an object for a string input on the rolling engines), streamed or not.

After the fuzzing the server is still healthy, idle (no KV memory held), and gives the same greedy
text as before it. The EXAMPLES run first on every engine: payloads that once broke the server.

Every class of violation (the invariant, and for a 5xx the exception the server logged) is reported at
the end with its count and its smallest payload, request and response, so that one run lists them all.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.support import ROOT, running_server, wait_idle

pytestmark = pytest.mark.slow

COMMON = """
engine=Python
option.dtype=fp32
option.kv_cache_memory=32MiB
"""
ENGINES = {
    "dynamic": COMMON + "option.rolling_batch=disable\nbatch_size=1\n",
    "rolling": COMMON + "option.rolling_batch=scheduler\noption.max_rolling_batch_size=8\n",
    "paged": COMMON + "option.rolling_batch=lmi-dist\noption.max_rolling_batch_size=8\n",
}
TIMEOUT_S = 30
MAX_EXAMPLES = 300
BASELINE = {"inputs": "The river", "parameters": {"max_new_tokens": 8}}
JSON_TYPES = ("application/json",)
STREAM_TYPES = ("application/jsonlines", "text/event-stream")


@dataclass
class Target:
    engine: str
    server: object
    session: requests.Session


@pytest.fixture(scope="module", params=list(ENGINES))
def target(request, tiny_model, tmp_path_factory):
    engine = request.param
    gen = running_server(tmp_path_factory.mktemp(f"fuzz-{engine}"), ENGINES[engine], tiny_model)
    server = next(gen)
    with requests.Session() as session:
        yield Target(engine, server, session)
    next(gen, None)  # stops the server and checks that it exits 0


# ---------------------------------------------------------------------------------------------
# Payloads


class Raw:
    """A JSON token written as is (NaN, Infinity, 1e400, ...): json.dumps cannot write most of them."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''})"


def dump(value) -> str:
    """JSON text, ASCII only: non-ASCII characters and lone surrogates become \\uXXXX escapes."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dump(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=True)  # floats: nan -> NaN, inf -> Infinity


@dataclass(frozen=True)
class Payload:
    body: bytes
    content_type: str | None = "application/json"
    accept: str | None = None
    kind: str = "lmi"

    def __repr__(self) -> str:
        return (f"Payload(kind={self.kind!r}, content_type={self.content_type!r}, accept={self.accept!r}, "
                f"body[{len(self.body)} bytes]={_cut(self.body, 600)})")


def _cut(data: bytes | str, limit: int) -> str:
    return repr(data[:limit]) + (f"... (+{len(data) - limit})" if len(data) > limit else "")


KNOWN = ["max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed",
         "stop_sequences", "stop", "ignore_eos", "ignore_eos_token", "details", "return_full_text",
         "decoder_input_details", "top_n_tokens", "stop_token_ids", "stream"]

SPECIAL_INTS = [0, -1, 1, 2, -(2**31), 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -(2**63),
                -(2**63) - 1, 2**64 - 1, 2**64, -(2**64), 10**30, -(10**30), 1023, 1024, 1025, 21, 10**6]
SPECIAL_FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, -1.0, -0.5, 1e-45, 5e-324, 2.2250738585072014e-308, 1e-300,
                  1e-30, 1e-8, 1e308, -1e308, 1.7976931348623157e308, 0.9999999999999999, 1.0000000000000002,
                  1e10, 3.0, 20.0, 1024.0, 1.5e19]
RAW_TOKENS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400", "-0", "1E2", "5.0", "-0.0",
              "1" + "0" * 5000, "0.1e1", "2e0"]
SPECIAL_STRINGS = ["\ud800", "\udfff", "a\udc80b", "\ud83d\ude00", "\x00", "\x1b[31m", "\u2028\u2029", "\ufeff",
                   "\uffff", "\U0010ffff", "<s>", "</s>", "<unk>", "<pad>", " ", "\n", "\r\n", "\t", "\\", "\"",
                   "é", "日本語", "🙂", "\u0301", "The river", "Once upon a time", "NaN", "null", "true", "1",
                   "{\"inputs\": 1}", "%s%n", "\x7f"]

pieces = st.one_of(st.sampled_from(SPECIAL_STRINGS), st.text(max_size=12),
                   st.text(st.characters(min_codepoint=0, max_codepoint=0x3f), max_size=8))
short_text = st.lists(pieces, max_size=4).map("".join)
scalars = st.one_of(st.sampled_from(SPECIAL_INTS), st.sampled_from(SPECIAL_FLOATS), st.booleans(), st.none(),
                    short_text, st.integers(), st.floats())
hostile = st.one_of(
    st.sampled_from(SPECIAL_INTS),
    st.sampled_from(SPECIAL_FLOATS),
    st.sampled_from(RAW_TOKENS).map(Raw),
    st.booleans(),
    st.none(),
    short_text,
    st.integers(),
    st.floats(),
    st.lists(scalars, max_size=3),
    st.dictionaries(short_text, scalars, max_size=2),
    st.sampled_from([[], {}, [[]], [[1]], [None], {"inputs": "a"}]),
)

stop_text = short_text.filter(bool)
stops = st.one_of(stop_text, st.lists(stop_text, max_size=3))
VALID = {
    "max_new_tokens": st.integers(1, 8),
    "do_sample": st.booleans(),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1, 1e-45, 5e-324, 1e-300, 1e308])),
    "top_k": st.one_of(st.integers(-1, 1100), st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 10**30])),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([1, 1e-45, 5e-324, 1e-300])),
    "repetition_penalty": st.one_of(st.floats(1e-3, 3), st.sampled_from([1, 5e-324, 1e-300, 1e-45, 1e308])),
    "seed": st.one_of(st.integers(0, 2**32), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30])),
    "stop_sequences": stops,
    "stop": stops,
    "ignore_eos": st.booleans(),
    "ignore_eos_token": st.booleans(),
    "details": st.booleans(),
    "return_full_text": st.booleans(),
    "decoder_input_details": st.booleans(),
    "top_n_tokens": st.integers(0, 20),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, 1100), st.sampled_from([2**31, 2**63, 2**64, 10**30])),
                               max_size=4),
    "stream": st.booleans(),
}
# how often each name is present (out of 8): max_new_tokens most often, to keep generation short
PRESENT = {"max_new_tokens": 7, "details": 4, "do_sample": 4, "top_n_tokens": 3, "temperature": 3, "top_p": 3,
           "repetition_penalty": 3}


@st.composite
def parameters(draw, clean: bool = False) -> dict:
    """Known names with valid values (edge values included); unless clean, some hostile ones and unknown names."""
    params = {}
    for name in KNOWN:
        if draw(st.integers(0, 7)) < PRESENT.get(name, 2):
            hostile_too = not clean and draw(st.integers(0, 5)) == 0
            params[name] = draw(st.one_of(VALID[name], hostile) if hostile_too else VALID[name])
    if not clean and draw(st.integers(0, 5)) == 0:
        unknown = st.one_of(st.sampled_from(["best_of", "n", "typical_p", "watermark", "truncate", "MAX_NEW_TOKENS",
                                             "max_tokens", "", "\ud800", "parameters", "inputs"]), short_text)
        for name, value in draw(st.dictionaries(unknown, hostile, min_size=1, max_size=3)).items():
            params.setdefault(name, value)
    return params


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, each as often as its weight (shrinks towards the first)."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


def _repeat(unit: str, size: int) -> str:
    return unit * max(1, size // len(dump(unit)))


huge_text = st.builds(_repeat, st.sampled_from(["a", "The river ", "é", "\ud800", "\x00", "🙂", "<s>", " "]),
                      st.sampled_from([1_000, 4_000, 20_000, 150_000]))
inputs_values = weighted((8, short_text), (4, st.lists(short_text, min_size=1, max_size=3)), (2, huge_text),
                         (1, st.lists(st.one_of(short_text, hostile), max_size=3)),
                         (1, st.lists(huge_text, min_size=1, max_size=2)), (2, hostile))


@st.composite
def lmi_bodies(draw) -> dict:
    if draw(st.booleans()):  # a body the server should accept, with edge values in its parameters
        body = {"inputs": draw(weighted((3, short_text), (1, st.lists(short_text, min_size=1, max_size=3)))),
                "parameters": draw(parameters(clean=True))}
        if draw(st.integers(0, 5)) == 0:
            body["stream"] = draw(st.booleans())
        return body
    body = {}
    if draw(st.integers(0, 9)):
        body["inputs"] = draw(inputs_values)
    if draw(st.integers(0, 9)):
        body["parameters"] = draw(parameters()) if draw(st.integers(0, 9)) else draw(hostile)
    if draw(st.integers(0, 4)) == 0:
        body["stream"] = draw(st.booleans()) if draw(st.integers(0, 3)) else draw(hostile)
    if draw(st.integers(0, 9)) == 0:
        body.update(draw(st.dictionaries(st.sampled_from(["messages", "model", "", "\ud800", "options"]),
                                         hostile, min_size=1, max_size=2)))
    if draw(st.integers(0, 4)) == 0:  # shuffle the key order (the last duplicate key wins in most parsers)
        body = dict(draw(st.permutations(list(body.items()))))
    return body


@st.composite
def encoded(draw, body: dict) -> bytes:
    text = dump(body)
    how = draw(st.sampled_from(["ascii"] * 16 + ["utf-8", "utf-8", "utf-16", "utf-32", "bom", "trailing"]))
    if how == "utf-8":  # lone surrogates become invalid UTF-8 (CESU-8 bytes)
        return _utf8(text)
    if how in ("utf-16", "utf-32"):
        return _unescaped(text).encode(how, "surrogatepass")
    if how == "bom":
        return b"\xef\xbb\xbf" + text.encode()
    if how == "trailing":
        return text.encode() + draw(st.sampled_from([b" ", b"\n", b"x", b",", b"}", b"\x00", b" {}"]))
    return text.encode()


def _decode_escapes(text: str) -> str:
    """The same JSON text with \\uXXXX escapes of non-ASCII characters written as the characters."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("\\\\", i):
            out.append("\\\\")
            i += 2
        elif text.startswith("\\u", i) and int(text[i + 2:i + 6], 16) >= 0x80:
            out.append(chr(int(text[i + 2:i + 6], 16)))
            i += 6
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _utf8(text: str) -> bytes:
    return _unescaped(text).encode("utf-8", "surrogatepass")


def _unescaped(text: str) -> str:
    """_decode_escapes, with surrogate pairs joined into their characters (lone ones stay lone)."""
    return _decode_escapes(text).encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")


def _nested(opener: str, depth: int, closed: bool) -> str:
    closer = {"[": "]", "{\"a\": ": "}", "{\"inputs\": ": "}"}[opener]
    return opener * depth + ("1" + closer * depth if closed else "")


nested = st.builds(_nested, st.sampled_from(["[", "{\"a\": ", "{\"inputs\": "]),
                   st.sampled_from([10, 900, 990, 1000, 2000, 10_000, 30_000]), st.booleans())
RAW_BODIES = [b"", b" ", b"\n", b"null", b"1", b"-1", b"[]", b"{}", b"\"x\"", b"true", b"NaN", b"Infinity", b"{",
              b"}", b"[", b"{\"inputs\":", b"{\"inputs\": \"a\"", b"\xff\xfe", b"\xff", b"\xc3\x28",
              b"{'inputs': 'a'}", b"{\"inputs\": \"a\"}garbage", b"{\"inputs\": \"a\",}", b"{inputs: \"a\"}",
              b"{\"inputs\": \"a\", \"inputs\": 1}", b"{\"inputs\": 1, \"inputs\": \"a\"}",
              b"{\"inputs\": \"\\ud800\\udc00\"}", b"{\"inputs\": \"\\u0000\"}", b"{\"inputs\": \"\\x\"}",
              b"{\"inputs\": \"a\\\"}", b"{\"inputs\": \"\x01\"}", b"\x00{\"inputs\": \"a\"}",
              b"inputs=a&parameters=b", b"--xyz\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nb\r\n--xyz--"]


@st.composite
def raw_bodies(draw) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.sampled_from(RAW_BODIES))
    if kind == 1:
        return draw(st.binary(max_size=64))
    inner = draw(nested)
    where = draw(st.sampled_from(["top", "inputs", "parameters", "unknown_parameter", "stop"]))
    return {"top": inner,
            "inputs": "{\"inputs\": " + inner + "}",
            "parameters": "{\"inputs\": \"a\", \"parameters\": " + inner + "}",
            "unknown_parameter": "{\"inputs\": \"a\", \"parameters\": {\"max_new_tokens\": 1, \"x\": " + inner + "}}",
            "stop": "{\"inputs\": \"a\", \"parameters\": {\"max_new_tokens\": 1, \"stop\": " + inner + "}}",
            }[where].encode()


CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", None, "text/plain",
                 "text/plain; charset=utf-8", "text/plain; charset=latin-1", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=xyz", "multipart/form-data", "application/octet-stream",
                 "text/html", "", ";;;=", "application/jsonlines", "application/json; charset=utf-16"]
ACCEPTS = [None, None, None, "text/event-stream", "*/*", "application/jsonlines", "application/json"]


@st.composite
def payloads(draw) -> Payload:
    content_type = "application/json" if draw(st.integers(0, 3)) else draw(st.sampled_from(CONTENT_TYPES))
    accept = draw(st.sampled_from(ACCEPTS))
    if draw(st.integers(0, 5)):
        return Payload(draw(encoded(draw(lmi_bodies()))), content_type, accept, "lmi")
    return Payload(draw(raw_bodies()), content_type, accept, "raw")


def _lmi(inputs, **parameters) -> bytes:
    return dump({"inputs": inputs, "parameters": parameters}).encode()


# Run first on every engine, before the generated payloads: hostile values that once broke the server.
EXAMPLES = [
    Payload(_lmi("\ud800", max_new_tokens=2)),  # a lone surrogate (the body holds the \ud800 escape)
    Payload(_lmi(["ok", "a\udfffb"], max_new_tokens=2)),
    Payload(_lmi("a", max_new_tokens=2, stop="\ud800")),
    Payload(_lmi("a", max_new_tokens=2, seed=2**64)),
    Payload(_lmi("a", max_new_tokens=2, top_k=2**64, do_sample=True)),
    Payload(_lmi("a", max_new_tokens=2, stop_token_ids=[2**64])),
    Payload(_lmi("a", max_new_tokens=2, stop_token_ids=[2**63])),
    Payload(_lmi("a", max_new_tokens=2, seed=10**30, top_k=-(2**64))),
    Payload(b"[" * 10_000, kind="raw"),
    Payload(("{\"inputs\": \"a\", \"parameters\": {\"x\": " + "[" * 5000 + "]" * 5000 + "}}").encode(), kind="raw"),
    Payload(_lmi("a", max_new_tokens=3, do_sample=True, temperature=1e-45, details=True)),
    Payload(_lmi("a", max_new_tokens=3, do_sample=True, top_p=1e-300, details=True)),
    Payload(_lmi("a", max_new_tokens=3, repetition_penalty=1e-300, details=True)),
    Payload(_lmi("a", max_new_tokens=3, do_sample=True, top_p=1e-45, top_n_tokens=5, details=True)),
    Payload(_lmi("a", max_new_tokens=1, do_sample=True, top_k=1, top_n_tokens=3, details=True)),
    Payload(dump({"inputs": "a", "stream": True, "parameters": {"max_new_tokens": 3, "repetition_penalty": 1e-300,
                                                               "details": True}}).encode()),
    Payload(_lmi("a", max_new_tokens=Raw("NaN"), temperature=Raw("Infinity"))),
    Payload(b"\xff\xfe", content_type="text/plain", kind="raw"),
]


# ---------------------------------------------------------------------------------------------
# Invariants


class Violation(AssertionError):
    def __init__(self, name: str, message: str, payload: Payload, *, fatal: bool = False):
        super().__init__(message)
        self.name, self.message, self.payload, self.fatal = name, message, payload, fatal


class Findings:
    """Every class of violation seen, with its count and its smallest payload."""

    def __init__(self, engine: str):
        self.engine = engine
        self.classes: dict[str, list] = {}  # name -> [count, smallest Violation]
        self.stopped = False  # after a request that got no answer: send nothing more
        self.sent = 0

    def add(self, v: Violation) -> None:
        entry = self.classes.setdefault(v.name, [0, v])
        entry[0] += 1
        if len(v.payload.body) < len(entry[1].payload.body):
            entry[1] = v
        self.stopped = self.stopped or v.fatal

    def report(self) -> str:
        out = [f"[{self.engine}] {len(self.classes)} class(es) of violation in {self.sent} fuzzed requests "
               f"(the smallest payload of each):"]
        for i, (name, (count, v)) in enumerate(self.classes.items(), 1):
            out.append(f"\n--- {i}. {name} ({count} payload(s))\n{v.message}")
        return "\n".join(out)


def _reject_constant(token: str):
    raise ValueError(f"{token} is not JSON")


def strict_json(text: str):
    return json.loads(text, parse_constant=_reject_constant)


def expected(payload: Payload) -> tuple[int, bool, bool] | None:
    """(number of inputs, inputs is a list, stream) as the server should read a body it accepts."""
    mime = (payload.content_type or "").split(";")[0].strip().lower()
    if mime == "text/plain":
        return 1, False, False
    try:
        body = json.loads(payload.body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or "inputs" not in body:
        return None
    inputs = body["inputs"]
    params = body.get("parameters") if isinstance(body.get("parameters"), dict) else {}
    stream = params["stream"] if "stream" in params else body.get("stream")  # as the server reads them
    return (len(inputs), True, stream is True) if isinstance(inputs, list) else (1, False, stream is True)


# A 424 means the model failed during generation (or did not answer within option.predict_timeout,
# minutes, far beyond TIMEOUT_S): on a healthy tiny model, that is a request the validation let
# through although the engine cannot run it. It should have been a 400.
MODEL_ERROR = "a 424 (the model failed) for a request that passed validation: it should have been a 400"


def _error_text(content: bytes) -> str:
    try:
        return str(json.loads(content).get("error", ""))[:80]
    except (ValueError, AttributeError):
        return _cut(content, 80)


def server_exception(log: str, request_id: str) -> tuple[str, str]:
    """('ExcType @ file:line in fn', traceback) the server logged for this request, or ('', '')."""
    start = log.find(f"[{request_id}] unexpected error")
    if start < 0:
        return "", ""
    lines = []
    for line in log[start:].splitlines()[1:]:
        if line[:4].isdigit() and line[4:5] == "-":  # the next log record
            break
        lines.append(line)
    where = [ln.strip() for ln in lines if ln.strip().startswith("File ")]
    what = [ln for ln in lines if ln and not ln[0].isspace() and not ln.startswith(("Traceback", "During", "The above"))]
    if not what:
        return "", ""
    location = ""
    if where:  # File "/path/x.py", line 12, in fn
        parts = where[-1].split('"')
        path = parts[1].replace(str(ROOT) + "/", "") if len(parts) > 2 else where[-1]
        location = f" @ {path}{parts[2].split(',')[1].replace(' line ', ':') if len(parts) > 2 else ''}" \
                   f" in {where[-1].rsplit(' in ', 1)[-1]}"
    return what[-1].split(":")[0][:80] + location, "server traceback:\n" + "\n".join(lines)[-2500:]


class Check:
    def __init__(self, target: Target, payload: Payload):
        self.target, self.payload = target, payload
        self.resp: requests.Response | None = None

    def fail(self, name: str, why: str, detail: str = "", *, fatal: bool = False) -> None:
        lines = [f"[{self.target.engine}] {name}: {why}", f"payload: {self.payload!r}"]
        if self.resp is not None:
            lines.append(f"response: {self.resp.status_code} {self.resp.headers.get('Content-Type')!r} "
                         f"{_cut(self.resp.content, 1200)}")
        if detail:
            lines.append(detail)
        raise Violation(name, "\n".join(lines), self.payload, fatal=fatal)

    def send(self) -> None:
        headers = {"X-Request-Id": f"fuzz-{uuid.uuid4().hex}"}
        if self.payload.content_type is not None:
            headers["Content-Type"] = self.payload.content_type
        if self.payload.accept is not None:
            headers["Accept"] = self.payload.accept
        self.request_id = headers["X-Request-Id"]
        try:
            self.resp = self.target.session.post(self.target.server.url + "/invocations", data=self.payload.body,
                                                 headers=headers, timeout=TIMEOUT_S)
        except requests.RequestException as exc:
            self.fail(f"no response ({type(exc).__name__})", repr(exc)[:500],
                      "server log tail:\n" + self.target.server.log()[-3000:], fatal=True)

    def run(self) -> None:
        self.send()
        resp = self.resp
        status = resp.status_code
        if status >= 500:
            cause, trace = server_exception(self.target.server.log(), self.request_id)
            self.fail(f"status {status}: {cause or _cut(resp.content, 100)}", "the status must be below 500", trace)
        if status == 424:
            self.fail(f"status 424: {_error_text(resp.content)}", MODEL_ERROR)
        if resp.headers.get("X-Request-Id") != self.request_id:
            self.fail("X-Request-Id not echoed", "every response carries the client's X-Request-Id")
        mime = resp.headers.get("Content-Type", "").split(";")[0].strip()
        try:
            text = resp.content.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.fail(f"{status} body not UTF-8", str(exc))
        if status != 200:
            self.check_error(status, mime, text)
        elif mime in STREAM_TYPES:
            self.check_stream(mime, text)
        else:
            self.check_200(mime, text)

    def parse(self, text: str, what: str):
        try:
            return strict_json(text)
        except (ValueError, RecursionError) as exc:
            reason = str(exc).split(" is not JSON")[0] if " is not JSON" in str(exc) else type(exc).__name__
            self.fail(f"{what} not strict JSON ({reason})", f"{exc}")

    def check_error(self, status: int, mime: str, text: str) -> None:
        if mime not in JSON_TYPES:
            self.fail(f"error {status} not application/json", f"Content-Type {mime!r}")
        self.check_error_shape(self.parse(text, f"{status} body"), status, f"{status} body")

    def check_error_shape(self, body, status: int | None, what: str) -> None:
        if not (isinstance(body, dict) and set(body) == {"code", "type", "error"} and isinstance(body["type"], str)
                and isinstance(body["error"], str) and body["error"] and type(body["code"]) is int):
            self.fail(f"{what}: not an error shape", 'an error is {"code": int, "type": str, "error": str}')
        if status is not None and body["code"] != status:
            self.fail(f"{what}: code != status", f"code {body['code']} != status {status}")
        if body["code"] >= 500:
            cause, trace = server_exception(self.target.server.log(), self.request_id)
            self.fail(f"{what}: code {body['code']}: {cause or body['error'][:80]}", "an error code must be below 500",
                      trace)
        if body["code"] == 424:
            self.fail(f"{what}: code 424: {body['error'][:80]}", MODEL_ERROR)

    def check_200(self, mime: str, text: str) -> None:
        if mime not in JSON_TYPES:
            self.fail("200 not application/json", f"Content-Type {mime!r}")
        body = self.parse(text, "200 body")
        want = expected(self.payload)
        if want is None:
            self.fail("200 for a body without inputs", "only a JSON object with inputs (or text/plain) is a 200")
        count, is_list, stream = want
        if stream:
            self.fail("200 JSON for a stream request", "a stream answers jsonlines or server-sent events")
        if self.target.engine == "dynamic" or is_list:
            if not (isinstance(body, list) and len(body) == count):
                self.fail("200 shape", f"want a list of {count} object(s)")
            items = body
        else:
            if not isinstance(body, dict):
                self.fail("200 shape", "want an object for a string input")
            items = [body]
        for item in items:
            if not (isinstance(item, dict) and isinstance(item.get("generated_text"), str)):
                self.fail("200 without generated_text", "each output has a generated_text string")

    def check_stream(self, mime: str, text: str) -> None:
        want = expected(self.payload)
        if self.target.engine == "dynamic" or want is None or not want[2] or want[1]:
            self.fail("unexpected stream", f"a {mime} answer to a request that is not a one-input stream")
        if mime == "text/event-stream":
            events = [e for e in text.split("\n\n") if e]
            if not all(e.startswith("data: ") for e in events):
                self.fail("SSE event without data:", "each event is data: {...}")
            lines = [e[len("data: "):] for e in events]
        else:
            if text and not text.endswith("\n"):
                self.fail("stream cut", "jsonlines end with a newline")
            lines = text.split("\n")[:-1]
        if not lines:
            self.fail("empty stream", "a stream has at least one line")
        objs = [self.parse(line, "stream line") for line in lines]
        for obj in objs[:-1]:
            if not (isinstance(obj, dict) and isinstance(obj.get("token"), dict)):
                self.fail("stream line without token", "each line but the last has a token")
        last = objs[-1]
        if isinstance(last, dict) and "code" in last:
            self.check_error_shape(last, None, "stream error line")
        elif not (isinstance(last, dict) and isinstance(last.get("generated_text"), str)):
            self.fail("stream without generated_text", "the last line carries generated_text")


def examples(payloads: list[Payload]):
    def decorate(test):
        for payload in reversed(payloads):
            test = example(payload)(test)
        return test
    return decorate


def greedy_text(target: Target) -> str:
    resp = target.session.post(target.server.url + "/invocations", json=BASELINE, timeout=TIMEOUT_S)
    assert resp.status_code == 200, (resp.status_code, resp.text)
    body = resp.json()
    return (body[0] if target.engine == "dynamic" else body)["generated_text"]


def health_problems(target: Target, before: str) -> list[str]:
    """What is wrong with the server after the fuzzing: not healthy, not idle, or a different greedy text."""
    try:
        ping = target.session.get(target.server.url + "/ping", timeout=TIMEOUT_S)
        if ping.status_code != 200:
            return [f"/ping {ping.status_code} {ping.text[:300]}\n{target.server.log()[-3000:]}"]
        if target.engine != "dynamic":
            slots = wait_idle(target.server)["kv_slots"]
            if slots:
                return [f"idle but {slots} KV slots still held"]
        after = greedy_text(target)
    except (requests.RequestException, AssertionError) as exc:
        return [f"after the fuzzing: {exc!r}"[:1500]]
    return [] if after == before else [f"greedy text changed after the fuzzing: {before!r} -> {after!r}"]


def test_fuzzed_invocations_never_break_the_server(target):
    """The EXAMPLES, then 300 generated payloads; every class of violation is reported at the end with its smallest payload
    (deterministic: derandomized, no database). Payloads are not shrunk: Hypothesis would stop exploring
    soon after the first failure, and the point is to see every class at once."""
    before = greedy_text(target)
    findings = Findings(target.engine)

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example, HealthCheck.filter_too_much])
    @given(payloads())
    @examples(EXAMPLES)
    def fuzz(payload: Payload):
        if findings.stopped:
            return
        findings.sent += 1
        try:
            Check(target, payload).run()
        except Violation as v:
            findings.add(v)

    fuzz()
    problems = health_problems(target, before)
    report = findings.report() if findings.classes else ""
    if problems:
        report += f"\n\n[{target.engine}] the server after the fuzzing:\n" + "\n".join(problems)
    assert not report, report
