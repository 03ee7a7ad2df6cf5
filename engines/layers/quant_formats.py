"""Decoders of pre-quantised checkpoint tensors (engines/weights/quant_checkpoint.py names the formats): one
checkpoint linear's tensors → `Decoded`, the common form every format reads as,

    W[o, i] = (q[o, i] − z[o, i // g]) · s[o, i // g]        (fp8: z = 0, q the fp8 value)

with q [out, in] the unsigned codes (uint8: 0..15 for 4 bits, 0..255 for 8; a signed int8 code c is
stored as c + 128) or the fp8 values, s and z [out, groups] float32. Packed int32 words hold their
values low bits first:  word = v0 | v1 << b | v2 << 2b | ...  (AWQ's eight nibbles hold outputs
0 2 4 6 1 3 5 7 of their block of eight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the layers import nothing above them; the loader hands the description down
    from engines.weights.quant_checkpoint import CheckpointQuant

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each nibble of an AWQ word holds, nibble 0 first


@dataclass
class Decoded:
    q: torch.Tensor  # [out, in] uint8 codes, or float8 values
    scales: torch.Tensor  # [out, groups] float32
    zeros: torch.Tensor | None  # [out, groups] float32 in code units; None: 0
    group_size: int  # inputs per group (in: one group per output row)
    bits: int

    def dequantize(self) -> torch.Tensor:
        """The float32 W [out, in]."""
        return dequantize(self.q, self.scales, self.zeros, self.group_size)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """W = (q − z) · s per group of `group_size` inputs (the last group may be short)."""
    group = torch.arange(q.shape[1], device=q.device) // group_size  # [in]
    w = q.float()
    if zeros is not None:
        w = w - zeros[:, group]
    return w * scales[:, group]


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32/bits values each along dim 0 → [R · 32/bits, C] (values 0 .. 2^bits − 1)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # [R, 32/bits, C]
    return values.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32/bits values each along dim 1 → [R, C · 32/bits]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed.unsqueeze(2) >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8)


def _per_row(scale: torch.Tensor, out: int) -> torch.Tensor:
    """A per-tensor ([] or [1]), per-channel ([out] or [out, 1]) or per-group ([out, G]) scale → [out, G]."""
    scale = scale.float()
    if scale.dim() < 2:
        scale = scale.reshape(-1, 1)
    return scale.expand(out, scale.shape[1]).contiguous() if scale.shape[0] == 1 else scale


def decode_gptq(quant: CheckpointQuant, t: dict[str, torch.Tensor], name: str) -> Decoded:
    bits = quant.bits
    q = unpack_rows(t["qweight"], bits)  # [in, out]
    k, out = q.shape
    zeros = unpack_cols(t["qzeros"], bits)[:, :out]  # [G, out]
    if quant.layout == "gptq":  # v1 stores z − 1 (AutoGPTQ's convention), wrapped to the code range
        zeros = (zeros + 1) & ((1 << bits) - 1)
    scales = t["scales"].float()  # [G, out]
    group = quant.group_size or k
    if "g_idx" in t and not torch.equal(t["g_idx"].long(), torch.arange(k) // group):
        raise ValueError(f"{name}: GPTQ g_idx is not in group order (act-order) although desc_act is false")
    return Decoded(_codes(q.t()), scales.t().contiguous(), zeros.t().float().contiguous(), group, bits)


def decode_gptq_act_order(quant: CheckpointQuant, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """desc_act: each input's group from g_idx → the float32 W [out, in] (no packed kernel takes it)."""
    bits = quant.bits
    q = unpack_rows(t["qweight"], bits).float()  # [in, out]
    zeros = unpack_cols(t["qzeros"], bits)[:, :q.shape[1]]
    if quant.layout == "gptq":
        zeros = (zeros + 1) & ((1 << bits) - 1)
    g_idx = t["g_idx"].long() if "g_idx" in t else torch.arange(q.shape[0]) // (quant.group_size or q.shape[0])
    return ((q - zeros.float()[g_idx]) * t["scales"].float()[g_idx]).t().contiguous()


def decode_awq(quant: CheckpointQuant, t: dict[str, torch.Tensor], name: str) -> Decoded:
    raw = unpack_cols(t["qweight"], 4)  # [in, out], each block of eight in AWQ's nibble order
    k, out = raw.shape
    position = (torch.arange(out) // 8) * 8 + torch.tensor(AWQ_ORDER).repeat(out // 8)  # nibble j → its output
    q = torch.empty_like(raw)
    q[:, position] = raw
    zeros = torch.empty_like(unpack_cols(t["qzeros"], 4))
    zeros[:, position] = unpack_cols(t["qzeros"], 4)
    return Decoded(_codes(q.t()), t["scales"].float().t().contiguous(), zeros.t().float().contiguous(),
                   quant.group_size or k, 4)


def decode_compressed_tensors(quant: CheckpointQuant, t: dict[str, torch.Tensor], name: str) -> Decoded:
    offset = 1 << (quant.bits - 1)  # signed codes are stored (packed) or read (int8) plus this
    if quant.layout == "pack-quantized":
        out, k = (int(v) for v in t["weight_shape"].tolist())
        q = unpack_cols(t["weight_packed"], quant.bits)[:, :k]  # already offset
    elif quant.layout == "int-quantized":
        q = t["weight"].to(torch.int32) + offset
        out, k = q.shape
    else:  # float-quantized
        return _decode_fp8(quant, t["weight"], t["weight_scale"])
    scales = _per_row(t["weight_scale"], out)
    zeros = None
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        if zp.dtype == torch.int32 and quant.layout == "pack-quantized":  # packed along the outputs
            zeros = unpack_rows(zp, quant.bits)[:out].float()
        else:
            zeros = _per_row(zp.to(torch.int32) + offset, out)
    if zeros is None:
        zeros = torch.full_like(scales, float(offset))
    return Decoded(_codes(q), scales, zeros, quant.group_size or k, quant.bits)


def _decode_fp8(quant: CheckpointQuant, weight: torch.Tensor, scale: torch.Tensor) -> Decoded:
    out, k = weight.shape
    if quant.block:  # scale [ceil(out / bo), ceil(in / bi)]: one per block → per row, per bi inputs
        bo, bi = quant.block
        return Decoded(weight, scale.float().repeat_interleave(bo, dim=0)[:out].contiguous(), None, bi, 8)
    return Decoded(weight, _per_row(scale, out), None, k, 8)


def decode_fp8(quant: CheckpointQuant, t: dict[str, torch.Tensor], name: str) -> Decoded:
    scale = t.get("weight_scale_inv", t.get("weight_scale"))  # both multiply: W = q · scale
    return _decode_fp8(quant, t["weight"], scale)


DECODERS = {"gptq": decode_gptq, "awq": decode_awq, "compressed-tensors": decode_compressed_tensors,
            "fp8": decode_fp8}


def decode(quant: CheckpointQuant, tensors: dict[str, torch.Tensor], name: str) -> Decoded:
    """One checkpoint linear (`name`: its prefix, for messages): its tensors by suffix → Decoded."""
    return DECODERS[quant.method](quant, tensors, name)
