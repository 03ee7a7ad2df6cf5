"""Pre-quantised checkpoints: what config.json's `quantization_config` says, read once, checked once.

Pure Python (no torch): the launcher checks `option.quantize` against it, the planner counts its
bytes, the loader (engines/weights/quant_load.py) decodes the tensors it names.

    GPTQ                 qweight int32 [in·b/32, out], qzeros int32 [groups, out·b/32], scales [groups, out], g_idx [in]
    AWQ (gemm)           qweight int32 [in, out/8] (nibbles in order 0 2 4 6 1 3 5 7), qzeros [groups, out/8], scales
    compressed-tensors   pack-quantized: weight_packed int32 [out, in·b/32], weight_scale [out, groups],
                         (weight_zero_point packed along out), weight_shape; int-/naive-quantized: int8 weight
                         + weight_scale; float-quantized: fp8 weight + weight_scale
    fp8                  fp8 weight + weight_scale_inv [out/bo, in/bi] (weight_block_size) or weight_scale [1]

Every format reads as W = (q − z) · s per group of inputs (fp8: W = q · s), which is what the loader
packs for a kernel or, where none exists, dequantises (and logs).
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
# what other loaders call formats we do not read, and what runs instead
_OTHERS = {
    "bitsandbytes": "bitsandbytes' NF4/FP4/int8 layouts",
    "exl2": "ExLlamaV2's layout", "eetq": "EETQ's layout", "hqq": "HQQ's layout", "marlin": "Marlin-only repacking",
    "aqlm": "AQLM codebooks", "quanto": "optimum-quanto's layout", "torchao": "torchao's tensor subclasses",
    "mxfp4": "MXFP4", "fbgemm_fp8": "FBGEMM's fp8 layout", "bitnet": "BitNet's ternary weights",
}
INSTEAD = ("serve the unquantised (bf16/fp16) checkpoint, optionally with option.quantize=int8 or int4, or a GPTQ, "
           "AWQ, compressed-tensors or fp8 checkpoint")


@dataclass(frozen=True)
class CheckpointQuant:
    """One checkpoint's weight quantisation, as every linear of it shares it.

    method: gptq | awq | compressed-tensors | fp8; layout: how the tensors are stored (gptq, gptq_v2, awq,
    pack-quantized, int-quantized, float-quantized, fp8); bits: 4 or 8 (fp8: 8); group_size: inputs per
    scale, None for one scale per output row (or, fp8, per tensor / per block: block); symmetric: no
    stored zero points; block: fp8's [out, in] block of one scale; ignore: module names left unquantised."""

    method: str
    layout: str
    bits: int
    group_size: int | None
    symmetric: bool = True
    desc_act: bool = False
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()

    @property
    def weight_bits(self) -> float:
        """Stored bits per weight, before scales."""
        return float(self.bits)


def read_checkpoint_quant(config: dict) -> CheckpointQuant | None:
    """config.json (as a dict) → its quantisation, None for an unquantised checkpoint; ValueError, naming
    what runs instead, for a format or a variant that does not load here."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower().replace("_", "-") if "quant_method" in qc else \
        "compressed-tensors" if "config_groups" in qc else ""
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        block = qc.get("weight_block_size")
        return CheckpointQuant("fp8", "fp8", 8, None, block=tuple(block) if block else None,
                               ignore=tuple(qc.get("modules_to_not_convert") or ()))
    name = method.replace("-", "_")
    what = _OTHERS.get(name, f"quant_method {method or '(none)'!r}")
    raise ValueError(f"this checkpoint is pre-quantised with {what} (config.json quantization_config), which "
                     f"lmi-serve does not load; {INSTEAD}")


def _refuse(what: str) -> ValueError:
    return ValueError(f"this checkpoint's quantization_config: {what}, which lmi-serve does not load; {INSTEAD}")


def _gptq(qc: dict) -> CheckpointQuant:
    bits, group = int(qc.get("bits", 4)), int(qc.get("group_size", -1))
    if bits not in (4, 8):
        raise _refuse(f"GPTQ with {bits}-bit weights (4 and 8 load)")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format {fmt!r} (gptq and gptq_v2 load)")
    return CheckpointQuant("gptq", fmt, bits, None if group <= 0 else group, bool(qc.get("sym", True)),
                           bool(qc.get("desc_act", False)))


def _awq(qc: dict) -> CheckpointQuant:
    bits, group = int(qc.get("bits", qc.get("w_bit", 4))), int(qc.get("group_size", qc.get("q_group_size", -1)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise _refuse(f"AWQ {version} with {bits}-bit weights (4-bit gemm loads)")
    return CheckpointQuant("awq", "awq", 4, None if group <= 0 else group, not qc.get("zero_point", True))


def _compressed_tensors(qc: dict) -> CheckpointQuant:
    fmt = str(qc.get("format", "")).lower()
    groups = [g for g in (qc.get("config_groups") or {}).values() if g.get("weights")]
    if not groups:
        raise _refuse("compressed-tensors without weight quantisation")
    weights = [g["weights"] for g in groups]
    if any(w != weights[0] for w in weights[1:]):
        raise _refuse("compressed-tensors with different weight schemes per module group")
    if any(g.get("input_activations") for g in groups):
        raise _refuse("compressed-tensors with quantised activations (W8A8 / FP8 dynamic); weight-only schemes load")
    w = weights[0]
    fmt = str(groups[0].get("format") or fmt)
    bits, kind, strategy = int(w.get("num_bits", 8)), w.get("type", "int"), w.get("strategy", "tensor")
    symmetric = bool(w.get("symmetric", True))
    ignore = tuple(qc.get("ignore") or ())
    if kind == "float":
        if bits != 8 or fmt not in ("float-quantized", "naive-quantized"):
            raise _refuse(f"compressed-tensors {fmt} float{bits}")
        block = tuple(w["block_structure"]) if strategy == "block" else None
        return CheckpointQuant("compressed-tensors", "float-quantized", 8, None, block=block, ignore=ignore)
    if fmt not in ("pack-quantized", "int-quantized", "naive-quantized") or bits not in (4, 8) \
            or strategy not in ("group", "channel", "tensor"):
        raise _refuse(f"compressed-tensors {fmt} int{bits} ({strategy})")
    if w.get("actorder") not in (None, "weight") and strategy == "group":
        raise _refuse(f"compressed-tensors with actorder={w.get('actorder')!r} (group order permuted)")
    return CheckpointQuant("compressed-tensors", "pack-quantized" if fmt == "pack-quantized" else "int-quantized",
                           bits, int(w["group_size"]) if strategy == "group" else None, symmetric, ignore=ignore)


def is_fp8(quant: CheckpointQuant) -> bool:
    return quant.method == "fp8" or quant.layout == "float-quantized"


def dequantize_reason(quant: CheckpointQuant, device_type: str, is_bf16: bool) -> str | None:
    """Why this checkpoint's weights dequantise to the model dtype on load (no packed kernel for them
    on `device_type`); None: they load packed (engines/weights/quant_load.py)."""
    if is_fp8(quant):
        from engines.layers.quant import Fp8Policy

        if quant.block:
            return (f"block-scaled fp8 (one scale per {quant.block[0]}x{quant.block[1]} block): the fp8 kernel takes "
                    "one scale per output row")
        if device_type == "cpu" and not Fp8Policy.allow_cpu:
            return "fp8 weights: no fp8 GEMM on CPU (fp8 runs on CUDA GPUs of compute capability 8.9+)"
        if device_type == "cuda" and not is_bf16:
            return "the fp8 GEMM writes bf16, and the model runs in another dtype"
        return None if device_type in ("cpu", "cuda") else f"no fp8 GEMM on {device_type}"
    if quant.desc_act:
        return "act-order GPTQ (desc_act): each input's group is permuted, which no packed kernel here takes"
    if quant.bits == 8 and quant.group_size:
        return f"8-bit weights in groups of {quant.group_size}: the int8 kernel takes one scale per output row"
    if quant.bits == 4 and quant.group_size and quant.group_size % 32:
        return f"4-bit groups of {quant.group_size}: the int4 kernel takes groups of 32, 64, 128 or 256 inputs"
    if device_type not in ("cpu", "cuda"):
        return f"no packed kernel on {device_type}"
    if quant.bits == 4 and device_type == "cuda" and not is_bf16:
        return "CUDA's int4 kernel takes bf16 activations only"
    return None


def packed_bytes_per_weight(quant: CheckpointQuant, dtype_bytes: int, row_inputs: int) -> float:
    """What one weight of a packed linear holds in memory, its share of scales and zero points included
    (int4: a scale and zero per kernel group of at most 256 inputs; int8: a scale per row of `row_inputs`;
    fp8: a float32 scale per row)."""
    if is_fp8(quant):
        return 1 + 4 / row_inputs
    if quant.bits == 8:
        return 1 + dtype_bytes / row_inputs
    return 0.5 + 2 * dtype_bytes / min(quant.group_size or 256, 256)


def check_quantize_option(option: str | None, quant: CheckpointQuant | None) -> None:
    """option.quantize against the checkpoint: unset or the checkpoint's own method for a pre-quantised
    one; int8/int4/int8_dynamic/fp8 (quantise at load) for an unquantised one."""
    if quant is None:
        if option in METHODS and option != "fp8":  # fp8 also quantises at load (engines/layers/quant.py)
            raise ValueError(f"option.quantize={option} loads a checkpoint pre-quantised with {option}, and this "
                             "one's config.json has no quantization_config; use option.quantize=int8 or int4 to "
                             "quantise at load, or unset it")
        return
    if option and option != quant.method:
        raise ValueError(f"option.quantize={option}: this checkpoint is already quantised with {quant.method} "
                         f"(config.json quantization_config); set option.quantize={quant.method} or unset it")
