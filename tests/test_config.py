"""Table-driven tests of container.config: precedence, aliases, engine selection, validation, build()."""

from __future__ import annotations

import os

import pytest

from container import config as cfgmod
from container.config import (
    build, collect_raw, count_gpus, resolve, resolve_port, resolve_tensor_parallel, select_engine,
)
from container.keys import ConfigError, memory_amount, memory_bytes
from engines.spec import ModelSpec
from engines.config import LmiConfig

LLAMA = "LlamaForCausalLM"


def case(id, props=None, env=None, *, values=None, engine=None, arch=LLAMA, error=None, warnings=(),
         build=None, fields=None):
    """One row of the table.

    values:   {key: (typed value, source prefix)} checked on resolve();
    engine:   expected select_engine(cfg, arch) (or scheduler.engine_kind when build is given);
    error:    substrings that the ConfigError message must contain (from resolve, or build when given);
    warnings: one tuple of substrings per expected warning, in order (default: no warnings at all);
    build:    kwargs for build() (num_gpus, num_cpus); fields: {"scheduler.batch_size": 4, ...}.
    """
    expect = dict(values=values or {}, engine=engine, arch=arch, error=error, warnings=list(warnings),
                  build=build, fields=fields or {})
    return pytest.param(props or {}, env or {}, expect, id=id)


BF16_CPU = frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})  # the dtype policy's CPU: bf16 by default
CPU2 = dict(num_gpus=0, num_cpus=2, cpu=BF16_CPU)
CPU4 = dict(num_gpus=0, num_cpus=4, cpu=BF16_CPU)
AVX2_CPU2 = dict(num_gpus=0, num_cpus=2, cpu=frozenset({"avx2", "fma"}))
GPU1 = dict(num_gpus=1, num_cpus=16)
GPU4 = dict(num_gpus=4, num_cpus=16)

CASES = [
    # ---- defaults --------------------------------------------------------------------------------
    case("defaults", {}, {"PATH": "/usr/bin", "HOME": "/root", "SERVING_FOO": "1", "HF_TOKEN": "x"},
         values={"engine": ("Python", "default"), "batch_size": (1, "default"),
                 "max_batch_delay": (100, "default"), "job_queue_size": (1000, "default"),
                 "option.rolling_batch": ("auto", "default"), "option.paged_attention": (True, "default"),
                 "option.tensor_parallel_degree": (1, "default"), "option.dtype": (None, "default"),
                 "option.max_rolling_batch_size": (32, "default"),
                 "option.max_rolling_batch_prefill_tokens": (1024, "default"),
                 "option.gpu_memory_utilization": (0.9, "default"), "option.model_id": (None, "default"),
                 "option.trust_remote_code": (False, "default"), "option.output_formatter": ("json", "default"),
                 "option.max_new_tokens": (30, "default"), "option.quantize": (None, "default")},
         engine="paged"),
    # ---- file > OPTION_* / SERVING_* / HF_MODEL_ID ---------------------------------------------------
    case("file-beats-option", {"option.rolling_batch": "scheduler"}, {"OPTION_ROLLING_BATCH": "lmi-dist"},
         values={"option.rolling_batch": ("scheduler", "file")}, engine="rolling"),
    case("option-fills", {}, {"OPTION_ROLLING_BATCH": "lmi-dist"},
         values={"option.rolling_batch": ("lmi-dist", "env (OPTION_ROLLING_BATCH)")}, engine="paged"),
    case("option-fills-other-key", {"option.dtype": "fp16"}, {"OPTION_MAX_MODEL_LEN": "4096"},
         values={"option.dtype": ("fp16", "file"), "option.max_model_len": (4096, "env (OPTION_MAX_MODEL_LEN)")}),
    case("option-engine", {}, {"OPTION_ENGINE": "MPI"}, values={"engine": ("MPI", "env (OPTION_ENGINE)")}),
    case("option-engine-file-wins", {"engine": "Python"}, {"OPTION_ENGINE": "MPI"},
         values={"engine": ("Python", "file")}),
    case("option-entrypoint", {}, {"OPTION_ENTRYPOINT": "djl_python.huggingface"},
         values={"engine": ("Python", "default")}),
    case("file-entrypoint-accepted", {"option.entryPoint": "model.py", "option.mpi_mode": "true",
                                      "minWorkers": "1", "maxWorkers": "1"}, {}),
    case("serving-job-queue", {}, {"SERVING_JOB_QUEUE_SIZE": "50"},
         values={"job_queue_size": (50, "env (SERVING_JOB_QUEUE_SIZE)")}),
    case("serving-file-wins", {"job_queue_size": "10"}, {"SERVING_JOB_QUEUE_SIZE": "50"},
         values={"job_queue_size": (10, "file")}),
    case("hf-model-id", {}, {"HF_MODEL_ID": "org/model", "HF_REVISION": "abc123"},
         values={"option.model_id": ("org/model", "env (HF_MODEL_ID)"),
                 "option.revision": ("abc123", "env (HF_REVISION)")}),
    case("option-model-id-beats-hf-model-id", {}, {"HF_MODEL_ID": "org/a", "OPTION_MODEL_ID": "org/b"},
         values={"option.model_id": ("org/b", "env (OPTION_MODEL_ID)")},
         warnings=[("HF_MODEL_ID='org/a' and OPTION_MODEL_ID='org/b' are both set: using OPTION_MODEL_ID value",
                    "DJL would load both")]),
    case("same-model-id-twice-is-quiet", {}, {"HF_MODEL_ID": "org/a", "OPTION_MODEL_ID": "org/a"},
         values={"option.model_id": ("org/a", "env (OPTION_MODEL_ID)")}),
    case("hf-model-id-file-wins", {"option.model_id": "s3://b/m/"}, {"HF_MODEL_ID": "org/model"},
         values={"option.model_id": ("s3://b/m/", "file"), "option.revision": (None, "default")}),
    case("empty-env-ignored", {}, {"OPTION_ROLLING_BATCH": "", "SERVING_BATCH_SIZE": "", "SM_NUM_GPUS": "",
                                   "HF_MODEL_ID": "", "OPTION_ENGINE": ""},
         values={"option.rolling_batch": ("auto", "default"), "batch_size": (1, "default"),
                 "option.tensor_parallel_degree": (1, "default"), "option.model_id": (None, "default"),
                 "engine": ("Python", "default")}),
    case("empty-option-leaves-alias", {}, {"OPTION_TENSOR_PARALLEL_DEGREE": "", "SM_NUM_GPUS": "2"},
         values={"option.tensor_parallel_degree": (2, "env (SM_NUM_GPUS)")}),
    # ---- TGI / SageMaker aliases: only when the LMI key is unset -------------------------------------
    case("sm-num-gpus", {}, {"SM_NUM_GPUS": "4"},
         values={"option.tensor_parallel_degree": (4, "env (SM_NUM_GPUS)")}),
    case("tp-env-max", {}, {"TENSOR_PARALLEL_DEGREE": "max"},
         values={"option.tensor_parallel_degree": ("max", "env (TENSOR_PARALLEL_DEGREE)")}),
    # The entrypoint maps SM_NUM_GPUS to TENSOR_PARALLEL_DEGREE only when the latter is unset (reference §1.4).
    case("tp-env-beats-sm-num-gpus", {}, {"SM_NUM_GPUS": "4", "TENSOR_PARALLEL_DEGREE": "2"},
         values={"option.tensor_parallel_degree": (2, "env (TENSOR_PARALLEL_DEGREE)")}),
    case("option-beats-sm-num-gpus", {}, {"SM_NUM_GPUS": "4", "OPTION_TENSOR_PARALLEL_DEGREE": "2"},
         values={"option.tensor_parallel_degree": (2, "env (OPTION_TENSOR_PARALLEL_DEGREE)")}),
    case("file-beats-tp-env", {"option.tensor_parallel_degree": "1"}, {"TENSOR_PARALLEL_DEGREE": "8"},
         values={"option.tensor_parallel_degree": (1, "file")}),
    case("max-batch-size", {}, {"MAX_BATCH_SIZE": "64"},
         values={"option.max_rolling_batch_size": (64, "env (MAX_BATCH_SIZE)"), "batch_size": (1, "default")},
         engine="paged"),
    case("max-batch-size-under-option", {}, {"MAX_BATCH_SIZE": "64", "OPTION_MAX_ROLLING_BATCH_SIZE": "16"},
         values={"option.max_rolling_batch_size": (16, "env (OPTION_MAX_ROLLING_BATCH_SIZE)")}),
    case("max-batch-prefill", {}, {"MAX_BATCH_PREFILL_TOKENS": "4096"},
         values={"option.max_rolling_batch_prefill_tokens": (4096, "env (MAX_BATCH_PREFILL_TOKENS)")}),
    case("max-batch-prefill-under-file", {"option.max_rolling_batch_prefill_tokens": "2048"},
         {"MAX_BATCH_PREFILL_TOKENS": "4096"},
         values={"option.max_rolling_batch_prefill_tokens": (2048, "file")}),
    case("max-concurrent", {}, {"MAX_CONCURRENT_REQUESTS": "7"},
         values={"job_queue_size": (7, "env (MAX_CONCURRENT_REQUESTS)")}),
    case("max-concurrent-under-serving", {}, {"MAX_CONCURRENT_REQUESTS": "7", "SERVING_JOB_QUEUE_SIZE": "9"},
         values={"job_queue_size": (9, "env (SERVING_JOB_QUEUE_SIZE)")}),
    case("hf-trust", {}, {"HF_MODEL_TRUST_REMOTE_CODE": "true"},
         values={"option.trust_remote_code": (True, "env (HF_MODEL_TRUST_REMOTE_CODE)")}, engine="rolling"),
    case("hf-trust-under-file", {"option.trust_remote_code": "false"}, {"HF_MODEL_TRUST_REMOTE_CODE": "true"},
         values={"option.trust_remote_code": (False, "file")}, engine="paged"),
    case("cuda-mem-fraction", {}, {"CUDA_MEMORY_FRACTION": "0.5"},
         values={"option.gpu_memory_utilization": (0.5, "env (CUDA_MEMORY_FRACTION)")}),
    case("cuda-mem-under-option", {}, {"CUDA_MEMORY_FRACTION": "0.5", "OPTION_GPU_MEMORY_UTILIZATION": "0.8"},
         values={"option.gpu_memory_utilization": (0.8, "env (OPTION_GPU_MEMORY_UTILIZATION)")}),
    case("hf-quantize", {}, {"HF_MODEL_QUANTIZE": "awq"}, values={"option.quantize": ("awq", "env (HF_MODEL_QUANTIZE)")}),
    # ---- batch_size alias ------------------------------------------------------------------------
    case("max-dynamic-batch-size", {"max_dynamic_batch_size": "8"}, {},
         values={"batch_size": (8, "file")}, engine="dynamic"),
    case("serving-max-dynamic-batch-size", {}, {"SERVING_MAX_DYNAMIC_BATCH_SIZE": "4"},
         values={"batch_size": (4, "env (SERVING_MAX_DYNAMIC_BATCH_SIZE)")}, engine="dynamic"),
    # ---- engine selection (DJL rules) -------------------------------------------------------------
    case("sel-batch-size", {"batch_size": "4"}, {}, engine="dynamic"),
    case("sel-disable", {"option.rolling_batch": "disable"}, {}, engine="dynamic"),
    case("sel-scheduler", {"option.rolling_batch": "scheduler"}, {}, engine="rolling"),
    case("sel-lmi-dist", {"option.rolling_batch": "lmi-dist"}, {}, engine="paged"),
    case("sel-auto", {"option.rolling_batch": "auto"}, {}, engine="paged"),
    case("sel-auto-qwen2", {}, {}, engine="paged", arch="Qwen2ForCausalLM"),
    case("sel-auto-unknown-arch", {}, {}, engine="paged", arch=None),
    case("sel-auto-no-paged", {"option.paged_attention": "false"}, {}, engine="rolling"),
    # the fallback: GPT-2's attention goes through transformers' attention interface (our paged KV); BLOOM's does not
    case("sel-auto-gpt2", {}, {}, engine="paged", arch="GPT2LMHeadModel"),
    case("sel-auto-bloom", {}, {}, engine="rolling", arch="BloomForCausalLM"),
    case("sel-auto-gpt2-trust", {"option.trust_remote_code": "true"}, {}, engine="rolling", arch="GPT2LMHeadModel"),
    # option.model_impl (vLLM's --model-impl): transformers' model on our paged KV where its attention allows
    case("impl-transformers-llama", {"option.model_impl": "transformers"}, {}, engine="paged",
         arch="LlamaForCausalLM"),
    case("impl-transformers-bloom", {"option.model_impl": "transformers"}, {}, engine="rolling",
         arch="BloomForCausalLM"),
    case("impl-native-gpt2", {"option.model_impl": "native"}, {}, arch="GPT2LMHeadModel", build=CPU2,
         error=["option.model_impl=native", "GPT2LMHeadModel", "no native implementation of GPT2LMHeadModel"]),
    case("impl-bad", {"option.model_impl": "vllm"}, {}, error=["option.model_impl", "vllm"]),
    case("sel-auto-trust", {"option.trust_remote_code": "true"}, {}, engine="rolling"),
    case("sel-auto-trust-no-arch", {"option.trust_remote_code": "true"}, {}, engine="rolling", arch=None),
    case("sel-scheduler-paged-default", {"option.rolling_batch": "scheduler"}, {},
         values={"option.paged_attention": (True, "default")}, engine="rolling"),
    # ---- contradictions -----------------------------------------------------------------------------
    case("bs-lmi-dist", {"batch_size": "4", "option.rolling_batch": "lmi-dist"}, {},
         error=["batch_size=4", "option.rolling_batch=lmi-dist"]),
    case("bs-scheduler", {"batch_size": "4", "option.rolling_batch": "scheduler"}, {},
         error=["batch_size=4", "option.rolling_batch=scheduler"]),
    case("bs-env-lmi-dist-file", {"option.rolling_batch": "lmi-dist"}, {"SERVING_BATCH_SIZE": "2"},
         error=["batch_size=2", "lmi-dist"]),
    case("paged-true-scheduler", {"option.paged_attention": "true", "option.rolling_batch": "scheduler"}, {},
         error=["option.paged_attention=true", "option.rolling_batch=scheduler"]),
    case("paged-false-lmi-dist", {"option.paged_attention": "false", "option.rolling_batch": "lmi-dist"}, {},
         error=["option.paged_attention=false", "option.rolling_batch=lmi-dist"]),
    case("mpi-dynamic", {"engine": "MPI", "batch_size": "4"}, {}, build=CPU2, error=["engine=MPI", "dynamic"]),
    case("mpi-disable", {"engine": "MPI", "option.rolling_batch": "disable"}, {}, build=GPU1,
         error=["engine=MPI", "dynamic"]),
    case("mpi-tp-over-cpus", {"engine": "MPI", "option.tensor_parallel_degree": "4"}, {}, build=CPU2,
         error=["option.tensor_parallel_degree=4", "2 CPU cores"]),
    case("tp-over-gpus", {"engine": "MPI", "option.tensor_parallel_degree": "8"}, {}, build=GPU4,
         error=["option.tensor_parallel_degree=8", "4 GPUs"]),
    case("tp2-python-rolling", {"engine": "Python", "option.tensor_parallel_degree": "2",
                                "option.rolling_batch": "scheduler"}, {},
         build=CPU4, error=["option.tensor_parallel_degree=2", "engine=Python"]),
    case("tp2-engine-unset-rolling-is-mpi", {"option.tensor_parallel_degree": "2"}, {}, build=CPU4,
         engine="paged", fields={"parallel.use_mpi": True, "parallel.tensor_parallel_degree": 2}),
    case("hf-model-id-sm-num-gpus-2", {}, {"HF_MODEL_ID": "org/model", "SM_NUM_GPUS": "2"}, build=GPU4,
         engine="paged", fields={"parallel.use_mpi": True, "parallel.tensor_parallel_degree": 2},
         values={"option.tensor_parallel_degree": (2, "env (SM_NUM_GPUS)")}),
    # ---- current LMI (v15) / vLLM spellings -------------------------------------------------------
    case("rolling-batch-vllm", {"option.rolling_batch": "vllm", "option.max_num_seqs": "64",
                                "option.max_num_batched_tokens": "2048", "option.max_model_len": "512",
                                "option.enable_prefix_caching": "true", "option.gpu_memory_utilization": "0.8"}, {},
         engine="paged", values={"option.max_rolling_batch_size": (64, "file as option.max_num_seqs"),
                                 "option.max_rolling_batch_prefill_tokens": (2048, "file as option.max_num_batched_tokens"),
                                 "option.max_model_len": (512, "file")}),
    case("vllm-alias-from-env", {}, {"OPTION_MAX_NUM_SEQS": "16"},
         values={"option.max_rolling_batch_size": (16, "env (OPTION_MAX_NUM_SEQS) as option.max_num_seqs")}),
    case("vllm-alias-file-beats-env-key", {"option.max_num_seqs": "16"}, {"OPTION_MAX_ROLLING_BATCH_SIZE": "8"},
         values={"option.max_rolling_batch_size": (16, "file as option.max_num_seqs")}),
    case("vllm-alias-conflict", {"option.max_num_seqs": "16", "option.max_rolling_batch_size": "8"}, {},
         error=["option.max_rolling_batch_size", "option.max_num_seqs", "set only one"]),
    case("vllm-alias-agrees", {"option.max_num_seqs": "16", "option.max_rolling_batch_size": "16"}, {},
         values={"option.max_rolling_batch_size": (16, "file")}),
    case("foreign-key-no-hint", {"option.max_logprobs": "20", "option.enable_chunked_prefill": "true"}, {},
         warnings=[("option.enable_chunked_prefill", "does not implement"),
                   ("option.max_logprobs", "does not implement")]),
    case("vllm-paged-false", {"option.rolling_batch": "vllm", "option.paged_attention": "false"}, {},
         error=["option.rolling_batch=vllm", "scheduler"]),
    case("tp2-python-dynamic-cpu", {"option.tensor_parallel_degree": "2", "batch_size": "4"}, {},
         build=CPU4, error=["option.tensor_parallel_degree=2", "engine=Python"]),
    case("tp2-mpi-fallback-arch", {"engine": "MPI", "option.tensor_parallel_degree": "2"}, {},
         arch="GPT2LMHeadModel", build=GPU4, error=["option.tensor_parallel_degree=2", "GPT2LMHeadModel"]),
    # option.quantize: weight-only int8 / int4 of our model code; every other name refused, naming what runs
    case("quantize-int8", {"option.quantize": "int8"}, {}, build=CPU2, engine="paged",
         values={"option.quantize": ("int8", "file")}, fields={"model.quantize": "int8", "model.dtype": "bf16"}),
    case("quantize-int4-upper", {"option.quantize": "INT4"}, {}, build=CPU2,
         values={"option.quantize": ("int4", "file")}, fields={"model.quantize": "int4"}),
    case("hf-quantize-int8", {}, {"HF_MODEL_QUANTIZE": "int8"}, build=GPU1,
         values={"option.quantize": ("int8", "env (HF_MODEL_QUANTIZE)")},
         fields={"model.quantize": "int8", "model.dtype": "bf16"}),
    case("quantize-int4-gpu-bf16", {"option.quantize": "int4"}, {}, build=GPU1, fields={"model.dtype": "bf16"}),
    case("quantize-int4-gpu-fp16", {"option.quantize": "int4", "option.dtype": "fp16"}, {}, build=GPU1,
         error=["option.quantize=int4 with option.dtype=fp16", "option.dtype=bf16"]),
    case("quantize-int8-tp2", {"option.quantize": "int8", "option.tensor_parallel_degree": "2"}, {}, build=CPU4,
         fields={"model.quantize": "int8", "parallel.tensor_parallel_degree": 2}),
    case("quantize-fallback", {"option.quantize": "int8"}, {}, arch="GPT2LMHeadModel", build=CPU2,
         error=["option.quantize=int8", "GPT2LMHeadModel", "transformers fallback", "unset option.quantize"]),
    case("quantize-impl-transformers", {"option.quantize": "int4", "option.model_impl": "transformers"}, {},
         build=CPU2, error=["option.quantize=int4", "option.model_impl=transformers"]),
    # a pre-quantised checkpoint's method: accepted by name, refused at build when the checkpoint is not one
    case("quantize-gptq", {"option.quantize": "gptq"}, {}, build=CPU2,
         error=["option.quantize=gptq loads a checkpoint pre-quantised with gptq", "no quantization_config",
                "option.quantize=int8 or int4"]),
    # fp8: quantised at load on GPUs (the compute capability is checked at load), an fp8 checkpoint's method too
    case("quantize-fp8-gpu", {"option.quantize": "fp8"}, {}, build=GPU1,
         fields={"model.quantize": "fp8", "model.dtype": "bf16"}),
    case("quantize-fp8-gpu-fp16", {"option.quantize": "fp8", "option.dtype": "fp16"}, {}, build=GPU1,
         error=["option.quantize=fp8 with option.dtype=fp16", "writes bf16", "option.dtype=bf16"]),
    case("quantize-fp8-cpu", {"option.quantize": "fp8"}, {}, build=CPU2,
         error=["option.quantize=fp8 runs on CUDA GPUs with fp8 tensor cores", "this host has none",
                "option.quantize=int8_dynamic"]),
    case("quantize-compressed-tensors-alias", {"option.quantize": "compressed_tensors"}, {},
         values={"option.quantize": ("compressed-tensors", "file")}),
    case("quantize-int8-dynamic", {"option.quantize": "int8_dynamic"}, {}, build=CPU2,
         fields={"model.quantize": "int8_dynamic"}),
    case("quantize-int8-dynamic-gpu", {"option.quantize": "int8_dynamic"}, {}, build=GPU1,
         error=["option.quantize=int8_dynamic runs on CPU", "option.quantize=int8"]),
    # LoRA: the paged engine on our model code, eager decode steps
    case("lora", {"option.enable_lora": "true", "option.max_loras": "3", "option.max_lora_rank": "32"}, {},
         build=CPU2, engine="paged",
         fields={"model.enable_lora": True, "model.max_loras": 3, "model.max_lora_rank": 32, "model.max_cpu_loras": 3,
                 "model.adapters": {}}),
    case("lora-modules", {"option.enable_lora": "true", "option.max_cpu_loras": "9",
                          "option.adapters": "math=/opt/ml/math, sql=s3://bucket/sql/ chat=org/chat-lora"}, {},
         build=CPU2, fields={"model.max_cpu_loras": 9, "model.adapters": {
             "math": "/opt/ml/math", "sql": "s3://bucket/sql/", "chat": "org/chat-lora"}}),
    case("lora-modules-vllm-json", {"option.enable_lora": "true"},
         {"OPTION_LORA_MODULES": '[{"name": "math", "path": "/opt/ml/math"}]'}, build=CPU2,
         fields={"model.adapters": {"math": "/opt/ml/math"}}),
    case("lora-modules-bad", {"option.enable_lora": "true", "option.adapters": "math"}, {},
         error=["option.adapters='math' is invalid", "name=path pairs"]),
    case("lora-modules-without-lora", {"option.adapters": "math=/opt/ml/math"}, {}, build=CPU2,
         error=["option.adapters is set and option.enable_lora is not"]),
    case("lora-cpu-below-device", {"option.enable_lora": "true", "option.max_loras": "4", "option.max_cpu_loras": "2"},
         {}, build=CPU2, error=["option.max_cpu_loras=2 is below option.max_loras=4"]),
    case("lora-padded", {"option.enable_lora": "true", "option.rolling_batch": "scheduler",
                         "option.paged_attention": "false"}, {}, build=CPU2, engine="rolling",
         fields={"model.enable_lora": True}),
    case("lora-dynamic", {"option.enable_lora": "true", "batch_size": "4"}, {}, build=CPU2,
         error=["option.enable_lora=true runs in the rolling-batch engines", "dynamic batching"]),
    case("lora-fallback", {"option.enable_lora": "true"}, {}, arch="GPT2LMHeadModel", build=CPU2,
         error=["option.enable_lora=true applies adapters to our model code", "transformers fallback"]),
    case("lora-speculative", {"option.enable_lora": "true", "option.speculative_method": "ngram"}, {}, build=CPU2,
         error=["option.enable_lora=true with option.speculative_method=ngram: LoRA adapters and speculative decoding are "
                "not supported together yet"]),
    case("lora-bad-rank", {"option.enable_lora": "true", "option.max_lora_rank": "0"}, {},
         error=["option.max_lora_rank='0'", ">= 1"]),
    case("quantize-bitsandbytes", {}, {"HF_MODEL_QUANTIZE": "bitsandbytes"},
         error=["option.quantize='bitsandbytes'", "do not load", "GPTQ, AWQ, compressed-tensors"]),
    case("quantize-unknown", {"option.quantize": "int3"}, {}, error=["option.quantize='int3'", "int8 or int4"]),
    # ---- invalid values: the key and the bad value are named ------------------------------------
    case("bad-batch-size-x", {"batch_size": "x"}, {}, error=["batch_size='x'", "integer"]),
    case("bad-batch-size-0", {"batch_size": "0"}, {}, error=["batch_size='0'", ">= 1"]),
    case("bad-batch-size-env", {}, {"SERVING_BATCH_SIZE": "lots"}, error=["batch_size='lots'"]),
    case("bad-delay", {"max_batch_delay": "-1"}, {}, error=["max_batch_delay='-1'", ">= 0"]),
    case("bad-dtype", {"option.dtype": "fp8"}, {}, error=["option.dtype='fp8'", "fp16"]),
    case("bad-rolling-batch", {"option.rolling_batch": "tnx"}, {},
         error=["option.rolling_batch='tnx'", "lmi-dist"]),
    case("bad-rolling-batch-env", {}, {"OPTION_ROLLING_BATCH": "trtllm"}, error=["option.rolling_batch='trtllm'"]),
    case("bad-paged", {"option.paged_attention": "maybe"}, {},
         error=["option.paged_attention='maybe'", "true or false"]),
    case("bad-gpu-mem-1.5", {"option.gpu_memory_utilization": "1.5"}, {},
         error=["option.gpu_memory_utilization='1.5'"]),
    case("bad-gpu-mem-0", {"option.gpu_memory_utilization": "0"}, {},
         error=["option.gpu_memory_utilization='0'"]),
    case("bad-gpu-mem-nan", {"option.gpu_memory_utilization": "nan"}, {},
         error=["option.gpu_memory_utilization='nan'"]),
    case("bad-cuda-mem-fraction", {}, {"CUDA_MEMORY_FRACTION": "2"}, error=["option.gpu_memory_utilization='2'"]),
    case("bad-kv-mem", {"option.kv_cache_memory": "abc"}, {}, error=["option.kv_cache_memory='abc'"]),
    case("bad-kv-mem-fraction", {"option.kv_cache_memory": "1.5"}, {}, error=["option.kv_cache_memory='1.5'"]),
    case("bad-kv-mem-zero", {"option.kv_cache_memory": "0"}, {}, error=["option.kv_cache_memory='0'"]),
    case("bad-tp-0", {"option.tensor_parallel_degree": "0"}, {},
         error=["option.tensor_parallel_degree='0'", ">= 1"]),
    case("bad-tp-word", {}, {"SM_NUM_GPUS": "two"}, error=["option.tensor_parallel_degree='two'"]),
    case("bad-engine", {"engine": "DeepSpeed"}, {}, error=["engine='DeepSpeed'", "MPI"]),
    case("bad-formatter", {"option.output_formatter": "xml"}, {}, error=["option.output_formatter='xml'"]),
    # ---- valid typed values ------------------------------------------------------------------------
    case("engine-mpi-lower", {"engine": "mpi"}, {}, values={"engine": ("MPI", "file")}),
    case("engine-mpi-env-lower", {}, {"OPTION_ENGINE": "mpi"}, values={"engine": ("MPI", "env (OPTION_ENGINE)")}),
    case("dtype-upper", {"option.dtype": "FP16"}, {}, values={"option.dtype": ("fp16", "file")}),
    case("rolling-batch-upper", {"option.rolling_batch": "LMI-DIST"}, {},
         values={"option.rolling_batch": ("lmi-dist", "file")}, engine="paged"),
    case("tp-max", {"option.tensor_parallel_degree": "max"}, {},
         values={"option.tensor_parallel_degree": ("max", "file")}),
    case("tp-max-upper", {"option.tensor_parallel_degree": "MAX"}, {},
         values={"option.tensor_parallel_degree": ("max", "file")}),
    case("kv-mem-gib", {"option.kv_cache_memory": "2GiB"}, {}, values={"option.kv_cache_memory": ("2GiB", "file")}),
    case("kv-mem-fraction", {"option.kv_cache_memory": "0.3"}, {}, values={"option.kv_cache_memory": ("0.3", "file")}),
    case("kv-mem-bytes", {"option.kv_cache_memory": "1073741824"}, {},
         values={"option.kv_cache_memory": ("1073741824", "file")}),
    case("bools", {"option.paged_attention": "OFF", "option.trust_remote_code": "yes",
                   "option.enable_prefix_caching": "1", "option.enforce_eager": "True"}, {},
         values={"option.paged_attention": (False, "file"), "option.trust_remote_code": (True, "file"),
                 "option.enable_prefix_caching": (True, "file"), "option.enforce_eager": (True, "file")},
         engine="rolling"),
    case("formatter-sse", {"option.output_formatter": "SSE"}, {}, values={"option.output_formatter": ("sse", "file")}),
    case("gpu-mem-one", {"option.gpu_memory_utilization": "1"}, {},
         values={"option.gpu_memory_utilization": (1.0, "file")}),
    # ---- unknown keys ----------------------------------------------------------------------------
    case("unknown-file", {"option.rolling_bach": "auto"}, {},
         warnings=[("unknown key option.rolling_bach", "(file)", "did you mean option.rolling_batch")]),
    case("unknown-option-env", {}, {"OPTION_ROLLING_BACH": "auto"},
         warnings=[("option.rolling_bach", "OPTION_ROLLING_BACH", "did you mean option.rolling_batch")]),
    case("unknown-file-and-env", {"batchsize": "4"}, {"OPTION_TENSOR_PARALEL_DEGREE": "2"},
         values={"batch_size": (1, "default"), "option.tensor_parallel_degree": (1, "default")},
         warnings=[("unknown key batchsize", "did you mean batch_size"),
                   ("option.tensor_paralel_degree", "did you mean option.tensor_parallel_degree")]),
    case("unknown-mixed-case-option", {}, {"OPTION_Dtype": "fp16"},
         values={"option.dtype": (None, "default")},
         warnings=[("option.Dtype", "did you mean option.dtype")]),
    case("unknown-serving-silent", {}, {"SERVING_FOO": "1", "SERVING_ROLLING_BACH": "x"}),
    # ---- build() --------------------------------------------------------------------------------
    case("build-cpu-defaults", {}, {}, build=CPU2, engine="paged",
         fields={"model.dtype": "bf16", "model.local_dir": "/models/m", "model.model_id": None,
                 "parallel.use_mpi": False, "parallel.tensor_parallel_degree": 1, "server.port": 8123,
                 "scheduler.batch_size": 1, "scheduler.job_queue_size": 1000, "scheduler.max_num_seqs": 32,
                 "scheduler.max_num_batched_tokens": 1024, "scheduler.kv_cache_memory": None}),
    # the dtype policy (engines/devices.py; every case in tests/test_precision.py)
    case("build-gpu-dtype", {}, {}, build=GPU1, engine="paged", fields={"model.dtype": "bf16"}),
    case("build-gpu-no-bf16", {}, {}, build={**GPU1, "gpu_bf16": False}, fields={"model.dtype": "fp16"}),
    case("build-avx2-cpu-dtype", {}, {}, build=AVX2_CPU2, fields={"model.dtype": "fp32"}),
    case("build-avx2-cpu-auto", {"option.dtype": "auto"}, {}, build=AVX2_CPU2, fields={"model.dtype": "fp32"}),
    case("build-avx2-cpu-explicit-bf16", {"option.dtype": "bf16"}, {}, build=AVX2_CPU2,
         fields={"model.dtype": "bf16", "model.dtype_why": "option.dtype=bf16"}),
    case("cpu-linear-default", {}, {}, build=CPU2, fields={"model.cpu_linear": "auto"}),
    case("cpu-linear-onednn", {"option.cpu_linear": "onednn"}, {}, build=CPU2, fields={"model.cpu_linear": "onednn"}),
    case("cpu-linear-under-compile", {"option.cpu_compile": "true"}, {}, build=CPU2,
         fields={"model.cpu_linear": "aten"}),
    case("cpu-linear-onednn-under-compile", {"option.cpu_compile": "true", "option.cpu_linear": "onednn"}, {},
         build=CPU2, error=["option.cpu_linear=onednn with option.cpu_compile=true", "inductor"]),
    case("cpu-linear-lmi-under-compile", {"option.cpu_compile": "true", "option.cpu_linear": "lmi"}, {},
         build=CPU2, error=["option.cpu_linear=lmi with option.cpu_compile=true", "our kernel's packed weights"]),
    case("build-avx2-cpu-int8", {"option.quantize": "int8"}, {}, build=AVX2_CPU2, fields={"model.dtype": "fp32"}),
    case("build-explicit-dtype", {"option.dtype": "fp32"}, {}, build=GPU1, fields={"model.dtype": "fp32"}),
    case("build-scheduler-fields",
         {"max_batch_delay": "50", "job_queue_size": "20", "option.max_rolling_batch_size": "8",
          "option.max_rolling_batch_prefill_tokens": "512", "option.kv_block_size": "32",
          "option.enable_prefix_caching": "true", "option.gpu_memory_utilization": "0.7",
          "option.kv_cache_memory": "2GiB", "option.predict_timeout": "60", "option.enforce_eager": "true"},
         {}, build=CPU2, engine="paged",
         fields={"scheduler.max_batch_delay_ms": 50, "scheduler.job_queue_size": 20, "scheduler.max_num_seqs": 8,
                 "scheduler.max_num_batched_tokens": 512, "scheduler.kv_block_size": 32,
                 "scheduler.enable_prefix_caching": True, "scheduler.gpu_memory_utilization": 0.7,
                 "scheduler.kv_cache_memory": "2GiB", "scheduler.predict_timeout_s": 60.0,
                 "scheduler.enforce_eager": True}),
    case("build-dynamic", {"batch_size": "4", "max_batch_delay": "10"}, {}, build=CPU2, engine="dynamic",
         fields={"scheduler.batch_size": 4, "scheduler.max_batch_delay_ms": 10}),
    case("build-server-fields",
         {"max_request_size": "1024", "http_workers": "3", "http_threads": "4", "option.output_formatter": "jsonlines",
          "option.max_new_tokens": "64", "option.model_loading_timeout": "600"}, {}, build=CPU2,
         fields={"server.max_request_size": 1024, "server.http_workers": 3, "server.http_threads": 4,
                 "server.output_formatter": "jsonlines", "server.default_max_new_tokens": 64,
                 "server.model_loading_timeout_s": 600.0}),
    case("build-model-fields", {"option.model_id": "org/m", "option.revision": "main",
                                "option.trust_remote_code": "true", "option.max_model_len": "2048"}, {},
         build=CPU2, engine="rolling",
         fields={"model.model_id": "org/m", "model.revision": "main", "model.trust_remote_code": True,
                 "model.max_model_len": 2048}),
    case("build-mpi-tp2", {"engine": "MPI", "option.tensor_parallel_degree": "2"}, {}, build=GPU4, engine="paged",
         fields={"parallel.use_mpi": True, "parallel.tensor_parallel_degree": 2}),
    case("build-mpi-tp2-cpu", {"engine": "MPI", "option.tensor_parallel_degree": "2",
                               "option.rolling_batch": "scheduler"}, {}, build=CPU2, engine="rolling",
         fields={"parallel.use_mpi": True, "parallel.tensor_parallel_degree": 2}),
    # ---- pipeline parallelism (docs/multinode.md) ---------------------------------------------------
    case("pp2-engine-unset-is-mpi", {"option.pipeline_parallel_degree": "2"}, {}, build=CPU2, engine="paged",
         fields={"parallel.use_mpi": True, "parallel.tensor_parallel_degree": 1,
                 "parallel.pipeline_parallel_degree": 2}),
    case("pp2-env", {"option.tensor_parallel_degree": "2", "option.mpi_hostfile": "/h"},
         {"OPTION_PIPELINE_PARALLEL_DEGREE": "2"}, build=CPU2, engine="paged",
         values={"option.pipeline_parallel_degree": (2, "env (OPTION_PIPELINE_PARALLEL_DEGREE)")},
         fields={"parallel.use_mpi": True, "parallel.tensor_parallel_degree": 2,
                 "parallel.pipeline_parallel_degree": 2, "parallel.hostfile": "/h"}),
    case("pp-zero", {"option.pipeline_parallel_degree": "0"}, {}, error=["option.pipeline_parallel_degree"]),
    case("pp2-ranks-over-cpus", {"option.tensor_parallel_degree": "2", "option.pipeline_parallel_degree": "2"}, {},
         build=CPU2, error=["4 ranks exceed the 2 CPU cores", "option.mpi_hostfile"]),
    case("pp2-padded", {"option.pipeline_parallel_degree": "2", "option.rolling_batch": "scheduler"}, {},
         build=CPU2, error=["pipeline_parallel_degree=2 runs in the paged engine", "rolling"]),
    case("pp2-dynamic", {"option.pipeline_parallel_degree": "2", "option.rolling_batch": "disable"}, {},
         build=CPU2, error=["pipeline_parallel_degree=2 runs in the paged engine", "dynamic"]),
    case("pp2-python", {"option.pipeline_parallel_degree": "2", "engine": "Python"}, {}, build=CPU2,
         error=["engine=Python", "set engine=MPI"]),
    case("pp2-fallback", {"option.pipeline_parallel_degree": "2"}, {}, arch="GPT2LMHeadModel", build=CPU2,
         error=["option.pipeline_parallel_degree=2: the stages run our model code",
                "GPT2LMHeadModel runs on the transformers fallback"]),
    case("pp3-over-layers", {"option.pipeline_parallel_degree": "3", "option.mpi_hostfile": "/h"}, {}, build=CPU2,
         error=["pipeline_parallel_degree=3 exceeds the model's 2 decoder layers"]),
    case("pp2-tp2-gpus", {"option.pipeline_parallel_degree": "2", "option.tensor_parallel_degree": "2"}, {},
         build=GPU4, engine="paged", fields={"parallel.use_mpi": True, "parallel.tensor_parallel_degree": 2,
                                             "parallel.pipeline_parallel_degree": 2, "parallel.copies": 1}),
    case("pp2-tp4-over-gpus", {"option.pipeline_parallel_degree": "2", "option.tensor_parallel_degree": "4"}, {},
         build=GPU4, error=["8 ranks exceed the 4 GPUs", "option.mpi_hostfile"]),
    case("pp2-lora", {"option.pipeline_parallel_degree": "2", "option.enable_lora": "true"}, {}, build=CPU2,
         error=["option.enable_lora=true", "not supported together"]),
    case("pp2-draft", {"option.pipeline_parallel_degree": "2", "option.speculative_model": "/d"}, {}, build=CPU2,
         error=["draft model", "ngram"]),
    case("build-tp-max-gpus", {"engine": "MPI"}, {"TENSOR_PARALLEL_DEGREE": "max"}, build=GPU4,
         fields={"parallel.tensor_parallel_degree": 4}),
    case("build-tp-max-cpu", {"option.tensor_parallel_degree": "max"}, {}, build=CPU2, engine="paged",
         fields={"parallel.tensor_parallel_degree": 1, "parallel.use_mpi": False}),
    case("build-python-dynamic-tp2-gpus", {"batch_size": "4", "option.tensor_parallel_degree": "2"}, {},
         build=GPU4, engine="dynamic", fields={"parallel.tensor_parallel_degree": 2, "parallel.use_mpi": False}),
    # ---- scheduling modes: a combination that cannot work is refused at start ------------------------
    case("async-with-ngram-refused", {"option.speculative_method": "ngram", "option.async_scheduling": "true"}, {},
         build=CPU2, error=["option.async_scheduling=true with option.speculative_method=ngram",
                            "set option.async_scheduling=false or drop option.speculative_method=ngram"]),
    case("async-with-multi-step-refused", {"option.num_scheduler_steps": "4", "option.async_scheduling": "true"}, {},
         build=CPU2, error=["option.async_scheduling=true with option.num_scheduler_steps=4"]),
    case("ngram-alone-runs-sync", {"option.speculative_method": "ngram"}, {}, build=CPU2, engine="paged",
         fields={"scheduler.async_scheduling": None, "scheduler.speculative_method": "ngram"}),
]


def _field(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _run(props, env, expect):
    cfg = resolve(props, env)
    for key, (value, source) in expect["values"].items():
        setting = cfg.settings[key]
        assert (setting.value, type(setting.value)) == (value, type(value)), key
        assert setting.source.startswith(source), (key, setting.source)
    assert len(cfg.warnings) == len(expect["warnings"]), cfg.warnings
    for warning, parts in zip(cfg.warnings, expect["warnings"]):
        for part in parts:
            assert part in warning, (part, warning)
    if expect["build"] is None:
        if expect["engine"] is not None:
            assert select_engine(cfg, spec_of(expect["arch"])) == expect["engine"]
        return None
    return build(cfg, local_dir="/models/m", spec=spec_of(expect["arch"]), port=8123, **expect["build"])


def spec_of(architecture: str | None) -> ModelSpec | None:
    """A checkpoint of that architecture (None: not known before download)."""
    model_type = {"GPT2LMHeadModel": "gpt2", "BloomForCausalLM": "bloom", "LlamaForCausalLM": "llama"}.get(
        architecture, "")
    return architecture and ModelSpec.from_dicts({"architectures": [architecture], "model_type": model_type,
                                                  "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4})


@pytest.mark.parametrize("props, env, expect", CASES)
def test_config_table(props, env, expect) -> None:
    if expect["error"] is not None:
        with pytest.raises(ConfigError) as info:
            _run(props, env, expect)
        message = str(info.value)
        for part in expect["error"]:
            assert part in message, (part, message)
        assert "\n" not in message  # one clear line
        return
    lmi = _run(props, env, expect)
    if lmi is None:
        assert not expect["fields"], "fields need build="
        return
    if expect["engine"] is not None:
        assert lmi.scheduler.engine_kind == expect["engine"]
    for dotted, value in expect["fields"].items():
        got = _field(lmi, dotted)
        assert (got, type(got)) == (value, type(value)), dotted
    data = lmi.to_json()
    assert LmiConfig.from_json(data) == lmi
    assert LmiConfig.from_json(data).to_json() == data


# ---- separate small tests ---------------------------------------------------------------------------


def test_option_entrypoint_maps_to_camel_case_key() -> None:
    raw, warnings = collect_raw({}, {"OPTION_ENTRYPOINT": "djl_python.huggingface", "OPTION_ENGINE": "MPI"})
    assert raw["option.entryPoint"] == ("djl_python.huggingface", "env (OPTION_ENTRYPOINT)")
    assert raw["engine"] == ("MPI", "env (OPTION_ENGINE)")
    assert "option.entrypoint" not in raw and "option.engine" not in raw
    assert warnings == []


def test_unknown_serving_env_is_not_collected() -> None:
    raw, warnings = collect_raw({}, {"SERVING_FOO": "1", "SERVING_JOB_QUEUE_SIZE": "5"})
    assert raw == {"job_queue_size": ("5", "env (SERVING_JOB_QUEUE_SIZE)")}
    assert warnings == []


def test_unknown_key_without_close_match_has_no_hint() -> None:
    cfg = resolve({"zzqqxx": "1"}, {})
    assert cfg.warnings == ["unknown key zzqqxx (file) is ignored"]


def test_cli_overrides_file_and_env() -> None:
    cfg = resolve({"batch_size": "2"}, {"SERVING_BATCH_SIZE": "3"}, cli={"batch_size": "5"})
    assert cfg.settings["batch_size"] == cfgmod.Setting(5, "cli")
    assert cfg.is_set("batch_size") and not cfg.is_set("engine")


@pytest.mark.parametrize("tp, gpus, cpus, expected", [
    pytest.param("max", 0, 2, 1, id="max-cpu"),
    pytest.param("max", 4, 2, 4, id="max-gpus"),
    pytest.param("2", 0, 2, 2, id="fits-cpus"),
    pytest.param("2", 4, 1, 2, id="fits-gpus"),
    pytest.param("4", 0, 2, "2 CPU cores", id="over-cpus"),
    pytest.param("8", 4, 64, "4 GPUs", id="over-gpus"),
])
def test_resolve_tensor_parallel(tp, gpus, cpus, expected) -> None:
    cfg = resolve({"option.tensor_parallel_degree": tp}, {})
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=f"option.tensor_parallel_degree={tp} exceeds the {expected}"):
            resolve_tensor_parallel(cfg, gpus, cpus)
    else:
        assert resolve_tensor_parallel(cfg, gpus, cpus) == expected


@pytest.mark.parametrize("spec, free, expected", [
    pytest.param("2GiB", 0, 2**31, id="gib"),
    pytest.param("512MB", 0, 512_000_000, id="mb"),
    pytest.param("0.5", 1000, 500, id="fraction"),
    pytest.param("1.0", 1000, 1000, id="fraction-one"),
    pytest.param("1073741824", 0, 1073741824, id="bytes"),
    pytest.param("1KiB", 0, 1024, id="kib"),
    pytest.param("3k", 0, 3000, id="k"),
    pytest.param("1.5GB", 0, 1_500_000_000, id="decimal-gb"),
    pytest.param("100B", 0, 100, id="b"),
    pytest.param("4 mi", 0, 4 * 2**20, id="space-mi"),
])
def test_memory_bytes(spec, free, expected) -> None:
    assert memory_amount("option.kv_cache_memory", spec) == spec.strip()
    assert memory_bytes(spec, free) == expected


@pytest.mark.parametrize("cli_port, env, expected", [
    pytest.param(None, {}, 8080, id="default"),
    pytest.param(None, {"SAGEMAKER_BIND_TO_PORT": "9000"}, 9000, id="sagemaker"),
    pytest.param(7000, {"SAGEMAKER_BIND_TO_PORT": "9000"}, 7000, id="cli-wins"),
    pytest.param(None, {"SAGEMAKER_BIND_TO_PORT": ""}, 8080, id="empty-env"),
    pytest.param(None, {"SAGEMAKER_BIND_TO_PORT": "abc"}, "SAGEMAKER_BIND_TO_PORT='abc'", id="not-a-number"),
    pytest.param(None, {"SAGEMAKER_BIND_TO_PORT": "70000"}, "SAGEMAKER_BIND_TO_PORT='70000'", id="out-of-range"),
])
def test_resolve_port(cli_port, env, expected) -> None:
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            resolve_port(cli_port, env)
    else:
        assert resolve_port(cli_port, env) == expected


@pytest.mark.parametrize("present, visible, expected", [
    pytest.param(None, None, 0, id="no-driver"),
    pytest.param(None, "0,1", 0, id="no-driver-visible"),
    pytest.param(2, None, 2, id="all"),
    pytest.param(2, "", 0, id="empty"),
    pytest.param(2, " ", 0, id="blank"),
    pytest.param(2, "0", 1, id="one"),
    pytest.param(2, "1,0", 2, id="two"),
    pytest.param(2, "-1", 0, id="minus-one"),
    pytest.param(2, "GPU-8f1c2d3e-aaaa-bbbb-cccc-000000000000", 1, id="uuid"),
    pytest.param(2, "0,1,2,3", 2, id="more-than-present"),
])
def test_count_gpus(monkeypatch, present, visible, expected) -> None:
    real_listdir = os.listdir

    def fake_listdir(path="."):
        if path == "/proc/driver/nvidia/gpus":
            if present is None:
                raise FileNotFoundError(path)
            return [f"0000:0{i}:00.0" for i in range(present)]
        return real_listdir(path)

    monkeypatch.setattr(cfgmod.os, "listdir", fake_listdir)
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert count_gpus(env) == expected


QUANTISED = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
             "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True}}


@pytest.mark.parametrize("quant, props, num_gpus, expect", [
    ("gptq", {}, 0, "bf16"),
    ("gptq", {"option.quantize": "gptq"}, 1, "bf16"),  # CUDA's int4 kernel: bf16 when option.dtype is unset
    ("gptq", {"option.quantize": "awq"}, 0,
     "option.quantize=awq: this checkpoint is already quantised with gptq (config.json quantization_config); "
     "set option.quantize=gptq or unset it"),
    ("gptq", {"option.quantize": "int8"}, 0, "already quantised with gptq"),
    ("bitsandbytes", {}, 0, "pre-quantised with bitsandbytes' NF4/FP4/int8 layouts (config.json "
                            "quantization_config), which lmi-serve does not load; serve the unquantised"),
])
def test_a_pre_quantised_checkpoint_is_checked_at_start(quant, props, num_gpus, expect) -> None:
    spec = ModelSpec.from_dicts({"architectures": [LLAMA], "model_type": "llama", "hidden_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "quantization_config": QUANTISED[quant]}, {}, None)
    cfg = resolve(props, {})
    if expect in ("bf16", "fp16"):
        built = build(cfg, local_dir="/models/m", spec=spec, port=8123, num_gpus=num_gpus, num_cpus=16, cpu=BF16_CPU)
        assert built.model.dtype == expect
        return
    with pytest.raises(ConfigError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        build(cfg, local_dir="/models/m", spec=spec, port=8123, num_gpus=num_gpus, num_cpus=16, cpu=BF16_CPU)
