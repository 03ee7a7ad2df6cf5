"""Helpers the tests share: free ports and real `lmi serve` processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
LMI = [sys.executable, "-m", "container.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`lmi serve` (or another launcher command) as a real subprocess on a free port."""

    def __init__(self, tmp: Path, properties: str | None, model_dir: Path | None, *,
                 env: dict[str, str] | None = None, cmd: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}.log"
        args = list(cmd) if cmd else [*LMI, "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if properties is not None:
            props = tmp / f"serving-{self.port}.properties"
            props.write_text(properties)
            args += ["--properties", str(props)]
        if model_dir is not None and not cmd:
            args += ["--model-dir", str(model_dir)]
        full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        self.ping_statuses: list[int] = []

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status = requests.get(self.url + "/ping", timeout=3).status_code
                self.ping_statuses.append(status)
                if status == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def post(self, body, path: str = "/invocations", **kwargs) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=kwargs.pop("timeout", 120), **kwargs)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def running_server(tmp: Path, properties: str, model_dir: Path):
    """A module fixture body: a ready server, stopped (and checked to exit 0) at the end."""
    srv = Server(tmp, properties, model_dir)
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def hf_oracle(model_dir):
    """Greedy HF `generate` on the same model, cut after EOS: generate(prompt, max_new_tokens) -> ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(prompt: str | list[int], max_new_tokens: int) -> list[int]:
        """`prompt`: text (tokenized with special tokens, as /invocations does) or token ids."""
        enc = tok(prompt, return_tensors="pt") if isinstance(prompt, str) else \
            {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)}
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        ids = out[0, enc["input_ids"].shape[1]:].tolist()
        return ids[: ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ids else ids

    generate.decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    generate.tokenizer = tok
    generate.model = model
    return generate


def ids_of(body: dict) -> list[int]:
    return [t["id"] for t in body["details"]["tokens"]]


def ping(server: Server) -> dict:
    return requests.get(server.url + "/ping", timeout=5).json()


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    """Poll `condition()` until it returns something truthy (returned), or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def wait_running(server: Server, n: int, timeout: float = 10.0) -> dict:
    """Wait until /ping (a snapshot up to a second old) shows `n` requests running."""
    return wait_for(lambda: (state := ping(server))["running"] == n and state, timeout, f"{n} running request(s)")


def wait_idle(server: Server, timeout: float = 10.0) -> dict:
    """Wait until the engine has nothing running or waiting; its last /ping body."""
    deadline = time.monotonic() + timeout
    state = ping(server)
    while time.monotonic() < deadline:
        state = ping(server)
        if state["running"] == 0 and state["waiting"] == 0:
            return state
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {state}")


def paged_engine(model_dir, **sched):
    """A loaded paged engine on a model in fp32 (defaults: a 4 MiB KV cache, max_num_seqs 4), publishing
    nowhere (drive_engine collects the outputs)."""
    return local_engine(model_dir, "paged", **sched)


def local_engine(model_dir, kind: str, model_impl: str = "auto", quantize: str | None = None, dtype: str = "fp32",
                 kv_cache_dtype: str = "auto", lora: dict | None = None, cpu_linear: str = "auto",
                 trust_remote_code: bool = False, **sched):
    """A loaded rolling engine of `kind` (paged | rolling: the padded one) on a model in `dtype`, in this
    process, publishing nowhere; as paged_engine. model_impl, quantize, cpu_linear, trust_remote_code:
    option.model_impl, option.quantize, option.cpu_linear, option.trust_remote_code."""
    from engines.config import ENGINE_PAGED, LmiConfig, ModelConfig, SchedulerConfig
    from engines.dist import SingleProcess
    from engines.loop.paged_engine import PagedEngine
    from engines.loop.rolling_engine import RollingEngine

    sched = {"kv_cache_memory": "4MiB", "max_num_seqs": 4, **sched}
    config = LmiConfig(model=ModelConfig(local_dir=str(model_dir), dtype=dtype, model_impl=model_impl,
                                         quantize=quantize, kv_cache_dtype=kv_cache_dtype, cpu_linear=cpu_linear,
                                         trust_remote_code=trust_remote_code, **(lora or {})),
                       scheduler=SchedulerConfig(engine_kind=kind, **sched))
    engine = (PagedEngine if kind == ENGINE_PAGED else RollingEngine)(config, lambda outs: None, SingleProcess())
    engine.load()
    return engine


def drive_engine(engine, requests, join_every: int = 1) -> dict:
    """A rolling engine offline: one (request id, prompt ids, SamplingParams) added every
    `join_every` steps (requests join mid-flight), then stepped to the end → request id → its
    Outputs."""
    from engines.protocol import Add

    outputs: dict = {}
    engine.publish = lambda outs: [outputs.setdefault(o.request_id, []).append(o) for o in outs]
    pending, steps = list(requests), 0
    while pending or engine.has_work():
        if pending and steps % join_every == 0:
            engine.add(Add(*pending.pop(0)))
        engine.step()
        steps += 1
        assert steps < 2000, "no progress"
    return outputs


def output_tokens(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def run_tp2_job(tmp_path, job: dict, dirs: list[str], ranks: int = 2) -> dict:
    """One `mpirun -np 2` (or `ranks`) of tests/tp_families.py over the model dirs with `job` (prompts,
    new_tokens, options) → model dir → its greedy tokens per prompt."""
    import json

    job_path, out = tmp_path / "job.json", tmp_path / "out.json"
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MASTER_PORT": str(free_port())}  # torch.distributed's rendezvous (job "backend": "gloo")
    proc = subprocess.run(["mpirun", "--allow-run-as-root", "--bind-to", "none", "--oversubscribe", "-np", str(ranks),
                           sys.executable, "-m",
                           "tests.tp_families", str(out), str(job_path), *dirs], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def compare_backends_over_mixed_steps(oracle_cls, backend_cls, device, dtype, block_size: int, atol: float,
                                      heads: tuple[int, int] = (8, 2), dim: int = 64, layer=None) -> None:
    """Prefill chunks (one after cached context), decodes, a proposal-like 3-token chunk and bucket
    padding over several steps, through the step buffers: `backend_cls` gives `oracle_cls`'s outputs
    for every real token, and its padding rows are zero (mixed steps)."""
    import torch

    from engines.attention.step import ForwardBatch, SeqChunk
    from engines.worker.step_buffers import StepBuffers

    torch.manual_seed(0)
    hq, hkv = heads
    layers = None if layer is None else [layer]  # one layer's LayerOptions (scale, window, softcap)
    backends = [cls(1, hkv, dim, block_size, dtype, device, layers) for cls in (oracle_cls, backend_cls)]
    for b in backends:
        b.allocate(16)
    buffers = [StepBuffers(2048, 4, 8, block_size, 16, device) for _ in backends]
    tables = {"a": [3, 9, 4, 0], "b": [5, 1, 2, 12], "c": [7, 6, 13, 14], "d": [8, 10, 11, 15]}
    done = dict.fromkeys(tables, 0)
    steps = [{"a": 3 * block_size + 5, "b": 40}, {"a": 1, "b": block_size + 3, "c": 17, "d": 2},
             {"a": 1, "b": 1, "c": 3, "d": 1}, {"a": 1, "b": 1, "c": 1, "d": 1}]
    for step in steps:
        chunks = [SeqChunk(done[s], n, tables[s], [0] * n, speculative=n == 3) for s, n in step.items()]
        for s, n in step.items():
            done[s] += n
        outs = []
        for backend, buf in zip(backends, buffers):
            view = buf.write(ForwardBatch(chunks, []))
            gen = torch.Generator(device="cpu").manual_seed(sum(done.values()))  # the same for both
            q, k, v = (torch.randn(1, view.num_tokens, h, dim, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))
            outs.append((backend.forward(0, q, k, v, backend.metadata(view))[0].float(), view))
        real = sum(step.values())
        torch.testing.assert_close(outs[1][0][:real], outs[0][0][:real], atol=atol, rtol=atol)
        if not outs[1][1].decode_only:
            assert torch.count_nonzero(outs[1][0][real:]) == 0
