"""Shared fixtures: a tiny model made here, a loopback S3 server, and real `lmi serve` processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.support import Server, free_port

# Without a GPU, Triton kernels (engines/kernels) run on CPU tensors under Triton's interpreter. It is
# read when a kernel is defined, so it is set before any test imports one; servers the tests start
# inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama with a tokenizer trained on the embedded corpus (seed 0)."""
    from container.model_maker import make_model

    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    make_model(str(out), arch="llama", size="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def encoders(tmp_path_factory) -> dict[str, Path]:
    """Tiny random embedding, reranking and classification checkpoints (container/encoder_maker.py), by kind."""
    from container.encoder_maker import ENCODER_KINDS, make_encoder

    root = tmp_path_factory.mktemp("encoders")
    for kind in ENCODER_KINDS:
        make_encoder(str(root / kind), kind)
    return {kind: root / kind for kind in ENCODER_KINDS}


@pytest.fixture(scope="session")
def hf(tiny_model):
    """HF `generate` on the tiny model: the oracle every engine is checked against."""
    from tests.support import hf_oracle

    return hf_oracle(tiny_model)


@pytest.fixture(scope="session")
def moto_endpoint():
    """moto in server mode on 127.0.0.1: a real S3-compatible HTTP server for boto3."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start")
            time.sleep(0.1)
    yield url
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def start_server(tmp_path):
    """Factory: start_server(properties, model_dir, env=...) → a ready Server, stopped at the end."""
    servers: list[Server] = []

    def start(properties: str | None, model_dir: Path | None, *, wait: bool = True, **kwargs) -> Server:
        server = Server(tmp_path, properties, model_dir, **kwargs)
        servers.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()
