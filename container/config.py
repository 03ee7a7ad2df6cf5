"""serving.properties + environment → one validated configuration, with where each value came from.

Precedence (DJL's, see shared/reference §1.4): the file wins; `OPTION_FOO` fills `option.foo` and
`SERVING_FOO` fills `foo` only when the file lacks the key; `HF_MODEL_ID`/`HF_REVISION` fill the
model keys; TGI/SageMaker names fill a key only when nothing above set it. This is the only module
that reads environment variables, and it takes them as an argument.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any, Mapping

from container.keys import ACCEPTED_UNUSED, FOREIGN_KEYS, KEY_ALIASES, KEYS, KEYS_BY_NAME, ConfigError
from engines.config import (
    ENGINE_DYNAMIC, ENGINE_HANDLER, ENGINE_PAGED, ENGINE_ROLLING,
    LmiConfig, ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig,
)
from engines.core.modes import scheduling_mode
from engines.models import registry
from engines.spec import ModelSpec
from engines.devices import DtypeChoice, choose_dtype, cpu_flags
from engines.weights.quant_checkpoint import check_quantize_option, read_checkpoint_quant

log = logging.getLogger(__name__)

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
)
_UPPER = re.compile(r"^[A-Z0-9_]+$")


class CapacityError(ConfigError):
    """The configuration asks for more devices than this machine has."""


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
    _check_static_contradictions(cfg)
    return cfg


def _check_static_contradictions(cfg: ResolvedConfig) -> None:
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


# DJL's built-in handlers: ours where we have the engine, else refused at start (option.entryPoint)
OUR_ENTRY_POINTS = {"djl_python.huggingface": None, "djl_python.lmi_vllm": "vllm", "djl_python.vllm": "vllm",
                    "djl_python.lmi_dist": "lmi-dist", "djl_python.rolling_batch": None}
REFUSED_ENTRY_POINTS = {
    "djl_python.transformers_neuronx": "AWS Inferentia / Trainium (the Neuron SDK)",
    "djl_python.neuron": "AWS Inferentia / Trainium (the Neuron SDK)",
    "djl_python.tensorrt_llm": "NVIDIA TensorRT-LLM", "djl_python.trtllm": "NVIDIA TensorRT-LLM",
    "djl_python.deepspeed": "DeepSpeed inference", "djl_python.sm_pipeline": "SageMaker model parallelism",
}


def custom_handler(cfg: ResolvedConfig, local_dir: str | None) -> str | None:
    """The custom handler option.entryPoint names (a .py file's path, or a module name), or model.py in the
    model dir when it is unset (DJL's rule); None: our engines. A built-in DJL name we cannot serve, or a
    handler file that is not there, is a ConfigError."""
    entry = (cfg["option.entryPoint"] or "").strip()
    if not entry:
        found = os.path.join(local_dir, "model.py") if local_dir else ""
        return found if found and os.path.isfile(found) else None
    if entry in OUR_ENTRY_POINTS:
        return None
    if entry.startswith("djl_python."):
        needs = REFUSED_ENTRY_POINTS.get(entry)
        why = f"it runs on {needs}, which this container does not have" if needs else "lmi-serve has no such handler"
        raise ConfigError(f"option.entryPoint={entry}: {why}; use djl_python.huggingface (lmi-serve's engines: "
                          f"rolling batch, paged attention), djl_python.lmi_vllm, or a model.py of your own")
    if entry.endswith(".py"):
        path = entry if os.path.isabs(entry) else os.path.join(local_dir or "", entry)
        if not os.path.isfile(path):
            raise ConfigError(f"option.entryPoint={entry}: no such file {path}")
        return path
    return entry  # a module importable from the model dir or the environment


def handler_properties(cfg: ResolvedConfig, local_dir: str) -> dict[str, str]:
    """What a custom handler's warm-up call gets as properties: every key set, option.* without the prefix
    (DJL's), and model_dir."""
    props = {(key[len("option."):] if key.startswith("option.") else key): value for key, value in cfg.raw.items()}
    props["model_dir"] = local_dir
    return props


def select_engine(cfg: ResolvedConfig, spec: ModelSpec | None) -> str:
    """DJL's rules: batch_size>1 or disable → dynamic; scheduler → padded; lmi-dist → paged;
    auto → paged unless paged_attention=false or the model cannot use our paged KV cache (a fallback
    architecture whose attention does not go through transformers' attention interface, or
    trust_remote_code)."""
    rb = cfg["option.rolling_batch"]
    if rb == "auto" and not cfg.is_set("option.rolling_batch"):  # DJL's lmi_vllm / lmi_dist entry points
        rb = OUR_ENTRY_POINTS.get((cfg["option.entryPoint"] or "").strip()) or rb
    if rb == "disable" or cfg["batch_size"] > 1:
        return ENGINE_DYNAMIC
    if rb == "scheduler":
        return ENGINE_ROLLING
    if rb == "vllm":
        log.info("option.rolling_batch=vllm: serving with the paged engine (lmi-serve's vLLM-style engine)")
        return ENGINE_PAGED
    if rb == "lmi-dist":
        return ENGINE_PAGED
    if not cfg["option.paged_attention"] or not pages_kv(cfg, spec):
        return ENGINE_ROLLING
    return ENGINE_PAGED


def pages_kv(cfg: ResolvedConfig, spec: ModelSpec | None) -> bool:
    """Whether the model can run on our paged KV cache: our model code, or transformers' whose
    attention goes through transformers' attention interface (never a checkpoint's own code)."""
    if cfg["option.trust_remote_code"]:
        return False
    if spec is None:
        return True
    if cfg["option.model_impl"] == "transformers":
        return registry.attention_interface_supported(spec.model_type)
    return registry.fallback_reason(spec) is None or registry.paged_fallback(spec)


def model_code(cfg: ResolvedConfig, spec: ModelSpec | None) -> str:
    """What runs the model, in words (the start log and `lmi plan`)."""
    fallback = fallback_reason(cfg, spec)
    if not fallback:
        return "native"
    if pages_kv(cfg, spec):
        return f"the transformers fallback, its attention on our KV cache ({fallback})"
    return f"the transformers fallback with transformers' own KV cache, padded ({fallback})"


def fallback_reason(cfg: ResolvedConfig, spec: ModelSpec | None) -> str | None:
    """Why the model runs on the transformers fallback (None: on our model code; also when the
    checkpoint is not known before download)."""
    if cfg["option.trust_remote_code"]:
        return "option.trust_remote_code=true runs the checkpoint's own code"
    if cfg["option.model_impl"] == "transformers":
        return "option.model_impl=transformers"
    return None if spec is None else registry.fallback_reason(spec)


def resolve_tensor_parallel(cfg: ResolvedConfig, num_gpus: int, num_cpus: int) -> int:
    tp = cfg["option.tensor_parallel_degree"]
    if tp == "max":
        if num_gpus == 0:
            log.info("option.tensor_parallel_degree=max on a machine without GPUs: using 1")
            return 1
        return num_gpus
    limit, what = (num_gpus, "GPUs") if num_gpus else (num_cpus, "CPU cores")
    if tp > limit:
        raise CapacityError(f"option.tensor_parallel_degree={tp} exceeds the {limit} {what} of this machine; "
                          f"set it to {limit} or less (or max)")
    return tp


def build(cfg: ResolvedConfig, *, local_dir: str, spec: ModelSpec | None,
          num_gpus: int, num_cpus: int, port: int, adapters: dict[str, str] | None = None,
          download_dir: str = "", cpu: frozenset[str] | None = None, gpu_bf16: bool | None = None) -> LmiConfig:
    """The typed configuration the engine and HTTP workers run with. adapters: option.adapters with
    each location resolved to a local directory (by the caller, which fetches S3 and hub ones); cpu:
    the CPU's feature flags (None: this one's), gpu_bf16: whether the GPUs compute bf16 (None: not
    known), which decide the dtype when option.dtype is unset (engines/devices.py)."""
    handler = custom_handler(cfg, local_dir)
    if handler is not None:
        return build_handler(cfg, handler, local_dir=local_dir, num_gpus=num_gpus, num_cpus=num_cpus, port=port)
    kind = select_engine(cfg, spec)
    fallback = fallback_reason(cfg, spec)
    if fallback and cfg["option.model_impl"] == "native":
        raise ConfigError(f"option.model_impl=native: {spec.architecture if spec else 'this model'} cannot run on "
                          f"our model code ({fallback}); use option.model_impl=auto for the transformers fallback")
    if fallback and kind != ENGINE_DYNAMIC:
        log.info("model code: %s; engine: %s", model_code(cfg, spec), kind)
    tp = resolve_tensor_parallel(cfg, num_gpus, num_cpus)
    pp = cfg["option.pipeline_parallel_degree"]
    use_mpi = cfg["engine"] == "MPI"
    if tp * pp > 1 and kind != ENGINE_DYNAMIC and not cfg.is_set("engine"):
        log.info("engine=MPI chosen: option.tensor_parallel_degree=%d, pipeline_parallel_degree=%d with a "
                 "rolling-batch engine and engine unset (as DJL does for lmi-dist)", tp, pp)
        use_mpi = True
    if pp > 1:
        check_pipeline(cfg, pp, tp, kind, fallback, spec, num_gpus, num_cpus)
    if use_mpi and kind == ENGINE_DYNAMIC:
        raise ConfigError("engine=MPI with dynamic batching: MPI runs the rolling-batch engines; "
                          "use engine=Python for batch_size>1 / option.rolling_batch=disable")
    if tp > 1 and not use_mpi and (kind != ENGINE_DYNAMIC or num_gpus == 0):
        raise ConfigError(f"option.tensor_parallel_degree={tp} with engine=Python: tensor parallelism "
                          "runs under MPI; set engine=MPI (or spread a dynamic-batching model over GPUs)")
    if tp > 1 and kind != ENGINE_DYNAMIC and fallback:
        raise ConfigError(f"option.tensor_parallel_degree={tp} with {spec.architecture if spec else 'this model'}: "
                          f"the HF fallback path runs at tensor_parallel_degree=1 only ({fallback})")
    dtype = quantized_dtype(cfg, num_gpus, fallback, spec, cpu_flags() if cpu is None else cpu, gpu_bf16)
    log.info("dtype: %s", dtype)
    check_kv_cache_dtype(cfg, kind)
    check_lora(cfg, kind, fallback)
    cpu_linear = cfg["option.cpu_linear"]
    if cfg["option.cpu_compile"] and cpu_linear in ("onednn", "lmi"):
        raise ConfigError(f"option.cpu_linear={cpu_linear} with option.cpu_compile=true: inductor cannot trace "
                          f"{'oneDNN' if cpu_linear == 'onednn' else 'our kernel'}'s packed weights; unset "
                          "option.cpu_linear (aten under compile) or option.cpu_compile")
    model = ModelConfig(local_dir=local_dir, model_id=cfg["option.model_id"], revision=cfg["option.revision"],
                        dtype=dtype.dtype, dtype_why=dtype.why, trust_remote_code=cfg["option.trust_remote_code"],
                        cpu_linear="aten" if cfg["option.cpu_compile"] and cpu_linear == "auto" else cpu_linear,
                        model_impl=cfg["option.model_impl"],
                        max_model_len=cfg["option.max_model_len"], quantize=cfg["option.quantize"],
                        kv_cache_dtype=cfg["option.kv_cache_dtype"], load_cache_dir=cfg["option.load_cache_dir"],
                        enable_lora=cfg["option.enable_lora"], max_loras=cfg["option.max_loras"],
                        max_lora_rank=cfg["option.max_lora_rank"],
                        max_cpu_loras=cfg["option.max_cpu_loras"] or cfg["option.max_loras"],
                        adapters=adapters if adapters is not None else cfg["option.adapters"] or {},
                        download_dir=download_dir)
    scheduler = SchedulerConfig(
        engine_kind=kind, batch_size=cfg["batch_size"], max_batch_delay_ms=cfg["max_batch_delay"],
        job_queue_size=cfg["job_queue_size"], max_num_seqs=cfg["option.max_rolling_batch_size"],
        max_num_batched_tokens=cfg["option.max_rolling_batch_prefill_tokens"],
        kv_block_size=cfg["option.kv_block_size"], enable_prefix_caching=cfg["option.enable_prefix_caching"],
        gpu_memory_utilization=cfg["option.gpu_memory_utilization"], kv_cache_memory=cfg["option.kv_cache_memory"],
        predict_timeout_s=float(cfg["option.predict_timeout"]), enforce_eager=cfg["option.enforce_eager"],
        cpu_compile=cfg["option.cpu_compile"], compile_cache_dir=cfg["option.compile_cache_dir"],
        attention_backend=cfg["option.attention_backend"], **speed_settings(cfg, kind))
    return LmiConfig(model=model, scheduler=scheduler,
                     parallel=placement(cfg, use_mpi, tp, num_gpus, num_cpus, pp),
                     server=server_config(cfg, local_dir, port))


def check_pipeline(cfg: ResolvedConfig, pp: int, tp: int, kind: str, fallback: str | None, spec: ModelSpec | None,
                   num_gpus: int, num_cpus: int) -> None:
    """option.pipeline_parallel_degree > 1: what it runs with (docs/multinode.md), else a ConfigError naming why."""
    what = f"option.pipeline_parallel_degree={pp}"
    if kind != ENGINE_PAGED:
        raise ConfigError(f"{what} runs in the paged engine (option.rolling_batch=auto or lmi-dist/vllm), not {kind}")
    if cfg["engine"] != "MPI" and cfg.is_set("engine"):
        raise ConfigError(f"{what} with engine=Python: the stages are MPI ranks; set engine=MPI")
    if fallback:
        raise ConfigError(f"{what} with {spec.architecture if spec else 'this model'}: the stages run our model code, "
                          f"and this model runs on the transformers fallback ({fallback})")
    if spec is not None and pp > spec.num_layers:
        raise ConfigError(f"{what} exceeds the model's {spec.num_layers} decoder layers")
    if cfg["option.enable_lora"]:
        raise ConfigError(f"{what} with option.enable_lora=true: LoRA adapters and pipeline stages are not supported "
                          "together yet")
    if cfg["option.speculative_method"] == "draft" or cfg["option.speculative_model"]:
        raise ConfigError(f"{what} with a draft model (option.speculative_model): not supported together yet "
                          "(prompt lookup, option.speculative_method=ngram, is)")
    limit, which = (num_gpus, "GPUs") if num_gpus else (num_cpus, "CPU cores")
    if not cfg["option.mpi_hostfile"] and tp * pp > limit:
        raise CapacityError(f"tensor_parallel_degree={tp} x {what} = {tp * pp} ranks exceed the {limit} {which} "
                            "of this machine; lower them or spread the ranks over hosts (option.mpi_hostfile)")


def model_copies(cfg: ResolvedConfig, use_mpi: bool, tp: int, num_gpus: int, num_cpus: int) -> int:
    """maxWorkers, else minWorkers, else DJL's default: #GPUs / TP under MPI on GPUs, else one; more copies
    than the devices (on CPU: cores) hold is a ConfigError."""
    low, high = cfg["minWorkers"], cfg["maxWorkers"]
    if low is not None and high is not None and low > high:
        raise ConfigError(f"minWorkers={low} exceeds maxWorkers={high}")
    asked = high if high is not None else low
    limit, what = (num_gpus // tp, f"{num_gpus} GPUs") if num_gpus else (num_cpus // tp, f"{num_cpus} CPU cores")
    if asked is None:
        return max(1, limit) if use_mpi and num_gpus else 1
    if asked > max(limit, 1):
        raise CapacityError(f"maxWorkers={asked}: this machine's {what} hold at most {max(limit, 1)} copies of "
                            f"tensor_parallel_degree={tp}; lower maxWorkers (or minWorkers)")
    return asked


def placement(cfg: ResolvedConfig, use_mpi: bool, tp: int, num_gpus: int, num_cpus: int,
              pp: int = 1) -> ParallelConfig:
    """The copies and what each holds: GPU copy i the devices i*TP ... i*TP+TP-1 (as CUDA_VISIBLE_DEVICES
    numbers them, DJL's rule), CPU copy i an equal share of this process's cores."""
    hosts = dict(hostfile=cfg["option.mpi_hostfile"], rsh_agent=cfg["option.mpi_rsh_agent"],
                 network=cfg["option.mpi_network"], pipeline_parallel_degree=pp)
    if hosts["hostfile"] and not use_mpi:
        raise ConfigError("option.mpi_hostfile needs engine=MPI with option.tensor_parallel_degree > 1 (the ranks "
                          "it spreads over the hosts)")
    copies = model_copies(cfg, use_mpi, tp * pp, num_gpus, num_cpus)
    if copies > 1 and cfg["option.enable_lora"]:
        raise ConfigError(f"maxWorkers={copies} with option.enable_lora=true: not supported together yet (adapters "
                          "are registered with one engine); serve LoRA adapters with one copy")
    if copies > 1 and hosts["hostfile"]:
        raise ConfigError(f"maxWorkers={copies} with option.mpi_hostfile: one copy spans the hosts")
    if copies == 1:
        return ParallelConfig(use_mpi=use_mpi, tensor_parallel_degree=tp, **hosts)
    if num_gpus:
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or \
            [str(i) for i in range(num_gpus)]
        return ParallelConfig(use_mpi=use_mpi, tensor_parallel_degree=tp, copies=copies,
                              copy_devices=[visible[i * tp:(i + 1) * tp] for i in range(copies)])
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(num_cpus))
    share = len(cores) // copies
    return ParallelConfig(use_mpi=use_mpi, tensor_parallel_degree=tp, copies=copies,
                          copy_cores=[cores[i * share:(i + 1) * share] for i in range(copies)])


def server_config(cfg: ResolvedConfig, local_dir: str, port: int) -> ServerConfig:
    return ServerConfig(port=port, max_request_size=cfg["max_request_size"], http_workers=cfg["http_workers"],
                        http_threads=cfg["http_threads"], output_formatter=cfg["option.output_formatter"],
                        default_max_new_tokens=cfg["option.max_new_tokens"],
                        model_loading_timeout_s=float(cfg["option.model_loading_timeout"]),
                        max_inputs_per_request=cfg["max_inputs_per_request"],
                        max_input_chars=cfg["max_input_chars"], drain_timeout_s=float(cfg["drain_timeout"]),
                        served_model_name=served_model_name(cfg, local_dir),
                        chat_template=cfg["option.chat_template"], tgi_compat=cfg["option.tgi_compat"],
                        tool_call_parser=cfg["option.tool_call_parser"])


def build_handler(cfg: ResolvedConfig, handler: str, *, local_dir: str, num_gpus: int, num_cpus: int,
                  port: int) -> LmiConfig:
    """A custom handler's configuration: one engine process running its handle(); the model options
    that drive our engines do not apply (it loads what it wants)."""
    tp = resolve_tensor_parallel(cfg, num_gpus, num_cpus)
    if tp > 1:
        raise ConfigError(f"option.tensor_parallel_degree={tp} with a custom handler ({handler}): a handler runs "
                          "as one process here; it may spread its own model over the devices (device_map)")
    model = ModelConfig(local_dir=local_dir, model_id=cfg["option.model_id"], entry_point=handler,
                        handler_properties=handler_properties(cfg, local_dir))
    scheduler = SchedulerConfig(engine_kind=ENGINE_HANDLER, job_queue_size=cfg["job_queue_size"],
                                predict_timeout_s=float(cfg["option.predict_timeout"]))
    return LmiConfig(model=model, scheduler=scheduler, parallel=ParallelConfig(),
                     server=server_config(cfg, local_dir, port))


def check_lora(cfg: ResolvedConfig, kind: str, fallback: str | None) -> None:
    """LoRA adapters run in the paged engine on our model code, decode steps eager (docs/lora.md)."""
    if not cfg["option.enable_lora"]:
        if cfg["option.adapters"]:
            raise ConfigError("option.adapters is set and option.enable_lora is not: set option.enable_lora=true to "
                              "serve them")
        return
    if kind == ENGINE_DYNAMIC:
        raise ConfigError("option.enable_lora=true runs in the rolling-batch engines, and this configuration runs "
                          "dynamic batching; use option.rolling_batch=lmi-dist (or auto), or scheduler")
    if fallback:
        raise ConfigError(f"option.enable_lora=true applies adapters to our model code, and this model runs on the "
                          f"transformers fallback ({fallback})")
    if cfg["option.speculative_method"]:
        raise ConfigError(f"option.enable_lora=true with option.speculative_method={cfg['option.speculative_method']}: "
                          "not supported together yet; unset one")
    if cfg["option.max_cpu_loras"] is not None and cfg["option.max_cpu_loras"] < cfg["option.max_loras"]:
        raise ConfigError(f"option.max_cpu_loras={cfg['option.max_cpu_loras']} is below option.max_loras="
                          f"{cfg['option.max_loras']}: every adapter on the device is also kept in RAM; raise it")


def check_kv_cache_dtype(cfg: ResolvedConfig, kind: str) -> None:
    """An fp8 KV cache is the paged engine's, read by its torch attention backend."""
    name, backend = cfg["option.kv_cache_dtype"], cfg["option.attention_backend"]
    if name == "auto":
        return
    if kind != ENGINE_PAGED:
        raise ConfigError(f"option.kv_cache_dtype={name} stores the paged engine's KV cache in fp8, and this "
                          f"configuration runs the {kind} engine; use option.rolling_batch=lmi-dist (or auto) or "
                          "unset option.kv_cache_dtype")
    if backend not in ("auto", "torch"):
        raise ConfigError(f"option.kv_cache_dtype={name} with option.attention_backend={backend}: the torch "
                          "backend reads fp8 caches; set option.attention_backend=torch or auto")


def quantized_dtype(cfg: ResolvedConfig, num_gpus: int, fallback: str | None, spec: ModelSpec | None,
                    cpu: frozenset[str], gpu_bf16: bool | None) -> DtypeChoice:
    """The model dtype and why, checked against option.quantize and the checkpoint's own
    quantization_config: quantisation runs on our model code only, and int4 on CUDA in bf16 only (bf16
    when option.dtype is unset); a pre-quantised checkpoint takes option.quantize unset or its own
    method. Otherwise option.dtype, or when unset (or auto) engines/devices.py's policy."""
    method, dtype = cfg["option.quantize"], cfg["option.dtype"]
    if dtype == "auto":
        dtype = None  # the policy: the checkpoint's dtype on GPUs, what the CPU computes natively on CPUs
    try:
        quant = read_checkpoint_quant(spec.config) if spec else None  # unknown before download: checked at load
        check_quantize_option(method, quant)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if quant and fallback:
        raise ConfigError(f"a {quant.method} checkpoint loads on our model code only, and {spec.architecture} runs "
                          f"on the transformers fallback ({fallback}); serve its unquantised checkpoint")
    if quant and quant.bits == 4 and num_gpus and not dtype:  # fp16 would dequantise the weights
        return DtypeChoice("bf16", f"CUDA's int4 kernel ({quant.method} checkpoint) takes bf16 only")
    if method and fallback:
        raise ConfigError(f"option.quantize={method} quantises the linear layers of our model code, and "
                          f"{spec.architecture if spec else 'this model'} runs on the transformers fallback "
                          f"({fallback}); unset option.quantize")
    if method == "fp8" and not quant:
        if not num_gpus:
            raise ConfigError("option.quantize=fp8 runs on CUDA GPUs with fp8 tensor cores (compute capability 8.9+: "
                              "L4, L40S, H100, H200), and this host has none; on CPU use option.quantize=int8_dynamic "
                              "(the fastest here) or int8")
        if dtype in ("fp16", "fp32"):
            raise ConfigError(f"option.quantize=fp8 with option.dtype={dtype}: the fp8 GEMM writes bf16; set "
                              "option.dtype=bf16 or unset it")
        return DtypeChoice("bf16", "option.quantize=fp8: the fp8 GEMM writes bf16")
    if method == "int8_dynamic" and num_gpus:
        raise ConfigError("option.quantize=int8_dynamic runs on CPU (PyTorch's x86 int8 GEMM), and this host has "
                          f"{num_gpus} GPU(s); use option.quantize=int8 (weight-only) or an fp8 checkpoint")
    if method == "int4" and num_gpus:
        if dtype in ("fp16", "fp32"):
            raise ConfigError(f"option.quantize=int4 with option.dtype={dtype} on GPUs: PyTorch's CUDA int4 kernel "
                              "takes bf16 activations only; set option.dtype=bf16 or option.quantize=int8")
        return DtypeChoice(dtype or "bf16", "option.quantize=int4 on GPUs: CUDA's int4 kernel takes bf16 only")
    checkpoint = spec.checkpoint_dtype if spec else None
    return choose_dtype(dtype, checkpoint, num_gpus=num_gpus, cpu=cpu, gpu_bf16=gpu_bf16)


def speed_settings(cfg: ResolvedConfig, kind: str) -> dict:
    """Speculative decoding and multi-step decode: the paged engine's, checked here."""
    method, draft, steps = cfg["option.speculative_method"], cfg["option.speculative_model"], \
        cfg["option.num_scheduler_steps"]
    if draft and not method:
        method = "draft"  # lmi-dist's option.speculative_draft_model alone turns it on
    if (method or steps > 1) and kind != ENGINE_PAGED:
        what = f"option.speculative_method={method}" if method else f"option.num_scheduler_steps={steps}"
        raise ConfigError(f"{what} needs the paged engine (option.rolling_batch=auto or lmi-dist), not the "
                          f"{kind} engine")
    if method == "draft" and not draft:
        raise ConfigError("option.speculative_method=draft needs option.speculative_model, the draft model's directory")
    if method == "draft" and not os.path.isfile(os.path.join(draft, "config.json")):
        raise ConfigError(f"option.speculative_model={draft}: not a model directory (no config.json there)")
    if method == "ngram" and draft:
        raise ConfigError("option.speculative_model is for option.speculative_method=draft, not ngram")
    lo, hi = cfg["option.ngram_prompt_lookup_min"], cfg["option.ngram_prompt_lookup_max"]
    if lo > hi:
        raise ConfigError(f"option.ngram_prompt_lookup_min={lo} is larger than option.ngram_prompt_lookup_max={hi}")
    settings = dict(speculative_method=method, num_speculative_tokens=cfg["option.num_speculative_tokens"],
                    speculative_model=draft, ngram_prompt_lookup_min=lo, ngram_prompt_lookup_max=hi,
                    num_scheduler_steps=steps, async_scheduling=cfg["option.async_scheduling"])
    try:  # the scheduling mode these make (the engine builds the same one)
        scheduling_mode(SchedulerConfig(**settings))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return settings


def served_model_name(cfg: ResolvedConfig, local_dir: str) -> str:
    """option.served_model_name, else option.model_id when it names a remote model (a hub id or an
    s3:// prefix), else the model directory's name (as vLLM names a model after what was asked for)."""
    if cfg["option.served_model_name"]:
        return cfg["option.served_model_name"]
    model_id = cfg["option.model_id"]
    if model_id and not os.path.exists(os.path.expanduser(model_id)):
        return model_id
    return os.path.basename(os.path.normpath(model_id or local_dir or "model")) or "model"


def read_spec(local_dir: str | None, max_model_len: int | None) -> ModelSpec | None:
    """The checkpoint's facts, when its config.json is at hand (None before a download)."""
    if not local_dir or not os.path.isfile(os.path.join(local_dir, "config.json")):
        return None
    return ModelSpec.read(local_dir, max_model_len)


def count_gpus(env: Mapping[str, str]) -> int:
    """NVIDIA GPUs visible to this process, without importing torch (the launcher stays light)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    try:
        present = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
    if visible is None:
        return present
    listed = [d for d in visible.split(",") if d.strip()]
    if "-1" in [d.strip() for d in listed[:1]]:
        return 0
    return min(present, len(listed))


def query_gpus(field: str) -> list[str] | None:
    """One nvidia-smi field per GPU (`--query-gpu=FIELD`, no header or units), without importing torch;
    None when nvidia-smi is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        return subprocess.run([smi, f"--query-gpu={field}", "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_supports_bf16() -> bool | None:
    """Whether every visible NVIDIA GPU computes bf16 (compute capability 8.0+: A100, A10G, L4, H100, ...);
    None when it cannot say."""
    caps = query_gpus("compute_cap")
    if not caps:
        return None
    try:
        return all(float(cap) >= 8.0 for cap in caps)
    except ValueError:
        return None


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
