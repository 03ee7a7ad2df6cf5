"""Checks the launcher makes before it starts anything, so that a server that cannot start says why
in one sentence instead of two tracebacks and "gunicorn exited with code 3".

Each check returns None or the sentence; `first_problem` runs them in order.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import socket
import struct

from engines.config import LmiConfig

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def check_model_files(model_dir: str) -> str | None:
    if not os.path.isdir(model_dir):
        return f"the model directory {model_dir} does not exist"
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return f"no model files in {model_dir}: config.json is missing"
    if not any(glob.glob(os.path.join(model_dir, p)) for p in WEIGHT_PATTERNS):
        return f"no model weights in {model_dir}: expected *.safetensors files"
    return None


def check_tokenizer(model_dir: str) -> str | None:
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return (f"no tokenizer.json in {model_dir}: the HTTP workers need a fast tokenizer "
                "(save the model's tokenizer with tokenizers or transformers)")
    return None


def read_safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file (name -> dtype, shape, data_offsets); no tensor data is
    read. ValueError when the file is not safetensors; OSError when it cannot be read."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"it is only {len(raw)} bytes long")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"its header claims {size} bytes")
        try:
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise ValueError(f"its header is not valid JSON ({exc})") from None
    header.pop("__metadata__", None)
    return header


def check_weights_readable(model_dir: str) -> str | None:
    """Every safetensors file opens and has a well-formed header (no tensor data is read)."""
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        try:
            read_safetensors_header(path)
        except PermissionError:
            return f"cannot read {path}: permission denied (the server runs as uid {os.getuid()})"
        except OSError as exc:
            return f"cannot read {path}: {exc.strerror or exc}"
        except ValueError as exc:
            return f"{path} is not a safetensors file: {exc}"
    return None


def check_port(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"port {port} on {host} is already in use by another process; stop it or choose "
                        "another port (--port or SAGEMAKER_BIND_TO_PORT)")
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def check_mpirun(config: LmiConfig, path: str | None) -> str | None:
    if config.parallel.use_mpi and config.parallel.ranks > 1 and not shutil.which("mpirun", path=path):
        return (f"mpirun was not found on PATH, and engine=MPI with {config.parallel.ranks} ranks "
                f"(tensor_parallel_degree={config.parallel.tensor_parallel_degree} x pipeline_parallel_degree="
                f"{config.parallel.pipeline_parallel_degree}) needs it: install Open MPI (openmpi-bin)")
    return None


def first_problem(config: LmiConfig, host: str, env: dict[str, str]) -> str | None:
    model_dir = config.model.local_dir
    checks = (lambda: check_model_files(model_dir), lambda: check_tokenizer(model_dir),
              lambda: check_weights_readable(model_dir), lambda: check_mpirun(config, env.get("PATH")),
              lambda: check_port(host, config.server.port))
    if config.model.entry_point is not None:  # a custom handler loads what it wants, from wherever
        checks = (lambda: None if os.path.isdir(model_dir) else f"the model directory {model_dir} does not exist",
                  lambda: check_port(host, config.server.port))
    for check in checks:
        problem = check()
        if problem:
            return problem
    return None
