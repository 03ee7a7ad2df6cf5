"""lmi-serve against the CPU peers, on one model, in one run, interleaved: our paged and padded
servers, llama.cpp's own server (continuous batching), Hugging Face `generate` and CTranslate2
(offline, one batch: no scheduling), all on the same workload: `clients` prompts of `prompt` tokens,
`new` greedy tokens each (EOS ignored).

    python -m benchmarks.peers --model-dir models/small --llama-cpp /path/to/llama.cpp \
        --rounds 3 --out benchmarks/results/peers_small.json
    python -m benchmarks.peers --model-dir models/small --llama-cpp /path/to/llama.cpp --rounds 3 \
        --variant int8=option.quantize=int8 --variant int4=option.quantize=int4 \
        --out benchmarks/results/peers_quant_small.json       # our quantised servers too

  * lmi paged / lmi padded: `lmi serve` in bf16, `clients` concurrent streaming clients.
  * lmi paged <label>: each --variant, the paged server with those properties added.
  * llama.cpp: `llama-server --parallel <clients>` on the model converted to GGUF bf16 and Q8_0 with
    llama.cpp's own `convert_hf_to_gguf.py` (the tree's `build/bin/llama-server`: build it with
    `cmake -B build && cmake --build build --target llama-server`, e.g. from the llama.cpp tree in
    the `llama-cpp-python` sdist). Our test tokenizer is a byte-level BPE that the converter does
    not know by hash: it is told that its pre-tokenizer is GPT-2's (which it is: ByteLevel with
    GPT-2's regex). Prompts go as token ids, so both servers see the same tokens.
  * HF generate: `AutoModelForCausalLM` in bf16, the whole batch in one `generate` call.
  * CTranslate2: the model converted by its own TransformersConverter, every compute type this CPU
    supports tried, the best one reported (`generate_batch`, greedy, min_length = new).

Every system is measured once per round; rounds interleave them. Reported: generated tokens per
second (medians), each system's ratio to ours, and its greedy agreement with HF `generate` in
float32 on the same prompts (the share of the reference's tokens reproduced before the first
difference, measured after the timed rounds). Servers stay up across rounds (an idle server
costs nothing). Also measured, with --compile-start: time to the first /ping 200 of the paged
server in eager mode and with option.cpu_compile, with an empty and with a warm compile cache.
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
    bodies = [{"inputs": tok.decode(p), "parameters": {"max_new_tokens": new, "ignore_eos": True, "details": True}}
              for p in prompts]
    wall, results, errors, _ = run_load(server, bodies, len(bodies), None, 0)
    if errors:
        raise RuntimeError(f"{errors} requests failed on {server.name}")
    return sum(r.num_tokens for r in results) / wall


def lmi_greedy_ids(server: BenchServer, prompts: list[list[int]], new: int, tok: TextTokenizer) -> list[list[int]]:
    def one(ids: list[int]) -> list[int]:
        resp = requests.post(server.url + "/invocations", timeout=1800, json={
            "inputs": tok.decode(ids), "parameters": {"max_new_tokens": new, "ignore_eos": True, "details": True}})
        resp.raise_for_status()
        return [t["id"] for t in resp.json()["details"]["tokens"]]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, prompts))


def prefix_agreement(ids: list[list[int]], reference: list[list[int]]) -> float:
    """The share of the reference's greedy tokens that a system reproduces before its first
    difference, over all prompts (1.0: the same continuations token for token)."""
    same = 0
    for a, b in zip(ids, reference):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += n
    return same / sum(len(b) for b in reference)


# -- llama.cpp --------------------------------------------------------------------------------------
def convert_to_gguf(llama_cpp: str, model_dir: str, out: str, outtype: str = "bf16") -> None:
    """llama.cpp's converter, told that our byte-level BPE tokenizer pre-tokenizes as GPT-2 does;
    outtype: bf16 or q8_0 (its own int8 quantisation, 32 weights per scale)."""
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

    def greedy_ids(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        def one(ids: list[int]) -> list[int]:
            resp = requests.post(self.url + "/completion", timeout=1800, json={
                "prompt": ids, "n_predict": new, "ignore_eos": True, "cache_prompt": False, "temperature": 0,
                "return_tokens": True})
            resp.raise_for_status()
            return resp.json()["tokens"]

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, prompts))

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--llama-cpp", help="a llama.cpp source tree with build/bin/llama-server")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile-start", action="store_true", help="also time /ping with and without compile")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=KEY=VALUE[,KEY=VALUE]",
                   help="also the paged server with these properties, e.g. int8=option.quantize=int8 "
                        "or compiled=option.cpu_compile=true (repeatable)")
    p.add_argument("--out", default="benchmarks/results/peers.json")
    p.add_argument("--ct2-dir", help=argparse.SUPPRESS)
    p.add_argument("--compute-type", help=argparse.SUPPRESS)
    p.add_argument("--one", choices=("hf", "ct2"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    prompts = workload(args.model_dir, args.clients, args.prompt)
    if args.one:
        tok_s, ids = (hf_generate(args.model_dir, prompts, args.new, args.compute_type or "bf16") if args.one == "hf"
                      else ctranslate2_generate(args.ct2_dir, args.model_dir, prompts, args.new, args.compute_type))
        print(json.dumps({"tok_s": tok_s, "ids": ids}))
        return 0

    work = tempfile.mkdtemp(prefix="lmi-peers-")
    tok = TextTokenizer(args.model_dir)
    args.ct2_dir = os.path.join(work, "ct2")
    import ctranslate2

    ctranslate2.converters.TransformersConverter(args.model_dir).convert(args.ct2_dir, force=True)
    types = ct2_compute_types()
    servers: dict[str, BenchServer] = {}
    llamas: dict[str, LlamaCppServer] = {}
    variants = dict(v.split("=", 1) for v in args.variant)  # label → "key=value,key=value"
    try:
        # one after the other: each measures its CPU at start
        for label, base, props in [("lmi paged", "paged", ""), ("lmi padded", "rolling", "")] + \
                [(f"lmi paged {label}", f"paged+{label}", props) for label, props in variants.items()]:
            extra = [f"{base}:{kv}" for kv in props.split(",") if kv]
            servers[label] = BenchServer(base, args.model_dir, "bf16", "512MiB", extra)
            servers[label].wait_ready()
        if args.llama_cpp:
            for outtype in ("bf16", "q8_0"):
                gguf = os.path.join(work, f"model-{outtype}.gguf")
                convert_to_gguf(args.llama_cpp, os.path.abspath(args.model_dir), gguf, outtype)
                llamas[f"llama.cpp server {outtype}"] = LlamaCppServer(args.llama_cpp, gguf, args.clients,
                                                                       args.prompt + args.new + 32)
        systems = {label: (lambda s=s: lmi_run(s, prompts, args.new, tok)) for label, s in servers.items()}
        systems["HF generate bf16"] = lambda: offline("hf", args, "bf16")
        for t in types:
            systems[f"CTranslate2 {t}"] = lambda t=t: offline("ct2", args, t)
        for label, server in llamas.items():
            systems[label] = lambda server=server: server.run(prompts, args.new)
        runs: dict[str, list[float]] = {name: [] for name in systems}
        for r in range(args.rounds):
            for name, fn in systems.items():
                runs[name].append(fn())
                print(f"  round {r + 1} {name:<28} {runs[name][-1]:7.1f} tok/s", flush=True)
        # greedy agreement with HF generate in float32, each system's tokens for the same prompts
        offline("hf", args, "fp32")
        reference = IDS["hf fp32"]
        ids = {label: lmi_greedy_ids(s, prompts, args.new, tok) for label, s in servers.items()}
        ids |= {label: s.greedy_ids(prompts, args.new) for label, s in llamas.items()}
        ids["HF generate bf16"] = IDS["hf bf16"]
        ids |= {f"CTranslate2 {t}": IDS[f"ct2 {t}"] for t in types}
        agreement = {name: prefix_agreement(ids[name], reference) for name in systems}
        starts = compile_start(args.model_dir) if args.compile_start else {}
    finally:
        for s in [*servers.values(), *llamas.values()]:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)

    med = {name: statistics.median(v) for name, v in runs.items()}
    ours = med["lmi paged"]
    best = {kind: max((n for n in med if n.startswith(kind)), key=med.get, default=None)
            for kind in ("lmi", "CTranslate2", "llama.cpp")}
    print(f"\n{args.model_dir}, {args.clients} clients, {args.prompt} in / {args.new} out, greedy, "
          f"medians of {args.rounds} interleaved rounds; agreement: the share of HF float32's greedy tokens "
          "reproduced before the first difference")
    print(f"  {'system':<30} {'tok/s':>8} {'lmi paged / it':>15} {'agreement':>10}")
    for name, value in med.items():
        print(f"  {name:<30} {value:>8.1f} {ours / value:>14.2f}x {agreement[name]:>10.3f}")
    ratios = {}
    if best["llama.cpp"]:
        ratios["lmi best / llama.cpp best"] = med[best["lmi"]] / med[best["llama.cpp"]]
        ratios["lmi paged bf16 / llama.cpp bf16"] = ours / med["llama.cpp server bf16"]
    if "CTranslate2 int8" in med:
        ratios["lmi best / CTranslate2 int8"] = med[best["lmi"]] / med["CTranslate2 int8"]
    print(f"  best: {best}")
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("one", "ct2_dir", "compute_type")},
                   "medians_tok_s": med, "runs": runs, "best": best, "ratios": ratios, "agreement": agreement,
                   "paged_over": {n: ours / v for n, v in med.items()}, "first_ping_s": starts}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
