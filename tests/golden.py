"""A golden set of responses: real servers (every engine, a custom handler), each route family, good
requests and bad ones, recorded once and compared after a restructuring that must not change a byte.

    python -m tests.golden record GOLDEN.json [--model-dir models/tiny]
    python -m tests.golden compare GOLDEN.json [--model-dir models/tiny]

Not a test: greedy tokens of a random model may differ between CPU kinds, so a set is compared on the
host that recorded it. Fields that differ between any two runs (ids, timestamps) are blanked."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import requests

from tests.support import Server

# option.cpu_linear pinned: auto measures kernels at start, and two kernels may differ in the last bit
PINNED = "option.cpu_linear=aten\n"
ENGINES = {
    "dynamic": PINNED + "engine=Python\nbatch_size=4\nmax_batch_delay=20\noption.dtype=fp32\n",
    "rolling": PINNED + "engine=Python\noption.dtype=fp32\noption.rolling_batch=scheduler\noption.max_rolling_batch_size=8\n",
    "paged": PINNED + "engine=Python\noption.dtype=fp32\noption.rolling_batch=lmi-dist\noption.max_rolling_batch_size=8\n"
             "option.kv_cache_memory=16MiB\n",
    "paged-tgi-compat": PINNED + "engine=Python\noption.dtype=fp32\noption.rolling_batch=lmi-dist\noption.kv_cache_memory=16MiB\n"
                        "option.tgi_compat=true\n",
    "custom": "engine=Python\noption.entryPoint=golden_handler.py\n",
}
HANDLER = '''
from djl_python import Input, Output


def handle(inputs: Input):
    if inputs.is_empty():
        return None
    body = inputs.get_as_json()
    if body.get("fail"):
        raise ValueError("asked to fail")
    return Output().add_as_json({"echo": body, "batch": len(inputs.get_batches())})
'''
HELLO = {"inputs": "Hello world", "parameters": {"max_new_tokens": 8}}
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "temperature": 0}  # (OpenAI's default: 1)
REQUESTS = [  # (method, path, body: dict | str | None)
    ("GET", "/ping", None),
    ("POST", "/invocations", HELLO),
    ("POST", "/invocations", {"inputs": "The cat", "parameters": {"max_new_tokens": 6, "details": True}}),
    ("POST", "/invocations", {"inputs": ["one", "two words"], "parameters": {"max_new_tokens": 4}}),
    ("POST", "/invocations", {**HELLO, "stream": True}),
    ("POST", "/invocations", {"inputs": "seeded", "parameters": {"max_new_tokens": 6, "do_sample": True,
                                                                 "seed": 7, "temperature": 0.9}}),
    ("POST", "/invocations", CHAT),
    ("POST", "/invocations", {"inputs": "x", "parameters": {"max_new_tokens": -1}}),
    ("POST", "/invocations", {"inputs": "x", "parameters": {"no_such_parameter": 1}}),
    ("POST", "/invocations", {"inputs": 5}),
    ("POST", "/invocations", "not json"),
    ("POST", "/invocations", {"fail": True}),
    ("POST", "/predictions/model", HELLO),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "logprobs": 2, "temperature": 0}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": ["a", "b c"], "max_tokens": 4, "stream": True,
                                 "seed": 3}),
    ("POST", "/v1/chat/completions", {"model": "tiny", **CHAT}),
    ("POST", "/v1/chat/completions", {"model": "tiny", **CHAT, "stream": True, "logprobs": True, "temperature": 0.8, "seed": 5,
                                      "top_logprobs": 2}),
    ("POST", "/v1/chat/completions", {"model": "tiny", **CHAT, "n": 0}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}),
    ("POST", "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 5, "details": True}}),
    ("POST", "/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 5}}),
    ("POST", "/", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}),
    ("POST", "/generate", {"inputs": ["a", "b"]}),
    ("GET", "/info", None),
    ("GET", "/adapters", None),
    ("POST", "/tokenize", {"prompt": "Hello world"}),
    ("GET", "/no/such/route", None),
]
VOLATILE = {"id", "created", "system_fingerprint", "model_sha", "docker_label", "sha"}


def blank(value):
    """The value with every volatile field blanked, recursively."""
    if isinstance(value, dict):
        return {k: "*" if k in VOLATILE and not (k == "id" and isinstance(v, int)) else blank(v)
                for k, v in value.items()}  # (an int "id" is a token's)
    if isinstance(value, list):
        return [blank(v) for v in value]
    return value


def normalise(text: str):
    """A JSON body, a JSON-lines or SSE stream: parsed and blanked line by line (other text as is)."""
    try:
        return blank(json.loads(text))
    except ValueError:
        pass
    lines = []
    for line in text.splitlines():
        prefix, _, rest = line.partition("data:") if line.startswith("data:") else ("", "", line)
        try:
            lines.append([prefix + "data:" if line.startswith("data:") else "", blank(json.loads(rest))])
        except ValueError:
            lines.append(line)
    return lines


def record_engine(name: str, properties: str, model_dir: Path, tmp: Path) -> list:
    if name == "custom":
        handler_dir = tmp / "handler"
        handler_dir.mkdir(exist_ok=True)
        (handler_dir / "golden_handler.py").write_text(HANDLER)
        model_dir = handler_dir
    server = Server(tmp, properties, model_dir)
    try:
        server.wait_ready(180)
        out = []
        for method, path, body in REQUESTS:
            kwargs = {"data": body} if isinstance(body, str) else {"json": body} if body is not None else {}
            resp = requests.request(method, server.url + path, timeout=120, **kwargs)
            out.append({"request": [method, path, body], "status": resp.status_code,
                        "content_type": resp.headers.get("Content-Type"), "body": normalise(resp.text)})
        return out
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["record", "compare"])
    parser.add_argument("path")
    parser.add_argument("--model-dir", default="models/tiny", help="served as `tiny` (its folder name)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        got = {name: record_engine(name, props, Path(args.model_dir).resolve(), Path(tmp))
               for name, props in ENGINES.items()}
    if args.mode == "record":
        Path(args.path).write_text(json.dumps(got, indent=1))
        print(f"recorded {sum(map(len, got.values()))} responses to {args.path}")
        return 0
    want = json.loads(Path(args.path).read_text())
    diffs = [(name, w["request"], w, g) for name in want for w, g in zip(want[name], got.get(name, [])) if w != g]
    for name, req, w, g in diffs:
        print(f"{name} {req[0]} {req[1]}: want {json.dumps(w)[:400]}\n    got {json.dumps(g)[:400]}")
    print(f"{len(diffs)} of {sum(map(len, want.values()))} responses differ")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
