"""Which settings combine, checked once at start with the reason for each refusal: engines and
their features (rolling batch vs dynamic batching, the paged engine's fp8 KV cache, speculation and
multi-step, pipeline stages, LoRA, the KV tiers), what runs on our model code only, and the dtype a quantisation
method needs. The sentences of the refusals the engine's runner can also make come from one table,
engines/config.py (OUR_CODE_ONLY, NOT_TOGETHER), so that both say the same.
"""

from __future__ import annotations

import os
import shutil

from container.keys import ConfigError
from container.merge import ResolvedConfig
from container.placement import CapacityError
from engines.config import (ENGINE_DYNAMIC, ENGINE_PAGED, SchedulerConfig, fallback_refusal, parse_memory,
                            together_refusal)
from engines.core.modes import scheduling_mode
from engines.devices import DtypeChoice, choose_dtype
from engines.spec import ModelSpec
from engines.weights.quant_checkpoint import check_quantize_option, read_checkpoint_quant


def check_pipeline(cfg: ResolvedConfig, pp: int, tp: int, kind: str, fallback: str | None, spec: ModelSpec | None,
                   num_gpus: int, num_cpus: int) -> None:
    """option.pipeline_parallel_degree > 1: what it runs with (docs/multinode.md), else a ConfigError naming why."""
    what = f"option.pipeline_parallel_degree={pp}"
    if kind != ENGINE_PAGED:
        raise ConfigError(f"{what} runs in the paged engine (option.rolling_batch=auto or lmi-dist/vllm), not {kind}")
    if cfg["engine"] != "MPI" and cfg.is_set("engine"):
        raise ConfigError(f"{what} with engine=Python: the stages are MPI ranks; set engine=MPI")
    if fallback:
        raise ConfigError(fallback_refusal("pipeline", spec.architecture if spec else None, fallback, pp=pp))
    if spec is not None and pp > spec.num_layers:
        raise ConfigError(f"{what} exceeds the model's {spec.num_layers} decoder layers")
    if cfg["option.enable_lora"]:
        raise ConfigError(together_refusal("pipeline", "lora", what, "option.enable_lora=true"))
    if cfg["option.speculative_method"] == "draft" or cfg["option.speculative_model"]:
        raise ConfigError(together_refusal("pipeline", "draft", what, "option.speculative_model"))
    limit, which = (num_gpus, "GPUs") if num_gpus else (num_cpus, "CPU cores")
    if not cfg["option.mpi_hostfile"] and tp * pp > limit:
        raise CapacityError(f"tensor_parallel_degree={tp} x {what} = {tp * pp} ranks exceed the {limit} {which} "
                            "of this machine; lower them or spread the ranks over hosts (option.mpi_hostfile)")


def check_parallel(cfg: ResolvedConfig, kind: str, tp: int, pp: int, use_mpi: bool, fallback: str | None,
                   spec: ModelSpec | None, num_gpus: int, num_cpus: int) -> None:
    """Tensor and pipeline parallelism: under MPI, with the rolling-batch engines, on our model code."""
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


def check_cpu_linear(cfg: ResolvedConfig) -> None:
    """A packed CPU kernel named under option.cpu_compile: inductor cannot trace it."""
    cpu_linear = cfg["option.cpu_linear"]
    if cfg["option.cpu_compile"] and cpu_linear in ("onednn", "lmi"):
        raise ConfigError(f"option.cpu_linear={cpu_linear} with option.cpu_compile=true: inductor cannot trace "
                          f"{'oneDNN' if cpu_linear == 'onednn' else 'our kernel'}'s packed weights; unset "
                          "option.cpu_linear (aten under compile) or option.cpu_compile")


def check_lora(cfg: ResolvedConfig, kind: str, fallback: str | None, architecture: str | None = None) -> None:
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
        raise ConfigError(fallback_refusal("lora", architecture, fallback))
    if cfg["option.speculative_method"]:
        raise ConfigError(together_refusal("lora", "speculative", "option.enable_lora=true",
                                           f"option.speculative_method={cfg['option.speculative_method']}"))
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


def check_kv_offload(cfg: ResolvedConfig, kind: str, pp: int) -> None:
    """The KV tiers sit below the paged engine's prefix cache (docs/kv-tiers.md); the host tier's
    folder must hold what it is asked to."""
    memory, disk_dir = cfg["option.kv_offload_memory"], cfg["option.kv_offload_dir"]
    if not memory and not disk_dir:
        return
    what = "option.kv_offload_memory" if memory else "option.kv_offload_dir"
    if kind != ENGINE_PAGED:
        raise ConfigError(f"{what} keeps the paged engine's KV blocks, and this configuration runs the {kind} "
                          "engine; use option.rolling_batch=lmi-dist (or auto)")
    if not cfg["option.enable_prefix_caching"]:
        raise ConfigError(f"{what}: the KV tiers sit below the prefix cache; set option.enable_prefix_caching=true")
    if pp > 1:
        raise ConfigError(f"{what} with pipeline_parallel_degree={pp}: the KV tiers support tensor parallelism "
                          "only (docs/kv-tiers.md)")
    if memory:
        check_shm_room(cfg["option.kv_offload_memory_dir"], memory)


def check_shm_room(folder: str, amount: str) -> None:
    """option.kv_offload_memory in bytes must fit the filesystem of its folder (Docker's /dev/shm is
    64 MiB unless --shm-size says more)."""
    value, is_fraction = parse_memory(amount)
    root = folder
    while not os.path.exists(root):
        root = os.path.dirname(root) or "/"
    free = shutil.disk_usage(root).free
    if not is_fraction and value > free:
        raise ConfigError(f"option.kv_offload_memory={amount} does not fit {folder}: its filesystem has "
                          f"{free / 2**20:.0f} MiB free (docker run --shm-size, or option.kv_offload_memory_dir)")


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
        raise ConfigError(fallback_refusal("quant_checkpoint", spec.architecture, fallback, method=quant.method))
    if quant and quant.bits == 4 and num_gpus and not dtype:  # fp16 would dequantise the weights
        return DtypeChoice("bf16", f"CUDA's int4 kernel ({quant.method} checkpoint) takes bf16 only")
    if method and fallback:
        raise ConfigError(fallback_refusal("quantize", spec.architecture if spec else None, fallback, method=method))
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


SLO_KEYS = ("option.scheduling_policy", "option.max_queue_wait_ms", "option.target_tpot_ms", "option.fair_share_key")


def slo_settings(cfg: ResolvedConfig, kind: str) -> dict:
    """Service-level scheduling (docs/scheduling.md): the paged engine's scheduler does it; the others
    would serve in arrival order whatever was asked, so they refuse it."""
    asked = [k for k in SLO_KEYS if cfg.is_set(k) and cfg[k] not in (None, "fcfs")]
    if asked and kind != ENGINE_PAGED:
        raise ConfigError(f"{asked[0]}={cfg[asked[0]]} needs the paged engine (option.rolling_batch=auto or "
                          f"lmi-dist), not the {kind} engine")
    return dict(scheduling_policy=cfg["option.scheduling_policy"], max_queue_wait_ms=cfg["option.max_queue_wait_ms"],
                target_tpot_ms=cfg["option.target_tpot_ms"], fair_share_key=cfg["option.fair_share_key"])
