"""The GPU benchmark: a Llama-2-7B-shape model (random bf16 weights) on one GPU, every engine as a
real `lmi serve`, against HF `generate` and the device's copy-bandwidth floor; issue 20's checks.

    python -m benchmarks.gpu [--model-dir DIR] [--out benchmarks/results/gpu.json] [--budget-s 480]
    python -m benchmarks.gpu --smoke     # CPU, the tiny model, small counts: checks the program

Phases, each with a deadline inside --budget-s (a phase that cannot fit is skipped and reported):
  model      the 7B-shape checkpoint written on the GPU (seeded, shard by shard), or reused
  tests      python -m pytest -q tests/test_gpu.py (its summary line)
  bandwidth  the best of 10 device-to-device copies of 2 GiB, read + write bytes counted; the
             batch-1 floor is the weight bytes a decode step reads (all but the input embedding,
             of which it reads a row a token) / that bandwidth
  hf         HF generate, bf16, sdpa: batch-1 ms/token and batch-N tok/s (32-token prompts)
  servers    dynamic, padded, paged and the paged variants, one at a time, each measured for
             batch-1 ms/token, N concurrent clients' tok/s, and the TTFT of a long prompt
GPU work of the first phases runs in child processes (`--one`): this process never holds GPU memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

import requests

from benchmarks.server import BenchServer
from benchmarks.workloads import prompt_of_length

LLAMA_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                intermediate_size=11008, max_position_embeddings=4096, vocab_size=32000)
INIT_STD = 0.02  # Llama's initializer_range: activations stay well inside bf16's range
SHARD_BYTES = 4 << 30
ENGINES = {"dynamic": "engine=Python\nbatch_size={clients}\nmax_batch_delay=50\n",
           "padded": "engine=Python\noption.rolling_batch=scheduler\n",
           "paged": "engine=Python\noption.rolling_batch=lmi-dist\n"}
COMMON = ("option.dtype=bf16\noption.max_model_len={max_len}\noption.max_rolling_batch_size={clients}\n"
          "option.max_rolling_batch_prefill_tokens={prefill}\noption.gpu_memory_utilization=0.9\n"
          "http_threads={threads}\n")
# phase -> (the most of the budget it may take, the seconds it needs to be worth starting)
SHARES = {"model": (0.35, 5), "tests": (0.2, 20), "bandwidth": (0.1, 5), "hf": (0.25, 20), "server": (0.2, 20)}
RESULT = "RESULT "


# -- the checkpoint -------------------------------------------------------------------------------
def llama_tensors(shape: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every tensor of a Llama checkpoint, in file order."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (vocab, h), "normal")]
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,), "ones"), (p + "self_attn.q_proj.weight", (h, h), "normal"),
                (p + "self_attn.k_proj.weight", (kv, h), "normal"), (p + "self_attn.v_proj.weight", (kv, h), "normal"),
                (p + "self_attn.o_proj.weight", (h, h), "normal"),
                (p + "post_attention_layernorm.weight", (h,), "ones"),
                (p + "mlp.gate_proj.weight", (inter, h), "normal"), (p + "mlp.up_proj.weight", (inter, h), "normal"),
                (p + "mlp.down_proj.weight", (h, inter), "normal")]
    return out + [("model.norm.weight", (h,), "ones"), ("lm_head.weight", (vocab, h), "head")]


def shard_groups(tensors: list, limit: int) -> list[list]:
    groups, size = [[]], 0
    for t in tensors:
        nbytes = 2 * math.prod(t[1])  # bf16
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    return groups


def random_tensor(size, init: str, live_vocab: int, gen, device):
    import torch

    if init == "ones":
        return torch.ones(size, dtype=torch.bfloat16, device=device)
    t = torch.empty(size, dtype=torch.bfloat16, device=device).normal_(0.0, INIT_STD, generator=gen)
    if init == "head":  # ids past the tokenizer's never win a greedy choice: every output token decodes
        t[live_vocab:] = 0
    return t


def llama_config(shape: dict, tok):
    import torch
    from transformers import LlamaConfig

    cfg = LlamaConfig(**shape, rms_norm_eps=1e-5, initializer_range=INIT_STD, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = torch.bfloat16
    return cfg


def card_matches(model_dir: str, shape: dict, seed: int) -> bool:
    try:
        with open(os.path.join(model_dir, "lmi_model_card.json")) as f:
            card = json.load(f)
        with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
            files = set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError):
        return False
    return card.get("shape") == shape and card.get("seed") == seed and all(
        os.path.isfile(os.path.join(model_dir, name)) for name in files)


def write_random_llama(out_dir: str, shape: dict, seed: int, device: str) -> dict:
    """config.json, generation_config.json, the project's tokenizer (as `lmi make-model` writes them)
    and random bf16 weights drawn on `device`, shard by shard; the model card last (it marks a
    complete checkpoint)."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from container.model_maker import make_world_readable, train_tokenizer

    tok = train_tokenizer()
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = shard_groups(llama_tensors(shape), SHARD_BYTES)
    weight_map, total, params = {}, 0, 0
    for k, group in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: random_tensor(size, init, len(tok), gen, device).cpu() for n, size, init in group}
        save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update({n: name for n in tensors})
        total += sum(t.numel() * 2 for t in tensors.values())
        params += sum(t.numel() for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    config = llama_config(shape, tok)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    card = {"architecture": "LlamaForCausalLM", "shape": shape, "seed": seed, "num_parameters": params,
            "dtype": "bfloat16", "init_std": INIT_STD, "lm_head_rows_zeroed_from": len(tok),
            "made_by": "benchmarks.gpu"}
    with open(os.path.join(out_dir, "lmi_model_card.json"), "w") as f:
        json.dump(card, f, indent=2)
    make_world_readable(out_dir)
    return card


def count_parameters(model_dir: str) -> tuple[int, int]:
    """(all parameters, those of the input embedding), from the safetensors headers alone."""
    n = embedding = 0
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with open(os.path.join(model_dir, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            for key, v in header.items():
                if key != "__metadata__":
                    n += math.prod(v["shape"])
                    embedding += math.prod(v["shape"]) if key.endswith("embed_tokens.weight") else 0
    return n, embedding


# -- the child jobs (`--one KIND`): GPU work in processes of its own ---------------------------------
def job_probe(job: dict) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {"cuda": cuda, "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
            "torch_cuda": torch.version.cuda, "gpu_count": torch.cuda.device_count() if cuda else 0,
            "memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else 0}


def job_write(job: dict) -> dict:
    from container.model_maker import make_model

    started = time.perf_counter()
    if job["size"] == "tiny":
        card = make_model(job["model_dir"], arch="llama", size="tiny", seed=job["seed"])
    else:
        card = write_random_llama(job["model_dir"], LLAMA_7B, job["seed"], job["device"])
    return {"written_s": round(time.perf_counter() - started, 1), "card": card}


def job_bandwidth(job: dict) -> dict:
    import torch

    dev = torch.device(job["device"])
    src = torch.ones(job["copy_bytes"], dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    best = min(times[1:])
    return {"copy_bytes": job["copy_bytes"], "best_s": best, "bytes_per_s": 2 * job["copy_bytes"] / best,
            "convention": "read + write: 2 x bytes copied / time, best of 9 after one warm-up copy"}


def load_hf(model_dir: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, device_map=device, **kw).eval()
    except (ImportError, ValueError, TypeError):  # a transformers that wants accelerate for device_map
        return AutoModelForCausalLM.from_pretrained(model_dir, **kw).to(device).eval()


def job_hf(job: dict) -> dict:
    import torch

    from handlers.tokenizer import TextTokenizer

    model = load_hf(job["model_dir"], job["device"])
    tok = TextTokenizer(job["model_dir"])
    ids = torch.tensor([tok.encode(t) for t in exact_prompts(job["model_dir"], job["prompt"], job["clients"],
                                                             job["seed"])], device=job["device"])
    sync = torch.cuda.synchronize if job["device"] == "cuda" else (lambda: None)

    def generate(x, n: int) -> float:
        sync()
        t = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        sync()
        assert out.shape[1] - x.shape[1] == n, (out.shape, n)
        return time.perf_counter() - t

    new = job["new"]
    with torch.inference_mode():
        logits = model(ids[:1]).logits
        finite = bool(torch.isfinite(logits).all())
        generate(ids[:1], 4)  # warm-up
        t1 = statistics.median(generate(ids[:1], 1) for _ in range(3))
        tn = generate(ids[:1], new)
        generate(ids, 4)
        tb = generate(ids, new)
    return {"finite_logits": finite, "logits_std": float(logits.float().std()),
            "batch1_ms_per_token": 1e3 * (tn - t1) / (new - 1), "batch1_s": tn,
            "batch_tok_s": ids.shape[0] * new / tb, "batch": ids.shape[0],
            "method": "(t(new) - t(1)) / (new - 1) at batch 1; batch x new / t at the batch"}


JOBS = {"probe": job_probe, "write": job_write, "bandwidth": job_bandwidth, "hf": job_hf}


# -- prompts ----------------------------------------------------------------------------------------
def exact_prompts(model_dir: str, n_tokens: int, count: int, seed: int) -> list[str]:
    """Texts cut from the embedded corpus that the model's tokenizer encodes to exactly n_tokens (<s> included)."""
    from container.model_maker import corpus_lines
    from handlers.tokenizer import TextTokenizer

    tok = TextTokenizer(model_dir)
    corpus = tok.encode(" ".join(corpus_lines() * 8))[1:]
    rng = random.Random(seed * 1000 + n_tokens)
    texts = [prompt_of_length(tok, corpus, n_tokens, rng) for _ in range(count)]
    bad = [len(tok.encode(t)) for t in texts if len(tok.encode(t)) != n_tokens]
    if bad:
        raise RuntimeError(f"prompts of {bad} tokens, not {n_tokens}")
    return texts


# -- the budget and child processes -----------------------------------------------------------------
class Budget:
    def __init__(self, total_s: float, reserve_s: float = 20):  # the reserve: stopping a server, the report
        self.total, self.end = total_s, time.monotonic() + total_s - reserve_s

    def left(self) -> float:
        return self.end - time.monotonic()

    def allow(self, phase: str) -> float | None:
        """Seconds the phase may take (its share, never past the end); None: fewer than it needs are left."""
        share, need = SHARES[phase]
        return None if self.left() < need else min(share * self.total, self.left())


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, cap: float = 1e9) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("phase deadline passed")
        return min(left, cap)


def run_child(cmd: list[str], timeout: float, env: dict) -> tuple[int | None, str, str]:
    """`cmd` in a session of its own, its whole group killed at the timeout (rc None) or on any error."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, err = proc.communicate()
        return None, out, err
    finally:
        if proc.poll() is None:
            kill_group(proc.pid)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def child_job(kind: str, ctx: dict, timeout: float) -> dict:
    job = {k: ctx[k] for k in ("model_dir", "device", "size", "seed", "clients", "prompt", "new", "copy_bytes")}
    rc, out, err = run_child([sys.executable, "-m", "benchmarks.gpu", "--one", kind, "--job", json.dumps(job)],
                             timeout, ctx["env"])
    if rc is None:
        raise TimeoutError(f"{kind} ran past its {timeout:.0f} s")
    found = [line[len(RESULT):] for line in out.splitlines() if line.startswith(RESULT)]
    if rc or not found:
        raise RuntimeError(f"{kind} failed (rc {rc}): {err.strip()[-1500:]}")
    return json.loads(found[-1])


def run_tests(ctx: dict, timeout: float) -> dict:
    if not ctx["probe"].get("cuda"):
        return {"skipped": "no CUDA device"}
    rc, out, err = run_child([sys.executable, "-m", "pytest", "-q", "tests/test_gpu.py"], timeout, ctx["env"])
    lines = [line for line in (out + err).splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(lines) if " in " in line and (
        "passed" in line or "failed" in line or "error" in line or "skipped" in line)), lines[-1] if lines else "")
    return {"rc": rc, "summary": summary if rc is not None else f"timed out after {timeout:.0f} s",
            "tail": "\n".join(lines[-15:]) if rc != 0 else ""}


# -- the servers ------------------------------------------------------------------------------------
def body(text: str, new: int, **extra) -> dict:
    return {"inputs": text, "parameters": dict(max_new_tokens=new, ignore_eos=True, details=True, **extra)}


def post(url: str, payload: dict, dl: Deadline) -> tuple[float, dict]:
    t = time.perf_counter()
    resp = requests.post(url + "/invocations", json=payload, timeout=dl.left(600))
    resp.raise_for_status()
    data = resp.json()
    return time.perf_counter() - t, data[0] if isinstance(data, list) else data


def stream(url: str, payload: dict, dl: Deadline) -> list[float]:
    """Seconds from the send to each token line."""
    t, times = time.perf_counter(), []
    with requests.post(url + "/invocations", json=dict(payload, stream=True), stream=True,
                       timeout=dl.left(120)) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line:
                if "token" not in json.loads(line):
                    raise RuntimeError(line[:300])
                times.append(time.perf_counter() - t)
                dl.left()
    return times


def check_prompt_lengths(server: BenchServer, ctx: dict, dl: Deadline) -> dict:
    """The server's own count of the prompts' tokens (decoder_input_details: rolling engines only)."""
    if not server.streams:
        return {"skipped": "decoder_input_details needs a rolling engine"}
    got = {}
    for text in (ctx["short"][0], ctx["long"][0]):
        _, out = post(server.url, body(text, 1, decoder_input_details=True), dl)
        got[len(ctx["tokenizer"].encode(text))] = len(out["details"]["prefill"])
    return {"local_vs_server": got, "ok": all(k == v for k, v in got.items())}


def batch1(server: BenchServer, ctx: dict, dl: Deadline) -> dict:
    """ms per token after the first: (median latency of `new` tokens - of 1 token) / (new - 1), the
    latency being the last token line's arrival when streamed. Also recorded, streamed only: the
    median over requests of (last token line - first) / (new - 1), which token lines delivered in
    a burst shorten (seen on CPU: a whole stream arriving at once), hence not the figure."""
    new, texts = ctx["new"], ctx["short"][:3]
    if not server.streams:
        l1 = statistics.median(post(server.url, body(t, 1), dl)[0] for t in texts)
        ln = statistics.median(post(server.url, body(t, new), dl)[0] for t in texts)
        return {"ms_per_token": 1e3 * (ln - l1) / (new - 1), "method": "not streamed: latency difference"}
    runs = [stream(server.url, body(t, new), dl) for t in texts]
    if any(len(times) != new for times in runs):
        raise RuntimeError(f"{[len(times) for times in runs]} token lines, not {new}")
    l1 = statistics.median(stream(server.url, body(t, 1), dl)[-1] for t in texts)
    ms = 1e3 * (statistics.median(times[-1] for times in runs) - l1) / (new - 1)
    gaps = [1e3 * (times[-1] - times[0]) / (new - 1) for times in runs]
    return {"ms_per_token": ms, "streamed_gap_ms": statistics.median(gaps), "streamed_gap_samples_ms": gaps,
            "bursty": statistics.median(gaps) < 0.75 * ms,
            "method": "streamed: latency difference of new and 1 tokens, medians of 3"}


def clients_throughput(server: BenchServer, ctx: dict, dl: Deadline) -> dict:
    post(server.url, body(ctx["short"][0], 16), dl)  # warm-up
    reps = []
    for _ in range(2):
        t = time.perf_counter()
        with ThreadPoolExecutor(len(ctx["short"])) as pool:
            outs = list(pool.map(lambda text: post(server.url, body(text, ctx["new"]), dl)[1], ctx["short"]))
        wall = time.perf_counter() - t
        tokens = sum(o["details"]["generated_tokens"] for o in outs)
        if tokens != len(outs) * ctx["new"]:
            raise RuntimeError(f"{tokens} tokens generated, not {len(outs) * ctx['new']}")
        reps.append(tokens / wall)
    return {"tok_s": statistics.median(reps), "reps": reps,
            "method": f"{len(ctx['short'])} concurrent non-streaming requests; generated tokens / wall"}


def ttft(server: BenchServer, ctx: dict, dl: Deadline) -> dict:
    if server.streams:
        samples = [1e3 * stream(server.url, body(t, 2), dl)[0] for t in ctx["long"][:3]]
        method = "streamed: send to the first token line, median of 3"
    else:
        samples = [1e3 * post(server.url, body(t, 1), dl)[0] for t in ctx["long"][:3]]
        method = "dynamic batching does not stream: full latency of max_new_tokens=1, median of 3"
    return {"ms": statistics.median(samples), "samples_ms": samples, "method": method}


def server_properties(engine: str, extra: list[str], ctx: dict) -> str:
    props = ENGINES[engine].format(clients=ctx["clients"]) + COMMON.format(
        max_len=ctx["ttft_prompt"] + 256, clients=ctx["clients"], prefill=max(2048, ctx["ttft_prompt"]),
        threads=max(32, ctx["clients"]))
    return props + "".join(p + "\n" for p in extra)


def bench_server(name: str, engine: str, extra: list[str], ctx: dict, allowed: float) -> dict:
    dl = Deadline(allowed)
    props = server_properties(engine, extra, ctx)
    server = BenchServer(name.replace(":", "-"), ctx["model_dir"], properties=props, streams=engine != "dynamic",
                         env=ctx["env"], session=True)
    result: dict = {"properties": props}
    try:
        t = time.monotonic()
        server.wait_ready(dl.left())
        result["ready_s"] = round(time.monotonic() - t, 1)
        for step, fn in (("prompt_check", check_prompt_lengths), ("batch1", batch1), ("clients", clients_throughput),
                         ("ttft", ttft)):
            try:
                result[step] = fn(server, ctx, dl)
            except Exception as exc:  # reported; the next measurement still runs if time is left
                result[step] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["log_tail"] = log_tail(server.log_path)
        print(f"  {name} failed: {result['error']}\n    " + "\n    ".join(result["log_tail"]), flush=True)
    finally:
        server.stop(timeout=15)
        server.kill_tree()
    return result


def log_tail(path: str, n: int = 15) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip() for line in f.readlines()[-n:]]
    except OSError:
        return []


# -- report -----------------------------------------------------------------------------------------
def figure(d: dict | None, *keys):
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d if isinstance(d, (int, float)) else None


def rows(report: dict) -> list[tuple[str, float | None, float | None, float | None]]:
    hf = report["phases"].get("hf", {})
    out = [("HF generate (bf16, sdpa)", figure(hf, "batch1_ms_per_token"), figure(hf, "batch_tok_s"), None)]
    for name, r in report["servers"].items():
        out.append((name, figure(r, "batch1", "ms_per_token"), figure(r, "clients", "tok_s"), figure(r, "ttft", "ms")))
    return out


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(report: dict, ctx: dict) -> None:
    floor, hf = report.get("floor_ms_per_token"), figure(report["phases"].get("hf"), "batch_tok_s")
    n, bw = ctx["clients"], figure(report["phases"].get("bandwidth"), "bytes_per_s")
    print(f"\nfloor: {fmt(floor, '.3f')} ms/token = {report.get('weight_bytes', 0) / 1e9:.4g} GB of bf16 weights "
          f"read per step (all but the input embedding) / {fmt(bw and bw / 1e12, '.3f')} TB/s device copy "
          "bandwidth (read + write counted)")
    head = (f"| system | batch-1 ms/token | x floor | {n} clients tok/s | x HF b{n} | TTFT {ctx['ttft_prompt']} ms |")
    print(head + "\n|" + "---|" * 6)
    for name, ms, tok_s, ttft_ms in rows(report):
        failed = report["servers"].get(name, {}).get("error") or report["servers"].get(name, {}).get("skipped")
        note = f" ({'failed' if report['servers'][name].get('error') else 'skipped'})" if failed else ""
        print(f"| {name}{note} | {fmt(ms)} | {fmt(ratio(ms, floor))} | {fmt(tok_s, '.1f')} | {fmt(ratio(tok_s, hf))} "
              f"| {fmt(ttft_ms, '.1f')} |")


def acceptance(report: dict, ctx: dict) -> list[dict]:
    paged, padded = report["servers"].get("paged", {}), report["servers"].get("padded", {})
    ms, tok_s = figure(paged, "batch1", "ms_per_token"), figure(paged, "clients", "tok_s")
    hf, floor = figure(report["phases"].get("hf"), "batch_tok_s"), report.get("floor_ms_per_token")
    n, p = ctx["clients"], ctx["ttft_prompt"]
    checks = [("paged batch 1 <= 4.5 ms/token", ms, lambda v: v <= 4.5),
              ("paged batch 1 <= 1.5x the floor", ratio(ms, floor), lambda v: v <= 1.5),
              (f"paged {n} clients 32/{ctx['new']} >= 6,000 tok/s", tok_s, lambda v: v >= 6000),
              (f"paged {n} clients >= 6x HF generate at batch {n}", ratio(tok_s, hf), lambda v: v >= 6),
              (f"paged >= padded ({n} clients tok/s)", ratio(tok_s, figure(padded, "clients", "tok_s")),
               lambda v: v >= 1),
              (f"paged TTFT of the {p}-token prompt <= 70 ms", figure(paged, "ttft", "ms"), lambda v: v <= 70)]
    for name, r in report["servers"].items():  # quantised variants (issue 22): against their own floor
        method = quantize_of(r.get("properties", ""))
        if not method:
            continue
        own = quantized_floor(report, ctx, method)
        checks.append((f"{name} batch 1 <= 1.5x its {method} weight-read floor ({fmt(own, '.3f')} ms)",
                       ratio(figure(r, "batch1", "ms_per_token"), own), lambda v: v <= 1.5))
        if method == "fp8":
            checks.append((f"{name} {n} clients >= 1.6x paged bf16", ratio(figure(r, "clients", "tok_s"), tok_s),
                           lambda v: v >= 1.6))
    return [{"check": c, "value": v, "result": "SKIP" if v is None else ("PASS" if ok(v) else "FAIL")}
            for c, v, ok in checks]


def quantize_of(properties: str) -> str | None:
    """option.quantize in a server's properties text, if any."""
    return next((line.split("=", 1)[1].strip() for line in properties.splitlines()
                 if line.strip().startswith("option.quantize=")), None)


def quantized_floor(report: dict, ctx: dict, method: str) -> float | None:
    """The batch-1 floor of a model quantised with `method`: the bf16 floor times the bytes a decode step
    reads quantised over bf16 (lmi plan's count of packed weights and scales; the input embedding,
    read a row a token, left out of both)."""
    from container.planner import read_model_shape

    floor = report.get("floor_ms_per_token")
    if not floor:
        return None
    shape = read_model_shape(ctx["model_dir"])
    embedding = 2 * (report["num_parameters"] - report["weight_bytes"] // 2)
    return floor * (shape.weight_bytes_per_rank(1, 2, method) - embedding) / \
        (shape.weight_bytes_per_rank(1, 2, None) - embedding)


def plot(report: dict, ctx: dict, path: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = rows(report)
    names = [r[0].replace(" (bf16, sdpa)", "") for r in data]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, col, title in zip(axes, (1, 2, 3), ("batch-1 ms/token", f"{ctx['clients']} clients tok/s",
                                               f"TTFT {ctx['ttft_prompt']} tokens, ms")):
        ax.bar(range(len(names)), [r[col] or 0 for r in data], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(title)
    if report.get("floor_ms_per_token"):
        axes[0].axhline(report["floor_ms_per_token"], color="tab:red", ls="--", label="bandwidth floor")
        axes[0].legend()
    fig.suptitle(f"lmi-serve on {report['device']['device_name']}: {os.path.basename(ctx['model_dir'])}, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return None


# -- main -------------------------------------------------------------------------------------------
def variants(spec: str) -> list[tuple[str, list[str]]]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, props = item.partition(":")
        out.append((f"paged:{name}", [p.strip() for p in props.split(",") if p.strip()]))
    return out


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "triton", "transformers", "tokenizers", "safetensors", "flask", "gunicorn"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def context(args) -> dict:
    tiny = args.size == "tiny"
    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), f"lmi-gpu-bench-llama-{args.size}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return {"model_dir": os.path.abspath(model_dir), "device": args.device, "size": args.size, "seed": args.seed,
            "clients": args.clients or (4 if tiny else 64), "prompt": 32,
            "new": args.new_tokens or (16 if tiny else 128),
            "ttft_prompt": args.ttft_prompt or (64 if tiny else 2048), "env": env,
            "copy_bytes": (256 << 20) if args.device == "cpu" else (2 << 30), "given_model": bool(args.model_dir)}


def phase(report: dict, name: str, budget: Budget, fn, share: str | None = None) -> dict:
    allowed = budget.allow(share or name)
    if allowed is None:
        out = {"skipped": f"{budget.left():.0f} s of the budget left"}
    else:
        t = time.monotonic()
        try:
            out = fn(allowed)
        except Exception as exc:  # reported; the other phases go on
            out = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        out["seconds"] = round(time.monotonic() - t, 1)
    print(f"[{name}] " + json.dumps({k: v for k, v in out.items() if k not in ("properties", "card", "tail")})[:600],
          flush=True)
    return out


def ensure_model(ctx: dict, allowed: float) -> dict:
    if os.path.isfile(os.path.join(ctx["model_dir"], "config.json")) and (
            ctx["given_model"] or ctx["size"] == "tiny" or card_matches(ctx["model_dir"], LLAMA_7B, ctx["seed"])):
        return {"reused": ctx["model_dir"]}
    return dict(child_job("write", ctx, allowed), written=ctx["model_dir"])


def run_multiturn(args, ctx: dict, report: dict) -> dict:
    """benchmarks/multiturn.py on this GPU (docs/kv-tiers.md): the pool sized by
    gpu_memory_utilization to the weights + 6 GiB (about 4 GiB of KV for the 7B shape: ~8,000
    tokens), 16 conversations of a 1,024-token document and 64-token turns: a working set 4x+ the pool."""
    from benchmarks import multiturn

    total = ctx["probe"].get("memory_bytes") or 80 * 2**30
    utilization = min(0.9, (report["weight_bytes"] + 6 * 2**30) / total)
    out = os.path.splitext(args.out)[0] + "_multiturn.json"
    multiturn.main(["--model-dir", ctx["model_dir"], "--conversations", "16", "--doc-tokens", "1024",
                    "--question-tokens", "64", "--answer-tokens", "64", "--rounds", "2", "--restart-docs", "3",
                    "--extra", f"option.dtype=bf16;option.gpu_memory_utilization={utilization:.3f};"
                               "option.max_model_len=4096", "--out", out])
    with open(out) as f:
        result = json.load(f)
    ttft = result.get("turns", {}).get("ttft", {})
    p50 = {name: [statistics.median(v) for v in per_turn] for name, per_turn in ttft.items()}
    return {"out": out, "utilization": utilization, "ttft_p50": p50,
            "host_vs_off_from_turn_3": [a / b for a, b in zip(p50.get("tiers off", [])[2:], p50.get("host tier", [])[2:])]}


def run(args, ctx: dict, report: dict) -> None:
    budget = Budget(args.budget_s)
    phases = report["phases"]
    ctx["probe"] = report["device"] = dict(child_job("probe", ctx, 120), **versions())
    if args.device == "cuda" and not ctx["probe"]["cuda"]:
        raise SystemExit("no CUDA device here: use --smoke (--device cpu --size tiny)")
    phases["model"] = phase(report, "model", budget, lambda s: ensure_model(ctx, s))
    if "error" in phases["model"] or "skipped" in phases["model"]:
        return
    report["num_parameters"], embedding = count_parameters(ctx["model_dir"])
    # what a decode step reads: every weight but the input embedding (one row a token), in bf16
    report["weight_bytes"] = 2 * (report["num_parameters"] - embedding)
    if args.multiturn:
        phases["multiturn"] = phase(report, "multiturn", budget, lambda s: run_multiturn(args, ctx, report))
        return
    phases["tests"] = ({"skipped": "--skip-tests"} if args.skip_tests else
                       phase(report, "tests", budget, lambda s: run_tests(ctx, s)))
    phases["bandwidth"] = phase(report, "bandwidth", budget, lambda s: child_job("bandwidth", ctx, s))
    if figure(phases["bandwidth"], "bytes_per_s"):
        report["floor_ms_per_token"] = 1e3 * report["weight_bytes"] / phases["bandwidth"]["bytes_per_s"]
    phases["hf"] = phase(report, "hf", budget, lambda s: child_job("hf", ctx, s))
    from handlers.tokenizer import TextTokenizer

    ctx["tokenizer"] = TextTokenizer(ctx["model_dir"])
    ctx["short"] = exact_prompts(ctx["model_dir"], ctx["prompt"], ctx["clients"], ctx["seed"])
    ctx["long"] = exact_prompts(ctx["model_dir"], ctx["ttft_prompt"], 3, ctx["seed"])
    systems = [(e, e, []) for e in args.engines.split(",") if e]
    systems += [(name, "paged", props) for name, props in variants(args.paged_variants)]
    for name, engine, extra in systems:
        report["servers"][name] = phase(report, name, budget, lambda s: bench_server(name, engine, extra, ctx, s),
                                        share="server")


def finish(report: dict, ctx: dict, out: str) -> None:
    report["elapsed_s"] = round(time.monotonic() - report.pop("_started"), 1)
    print_table(report, ctx)
    report["acceptance"] = acceptance(report, ctx)
    print("\nacceptance (issue 20: 7B bf16 on one H200)" + (" - smoke run, thresholds not meaningful here"
                                                             if ctx["size"] == "tiny" else "") + ":")
    for c in report["acceptance"]:
        print(f"  {c['result']:<4} {c['check']}: {fmt(c['value'])}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    png = os.path.splitext(out)[0] + ".png"
    warning = plot(report, ctx, png) if report["device"] else "no device probe: no plot"
    report["plot"] = None if warning else png
    with open(out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"\nwrote {out}" + (f" and {png}" if not warning else f" (warning: {warning})"), flush=True)


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="serve this model (default: the 7B-shape checkpoint, written once into "
                                       "$TMPDIR/lmi-gpu-bench-llama-7b)")
    p.add_argument("--out", help="JSON results; a PNG beside it (default benchmarks/results/gpu.json, "
                                 "gpu_smoke_cpu.json with --smoke)")
    p.add_argument("--budget-s", type=float, default=480, help="the whole run's time budget (default 480)")
    p.add_argument("--skip-tests", action="store_true", help="do not run tests/test_gpu.py")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size", choices=("7b", "tiny"), default="7b")
    p.add_argument("--smoke", action="store_true", help="--device cpu --size tiny: a check of the program")
    p.add_argument("--engines", default="dynamic,padded,paged", help="comma list of: dynamic, padded, paged")
    p.add_argument("--paged-variants", default="eager:option.enforce_eager=true",
                   help="'NAME:KEY=VALUE[,KEY=VALUE];...' paged servers with extra properties, e.g. "
                        "'triton:option.attention_backend=triton;flex:option.attention_backend=flex'")
    p.add_argument("--clients", type=int, help="concurrent clients and the HF batch (default 64; 4 with --smoke)")
    p.add_argument("--new-tokens", type=int, help="new tokens per request (default 128; 16 with --smoke)")
    p.add_argument("--ttft-prompt", type=int, help="the TTFT prompt's tokens (default 2048; 64 with --smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--multiturn", action="store_true", help="only the multi-turn KV-tier run (benchmarks/multiturn.py "
                                                            "on this GPU, docs/kv-tiers.md) after the model phase")
    p.add_argument("--one", choices=sorted(JOBS), help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.size = "cpu", "tiny"
    args.out = args.out or ("benchmarks/results/gpu_smoke_cpu.json" if args.size == "tiny" else
                            "benchmarks/results/gpu.json")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.one:
        print(RESULT + json.dumps(JOBS[args.one](json.loads(args.job)), default=str), flush=True)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers still stop (finally blocks)
    ctx = context(args)
    report = {"command": " ".join([sys.executable, "-m", "benchmarks.gpu"] + sys.argv[1:]),
              "settings": {k: v for k, v in ctx.items() if k != "env"}, "device": {}, "phases": {}, "servers": {},
              "_started": time.monotonic()}
    print(f"model {ctx['model_dir']}; {ctx['clients']} clients, {ctx['prompt']} in / {ctx['new']} out, TTFT prompt "
          f"{ctx['ttft_prompt']} tokens; budget {args.budget_s:.0f} s", flush=True)
    try:
        run(args, ctx, report)
    finally:
        for key in ("probe", "tokenizer", "short", "long"):
            ctx.pop(key, None)
        finish(report, ctx, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
