"""Every configuration key we know: its parser, its default and one line of documentation.

The table is the single source for validation, `lmi config`, the "did you mean" hints and the
configuration reference in docs/configuration.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from engines.config import memory_bytes, parse_memory  # noqa: F401 (memory_bytes re-exported)


class ConfigError(ValueError):
    """One clear line naming the key, the value and the fix."""


Parser = Callable[[str, str], Any]  # (key, raw value) -> typed value


def _fail(key: str, raw: str, expected: str) -> ConfigError:
    return ConfigError(f"{key}={raw!r} is invalid: expected {expected}")


def integer(minimum: int | None = None) -> Parser:
    def parse(key: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise _fail(key, raw, "an integer") from None
        if minimum is not None and value < minimum:
            raise _fail(key, raw, f"an integer >= {minimum}")
        return value

    return parse


def number(low: float, high: float, *, low_open: bool = False) -> Parser:
    def parse(key: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise _fail(key, raw, "a number") from None
        if value != value or value > high or value < low or (low_open and value == low):
            bracket = "(" if low_open else "["
            raise _fail(key, raw, f"a number in {bracket}{low}, {high}]")
        return value

    return parse


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def boolean(key: str, raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise _fail(key, raw, "true or false")


def choice(*values: str, case_sensitive: bool = False) -> Parser:
    def parse(key: str, raw: str) -> str:
        for v in values:
            if raw == v or (not case_sensitive and raw.lower() == v.lower()):
                return v
        raise _fail(key, raw, "one of " + ", ".join(values))

    return parse


def text(key: str, raw: str) -> str:
    return raw


# option.task: DJL's, vLLM's and TEI's names for the three tasks served (engines/config.py TASKS)
TASK_NAMES = {
    **dict.fromkeys(("text-generation", "text_generation", "generate", "generation"), "text-generation"),
    **dict.fromkeys(("text-embedding", "text_embedding", "embedding", "embed", "feature-extraction",
                     "sentence-similarity", "sentence-embeddings"), "text-embedding"),
    **dict.fromkeys(("text-classification", "text_classification", "classify", "classification", "score", "rerank",
                     "sentiment-analysis"), "text-classification"),
}


def task(key: str, raw: str) -> str:
    name = TASK_NAMES.get(raw.strip().lower())
    if name is None:
        raise ConfigError(f"{key}={raw}: lmi-serve serves text-generation, text-embedding (embedding models: "
                          "/v1/embeddings, /embed) and text-classification (classifiers and cross-encoders: /rerank, "
                          "/v1/score); set one of those, or unset it to detect the task from the checkpoint")
    return name


# quantised at load (engines/layers/quant.py): int8 / int4 weight-only, int8_dynamic int8 activations too (CPU),
# fp8 (CUDA 8.9+; also an fp8 checkpoint's own method)
QUANTIZE_METHODS = ("int8", "int4", "int8_dynamic", "fp8")
# a pre-quantised checkpoint's own method: accepted when config.json's quantization_config says the same
# (checked where the checkpoint is known: container/config.py, engines/weights/quant_checkpoint.py)
PREQUANTIZED_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
_QUANTIZE_ALIASES = {"compressed_tensors": "compressed-tensors"}
_QUANTIZE_MISSING = {
    **dict.fromkeys(("marlin", "gptq_marlin", "awq_marlin", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4",
                     "eetq", "exl2", "squeezellm"),
                    "checkpoints in this format do not load; GPTQ, AWQ, compressed-tensors and fp8 ones do"),
}


def lora_modules(key: str, raw: str) -> dict[str, str]:
    """LoRA adapters by name: `name=path` pairs separated by spaces or commas (vLLM's --lora-modules), or
    JSON: an object {name: path} or vLLM's list of {"name", "path"}. A path: a local directory, s3://
    prefix or hub id."""
    import json

    text_value = raw.strip()
    try:
        parsed = json.loads(text_value) if text_value[:1] in "[{" else None
    except ValueError:
        raise _fail(key, raw, "name=path pairs, or JSON") from None
    if isinstance(parsed, list) and all(isinstance(m, dict) and {"name", "path"} <= set(m) for m in parsed):
        pairs = [(str(m["name"]), str(m["path"])) for m in parsed]
    elif isinstance(parsed, dict):
        pairs = [(str(k), str(v)) for k, v in parsed.items()]
    elif parsed is None:
        items = [item for item in text_value.replace(",", " ").split() if item]
        if not all("=" in item for item in items):
            raise _fail(key, raw, "name=path pairs separated by spaces or commas (e.g. math=/opt/ml/math "
                                  "sql=s3://bucket/sql/)")
        pairs = [tuple(item.split("=", 1)) for item in items]
    else:
        raise _fail(key, raw, 'a JSON object {"name": "path"} or a list of {"name": ..., "path": ...}')
    found: dict[str, str] = {}
    for name, path in pairs:
        if not name or not path or name in found:
            raise _fail(key, raw, "each adapter named once, with a path")
        found[name] = path
    return found


def quantize_method(key: str, raw: str) -> str:
    name = raw.strip().lower()
    name = _QUANTIZE_ALIASES.get(name, name)
    if name in QUANTIZE_METHODS or name in PREQUANTIZED_METHODS:
        return name
    why = _QUANTIZE_MISSING.get(name, "not a method of lmi-serve")
    raise ConfigError(f"{key}={raw!r} is not supported ({why}); what runs: int8 or int4 (weight-only) or "
                      "int8_dynamic (int8 activations too, CPU) or fp8 (fp8 weights and activations, CUDA 8.9+), quantised at "
                      "load from a bf16/fp16/fp32 checkpoint, the method of a pre-quantised GPTQ, AWQ, "
                      "compressed-tensors or fp8 checkpoint, or unset it")


def tensor_parallel(key: str, raw: str) -> int | str:
    if raw.strip().lower() == "max":
        return "max"
    return integer(1)(key, raw)


def memory_amount(key: str, raw: str) -> str:
    """Bytes ("2GiB", "512MB", "1073741824") or a fraction of free RAM in (0, 1]; kept as text."""
    try:
        parse_memory(raw)
    except ValueError as exc:
        raise _fail(key, raw, str(exc)) from None
    return raw.strip()


@dataclass(frozen=True)
class Key:
    name: str
    parse: Parser
    default: Any
    doc: str


KEYS: tuple[Key, ...] = (
    # model-server keys (no prefix)
    Key("engine", choice("Python", "MPI"), "Python", "Python: one process; MPI: mpirun with tensor_parallel_degree ranks"),
    Key("batch_size", integer(1), 1, "dynamic batch size in prompts; >1 selects dynamic batching"),
    Key("max_batch_delay", integer(0), 100, "ms the first queued request waits for a dynamic batch to fill"),
    Key("job_queue_size", integer(1), 1000, "requests that may wait for the engine; beyond it 503"),
    Key("max_request_size", integer(1), 64 * 1024 * 1024, "largest request body in bytes; beyond it 413"),
    Key("http_workers", integer(1), 2, "gunicorn worker processes (thin clients of the one engine)"),
    Key("http_threads", integer(1), 32, "threads per gunicorn worker (concurrent requests per worker)"),
    Key("max_inputs_per_request", integer(1), 256, "prompts one request may carry in \"inputs\"; beyond it 400"),
    Key("max_input_chars", integer(1), 1_000_000, "characters one prompt may have (checked before tokenizing); beyond it 400"),
    Key("drain_timeout", integer(0), 20,
        "seconds in-flight requests may take to finish after SIGTERM; then they are aborted with 503"),
    Key("download_dir", text, None, "where s3:// models are cached (default ~/.cache/lmi-serve/download)"),
    # several models behind one server (docs/multi-model.md)
    Key("multi_model", boolean, False,
        "SageMaker's multi-model mode (SAGEMAKER_MULTI_MODEL=true): start with the models of the model dir, if any, "
        "and serve those registered at run time through POST /models; a model's crash restarts it alone"),
    Key("model_url_pattern", text, r"^(file://)?/opt/ml/models?/",
        "the models POST /models may register: a regex their url must match (default: the local model store "
        "SageMaker mounts, nothing remote); `.*` allows any local dir, s3:// prefix or hub id"),
    Key("allow_custom_code", boolean, False,
        "whether a model registered at run time may run its own code (a model.py, option.entryPoint, "
        "option.trust_remote_code); refused at registration otherwise"),
    Key("option.max_models_memory", memory_amount, None,
        "the memory the models loaded at once may need (bytes, or a fraction of the machine's: GPU memory, else "
        "available RAM), as lmi plan's memory model counts them; a model that needs more room unloads the least "
        "recently used idle ones (they load again on their next request). Unset: the whole machine"),
    Key("required_memory_mb", integer(1), None,
        "DJL's: the MiB one copy of this model needs, instead of lmi plan's estimate (for the multi-model budget)"),
    # engine keys
    Key("option.model_id", text, None, "local dir, s3://bucket/prefix/ or hub id (default: the model dir)"),
    Key("option.revision", text, None, "hub revision (branch, tag or commit)"),
    Key("option.dtype", choice("fp32", "fp16", "bf16", "auto"), None,
        "weight dtype; unset or auto: the checkpoint's dtype on GPUs (fp32 checkpoints in bf16; fp16 without "
        "bf16), bf16 on CPUs that compute it natively (AVX512-BF16, AMX), else fp32"),
    Key("option.tensor_parallel_degree", tensor_parallel, 1, "ranks per model copy; max = all GPUs"),
    Key("option.pipeline_parallel_degree", integer(1), 1,
        "pipeline stages: the decoder layers split over this many groups of tensor_parallel_degree ranks "
        "(engine=MPI, the paged engine, our model code; across hosts with option.mpi_hostfile) (docs/multinode.md)"),
    Key("option.rolling_batch", choice("auto", "scheduler", "lmi-dist", "vllm", "disable"), "auto",
        "auto, scheduler (padded KV), lmi-dist or vllm (paged KV) or disable (dynamic batching)"),
    Key("option.paged_attention", boolean, True, "with rolling_batch=auto: paged (true) or padded (false) KV cache"),
    Key("option.max_rolling_batch_size", integer(1), 32, "max_num_seqs: rows in the running batch"),
    Key("option.max_rolling_batch_prefill_tokens", integer(1), 1024, "max_num_batched_tokens per step"),
    Key("option.max_model_len", integer(1), None, "prompt + new tokens limit (default: the model's)"),
    Key("option.trust_remote_code", boolean, False, "allow the checkpoint's own modeling code (HF fallback path)"),
    Key("option.model_impl", choice("auto", "native", "transformers"), "auto",
        "model code (vLLM's --model-impl): ours where we implement the architecture (auto), ours or refuse to "
        "start (native), or transformers' (its attention on our KV cache where its code allows)"),
    Key("option.output_formatter", choice("json", "jsonlines", "sse"), "json", "response format"),
    Key("option.model_loading_timeout", integer(1), 1800, "seconds the engine may take to become ready"),
    Key("option.predict_timeout", integer(1), 240, "seconds one engine step may take"),
    Key("option.gpu_memory_utilization", number(0.0, 1.0, low_open=True), 0.9, "GPU memory fraction for weights + KV cache"),
    Key("option.kv_cache_memory", memory_amount, None,
        "CPU KV cache: bytes or a fraction of free RAM (unset: what max_rolling_batch_size sequences of "
        "max_model_len need, at most 0.25 of available RAM)"),
    Key("option.kv_block_size", integer(1), 16, "tokens per paged KV block"),
    Key("option.enable_prefix_caching", boolean, False, "reuse KV blocks of shared prompt prefixes"),
    Key("option.kv_offload_memory", memory_amount, None,
        "KV tiers (docs/kv-tiers.md): a host-memory tier below the paged cache, bytes or a fraction of available "
        "RAM, shared by the model copies on the host; needs option.enable_prefix_caching"),
    Key("option.kv_offload_memory_dir", text, "/dev/shm/lmi-kv",
        "where the host-memory KV tier lives: a folder on a shared-memory (tmpfs) filesystem"),
    Key("option.kv_offload_dir", text, None,
        "KV tiers: a folder for the disk tier below the host tier, kept across restarts"),
    Key("option.kv_offload_disk", memory_amount, "0.5",
        "the disk KV tier's bytes, or a fraction of the free space under option.kv_offload_dir"),
    Key("option.enforce_eager", boolean, False, "no CUDA graphs / torch.compile: every step runs eagerly"),
    Key("option.cpu_compile", boolean, False,
        "CPU: the paged engine's decode step compiled by torch.compile (inductor), every batch bucket before "
        "/ping turns 200 (off by default: measured no faster on CPU, docs/paged.md)"),
    Key("option.cpu_linear", choice("auto", "aten", "onednn", "upcast", "lmi"), "auto",
        "CPU: the linear layers' kernel: auto (the fastest for this CPU, dtype and model, measured at load), aten "
        "(F.linear: MKL / oneDNN per call), onednn (weights reordered once into oneDNN's layout), upcast (bf16 "
        "weights multiplied in float32), lmi (our C kernel, engines/kernels/cpu_gemm.c); auto is aten under "
        "option.cpu_compile (docs/quantization.md#cpu-kernels)"),
    Key("option.compile_cache_dir", text, None,
        "where torch.compile keeps its compiled code (TORCHINDUCTOR_CACHE_DIR), so that a restart is warm"),
    Key("option.tgi_compat", boolean, False, "/invocations answers as TGI's POST / (an array, or TGI's SSE stream)"),
    Key("option.attention_backend", choice("auto", "flash_attn", "triton", "flex", "cpu", "torch"), "auto",
        "paged attention kernels: flash_attn (CUDA with flash-attn installed), triton (CUDA), flex (PyTorch "
        "FlexAttention), cpu (our C decode kernel), torch, or auto (flash_attn, else triton on CUDA; on CPU cpu "
        "when its kernel builds, else torch; torch for an fp8 KV cache)"),
    Key("option.enable_lora", boolean, False,
        "paged engine: serve LoRA adapters (PEFT format) beside the base model: those under MODEL_DIR/adapters/<name>, "
        "in option.adapters, or registered at run time; a request names one (LMI \"adapters\", TGI "
        "parameters.adapter_id, OpenAI model), base and adapter rows share each step (docs/lora.md)"),
    Key("option.max_loras", integer(1), 4, "LoRA adapters on the device at once (slots; the least recently used "
                                           "idle one makes room for another)"),
    Key("option.max_lora_rank", integer(1), 16, "the largest LoRA rank an adapter may have (slots are padded to it)"),
    Key("option.max_cpu_loras", integer(1), None, "LoRA adapters kept read in RAM, the most recently used (unset: "
                                                  "option.max_loras; others are read from disk when next placed)"),
    Key("option.adapters", lora_modules, None,
        "LoRA adapters served from the start besides MODEL_DIR/adapters: name=path pairs (a local directory, s3:// "
        "prefix or hub id), or JSON (vLLM's lora_modules)"),
    Key("option.kv_cache_dtype", choice("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), "auto",
        "paged engine: how K/V are stored: auto (the model dtype), or fp8 (= fp8_e4m3) / fp8_e5m2, half of bf16's "
        "bytes, rounded on write and widened on read by the torch attention backend (docs/quantization.md)"),
    Key("option.speculative_method", choice("ngram", "draft"), None,
        "paged engine: speculative decoding by n-gram prompt lookup or a draft model (unset: off; "
        "option.speculative_model alone means draft)"),
    Key("option.num_speculative_tokens", integer(1), 3, "tokens proposed per step with speculative decoding"),
    Key("option.speculative_model", text, None,
        "the draft model's directory (same tokenizer as the model; loaded at TP 1 on rank 0)"),
    Key("option.ngram_prompt_lookup_min", integer(1), 1, "ngram speculation: the shortest suffix looked up"),
    Key("option.ngram_prompt_lookup_max", integer(1), 4, "ngram speculation: the longest suffix looked up"),
    Key("option.num_scheduler_steps", integer(1), 1,
        "paged engine: decode steps run back to back per plan when every request decodes (multi-step)"),
    Key("option.scheduling_policy", choice("fcfs", "priority"), "fcfs",
        "paged engine: fcfs admits requests in arrival order; priority by their `priority` (lower first, then "
        "arrival), a higher one preempting the lowest running when the batch or the blocks are full "
        "(docs/scheduling.md)"),
    Key("option.max_queue_wait_ms", number(0.0, 1e9, low_open=True), None,
        "paged engine: a request that cannot start (its first token) within this many ms is answered 503 with "
        "Retry-After at once, instead of waiting (a request's own timeout may be shorter)"),
    Key("option.target_tpot_ms", number(0.0, 1e9, low_open=True), None,
        "paged engine: cap the running batch and the prefill chunks so that the measured step time (the time per "
        "output token) stays under this many ms"),
    Key("option.fair_share_key", text, None,
        "paged engine: share admission fairly between tenants named by this request header (e.g. X-Tenant), or "
        "between LoRA adapters with the value `adapter`"),
    Key("option.async_scheduling", boolean, None,
        "paged engine: schedule and prepare the next step while this one runs (unset: on, except with speculative "
        "decoding or multi-step, which it does not pipeline; true with either is refused)"),
    Key("option.max_new_tokens", integer(1), 30, "default max_new_tokens of a request"),
    Key("option.load_cache_dir", text, None,
        "directory for a load-optimised copy of each rank's weights: written on the first start, read on later "
        "ones (native models)"),
    Key("option.task", task, None,
        "what the model serves: text-generation, text-embedding (also embedding, feature-extraction) or "
        "text-classification (also classify, score, rerank; cross-encoders); unset: detected from the checkpoint "
        "(docs/embeddings.md)"),
    Key("option.max_client_batch_size", integer(1), 512,
        "embeddings and scores: the most inputs (texts, or documents to rank) one request may carry (TEI's "
        "--max-client-batch-size)"),
    Key("option.served_model_name", text, None,
        "the model name /v1/models lists and OpenAI requests must use (default: option.model_id when it is "
        "not a local path, else the model dir's name)"),
    Key("option.chat_template", text, None,
        "chat template: a file path or an inline Jinja template (default: the tokenizer's)"),
    Key("option.mpi_hostfile", text, None,
        "multi-node: an Open MPI hostfile; the ranks of engine=MPI are spread over its hosts (rank 0, which the "
        "HTTP front end talks to, on the first: list this host first) (docs/multinode.md)"),
    Key("option.mpi_rsh_agent", text, None,
        "multi-node: the command mpirun starts remote daemons with (Open MPI's plm_rsh_agent; default ssh)"),
    Key("option.mpi_network", text, None,
        "multi-node: the network (a CIDR such as 10.0.0.0/24, or an interface) the ranks talk over, TCP "
        "(Open MPI's btl_tcp_if_include and oob_tcp_if_include)"),
    Key("maxWorkers", integer(1), None,
        "model copies on this host, each an engine group of option.tensor_parallel_degree devices (on CPU: an equal "
        "share of the cores) behind the one front end, which sends each request to the copy with the fewest "
        "outstanding tokens; a copy that dies is restarted. Unset: minWorkers, else with engine=MPI on GPUs "
        "#GPUs / tensor_parallel_degree (DJL's rule), else 1 (docs/copies.md)"),
    Key("minWorkers", integer(1), None, "DJL's lower bound of model copies: the count when maxWorkers is unset "
        "(copies are not scaled between the two)"),
    Key("option.entryPoint", text, None,
        "the handler: a custom handler file (model.py, or <name>.py in the model dir, or a path) or module whose "
        "handle(inputs) serves /invocations with DJL's djl_python API; djl_python.huggingface (our engines), "
        "djl_python.lmi_vllm / djl_python.vllm (the paged engine); other built-in DJL handlers are refused. Unset: "
        "model.py in the model dir when there is one, else our engines (docs/custom-handlers.md)"),
    Key("option.tool_call_parser", choice("llama3_json", "hermes", "mistral"), None,
        "how tool calls are read from the model's reply with tool_choice=auto (llama3_json: Llama 3.x JSON; hermes: "
        "<tool_call> blocks (Qwen, Hermes); mistral: [TOOL_CALLS]); unset: auto is refused, required and a named "
        "function still work (docs/api.md)"),
    Key("option.quantize", quantize_method, None,
        "quantisation of our model code's linear layers at load: int8 (weight-only, per output channel) or int4 "
        "(weight-only, groups of 32 inputs), CPU and CUDA (int4 on CUDA in bf16); int8_dynamic (int8 weights and "
        "activations, CPU); fp8 (e4m3 weights per output channel and activations per token, torch._scaled_mm: CUDA "
        "GPUs of compute capability 8.9+, bf16); the embeddings and LM head stay unquantised. "
        "A pre-quantised checkpoint (config.json quantization_config) loads with it unset or set to its own "
        "method: gptq, awq, compressed-tensors or fp8 (docs/quantization.md)"),
)

# DJL keys that are accepted for compatibility but change nothing here (no warning for them).
ACCEPTED_UNUSED = frozenset({
    "option.mpi_mode", "option.device_map",
    "option.enable_streaming", "option.low_cpu_mem_usage", "option.disable_flash_attn",
    "max_idle_time", "load_on_devices", "reserved_memory_mb", "option.parallel_loading", "option.load_format",
})

KEYS_BY_NAME = {k.name: k for k in KEYS}

# DJL's alias for batch_size and lmi-dist's speculative keys, and vLLM's engine-argument spellings of
# our keys (current LMI images write these); an alias and its key both set to different values is an error.
KEY_ALIASES = {"max_dynamic_batch_size": "batch_size",
               "option.max_num_seqs": "option.max_rolling_batch_size",
               "option.max_num_batched_tokens": "option.max_rolling_batch_prefill_tokens",
               "option.speculative_draft_model": "option.speculative_model",
               "option.speculative_length": "option.num_speculative_tokens",
               "option.lora_modules": "option.adapters",
               # DJL's worker counts (model copies): the GPU spellings and SERVING_MIN/MAX_WORKERS
               "gpu.minWorkers": "minWorkers", "gpu.maxWorkers": "maxWorkers", "cpu.minWorkers": "minWorkers",
               "cpu.maxWorkers": "maxWorkers", "min_workers": "minWorkers", "max_workers": "maxWorkers"}

# DJL and vLLM settings lmi-serve does not implement: ignored with a warning that says so, never
# with a "did you mean" pointing at an unrelated key of ours.
FOREIGN_KEYS = frozenset({
    "option.max_logprobs", "option.enable_chunked_prefill", "option.cpu_offload_gb_per_gpu", "option.cpu_offload_gb",
    "option.lora_extra_vocab_size",
    "option.draft_model_tp_size", "option.record_acceptance_rate",
    "option.decoding_strategy", "option.max_sparsity", "option.max_splits", "option.waiting_steps",
    "option.swap_space", "option.block_size", "option.seed", "option.tokenizer", "option.tokenizer_mode",
    "option.max_input_len", "option.max_output_len", "option.async_mode", "option.use_passive_workers",
    "option.image_placeholder_token", "option.enable_venv", "option.pythonExecutable",
    "option.env", "option.handler", "option.max_seq_len_to_capture",
})
