"""The resolved, validated configuration that the launcher hands to the engine and the HTTP workers.

`container.config` builds it once from serving.properties and the environment; it travels as JSON
in the per-launch run directory. Nothing here reads the environment. Pure Python (no torch), so
handlers may import it.
"""

from __future__ import annotations

import os
import re

import msgspec

ENGINE_DYNAMIC = "dynamic"
ENGINE_ROLLING = "rolling"
ENGINE_PAGED = "paged"
ENGINE_HANDLER = "handler"  # a custom handler (model.py): engines/custom/handler_engine.py
ENGINE_POOLING = "pooling"  # embeddings and scores (option.task): engines/pooling/engine.py
ENGINE_KINDS = (ENGINE_DYNAMIC, ENGINE_ROLLING, ENGINE_PAGED, ENGINE_HANDLER, ENGINE_POOLING)

# what a model serves (option.task, or detected from the checkpoint: container/tasks.py)
TASK_GENERATION = "text-generation"
TASK_EMBEDDING = "text-embedding"
TASK_CLASSIFICATION = "text-classification"  # also cross-encoders: /rerank, /v1/score
TASKS = (TASK_GENERATION, TASK_EMBEDDING, TASK_CLASSIFICATION)


class PoolingSpec(msgspec.Struct, frozen=True):
    """An embedding or classification model's facts, read once from its checkpoint (engines/pooling/spec.py):
    sentence-transformers' modules.json, 1_Pooling/config.json and Normalize, else the architecture's defaults."""

    task: str  # TASK_EMBEDDING | TASK_CLASSIFICATION
    architecture: str
    is_causal: bool = False  # a decoder (Qwen3-Embedding): causal attention, last-token pooling
    pooling: str = "mean"  # cls | mean | max | lasttoken | mean_sqrt_len_tokens (embeddings)
    normalize: bool = False  # unit length (a Normalize module)
    max_input_tokens: int = 512  # longer inputs are truncated to it, or refused when the caller asks
    dimensions: int = 0  # the vector's length (embeddings), the number of labels (classification)
    labels: list[str] = []  # classification: the config's id2label, in id order

# Architectures with our own (TP-aware) implementation; anything else runs on the HF fallback path,
# which only the padded rolling-batch engine (and dynamic batching) can drive.
class ModelConfig(msgspec.Struct, frozen=True):
    local_dir: str  # where the weights are, after s3/hub resolution
    model_id: str | None = None  # what the user asked for
    revision: str | None = None
    dtype: str = "fp32"  # fp32 | fp16 | bf16 | auto (= the checkpoint's torch_dtype)
    dtype_why: str = ""  # why the launcher chose it (engines/devices.py), for the engine's log
    cpu_linear: str = "auto"  # CPU linear kernels: auto (measured at load) | aten | onednn | upcast | lmi
    trust_remote_code: bool = False
    model_impl: str = "auto"  # auto | native | transformers (option.model_impl)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    quantize: str | None = None
    kv_cache_dtype: str = "auto"  # how K/V are stored: auto (the model dtype) | fp8 (= fp8_e4m3) | fp8_e5m2
    load_cache_dir: str | None = None  # a load-optimised copy of each rank's weights (engines/weights/load_cache.py)
    # LoRA adapters (engines/layers/lora.py, docs/lora.md): MODEL_DIR/adapters/<name>, option.adapters, or
    # registered at run time; max_loras in device slots, the max_cpu_loras most recently used read in RAM
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 4
    adapters: dict[str, str] = {}  # option.adapters: name → local PEFT directory (S3 fetched by the launcher)
    download_dir: str = ""  # where S3 artifacts go (adapters registered at run time too)
    # a custom handler (engine kind "handler"): its file (a path) or module name, and the properties its
    # warm-up call receives (serving.properties' keys, option.* without the prefix, and model_dir)
    entry_point: str | None = None
    handler_properties: dict[str, str] = {}
    task: str = TASK_GENERATION  # option.task (TASKS); the pooling engine's model facts in `pooling`
    pooling: PoolingSpec | None = None


class SchedulerConfig(msgspec.Struct, frozen=True):
    engine_kind: str = ENGINE_PAGED
    # dynamic batching
    batch_size: int = 1
    max_batch_delay_ms: int = 100
    # every engine: requests waiting for admission beyond this are refused with 503
    job_queue_size: int = 1000
    # rolling engines
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    kv_block_size: int = 16
    enable_prefix_caching: bool = False
    # KV tiers below the paged cache (docs/kv-tiers.md): a host-memory tier in a shared-memory folder,
    # a disk tier; sizes as kv_cache_memory (a fraction: of the RAM available, of the disk's free space)
    kv_offload_memory: str | None = None
    kv_offload_memory_dir: str = "/dev/shm/lmi-kv"
    kv_offload_dir: str | None = None
    kv_offload_disk: str = "0.5"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: str | None = None  # CPU: bytes ("2GiB", "1073741824") or a fraction ("0.3")
    predict_timeout_s: float = 240.0
    enforce_eager: bool = False  # no CUDA graphs, no torch.compile
    cpu_compile: bool = False  # CPU: torch.compile the paged decode step
    compile_cache_dir: str | None = None  # TORCHINDUCTOR_CACHE_DIR
    attention_backend: str = "auto"  # auto | flash_attn | triton | flex | torch (engines/attention)
    # paged engine: fewer forwards per token, no idle device (docs/paged.md)
    speculative_method: str | None = None  # ngram | draft | None
    num_speculative_tokens: int = 3
    speculative_model: str | None = None  # draft: a local directory
    ngram_prompt_lookup_min: int = 1
    ngram_prompt_lookup_max: int = 4
    num_scheduler_steps: int = 1
    # the next step scheduled while this one runs; None: wherever the mode allows (engines/core/modes.py)
    async_scheduling: bool | None = None
    # service levels (engines/core/slo.py, docs/scheduling.md)
    scheduling_policy: str = "fcfs"  # fcfs | priority
    max_queue_wait_ms: float | None = None  # shed a request that cannot start within it
    target_tpot_ms: float | None = None  # cap the batch so that a step stays under it
    fair_share_key: str | None = None  # a header naming the tenant, or "adapter"


class ParallelConfig(msgspec.Struct, frozen=True):
    use_mpi: bool = False
    tensor_parallel_degree: int = 1
    pipeline_parallel_degree: int = 1  # stages of tensor_parallel_degree ranks each (docs/multinode.md)
    # model copies on this host (maxWorkers; docs/copies.md): each an engine group of its own, pinned to its
    # GPUs (copy_devices: CUDA ids) or, on CPU, its cores (copy_cores); empty: one copy, not pinned
    copies: int = 1
    copy_devices: list[list[str]] = []
    copy_cores: list[list[int]] = []
    # multi-node (docs/multinode.md): mpirun's hostfile, remote launch agent, and the ranks' TCP network
    hostfile: str | None = None
    rsh_agent: str | None = None
    network: str | None = None

    @property
    def ranks(self) -> int:
        """The ranks of one model copy: its stages' tensor-parallel groups."""
        return self.tensor_parallel_degree * self.pipeline_parallel_degree


class ServerConfig(msgspec.Struct, frozen=True):
    port: int = 8080
    max_request_size: int = 64 * 1024 * 1024
    http_workers: int = 2
    http_threads: int = 32
    output_formatter: str = "json"  # json | jsonlines | sse
    default_max_new_tokens: int = 30
    model_loading_timeout_s: float = 1800.0
    max_inputs_per_request: int = 256
    max_input_chars: int = 1_000_000
    drain_timeout_s: float = 20.0  # SageMaker kills the container 30 s after SIGTERM
    served_model_name: str = "model"  # what /v1/models lists and OpenAI requests name
    chat_template: str | None = None  # option.chat_template: a file path or an inline template
    tgi_compat: bool = False  # option.tgi_compat: /invocations answers as TGI's POST /
    tool_call_parser: str | None = None  # option.tool_call_parser: llama3_json | hermes | mistral (tool_choice=auto)
    max_client_batch_size: int = 512  # embeddings and scores: the most inputs one request may carry


class LmiConfig(msgspec.Struct, frozen=True):
    model: ModelConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    server: ServerConfig = ServerConfig()

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> "LmiConfig":
        return msgspec.json.decode(data, type=cls)

    @classmethod
    def read(cls, path: str) -> "LmiConfig":
        with open(path, "rb") as f:
            return cls.from_json(f.read())


def runner_model(config: LmiConfig) -> ModelConfig:
    """The model config every rank's runner loads: `cpu_linear` auto is aten under option.cpu_compile
    (inductor cannot trace the packed kernels' opaque weights; the launcher resolves it so too)."""
    if config.scheduler.cpu_compile and config.model.cpu_linear == "auto":
        return msgspec.structs.replace(config.model, cpu_linear="aten")
    return config.model


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_memory(spec: str) -> tuple[float, bool]:
    """`option.kv_cache_memory`: bytes ("2GiB", "512MB", "1073741824") → (bytes, False), or a
    fraction of free memory ("0.3") → (0.3, True). ValueError says what is expected."""
    m = _SIZE.match(spec)
    if not m:
        raise ValueError('bytes such as "2GiB" or "1073741824", or a fraction such as "0.3"')
    amount, unit = float(m.group(1)), (m.group(2) or "").lower().rstrip("b")
    is_fraction = not unit and "." in m.group(1)
    if is_fraction and not 0 < amount <= 1:
        raise ValueError("a fraction in (0, 1] or a whole number of bytes")
    if amount <= 0:
        raise ValueError("a positive amount")
    return (amount, True) if is_fraction else (amount * _UNITS[unit], False)


def memory_bytes(spec: str, free_bytes: int) -> int:
    """Bytes for a `parse_memory` spec (a fraction applies to `free_bytes`)."""
    amount, is_fraction = parse_memory(spec)
    return int(amount * free_bytes) if is_fraction else int(amount)


def lora_adapter_names(adapters_dir: str) -> list[str]:
    """The directories under MODEL_DIR/adapters holding an adapter_config.json, sorted."""
    if not os.path.isdir(adapters_dir):
        return []
    return sorted(d for d in os.listdir(adapters_dir)
                  if os.path.isfile(os.path.join(adapters_dir, d, "adapter_config.json")))


def lora_sources(model: ModelConfig) -> dict[str, str]:
    """The LoRA adapters served from the start, name → directory, in the order every rank registers
    them (and places the first max_loras in slots): MODEL_DIR/adapters/<name>, then option.adapters."""
    adapters_dir = os.path.join(model.local_dir, "adapters")
    found = {name: os.path.join(adapters_dir, name) for name in lora_adapter_names(adapters_dir)}
    for name, path in model.adapters.items():
        if name in found:
            raise ValueError(f"LoRA adapter {name!r} is in option.adapters and under {adapters_dir}: rename one")
        found[name] = path
    return found



# -- which features combine ----------------------------------------------------------------------
# One table, read by the launcher's check (container/compat.py), `lmi plan` (through it) and the
# engine's runner (engines/worker/model_runner.py), so that a refusal says the same wherever it is made.

# features that run on our model code only: what each does (the refusal's first half) and the fix
OUR_CODE_ONLY = {
    "quant_checkpoint": ("a {method} checkpoint loads on our model code only", "serve its unquantised checkpoint"),
    "quantize": ("option.quantize={method} quantises the linear layers of our model code", "unset option.quantize"),
    "lora": ("option.enable_lora=true applies adapters to our model code", "unset option.enable_lora"),
    "pipeline": ("option.pipeline_parallel_degree={pp}: the stages run our model code",
                 "unset option.pipeline_parallel_degree"),
}

# pairs of features not supported together yet, and why (either order)
NOT_TOGETHER = {
    frozenset({"pipeline", "lora"}): "LoRA adapters and pipeline stages are not supported together yet",
    frozenset({"pipeline", "quant_checkpoint"}): "a pre-quantised checkpoint and pipeline stages are not supported "
                                                 "together yet (docs/multinode.md)",
    frozenset({"pipeline", "draft"}): "a draft model (option.speculative_model) and pipeline stages are not "
                                      "supported together yet (prompt lookup, option.speculative_method=ngram, is)",
    frozenset({"lora", "speculative"}): "LoRA adapters and speculative decoding are not supported together yet; "
                                        "unset one",
}


def fallback_refusal(feature: str, architecture: str | None, why: str | None, **values) -> str:
    """Why `feature` cannot run on a model the transformers fallback runs (`why`: the fallback's reason)."""
    does, fix = OUR_CODE_ONLY[feature]
    because = f" ({why})" if why else ""
    return f"{does.format(**values)}, and {architecture or 'this model'} runs on the transformers fallback" \
           f"{because}; {fix}"


def together_refusal(first: str, second: str, first_setting: str, second_setting: str) -> str:
    """Why two features (each named by the setting that asked for it) cannot run together."""
    return f"{first_setting} with {second_setting}: {NOT_TOGETHER[frozenset({first, second})]}"
