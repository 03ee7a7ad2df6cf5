"""What a model serves (option.task, else detected from its checkpoint), and the configuration of the
pooling engine that serves embeddings and scores (docs/embeddings.md).

    option.task set      → that task, checked against the checkpoint (an encoder cannot generate;
                           a classifier needs a …ForSequenceClassification head)
    option.task unset    → …ForSequenceClassification: text-classification; modules.json (sentence-
                           transformers) or an encoder: text-embedding; anything else: text-generation
"""

from __future__ import annotations

import logging
import os

from container.compat import quantized_dtype
from container.keys import ConfigError
from container.merge import ResolvedConfig
from container.placement import placement, resolve_tensor_parallel
from engines.config import (ENGINE_POOLING, TASK_GENERATION, LmiConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                            ServerConfig)
from engines.pooling.spec import PoolingSpecError, architecture_of, detect_task, is_encoder, read_json, \
    read_pooling_spec
from engines.spec import ModelSpec

log = logging.getLogger(__name__)

# generation settings that mean nothing to a pooling model: set, they are refused by name
GENERATION_ONLY = ("option.rolling_batch", "option.enable_lora", "option.quantize", "option.speculative_method",
                   "option.enable_prefix_caching", "option.kv_cache_dtype", "option.cpu_compile", "batch_size")


def resolve_task(cfg: ResolvedConfig, local_dir: str | None) -> str:
    """The model's task; ConfigError when option.task asks for one its checkpoint cannot serve."""
    if not local_dir:
        return cfg["option.task"] or TASK_GENERATION
    config = read_json(os.path.join(local_dir, "config.json"))
    config = config if isinstance(config, dict) else {}
    detected = detect_task(local_dir, config)
    task = cfg["option.task"] or detected
    if task == TASK_GENERATION and is_encoder(config):
        raise ConfigError(f"option.task=text-generation: {architecture_of(config) or config.get('model_type')} is "
                          f"an encoder, which cannot generate text; serve it with option.task={detected}")
    if not cfg["option.task"] and task != TASK_GENERATION:
        log.info("option.task unset: serving %s (detected from the checkpoint)", task)
    return task


def build_pooling(cfg: ResolvedConfig, task: str, *, local_dir: str, spec: ModelSpec | None, num_gpus: int,
                  num_cpus: int, cpu: frozenset[str], gpu_bf16: bool | None, server: ServerConfig, env) -> LmiConfig:
    """The configuration of a model served by the pooling engine: one process per copy, no tensor parallelism."""
    for key in GENERATION_ONLY:
        if cfg.is_set(key) and not (key == "batch_size" and cfg[key] == 1):
            raise ConfigError(f"{key}={cfg.raw.get(key, cfg[key])} is a text-generation setting; this model serves "
                              f"{task} (option.task), which batches its inputs by max_rolling_batch_size and "
                              "max_rolling_batch_prefill_tokens: unset it")
    tp = resolve_tensor_parallel(cfg, num_gpus, num_cpus)
    if tp * cfg["option.pipeline_parallel_degree"] > 1:
        raise ConfigError(f"option.tensor_parallel_degree={tp}: a {task} model runs in one process per copy; "
                          "set maxWorkers for more copies instead")
    pooling = None  # (a remote checkpoint `lmi config` shows before any download: read once it is here)
    if local_dir and os.path.isfile(os.path.join(local_dir, "config.json")):
        try:
            pooling = read_pooling_spec(local_dir, task, cfg["option.max_model_len"])
        except PoolingSpecError as exc:
            raise ConfigError(str(exc)) from None
        log.info("task: %s (%s, %s)", task, pooling.architecture,
                 f"labels {', '.join(pooling.labels)}" if pooling.labels else f"{pooling.pooling} pooling")
    dtype = quantized_dtype(cfg, num_gpus, "a pooling model", spec, cpu, gpu_bf16)
    model = ModelConfig(local_dir=local_dir, model_id=cfg["option.model_id"], revision=cfg["option.revision"],
                        dtype=dtype.dtype, dtype_why=dtype.why, trust_remote_code=cfg["option.trust_remote_code"],
                        max_model_len=pooling.max_input_tokens if pooling else None, task=task, pooling=pooling)
    scheduler = SchedulerConfig(engine_kind=ENGINE_POOLING, job_queue_size=cfg["job_queue_size"],
                                max_num_seqs=cfg["option.max_rolling_batch_size"],
                                max_num_batched_tokens=cfg["option.max_rolling_batch_prefill_tokens"],
                                predict_timeout_s=float(cfg["option.predict_timeout"]))
    parallel = placement(cfg, False, 1, num_gpus, num_cpus, 1, env) if num_gpus or num_cpus else ParallelConfig()
    return LmiConfig(model=model, scheduler=scheduler, parallel=parallel, server=server)
