"""serving.properties + environment → one validated configuration (engines/config.py's LmiConfig),
in three steps, each its own module:

    container/merge.py       file and environment merged and typed, with each value's source
    container/compat.py      which settings combine (the reason for each refusal)
    container/placement.py   where the engine runs: TP degree, model copies, devices
    this module              the engine chosen, the dtype, and the typed configuration built

This is the only module that reads the process's environment (os.environ, passed on as an argument);
its names below re-export the steps' for the launcher, the CLI and the tests.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

from container.compat import (check_cpu_linear, check_kv_cache_dtype, check_kv_offload, check_lora, check_parallel,  # noqa: F401
                              check_pipeline, quantized_dtype, slo_settings, speed_settings)
from container.keys import ConfigError
from container.merge import (CLI, DEFAULT, ENV, FILE, ResolvedConfig, Setting, check_static_contradictions,  # noqa: F401
                             collect_raw, default_download_dir, describe, resolve, resolve_port)
from container.tasks import build_pooling, resolve_task
from container.placement import (CapacityError, count_gpus, gpu_supports_bf16, model_copies, placement,  # noqa: F401
                                 query_gpus, resolve_tensor_parallel)
from engines.config import (
    ENGINE_DYNAMIC, ENGINE_HANDLER, ENGINE_PAGED, ENGINE_ROLLING, TASK_GENERATION,
    LmiConfig, ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig,
)
from engines.devices import cpu_flags
from engines.models import registry
from engines.spec import ModelSpec

log = logging.getLogger(__name__)


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


def build(cfg: ResolvedConfig, *, local_dir: str, spec: ModelSpec | None,
          num_gpus: int, num_cpus: int, port: int, adapters: dict[str, str] | None = None,
          download_dir: str = "", cpu: frozenset[str] | None = None, gpu_bf16: bool | None = None,
          env: Mapping[str, str] | None = None) -> LmiConfig:
    """The typed configuration the engine and HTTP workers run with. adapters: option.adapters, each a local
    directory (the caller fetches S3 and hub ones); cpu: the CPU's flags, gpu_bf16: whether the GPUs compute bf16
    (None: this host's; they decide an unset option.dtype); env: whose CUDA_VISIBLE_DEVICES numbers copies' GPUs."""
    handler = custom_handler(cfg, local_dir)
    if handler is not None:
        return build_handler(cfg, handler, local_dir=local_dir, num_gpus=num_gpus, num_cpus=num_cpus, port=port)
    cpu, env = cpu_flags() if cpu is None else cpu, os.environ if env is None else env
    if (task := resolve_task(cfg, local_dir)) != TASK_GENERATION:
        return build_pooling(cfg, task, local_dir=local_dir, spec=spec, num_gpus=num_gpus, num_cpus=num_cpus, cpu=cpu,
                             gpu_bf16=gpu_bf16, server=server_config(cfg, local_dir, port), env=env)
    kind = select_engine(cfg, spec)
    fallback = fallback_reason(cfg, spec)
    if fallback and cfg["option.model_impl"] == "native":
        raise ConfigError(f"option.model_impl=native: {spec.architecture if spec else 'this model'} cannot run on "
                          f"our model code ({fallback}); use option.model_impl=auto for the transformers fallback")
    if fallback and kind != ENGINE_DYNAMIC:
        log.info("model code: %s; engine: %s", model_code(cfg, spec), kind)
    tp, pp = resolve_tensor_parallel(cfg, num_gpus, num_cpus), cfg["option.pipeline_parallel_degree"]
    use_mpi = cfg["engine"] == "MPI"
    if tp * pp > 1 and kind != ENGINE_DYNAMIC and not cfg.is_set("engine"):
        log.info("engine=MPI chosen: option.tensor_parallel_degree=%d, pipeline_parallel_degree=%d with a "
                 "rolling-batch engine and engine unset (as DJL does for lmi-dist)", tp, pp)
        use_mpi = True
    check_parallel(cfg, kind, tp, pp, use_mpi, fallback, spec, num_gpus, num_cpus)
    dtype = quantized_dtype(cfg, num_gpus, fallback, spec, cpu, gpu_bf16)
    log.info("dtype: %s", dtype)
    check_kv_cache_dtype(cfg, kind)
    check_kv_offload(cfg, kind, pp)
    check_lora(cfg, kind, fallback, spec.architecture if spec else None)
    check_cpu_linear(cfg)
    cpu_linear = cfg["option.cpu_linear"]
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
        attention_backend=cfg["option.attention_backend"], kv_offload_memory=cfg["option.kv_offload_memory"],
        kv_offload_memory_dir=cfg["option.kv_offload_memory_dir"], kv_offload_dir=cfg["option.kv_offload_dir"],
        kv_offload_disk=cfg["option.kv_offload_disk"], **speed_settings(cfg, kind), **slo_settings(cfg, kind))
    return LmiConfig(model=model, scheduler=scheduler,
                     parallel=placement(cfg, use_mpi, tp, num_gpus, num_cpus, pp, env),
                     server=server_config(cfg, local_dir, port))


def server_config(cfg: ResolvedConfig, local_dir: str, port: int) -> ServerConfig:
    return ServerConfig(port=port, max_request_size=cfg["max_request_size"], http_workers=cfg["http_workers"],
                        http_threads=cfg["http_threads"], output_formatter=cfg["option.output_formatter"],
                        default_max_new_tokens=cfg["option.max_new_tokens"],
                        model_loading_timeout_s=float(cfg["option.model_loading_timeout"]),
                        max_inputs_per_request=cfg["max_inputs_per_request"],
                        max_input_chars=cfg["max_input_chars"], drain_timeout_s=float(cfg["drain_timeout"]),
                        served_model_name=served_model_name(cfg, local_dir),
                        chat_template=cfg["option.chat_template"], tgi_compat=cfg["option.tgi_compat"],
                        tool_call_parser=cfg["option.tool_call_parser"],
                        max_client_batch_size=cfg["option.max_client_batch_size"])


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
