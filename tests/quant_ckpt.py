"""Pre-quantised versions of a tiny fp32 model directory, each format written as its own tools write it:
compressed-tensors through the compressed_tensors package itself (its quantisation config applied to
transformers' model, min/max scales, its ModelCompressor packing and config), GPTQ, AWQ and fp8 by
their published layouts (no GPTQ/AWQ library installs here):

    GPTQ  qweight int32 [in·b/32, out] (input 32/b·r + j in bits b·j of row r), qzeros int32 [G, out·b/32]
          holding z − 1 (v1, AutoGPTQ) or z (gptq_v2), scales fp16 [G, out], g_idx int32 [in]
    AWQ   qweight int32 [in, out/8], nibble j of word c holding output 8c + (0 2 4 6 1 3 5 7)[j];
          qzeros int32 [G, out/8] likewise; scales fp16 [G, out]
    fp8   weight float8_e4m3fn, weight_scale_inv fp32 [out/bo, in/bi] (weight_block_size [bo, bi])
"""

from __future__ import annotations

import json
import os
import shutil

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _copy_side_files(src: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        if name not in ("model.safetensors", "config.json") and os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), out)


def _write(src: str, out: str, tensors: dict, quantization_config: dict | None) -> None:
    from safetensors.torch import save_file

    _copy_side_files(src, out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quantization_config:
        config["quantization_config"] = quantization_config
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def _linears(state: dict):
    for name in list(state):
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            yield name[: -len(".weight")], state.pop(name)


def minmax_quantize(w: torch.Tensor, bits: int, group: int, sym: bool):
    """GPTQ/AWQ-style min/max: → codes [out, in] (0 .. 2^b − 1), fp16 scales and integer zeros [out, G]."""
    maxq = (1 << bits) - 1
    out, k = w.shape
    g = w.reshape(out, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if sym:
        top = torch.maximum(lo.abs(), hi)
        scales = (2 * top / maxq).clamp(min=1e-8).half()
        zeros = torch.full_like(scales, (maxq + 1) // 2, dtype=torch.int32)
    else:
        scales = ((hi - lo) / maxq).clamp(min=1e-8).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, maxq).to(torch.int32)
    q = torch.round(g / scales.float()[..., None] + zeros[..., None]).clamp(0, maxq).to(torch.int32)
    return q.reshape(out, k), scales, zeros


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 bits → the int32 with those bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Pack `values` (int, 0 .. 2^b − 1) along `dim` into int32 words, value j of a word in bits b·j;
    `order[j]`: which of the word's values goes into slot j (AWQ), default j."""
    per = 32 // bits
    v = values.long().movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., list(order)]
    words = sum(v[..., j] << (bits * j) for j in range(per))
    return _to_int32(words).movedim(-1, dim)


def write_gptq(src: str, out: str, bits: int = 4, group: int = 32, sym: bool = True, version: str = "gptq",
               desc_act: bool = False) -> None:
    from safetensors.torch import load_file

    state = load_file(os.path.join(src, "model.safetensors"))
    tensors = {}
    for prefix, w in ((p, w.float()) for p, w in _linears(state)):
        k = w.shape[1]
        span = group if group > 0 else k  # -1: one group per output row
        q, scales, zeros = minmax_quantize(w, bits, span, sym)
        g_idx = torch.arange(k, dtype=torch.int32) // span
        if desc_act:  # act-order: inputs quantised in a permuted order, each input's group in g_idx
            g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(k))]
            scales_per_in, zeros_per_in = scales[:, g_idx.long()].float(), zeros[:, g_idx.long()]
            q = torch.round(w / scales_per_in + zeros_per_in).clamp(0, (1 << bits) - 1).to(torch.int32)
        stored = (zeros - 1) & ((1 << bits) - 1) if version == "gptq" else zeros
        tensors[prefix + ".qweight"] = _pack(q.t(), bits, 0)  # [in · b/32, out]
        tensors[prefix + ".qzeros"] = _pack(stored.t(), bits, 1)  # [G, out · b/32]
        tensors[prefix + ".scales"] = scales.t().contiguous()  # [G, out] fp16
        tensors[prefix + ".g_idx"] = g_idx
    tensors.update(state)
    _write(src, out, tensors, {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                               "desc_act": desc_act, "checkpoint_format": version})


def write_awq(src: str, out: str, group: int = 32) -> None:
    from safetensors.torch import load_file

    state = load_file(os.path.join(src, "model.safetensors"))
    tensors = {}
    for prefix, w in ((p, w.float()) for p, w in _linears(state)):
        q, scales, zeros = minmax_quantize(w, 4, group, sym=False)
        tensors[prefix + ".qweight"] = _pack(q.t(), 4, 1, AWQ_ORDER)  # [in, out/8]
        tensors[prefix + ".qzeros"] = _pack(zeros.t(), 4, 1, AWQ_ORDER)  # [G, out/8]
        tensors[prefix + ".scales"] = scales.t().contiguous()
    tensors.update(state)
    _write(src, out, tensors, {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                               "zero_point": True})


def write_fp8(src: str, out: str, block: tuple[int, int] = (32, 32)) -> None:
    from safetensors.torch import load_file

    state = load_file(os.path.join(src, "model.safetensors"))
    tensors = {}
    for prefix, w in ((p, w.float()) for p, w in _linears(state)):
        bo, bi = block
        out_f, k = w.shape
        blocks = w.reshape(out_f // bo, bo, k // bi, bi)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [out/bo, in/bi]
        q = (blocks / scale[:, None, :, None]).reshape(out_f, k).to(torch.float8_e4m3fn)
        tensors[prefix + ".weight"] = q
        tensors[prefix + ".weight_scale_inv"] = scale
    tensors.update(state)
    _write(src, out, tensors, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                               "weight_block_size": list(block)})


def write_compressed_tensors(src: str, out: str, scheme: str) -> None:
    """scheme: w4a16 (pack-quantized int4, groups of 32, symmetric), w4a16-asym, w8-channel
    (int-quantized int8 per channel), fp8-channel (float-quantized). Written by compressed_tensors."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    args, fmt = {
        "w4a16": (QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
                  "pack-quantized"),
        "w4a16-asym": (QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
                       "pack-quantized"),
        "w8-channel": (QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"), "int-quantized"),
        "fp8-channel": (QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"),
                        "float-quantized"),
    }[scheme]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    for m in model.modules():
        if not hasattr(m, "weight_scale"):
            continue
        w = m.weight.data
        if args.strategy == "group":
            g = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = g.amin(-1), g.amax(-1)
        else:
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        scale, zero = calculate_qparams(lo, hi, args)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    _copy_side_files(src, out)
    model.save_pretrained(out)
    compressor.update_config(out)
