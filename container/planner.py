"""`lmi plan` and the start-up check of `lmi serve`: a checkpoint's shape (config.json and the
safetensors headers, never the weights) + the resolved settings + a machine → engines.weights.memory_plan.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from dataclasses import asdict

from container.config import query_gpus
from container.preflight import read_safetensors_header
from engines.config import ENGINE_PAGED, memory_bytes
from engines.weights.memory_plan import Machine, ModelShape, Plan, Workload, available_ram, count, gib
from engines.spec import ModelSpec
from engines.devices import choose_dtype, cpu_flags
from engines.weights.quant_checkpoint import read_checkpoint_quant

TORCH_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                  "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def read_model_shape(local_dir: str, max_model_len_override: int | None = None,
                     spec: ModelSpec | None = None) -> ModelShape:
    """The shape of the checkpoint in `local_dir` (its ModelSpec, read here unless given)."""
    spec = spec or ModelSpec.read(local_dir, max_model_len_override)
    shape = dict(hidden_size=spec.hidden_size, num_layers=spec.num_layers, num_heads=spec.num_heads,
                 num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, intermediate_size=spec.intermediate_size,
                 vocab_size=spec.vocab_size)
    try:
        quant = read_checkpoint_quant(spec.config)
    except ValueError:  # a format that does not load: the start refuses it; plan it as unquantised
        quant = None
    counted = count_checkpoint_parameters(local_dir, quant)
    total, replicated, linears = counted if counted else (*estimate_parameters(spec.config, **shape),
                                                          estimate_linear_parameters(spec.config, **shape))
    dtype = TORCH_DTYPE_NAMES.get(str(spec.checkpoint_dtype or "float32"), "fp32")
    return ModelShape(spec, num_parameters=total, replicated_parameters=replicated, checkpoint_dtype=dtype,
                      linear_parameters=linears, checkpoint_quant=quant)


# a decoder layer's tensor (Llama-style `layers.N.`, Falcon's `h.N.`); of those, what option.quantize leaves
# alone: MoE experts and routers (Mixtral's block_sparse_moe.gate, Qwen2-MoE's mlp.gate and shared_expert_gate)
_DECODER_TENSOR = re.compile(r"(?:^|\.)(?:layers|h)\.\d+\.")
_NOT_QUANTIZED = re.compile(r"experts\.|(?:block_sparse_moe|mlp)\.gate\.weight$|shared_expert_gate\.weight$")


def is_quantized_linear(name: str, shape: list[int]) -> bool:
    """Whether option.quantize packs this checkpoint tensor: a decoder layer's dense 2-D weight."""
    return len(shape) == 2 and bool(_DECODER_TENSOR.search(name)) and not _NOT_QUANTIZED.search(name)


# a pre-quantised checkpoint's tensors: packed weights (32 / bits values per int32) and their bookkeeping
_PACKED = ("qweight", "weight_packed")
_QUANT_BOOKKEEPING = ("qzeros", "scales", "g_idx", "weight_scale", "weight_zero_point", "weight_shape",
                      "weight_scale_inv", "input_scale", "output_scale", "weight_g_idx")


def count_checkpoint_parameters(local_dir: str, quant=None) -> tuple[int, int, int] | None:
    """(all parameters, those of 1-D tensors, those of quantisable linears) from the safetensors
    headers; None without any. quant: a pre-quantised checkpoint's format: its packed weights count
    the values they hold, their scales and zero points not at all."""
    paths = sorted(glob.glob(os.path.join(local_dir, "*.safetensors")))
    if not paths:
        return None
    total = replicated = linears = 0
    for path in paths:
        for name, meta in read_safetensors_header(path).items():
            numel = 1
            for d in meta["shape"]:
                numel *= d
            prefix, _, suffix = name.rpartition(".")
            if quant is not None and suffix in _QUANT_BOOKKEEPING:
                continue
            if quant is not None and suffix in _PACKED:
                numel, name = numel * (32 // quant.bits), prefix + ".weight"
            total += numel
            replicated += numel if len(meta["shape"]) <= 1 else 0
            linears += numel if is_quantized_linear(name, meta["shape"]) else 0
    return total, replicated, linears


def estimate_parameters(cfg: dict, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                        head_dim: int, intermediate_size: int, vocab_size: int) -> tuple[int, int]:
    """Llama-family count when there are no weights to read: embeddings (and an untied LM head),
    q/k/v/o, a gated MLP (gate/up/down; two matrices for GPT-2/Falcon), two norms per layer + one."""
    mlp_mats = 2 if cfg.get("model_type") in ("gpt2", "falcon") else 3
    attention = hidden_size * head_dim * (2 * num_heads + 2 * num_kv_heads)
    norms = (2 * num_layers + 1) * hidden_size
    embeddings = vocab_size * hidden_size * (1 if cfg.get("tie_word_embeddings") else 2)
    return embeddings + num_layers * (attention + mlp_mats * hidden_size * intermediate_size) + norms, norms


def estimate_linear_parameters(cfg: dict, *, hidden_size: int, num_layers: int, num_heads: int,
                               num_kv_heads: int, head_dim: int, intermediate_size: int, **_) -> int:
    """estimate_parameters' q/k/v/o and MLP matrices: what option.quantize packs."""
    mlp_mats = 2 if cfg.get("model_type") in ("gpt2", "falcon") else 3
    return num_layers * (hidden_size * head_dim * (2 * num_heads + 2 * num_kv_heads)
                         + mlp_mats * hidden_size * intermediate_size)


def this_machine(num_gpus: int) -> Machine | None:
    """This machine: its GPUs (memory from nvidia-smi; None when it cannot say), else its RAM."""
    if not num_gpus:
        return Machine("this machine's RAM", 0, available_ram())
    out = query_gpus("memory.total")
    if out is None:
        return None
    mib = min(int(v) for v in out[:num_gpus]) if out else 0
    return Machine(f"this machine ({num_gpus} x {mib} MiB GPUs)", num_gpus, mib * 2**20) if mib else None


def workload(resolved, shape: ModelShape, machine: Machine, engine_kind: str, *, prompt_tokens: int | None = None,
             output_tokens: int | None = None) -> Workload:
    """The settings that matter, from a container.config.ResolvedConfig."""
    # a GPU machine named by --instance / --gpus: its bf16 support is not known here (taken as yes)
    dtype = choose_dtype(resolved["option.dtype"], shape.checkpoint_dtype, num_gpus=machine.num_devices,
                         cpu=cpu_flags())
    tp = resolved["option.tensor_parallel_degree"]
    if tp == "max":
        tp = max(machine.num_devices, 1)
    output = output_tokens if output_tokens is not None else min(resolved["option.max_new_tokens"], shape.max_model_len)
    prompt = prompt_tokens if prompt_tokens is not None else shape.max_model_len - output
    spec = resolved["option.kv_cache_memory"]
    kv_bytes = memory_bytes(spec, machine.device_bytes) if spec and not machine.is_gpu else None
    tiers = []  # a fraction: of this host's RAM, of the free space under the disk tier's folder (0 when not there)
    if resolved["option.kv_offload_memory"]:
        tiers.append(("host", memory_bytes(resolved["option.kv_offload_memory"], available_ram())))
    if resolved["option.kv_offload_dir"]:
        folder = resolved["option.kv_offload_dir"]
        free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
        tiers.append(("disk", memory_bytes(resolved["option.kv_offload_disk"], free)))
    return Workload(dtype=dtype.dtype, dtype_why=dtype.why, tensor_parallel_degree=tp,
                    max_num_seqs=resolved["option.max_rolling_batch_size"],
                    max_num_batched_tokens=resolved["option.max_rolling_batch_prefill_tokens"],
                    max_model_len=shape.max_model_len, prompt_tokens=prompt, output_tokens=output,
                    kv_block_size=resolved["option.kv_block_size"],
                    gpu_memory_utilization=resolved["option.gpu_memory_utilization"], kv_cache_bytes=kv_bytes,
                    is_paged=engine_kind == ENGINE_PAGED, quantize=resolved["option.quantize"],
                    kv_cache_dtype=resolved["option.kv_cache_dtype"], kv_tier_bytes=tuple(tiers))


def summary(p: Plan) -> str:
    """One line: what runs where, the two big numbers, and the verdict."""
    w = p.workload
    q = p.shape.checkpoint_quant
    dtype = f"{w.dtype} ({w.quantize} linears)" if w.quantize in ("int8", "int4") else \
        f"{w.dtype} ({q.method} {q.bits}-bit linears)" if q else w.dtype
    head = (f"plan: {p.shape.architecture} {count(p.shape.num_parameters)} parameters, {dtype}, "
            f"TP {w.tensor_parallel_degree} on {p.machine.name}: weights {gib(p.weight_bytes)}/rank, KV cache "
            f"{p.kv_tokens:,} tokens ({p.kv_bytes_per_token:,} bytes/token/rank), {p.max_concurrent_seqs:,} "
            f"sequences of {w.sequence_tokens:,} tokens")
    return f"{head}; {p.problems[0]}" if p.problems else f"{head}; fits"


def table(p: Plan) -> list[str]:
    w, s = p.workload, p.shape
    rows = [("model", f"{s.architecture} ({s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads, "
                      f"{s.num_kv_heads} KV heads of {s.head_dim})"),
            ("parameters", f"{s.num_parameters:,}"),
            ("machine", p.machine.name),
            ("dtype / tensor_parallel_degree", f"{w.dtype} / {w.tensor_parallel_degree}"
                                               + (f" (dtype: {w.dtype_why})" if w.dtype_why else "")),
            ("option.quantize", f"{w.quantize}: {count(s.linear_parameters)} linear parameters"
             if w.quantize in ("int8", "int4") else f"pre-quantised {s.checkpoint_quant.method} checkpoint: "
             f"{count(s.linear_parameters)} linear parameters" if s.checkpoint_quant else "none"),
            ("usable memory per rank", f"{gib(p.usable_bytes)} ({p.usable_bytes:,} bytes)"),
            ("weights per rank", f"{gib(p.weight_bytes)} ({p.weight_bytes:,} bytes)"),
            ("activation/workspace headroom", f"{gib(p.headroom_bytes)} ({p.headroom_bytes:,} bytes)"),
            ("KV bytes per token per rank", f"{p.kv_bytes_per_token:,}"),
            ("KV cache per rank", f"{gib(p.kv_bytes)} ({p.kv_bytes:,} bytes)"),
            ("KV tokens that fit", f"{p.kv_tokens:,}"),
            *((f"KV {name} tier below the pool", f"{gib(size)}: {p.kv_tier_tokens[name]:,} tokens")
              for name, size in w.kv_tier_bytes),
            (f"sequences of {w.prompt_tokens:,}+{w.output_tokens:,} tokens", f"{p.max_concurrent_seqs:,}"),
            ("max_rolling_batch_size reachable", _yes_no(p.max_concurrent_seqs >= w.max_num_seqs, w.max_num_seqs)),
            ("max_num_batched_tokens reachable", _yes_no(p.kv_tokens >= w.max_num_batched_tokens,
                                                         w.max_num_batched_tokens)),
            ("smallest tensor_parallel_degree that fits", str(p.smallest_tp) if p.smallest_tp else "none")]
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows] + p.problems + p.notes + [summary(p)]


def _yes_no(ok: bool, value: int) -> str:
    return f"{'yes' if ok else 'no'} ({value:,})"


def to_json(p: Plan) -> str:
    body = {k: v for k, v in asdict(p).items() if k not in ("shape", "machine", "workload")}
    body.update(shape=p.shape.to_dict(), machine=asdict(p.machine), workload=asdict(p.workload), fits=p.fits,
                summary=summary(p), kv_tier_tokens=p.kv_tier_tokens)
    return json.dumps(body, indent=2)



def config_dir(model: str | None, revision: str | None = None) -> str:
    """A local directory holding the model's config.json: the model itself, or for a hub id the
    hub cache after fetching config.json and the safetensors headers' files' index only."""
    if not model:
        raise ValueError("no model: give a model directory or hub id, --model-dir, or option.model_id")
    if os.path.isdir(os.path.expanduser(model)):
        return os.path.expanduser(model)
    if model.startswith("s3://"):
        raise ValueError(f"{model}: lmi plan reads local directories and hub ids; download the config first")
    try:
        from huggingface_hub import hf_hub_download

        return os.path.dirname(hf_hub_download(model, "config.json", revision=revision))
    except Exception as exc:  # offline, unknown repo, gated: one line
        raise ValueError(f"cannot fetch config.json of {model!r} from the hub: {type(exc).__name__}: {exc}") from None
