"""A model registered at run time (POST /models, docs/multi-model.md): its url checked against the
allow-list, fetched, configured from its own serving.properties and the registration's parameters,
its custom code checked against what the operator allows, and what it needs of the memory budget.

Every refusal is a `Refusal` with the HTTP status and one sentence naming the rule that refused it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import msgspec

from container import config as cfgmod
from container.keys import ConfigError
from container.preflight import check_model_files, check_tokenizer
from container.properties import PropertiesError, read_properties
from engines.config import LmiConfig
from engines.weights.artifacts import ArtifactError, resolve_model

MIB = 1 << 20
# DJL's POST /models parameters → our keys (others DJL takes are refused by name; option.* keys pass as they are)
DJL_PARAMETERS = {"engine": "engine", "job_queue_size": "job_queue_size", "batch_size": "batch_size",
                  "max_batch_delay": "max_batch_delay", "min_worker": "minWorkers", "max_worker": "maxWorkers",
                  "max_idle_time": "max_idle_time", "required_memory_mb": "required_memory_mb"}
IGNORED_PARAMETERS = ("model_name", "url", "synchronous", "model_version")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class Refusal(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Registration:
    name: str
    url: str
    config: LmiConfig
    need_bytes: int  # one load of the model: every copy and rank


def name_of(url: str) -> str:
    """DJL's: a registration without model_name is named after its url's last part."""
    last = url.rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".tar.gz", ".tgz", ".zip", ".tar"):
        last = last.removesuffix(suffix)
    return last


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise Refusal(400, f"model_name={name!r} is invalid: letters, digits, '_', '-' and '.', at most 128, "
                           "starting with a letter or digit")
    return name


def check_allowed(url: str, pattern: str) -> None:
    if not re.match(pattern, url):
        raise Refusal(403, f"model url {url!r} is refused by model_url_pattern={pattern!r} (the server's allow-list "
                           "of model sources); the operator may widen it in serving.properties or "
                           "SERVING_MODEL_URL_PATTERN")


def properties_of(local_dir: str, options: dict[str, str]) -> dict[str, str]:
    """The model dir's serving.properties, with the registration's parameters over it."""
    props: dict[str, str] = {}
    path = os.path.join(local_dir, "serving.properties")
    if os.path.isfile(path):
        try:
            props = read_properties(path)
        except PropertiesError as exc:
            raise Refusal(400, f"the model's serving.properties: {exc}") from None
    for key, value in options.items():
        if key in IGNORED_PARAMETERS:
            continue
        target = DJL_PARAMETERS.get(key, key)
        if target not in DJL_PARAMETERS.values() and not target.startswith("option."):
            raise Refusal(400, f"unknown registration parameter {key!r}: DJL's {', '.join(sorted(DJL_PARAMETERS))}, "
                               "or option.* keys of serving.properties")
        props[target] = value
    return props


def register(name: str, url: str, options: dict[str, str], *, url_pattern: str, allow_custom_code: bool,
             download_dir: str, num_gpus: int, num_cpus: int, port: int, device_bytes: int) -> Registration:
    """Everything decided before any process starts; a Refusal otherwise."""
    check_name(name)
    check_allowed(url, url_pattern)
    try:
        local_dir = resolve_model(url, None, download_dir=download_dir)
    except ArtifactError as exc:
        raise Refusal(404, f"model url {url!r}: {exc}") from None
    try:
        resolved = cfgmod.resolve(properties_of(local_dir, options), {})
        handler = cfgmod.custom_handler(resolved, local_dir)
        if (handler is not None or resolved["option.trust_remote_code"]) and not allow_custom_code:
            what = f"a custom handler ({os.path.basename(handler)})" if handler else "option.trust_remote_code=true"
            raise Refusal(403, f"model {name!r} brings its own code, {what}, and allow_custom_code is false: the "
                               "operator allows registered models to run their code with allow_custom_code=true")
        if handler is None:
            problem = check_model_files(local_dir) or check_tokenizer(local_dir)
            if problem:
                raise Refusal(400, f"model {name!r}: {problem}")
        spec = cfgmod.read_spec(local_dir, resolved["option.max_model_len"])
        config = cfgmod.build(resolved, local_dir=local_dir, spec=spec, num_gpus=num_gpus, num_cpus=num_cpus,
                              port=port, download_dir=download_dir)
    except ConfigError as exc:
        raise Refusal(400, f"model {name!r}: {exc}") from None
    config = msgspec.structs.replace(config, server=msgspec.structs.replace(config.server, served_model_name=name))
    return Registration(name, url, config, need_bytes(config, resolved, spec, device_bytes))


def need_bytes(config: LmiConfig, resolved, spec, device_bytes: int) -> int:
    """What one load of the model needs: required_memory_mb per copy when set, a custom handler or a pooling
    model its files plus one interpreter, else lmi plan's figures (weights, KV cache, headroom per rank) for every rank
    of every copy; on GPUs at least its gpu_memory_utilization share of each device."""
    from engines.weights.memory_plan import CPU_RUNTIME_BYTES, Machine, available_ram, plan
    from container import planner

    copies, ranks = config.parallel.copies, config.parallel.ranks
    if resolved["required_memory_mb"]:
        return resolved["required_memory_mb"] * MIB * copies

    def files_need() -> int:  # its files and an interpreter
        return (_files_bytes(config.model.local_dir) + CPU_RUNTIME_BYTES) * copies

    if config.model.entry_point is not None or config.model.pooling is not None or spec is None:
        return files_need()  # (a pooling model keeps no KV cache: its weights and an interpreter)
    num_gpus = cfgmod.count_gpus(os.environ)
    machine = Machine("this machine", num_gpus, device_bytes if num_gpus else available_ram())
    try:
        shape = planner.read_model_shape(config.model.local_dir, spec=spec)
    except (OSError, ValueError):  # (no memory model for it)
        return files_need()
    p = plan(shape, machine, planner.workload(resolved, shape, machine, config.scheduler.engine_kind))
    per_rank = p.weight_bytes + p.headroom_bytes + p.kv_bytes
    if machine.is_gpu:
        per_rank = max(per_rank, int(device_bytes * config.scheduler.gpu_memory_utilization))
    return per_rank * ranks * copies


def _files_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, names in os.walk(directory) for f in names)
