"""serving.properties + environment → one typed set of settings, with where each value came from.

Precedence (DJL's, see shared/reference §1.4): the file wins; `OPTION_FOO` fills `option.foo` and
`SERVING_FOO` fills `foo` only when the file lacks the key; `HF_MODEL_ID`/`HF_REVISION` fill the
model keys; TGI/SageMaker names fill a key only when nothing above set it. The environment comes in
as an argument: container/config.py is the one caller that reads os.environ.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from container.keys import ACCEPTED_UNUSED, FOREIGN_KEYS, KEY_ALIASES, KEYS, KEYS_BY_NAME, ConfigError

log = logging.getLogger("container.config")

FILE, ENV, DEFAULT, CLI = "file", "env", "default", "cli"

# TGI / SageMaker environment names → LMI key; used only when the LMI key is still unset.
ENV_ALIASES = (
    ("TENSOR_PARALLEL_DEGREE", "option.tensor_parallel_degree"),
    ("SM_NUM_GPUS", "option.tensor_parallel_degree"),  # TGI's name, below LMI's own
    ("MAX_BATCH_SIZE", "option.max_rolling_batch_size"),
    ("MAX_BATCH_PREFILL_TOKENS", "option.max_rolling_batch_prefill_tokens"),
    ("MAX_CONCURRENT_REQUESTS", "job_queue_size"),
    ("HF_MODEL_TRUST_REMOTE_CODE", "option.trust_remote_code"),
    ("HF_MODEL_QUANTIZE", "option.quantize"),
    ("CUDA_MEMORY_FRACTION", "option.gpu_memory_utilization"),
    ("DJL_ENTRY_POINT", "option.entryPoint"),  # DJL's, below OPTION_ENTRYPOINT
    ("SAGEMAKER_NUM_MODEL_WORKERS", "maxWorkers"),
    ("SAGEMAKER_MAX_REQUEST_SIZE", "max_request_size"),
    ("SAGEMAKER_MULTI_MODEL", "multi_model"),
    ("HF_TASK", "option.task"),  # DJL's: the task of an HF_MODEL_ID model
)
_UPPER = re.compile(r"^[A-Z0-9_]+$")


@dataclass(frozen=True)
class Setting:
    value: Any
    source: str  # file | env (NAME) | default | cli


@dataclass
class ResolvedConfig:
    """Typed values of every known key, their sources, and the warnings met on the way."""

    settings: dict[str, Setting]
    warnings: list[str] = field(default_factory=list)
    raw: dict[str, str] = field(default_factory=dict)  # every key set (known or not) → its text (custom handlers)

    def __getitem__(self, key: str) -> Any:
        return self.settings[key].value

    def is_set(self, key: str) -> bool:
        return self.settings[key].source != DEFAULT


def collect_raw(properties: Mapping[str, str], env: Mapping[str, str]) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """Merge file and environment by DJL's precedence: {key: (raw value, source)} and warnings."""
    raw: dict[str, tuple[str, str]] = {}
    warnings: list[str] = []
    for key, value in properties.items():
        _put(raw, key, value, FILE)
    checked = {key for key in raw}  # file keys and OPTION_* keys get "did you mean" hints
    # HF_MODEL_ID / HF_REVISION after the OPTION_* variables: an OPTION_* name says the key exactly
    for name, value in sorted(env.items(), key=lambda item: (item[0].startswith("HF_"), item[0])):
        value = value.strip()
        if not value:
            continue
        key = _env_key(name)
        if key is None:
            continue
        if KEY_ALIASES.get(key, key) not in raw:
            _put(raw, key, value, f"{ENV} ({name})")
            if name.startswith("OPTION_"):
                checked.add(KEY_ALIASES.get(key, key))
    for name, option in (("HF_MODEL_ID", "OPTION_MODEL_ID"), ("HF_REVISION", "OPTION_REVISION")):
        ours, theirs = (env.get(option) or "").strip(), (env.get(name) or "").strip()
        if ours and theirs and ours != theirs:
            used = "the properties file's" if raw.get(_env_key(name), ("", ""))[1] == FILE else option
            warnings.append(f"{name}={theirs!r} and {option}={ours!r} are both set: using {used} value (an "
                            f"OPTION_* variable names its key exactly; {name} is SageMaker's shorthand, and DJL "
                            "would load both models)")
    for name, key in ENV_ALIASES:
        if (env.get(name) or "").strip() and key not in raw:
            raw[key] = (env[name].strip(), f"{ENV} ({name})")
    for key in sorted(checked):
        if key in FOREIGN_KEYS:
            warnings.append(f"{key} ({raw[key][1]}) is a DJL/vLLM setting lmi-serve does not implement: ignored")
        elif key not in KEYS_BY_NAME and key not in ACCEPTED_UNUSED:
            warnings.append(_unknown_key_warning(key, raw[key][1]))
    return raw, warnings


def _put(raw: dict[str, tuple[str, str]], key: str, value: str, source: str) -> None:
    """Store under our name; an alias (vLLM's spelling) keeps its name in the source. The alias and
    its key from the same source with different values: one line naming both."""
    target = KEY_ALIASES.get(key, key)
    if target != key:
        source = f"{source} as {key}"
    if target in raw and raw[target][1].split(" as ")[0] == source.split(" as ")[0] \
            and raw[target][0].strip() != value.strip():
        alias = key if key != target else raw[target][1].split(" as ")[-1]
        raise ConfigError(f"{alias} and {target} disagree ({raw[target][0]!r} and {value!r}; {alias} is another "
                          f"name for {target}); set only one of them")
    raw[target] = (value, source)


def _env_key(name: str) -> str | None:
    if name.startswith("OPTION_"):
        suffix = name[len("OPTION_"):]
        k = suffix.lower() if _UPPER.match(suffix) else suffix
        if k == "engine":
            return "engine"
        return "option." + ("entryPoint" if k == "entrypoint" else k)
    if name.startswith("SERVING_"):
        key = name[len("SERVING_"):].lower()
        return KEY_ALIASES.get(key, key) if key in KEYS_BY_NAME or key in KEY_ALIASES else None
    if name == "HF_MODEL_ID":
        return "option.model_id"
    if name == "HF_REVISION":
        return "option.revision"
    return None


def _unknown_key_warning(key: str, source: str) -> str:
    known = [k.name for k in KEYS]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown key {key} ({source}) is ignored{hint}"


def resolve(properties: Mapping[str, str], env: Mapping[str, str], *,
            cli: Mapping[str, str] | None = None) -> ResolvedConfig:
    """Parse and type every key; raise ConfigError on the first invalid value."""
    raw, warnings = collect_raw(properties, env)
    for key, value in (cli or {}).items():
        raw[key] = (value, CLI)
    settings: dict[str, Setting] = {}
    for spec in KEYS:
        if spec.name in raw:
            value, source = raw[spec.name]
            settings[spec.name] = Setting(spec.parse(spec.name, value), source)
        else:
            settings[spec.name] = Setting(spec.default, DEFAULT)
    cfg = ResolvedConfig(settings, warnings, {key: value for key, (value, _) in raw.items()})
    check_static_contradictions(cfg)
    return cfg


def check_static_contradictions(cfg: ResolvedConfig) -> None:
    """Keys that contradict one another whatever the model: the engine keys."""
    rb = cfg["option.rolling_batch"]
    if cfg["batch_size"] > 1 and rb in ("scheduler", "lmi-dist", "vllm"):
        raise ConfigError(
            f"batch_size={cfg['batch_size']} with option.rolling_batch={rb}: dynamic batching and "
            "rolling batch exclude each other; set batch_size=1 or option.rolling_batch=disable")
    paged = cfg["option.paged_attention"]
    if cfg.is_set("option.paged_attention"):
        if paged and rb == "scheduler":
            raise ConfigError("option.paged_attention=true with option.rolling_batch=scheduler: the scheduler "
                              "engine uses a padded KV cache; use option.rolling_batch=lmi-dist or auto")
        if not paged and rb in ("lmi-dist", "vllm"):
            raise ConfigError(f"option.paged_attention=false with option.rolling_batch={rb}: {rb} is the "
                              "paged engine; use option.rolling_batch=scheduler for a padded KV cache")



def default_download_dir(env: Mapping[str, str]) -> str:
    return os.path.join(env.get("HOME") or "/tmp", ".cache", "lmi-serve", "download")


def describe(cfg: ResolvedConfig) -> list[str]:
    """Lines `key = value  [source]` for every key, for `lmi config` and the start-up log."""
    width = max(len(k) for k in cfg.settings)
    return [f"{k:<{width}} = {s.value!s:<24} [{s.source}]" for k, s in cfg.settings.items()]


def resolve_port(cli_port: int | None, env: Mapping[str, str]) -> int:
    """--port, else SAGEMAKER_BIND_TO_PORT, else 8080."""
    if cli_port:
        return cli_port
    raw = env.get("SAGEMAKER_BIND_TO_PORT")
    if raw:
        try:
            port = int(raw)
        except ValueError:
            port = 0
        if not 0 < port < 65536:
            raise ConfigError(f"SAGEMAKER_BIND_TO_PORT={raw!r} is invalid: expected a port number (1-65535)")
        return port
    return 8080
