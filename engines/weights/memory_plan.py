"""Memory arithmetic of a deployment, before anything is loaded: pure Python, no torch.

`lmi plan`, the start-up check of `lmi serve` and the engines' default KV budget all use it, so the
figures a user sees before launch are the ones the engine sizes its cache with.

Per rank (one GPU, or one CPU process):

    usable      = device memory × gpu_memory_utilization            (CPU: available RAM / ranks)
    weights     = sharded params / TP + replicated params (norms, biases, KV heads copied when
                  there are fewer KV heads than ranks), × dtype bytes; with option.quantize the
                  decoder layers' dense linears at int8: 1 byte + a scale per output row, int4:
                  ½ byte + a scale and a zero point per group of 32 inputs (engines/layers/quant.py)
    headroom    = fixed runtime overhead + activations of one step of max_num_batched_tokens
                  tokens + float32 logits of max_num_seqs rows
    KV          = usable − weights − headroom, in tokens of kv_bytes_per_token (paged: whole blocks)
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from engines.spec import ModelSpec, local_kv_heads
from engines.weights.quant_checkpoint import CheckpointQuant, dequantize_reason, packed_bytes_per_weight

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
GPU_RUNTIME_BYTES = GIB  # CUDA context, cuBLAS workspace, NCCL buffers: outside torch's tensors
CPU_RUNTIME_BYTES = GIB // 2  # the Python interpreter, torch and transformers of one rank
DEFAULT_CPU_KV_FRACTION = 0.25  # of available RAM: the cap of the CPU KV cache when unset
TP_DEGREES = (1, 2, 4, 8)
LOGITS_COPIES = 2  # gathered logits and the sampler's processed copy, float32
QUANT_WEIGHT_BYTES = {"int8": 1.0, "int8_dynamic": 1.0, "int4": 0.5, "fp8": 1.0}  # option.quantize: bytes per linear weight, before scales
INT4_GROUP_SIZE = 32  # engines/layers/quant.py's (no torch here)


def _from_spec(name: str) -> property:
    return property(lambda self: getattr(self.spec, name), doc=f"ModelSpec.{name}")


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a checkpoint: its ModelSpec (config.json's facts, read once) and
    what the safetensors headers count."""

    spec: ModelSpec
    num_parameters: int
    replicated_parameters: int  # 1-D tensors (norms, biases): every rank holds them whole
    checkpoint_dtype: str  # fp32 | fp16 | bf16
    linear_parameters: int = 0  # the decoder layers' dense linears (what option.quantize packs), all ranks'
    checkpoint_quant: CheckpointQuant | None = None  # a pre-quantised checkpoint's format (its linears' bytes)

    architecture = _from_spec("architecture")
    hidden_size = _from_spec("hidden_size")
    num_layers = _from_spec("num_layers")
    num_heads = _from_spec("num_heads")
    num_kv_heads = _from_spec("num_kv_heads")
    head_dim = _from_spec("head_dim")
    intermediate_size = _from_spec("intermediate_size")
    vocab_size = _from_spec("vocab_size")
    max_model_len = _from_spec("max_model_len")

    def to_dict(self) -> dict:
        """The shape's figures, as `lmi plan --json` shows them."""
        out = {"architecture": self.architecture, "num_parameters": self.num_parameters,
               "replicated_parameters": self.replicated_parameters}
        out.update({name: getattr(self, name) for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                                            "head_dim", "intermediate_size", "vocab_size",
                                                            "max_model_len")})
        quant = self.checkpoint_quant
        return {**out, "checkpoint_dtype": self.checkpoint_dtype, "linear_parameters": self.linear_parameters,
                "checkpoint_quant": asdict(quant) if quant is not None else None}

    def can_split(self, tp: int) -> bool:
        if self.num_heads % tp:
            return False
        try:
            local_kv_heads(self.num_kv_heads, tp)
        except ValueError:
            return False
        return True

    def weight_bytes_per_rank(self, tp: int, dtype_bytes: int, quantize: str | None = None, packs: bool = True) -> int:
        """packs: a pre-quantised checkpoint's linears stay packed here (else they dequantise to the dtype)."""
        kv_proj = self.num_layers * 2 * self.hidden_size * self.head_dim  # per KV head
        kv_local = local_kv_heads(self.num_kv_heads, tp)[0]
        local = math.ceil((self.num_parameters - self.replicated_parameters - kv_proj * self.num_kv_heads) / tp) \
            + self.replicated_parameters + kv_proj * kv_local
        quantize = quantize if quantize in QUANT_WEIGHT_BYTES else None  # a checkpoint's own method: below
        pre_quantized = self.checkpoint_quant is not None and packs
        if not quantize and not pre_quantized:
            return local * dtype_bytes
        linears = math.ceil((self.linear_parameters - kv_proj * self.num_kv_heads) / tp) + kv_proj * kv_local
        if pre_quantized:
            per_weight = packed_bytes_per_weight(self.checkpoint_quant, dtype_bytes, self.hidden_size)
        else:
            scales = {"int8": dtype_bytes / self.hidden_size, "int8_dynamic": 4 / self.hidden_size,
                      "fp8": 4 / self.hidden_size, "int4": 2 * dtype_bytes / INT4_GROUP_SIZE}[quantize]
            per_weight = QUANT_WEIGHT_BYTES[quantize] + scales
        return (local - linears) * dtype_bytes + math.ceil(linears * per_weight)

    def kv_bytes_per_token(self, tp: int, dtype_bytes: int) -> int:
        """K and V of one token over all layers, on one rank."""
        return 2 * self.num_layers * local_kv_heads(self.num_kv_heads, tp)[0] * self.head_dim * dtype_bytes

    def activation_bytes(self, tp: int, dtype_bytes: int, num_tokens: int, num_seqs: int) -> int:
        """Peak activations of one step on one rank: the residual and normed hidden states, the
        q/k/v and attention outputs, gate/up/activation of the MLP; plus float32 logits."""
        kv_local = local_kv_heads(self.num_kv_heads, tp)[0]
        per_token = (2 * self.hidden_size + (2 * self.num_heads // tp + 2 * kv_local) * self.head_dim
                     + 3 * math.ceil(self.intermediate_size / tp))
        return num_tokens * per_token * dtype_bytes + LOGITS_COPIES * num_seqs * self.vocab_size * 4


@dataclass(frozen=True)
class Machine:
    """Where the model runs: `num_devices` GPUs of `device_bytes` each, or CPU RAM (num_devices 0)."""

    name: str
    num_devices: int
    device_bytes: int  # per GPU; on CPU the available RAM

    @property
    def is_gpu(self) -> bool:
        return self.num_devices > 0


@dataclass(frozen=True)
class Workload:
    """The settings of serving.properties that the arithmetic reads."""

    dtype: str  # fp32 | fp16 | bf16
    tensor_parallel_degree: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prompt_tokens: int
    output_tokens: int
    kv_block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None  # CPU: option.kv_cache_memory resolved to bytes (all ranks)
    quantize: str | None = None  # option.quantize: int8 | int4 (weight-only, the decoder's linears)
    kv_cache_dtype: str = "auto"  # option.kv_cache_dtype: auto (the model dtype) | fp8 | fp8_e4m3 | fp8_e5m2
    is_paged: bool = True
    dtype_why: str = ""  # why this dtype (engines/devices.py), for the plan's table
    kv_tier_bytes: tuple[tuple[str, int], ...] = ()  # the KV tiers (docs/kv-tiers.md): (host | disk, bytes, all ranks)

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    machine: Machine
    workload: Workload
    usable_bytes: int  # per rank
    weight_bytes: int  # per rank
    headroom_bytes: int  # per rank
    kv_bytes_per_token: int  # per rank
    kv_bytes: int  # per rank
    kv_tokens: int
    max_concurrent_seqs: int
    smallest_tp: int | None
    problems: list[str]  # "does not fit: ..." lines; empty when it fits
    notes: list[str]  # limits that cannot be reached, said with the number to change

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def kv_tier_tokens(self) -> dict[str, int]:
        """Tokens each KV tier holds below the pool (its bytes over every rank's bytes per token)."""
        per_token = self.kv_bytes_per_token * self.workload.tensor_parallel_degree
        return {name: size // per_token for name, size in self.workload.kv_tier_bytes} if per_token else {}


def cpu_kv_budget_bytes(kv_bytes_per_token: int, max_num_seqs: int, max_model_len: int, available: int,
                        num_ranks: int, block_size: int = 1) -> int:
    """Default KV cache of one CPU rank: what max_num_seqs sequences of max_model_len tokens need
    (whole blocks), capped by DEFAULT_CPU_KV_FRACTION of the available RAM shared by the ranks."""
    tokens_per_seq = math.ceil(max_model_len / block_size) * block_size
    need = max_num_seqs * tokens_per_seq * kv_bytes_per_token
    return min(need, int(available * DEFAULT_CPU_KV_FRACTION) // num_ranks)


def plan(shape: ModelShape, machine: Machine, work: Workload) -> Plan:
    """The memory plan of one deployment, with the smallest TP degree that fits."""
    tp = work.tensor_parallel_degree
    if not shape.can_split(tp):
        raise ValueError(f"option.tensor_parallel_degree={tp} does not divide the model's {shape.num_heads} "
                         f"attention heads and {shape.num_kv_heads} KV heads; use one of "
                         f"{', '.join(str(t) for t in TP_DEGREES if shape.can_split(t))}")
    figures = _figures(shape, machine, work, tp)
    problems = _problems(machine, work, figures)
    smallest = next((t for t in TP_DEGREES if t <= max(machine.num_devices, 1) and shape.can_split(t)
                     and not _problems(machine, work, _figures(shape, machine, work, t))), None)
    if problems and smallest is not None and smallest != tp:
        problems = [p + f" (option.tensor_parallel_degree={smallest} fits)" for p in problems]
    kv_tokens = figures["kv_tokens"]
    seqs = kv_tokens // work.sequence_tokens if work.sequence_tokens else 0
    return Plan(shape, machine, work, figures["usable"], figures["weights"], figures["headroom"],
                figures["per_token"], figures["kv"], kv_tokens, seqs, smallest, problems,
                _notes(machine, work, kv_tokens, seqs) if not problems else [])


def _figures(shape: ModelShape, machine: Machine, work: Workload, tp: int) -> dict[str, int]:
    dtype_bytes = DTYPE_BYTES[work.dtype]
    per_token = shape.kv_bytes_per_token(tp, dtype_bytes if work.kv_cache_dtype == "auto" else 1)
    packs = shape.checkpoint_quant is None or not dequantize_reason(
        shape.checkpoint_quant, "cuda" if machine.is_gpu else "cpu", work.dtype == "bf16")
    weights = shape.weight_bytes_per_rank(tp, dtype_bytes, work.quantize, packs)
    activations = shape.activation_bytes(tp, dtype_bytes, work.max_num_batched_tokens, work.max_num_seqs)
    if machine.is_gpu:
        usable = int(machine.device_bytes * work.gpu_memory_utilization)
        headroom = GPU_RUNTIME_BYTES + activations
        kv = max(usable - weights - headroom, 0)
    else:
        usable = machine.device_bytes // tp
        headroom = CPU_RUNTIME_BYTES + activations
        kv = (work.kv_cache_bytes // tp if work.kv_cache_bytes is not None else cpu_kv_budget_bytes(
            per_token, work.max_num_seqs, work.max_model_len, machine.device_bytes, tp, work.kv_block_size))
        kv = min(kv, max(usable - weights - headroom, 0))
    block = work.kv_block_size if work.is_paged else 1
    kv_tokens = kv // per_token // block * block
    return {"tp": tp, "usable": usable, "weights": weights, "headroom": headroom, "per_token": per_token, "kv": kv,
            "kv_tokens": kv_tokens}


def _problems(machine: Machine, work: Workload, f: dict[str, int]) -> list[str]:
    tp = f["tp"]
    if machine.is_gpu and tp > machine.num_devices:
        return [f"does not fit: option.tensor_parallel_degree={tp} needs {tp} GPUs, {machine.name} has "
                f"{machine.num_devices}; set option.tensor_parallel_degree to {machine.num_devices} or less"]
    where = (f"{gib(f['usable'])} of {gib(machine.device_bytes)} per GPU is usable at gpu_memory_utilization="
             f"{work.gpu_memory_utilization:g}" if machine.is_gpu else f"{gib(f['usable'])} of RAM per rank")
    if f["weights"] + f["headroom"] > f["usable"]:
        return [f"does not fit: the weights need {gib(f['weights'])} per rank in {work.dtype} at "
                f"tensor_parallel_degree={tp} (+ {gib(f['headroom'])} headroom), but {where}; raise "
                "option.tensor_parallel_degree or use a bigger instance"]
    if f["kv_tokens"] < work.max_model_len and not _is_explicit_kv(machine, work):
        fix = ("make room: option.gpu_memory_utilization, option.tensor_parallel_degree, "
               "option.max_rolling_batch_prefill_tokens" if machine.is_gpu else "set option.kv_cache_memory")
        return [f"does not fit: the KV cache holds {f['kv_tokens']:,} tokens per rank, less than one sequence of "
                f"max_model_len={work.max_model_len:,}; set option.max_model_len to {f['kv_tokens']:,} or less, "
                f"or {fix}"]
    return []


def _is_explicit_kv(machine: Machine, work: Workload) -> bool:
    """An option.kv_cache_memory the user chose is served as asked (longer requests get 507)."""
    return not machine.is_gpu and work.kv_cache_bytes is not None


def _notes(machine: Machine, work: Workload, kv_tokens: int, seqs: int) -> list[str]:
    notes = []
    if kv_tokens < work.max_model_len and _is_explicit_kv(machine, work):
        notes.append(f"option.kv_cache_memory holds {kv_tokens:,} tokens, less than one sequence of max_model_len="
                     f"{work.max_model_len:,}: longer requests are refused with 507")
    if seqs < work.max_num_seqs:
        notes.append(f"option.max_rolling_batch_size={work.max_num_seqs} cannot be reached: {seqs} sequences of "
                     f"{work.sequence_tokens:,} tokens fit; set it to {seqs} or shorten the sequences")
    if kv_tokens < work.max_num_batched_tokens:
        notes.append(f"option.max_rolling_batch_prefill_tokens={work.max_num_batched_tokens} cannot be reached: "
                     f"the KV cache holds {kv_tokens:,} tokens; set it to {kv_tokens} or less")
    return notes


def gib(n: int) -> str:
    """Bytes for people: GiB with two decimals, MiB or KiB below a GiB."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1024:.2f} KiB"


def count(n: int) -> str:
    """205,120 → "205.1 K"; 6,738,415,616 → "6.74 B"."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'B' else 1}f} {unit}"
    return str(n)


def available_ram() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), in bytes."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
