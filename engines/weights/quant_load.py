"""Loading a pre-quantised checkpoint into our model code (engines/weights/quant_checkpoint.py reads its format).

Packed where a kernel exists (4-bit groups of 32·2^k inputs or whole rows → Int4Weight, 8-bit
symmetric rows → Int8Weight; engines/layers/quant.py). Each checkpoint linear is decoded whole
(engines/layers/quant_formats.py: codes q, scales s, zero points z), and the model's own loading code
(the load_weight that reads a bf16 checkpoint: TP shards, fused q/k/v and gate/up) copies this
rank's part of each into capture tensors standing in for the linear's weight:

    pass q: weight ← [out_l, in_l]  codes (fp16 holds 0..255 exactly)
    pass s: weight ← [out_l, G_l]   scales: a row-parallel shard's inputs lo:hi are groups lo/g : hi/g
    pass z: weight ← [out_l, G_l]   zero points

then each linear packs its shard in the kernel's convention, (q − z)·s = (q − 8)·s + (8 − z)·s. Every
other parameter stands aside meanwhile (a zero-size stand-in), so a quantised tensor whose target is
not a parallel linear (a quantised LM head) fails there and loads dequantised instead.

fp8 weights with per-tensor or per-channel scales → Fp8Weight (per-row scales: a fused q/k/v keeps each
part's) where the fp8 GEMM runs (CUDA 8.9+, bf16). Dequantised to the model dtype, with a log line
saying why: fp8 elsewhere (CPU) and block-scaled fp8, act-order GPTQ, 8-bit groups, and any shard
whose shape the int4 kernel cannot take.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

import torch
from torch import nn

from engines.layers.linear import ColumnParallelLinear, RowParallelLinear
from engines.layers.quant import INT4_ROWS_MULTIPLE, Fp8Weight, Int4Weight, Int8Weight, fp8_kernel_problem
from engines.layers.quant_formats import decode, decode_gptq_act_order, dequantize
from engines.weights.quant_checkpoint import CheckpointQuant, dequantize_reason, is_fp8

log = logging.getLogger(__name__)

MARKERS = ("qweight", "weight_packed", "weight_scale", "weight_scale_inv")  # a quantised linear has one
IGNORED = ("input_scale", "output_scale", "k_scale", "v_scale")  # activation scales: activations stay unquantised
Reader = Callable[[], torch.Tensor]  # the whole checkpoint tensor


def quantized_prefixes(names) -> set[str]:
    return {n.rpartition(".")[0] for n in names if n.rpartition(".")[2] in MARKERS}


def is_quantized_tensor(name: str, prefixes: set[str]) -> bool:
    prefix, _, suffix = name.rpartition(".")
    return prefix in prefixes and suffix != "bias"


def pack_quantized(model: nn.Module, quant: CheckpointQuant, tensors: dict[str, dict[str, Reader]],
                   dtype: torch.dtype) -> tuple[Counter, dict[str, dict[str, Reader]]]:
    """Before anything else loads (the linears' own weights never touched, so on CPU never in memory):
    pack every quantised linear (`tensors`: prefix → suffix → reader) that a kernel takes. → how many
    linear shards packed each way, and the checkpoint linears left for load_dequantized."""
    if any(p.dim() == 3 for p in model.parameters()):
        raise ValueError(f"a {quant.method} checkpoint of a model with stacked MoE experts: pre-quantised experts "
                         "do not load yet; serve the bf16 checkpoint (option.quantize=int8 or int4 for the rest)")
    device = next(model.parameters()).device
    why = dequantize_reason(quant, device.type, dtype == torch.bfloat16) or \
        (fp8_kernel_problem(device, dtype) if is_fp8(quant) else None)
    if why:
        log.warning("%s checkpoint: dequantising its weights to %s on load (%s); they take the memory of an "
                    "unquantised model", quant.method, dtype, why)
        return Counter(), tensors
    return _pack_all(model, quant, tensors, dtype)


def load_dequantized(model: nn.Module, quant: CheckpointQuant, tensors: dict[str, dict[str, Reader]]) -> int:
    """Load each checkpoint linear dequantised to the model dtype through the model's load_weight (after
    the other weights: it is the ordinary path). → how many."""
    done = 0
    for prefix, readers in tensors.items():
        t = _read_all(readers)
        w = decode_gptq_act_order(quant, t) if quant.desc_act else decode(quant, t, prefix).dequantize()
        if model.load_weight(prefix + ".weight", list(w.shape), lambda idx, w=w: w[idx]):
            done += 1
        else:
            log.warning("unused quantised checkpoint linear: %s", prefix)
    return done


def packed_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters of packed weights (nothing else fills them)."""
    packed = (Int4Weight, Int8Weight, Fp8Weight)
    return {id(p) for m in model.modules() if isinstance(m, packed) for p in m.parameters()}


def _read_all(readers: dict[str, Reader]) -> dict[str, torch.Tensor]:
    return {suffix: read() for suffix, read in readers.items() if suffix not in IGNORED}


def _group_columns(t: torch.Tensor, index: tuple, group: int | None, prefix: str) -> torch.Tensor:
    """Scales or zeros [out, G] read with a weight's index: input columns lo:hi → groups lo/g : hi/g."""
    cols = index[1] if len(index) > 1 else slice(None)
    if cols == slice(None) or t.shape[1] == 1:
        return t[index[0]]
    lo, hi = cols.start, cols.stop
    if lo % group or hi % group:
        raise ValueError(f"{prefix}: this rank's input columns {lo}:{hi} split a quantisation group of {group} "
                         f"inputs; choose an option.tensor_parallel_degree that divides its {t.shape[1]} groups")
    return t[index[0], lo // group:hi // group]


def _pack_all(model: nn.Module, quant: CheckpointQuant, tensors: dict[str, dict[str, Reader]],
              dtype: torch.dtype) -> tuple[Counter, dict[str, dict[str, Reader]]]:
    linears = {name: m for name, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    originals = {name: m.weight for name, m in linears.items()}
    group = quant.group_size
    # codes: uint8 for 4 bits (255: not filled), int16 for 8 (-1: not filled), float32 for fp8 values (NaN, as
    # scales and zeros); fp8 has no zeros
    fp8 = is_fp8(quant)
    code_dtype, unfilled = (torch.float32, float("nan")) if fp8 else (torch.uint8, 255) if quant.bits == 4 \
        else (torch.int16, -1)

    def capture(shape, kind, fill, device):
        return nn.Parameter(torch.full(shape, fill, dtype=kind, device=device), requires_grad=False)

    caps = {}
    for name, w in originals.items():
        out_l, in_l = w.shape
        groups = in_l // group if group else 1
        caps[name] = [capture((out_l, in_l), code_dtype, unfilled, w.device),
                      capture((out_l, groups), torch.float32, float("nan"), w.device),
                      capture((out_l, groups), torch.float32, float("nan"), w.device)]
    aside = _stand_aside(model, linears)
    leftovers = {}
    try:
        for prefix, readers in tensors.items():
            d = decode(quant, _read_all(readers), prefix)
            stages = [lambda idx, d=d: d.q[idx],
                      lambda idx, d=d, p=prefix: _group_columns(d.scales, idx, group, p),
                      lambda idx, d=d, p=prefix: _group_columns(d.zeros, idx, group, p)]
            for stage, reader in enumerate(stages[:2] if fp8 else stages):
                for name, m in linears.items():
                    m.weight = caps[name][stage]
                try:
                    used = model.load_weight(prefix + ".weight", list(d.q.shape), reader)
                except (RuntimeError, AssertionError, IndexError):  # its target is no parallel linear
                    leftovers[prefix] = readers  # e.g. a quantised LM head: loaded dequantised, later
                    log.warning("%s: quantised in the checkpoint, no packed form for its target: loading it "
                                "dequantised to %s", prefix, dtype)
                    break
                if not used:
                    log.warning("unused quantised checkpoint linear: %s", prefix)
                    break
    finally:
        for name, m in linears.items():
            m.weight = originals[name]
        for module, key, p in aside:
            module._parameters[key] = p
    return _pack_captured(linears, caps, quant, unfilled, dtype), leftovers


def _pack_captured(linears: dict[str, nn.Module], caps: dict[str, list], quant: CheckpointQuant, unfilled,
                   dtype: torch.dtype) -> Counter:
    """Each linear whose codes, scales (and zeros) the checkpoint filled, packed in place of its weight."""
    fp8 = is_fp8(quant)
    done = Counter()
    for name, m in linears.items():
        q, s, z = caps.pop(name)
        missing = torch.isnan(q) if fp8 else q == unfilled
        if missing.all():
            continue  # not quantised in the checkpoint: its weight loads as it is
        if missing.any() or torch.isnan(s).any() or (not fp8 and torch.isnan(z).any()):
            raise ValueError(f"{name}: the checkpoint quantises some of its fused parts and not others")
        packed, how = (Fp8Weight.from_quantized(q, s[:, 0]), "fp8") if fp8 else pack_shard(q, s, z, quant.group_size,
                                                                                          quant.bits, dtype)
        done[how] += 1
        del m.weight
        m.weight = packed
    if done["dequantised"]:
        log.warning("%s checkpoint: %d linear shards dequantised to %s (shapes the packed kernels cannot take)",
                    quant.method, done["dequantised"], dtype)
    return done


def _stand_aside(model: nn.Module, linears: dict[str, nn.Module]) -> list:
    """Swap every parameter but the linears' weights for a zero-size stand-in; → what to put back."""
    aside, linear_modules = [], set(map(id, linears.values()))
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None or (id(module) in linear_modules and key == "weight"):
                continue
            aside.append((module, key, p))
            module._parameters[key] = nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), requires_grad=False)
    return aside


def pack_shard(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group: int | None, bits: int,
               dtype: torch.dtype) -> tuple[nn.Module | nn.Parameter, str]:
    """One linear shard's codes q [out, in], scales and zeros [out, G] → its packed weight (or, where no
    kernel takes the shape, the dequantised weight) and which it is: int4 | int8 | dequantised."""
    out, k = q.shape
    span = group if s.shape[1] > 1 else k  # inputs per scale
    if bits == 4:
        rows = INT4_ROWS_MULTIPLE if q.device.type == "cpu" else 8
        kernel_group = next((g for g in (256, 128, 64, 32) if span % g == 0 and k % g == 0), None)
        if kernel_group and out % rows == 0:
            r = span // kernel_group  # a checkpoint group of r kernel groups: its scale repeated
            scales = s.repeat_interleave(r, dim=1)
            zeros = ((8 - z) * s).repeat_interleave(r, dim=1)  # (q − z)·s = (q − 8)·s + (8 − z)·s
            return Int4Weight.from_quantized(q.to(torch.int32), scales.t().to(dtype), zeros.t().to(dtype),
                                             kernel_group), "int4"
    if bits == 8 and s.shape[1] == 1 and bool((z == 128).all()):
        return Int8Weight.from_quantized((q.to(torch.int32) - 128).to(torch.int8), s[:, 0].to(dtype)), "int8"
    return nn.Parameter(dequantize(q, s, z, span).to(dtype), requires_grad=False), "dequantised"
