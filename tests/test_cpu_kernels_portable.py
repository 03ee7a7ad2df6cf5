"""The C kernels' loops without AVX-512 (what an AVX2-only host runs): each kernel built for x86-64-v3
(AVX2 + FMA, no AVX-512, no VNNI, no AVX512-BF16) computes what the native build computes here —
the int8 and W4A8 sums exactly, the float ones up to their order."""

from __future__ import annotations

import platform

import pytest
import torch

from engines.kernels import cpu_attention, cpu_gemm, cpu_ops, cpu_qlinear, torch_ops
from engines.layers.quant import Int8DynamicWeight, int4_quantize

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or cpu_attention.compiler() is None,
                                reason="x86 with a C compiler only")

AVX2 = ("-march=x86-64-v3",)  # after -march=native: the last -march wins


def _avx2(module, extra=()):
    return module.bind(cpu_attention.cached_build(module.SOURCE, "test build (AVX2)", extra + AVX2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_and_w4a8_kernels_without_vnni(dtype) -> None:
    lib = _avx2(cpu_qlinear)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 200, generator=gen) * 0.05
    x = (torch.randn(6, 200, generator=gen) * 3).to(dtype)
    weight = Int8DynamicWeight(w, per_row=True)
    for rows in (1, 6):
        assert torch.equal(cpu_qlinear.linear(x[:rows], weight._rows, weight._scales, lib=lib), weight(x[:rows]))
    q, scales, zeros = int4_quantize(w[:, :192], 32, dtype)
    packed = cpu_qlinear.pack_int4(q, scales, zeros)
    for rows in (1, 6):
        want = cpu_qlinear.w4a8_reference(x[:rows, :192], q, scales, zeros)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
        torch.testing.assert_close(cpu_qlinear.w4a8(x[:rows, :192], packed, lib=lib).float(), want, **tol)


def test_dense_kernel_with_avx2_only() -> None:
    """float32 runs its AVX2 + FMA loops (tiles of 2 rows); bf16 has none there: the call says so."""
    lib = _avx2(cpu_gemm)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(37, 100, generator=gen)
    x = torch.randn(5, 100, generator=gen)
    packed = cpu_gemm.pack(w, lib=lib)
    for rows in (1, 2, 5):
        torch.testing.assert_close(cpu_gemm.gemm_packed(x[:rows], packed, 37, lib=lib).double(),
                                   x[:rows].double() @ w.double().t(), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="packed torch.bfloat16 kernel was built without its vector instructions"):
        cpu_gemm.gemm_packed(x.bfloat16(), cpu_gemm.pack(w.bfloat16(), lib=lib), 37, lib=lib)


def test_fused_ops_without_avx512(monkeypatch) -> None:
    lib = _avx2(cpu_ops, ("-ffp-contract=off",))
    monkeypatch.setattr(cpu_ops, "load", lambda: lib)
    cos, sin = torch_ops.rotary_tables(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), 512)
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(20, 1024, generator=gen).to(dtype)
        q, k = qkv[:, :768].view(20, 12, 64), qkv[:, 768:].view(20, 4, 64)
        positions = torch.randint(0, 512, (20,), generator=gen)
        want = torch_ops.rotary_embedding(positions, q, k, cos, sin)
        got = cpu_ops.rotary_embedding(positions, q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        x, res = torch.randn(20, 768, generator=gen).to(dtype), torch.randn(20, 768, generator=gen).to(dtype)
        weight = (torch.rand(768, generator=gen) + 0.5).to(dtype)
        (want_y, want_r), (got_y, got_r) = torch_ops.add_rms_norm(x, res, weight, 1e-5), cpu_ops.add_rms_norm(x, res, weight, 1e-5)
        assert torch.equal(got_r, want_r)
        torch.testing.assert_close(got_y, want_y, atol=0, rtol=4e-6 if dtype == torch.float32 else 2 ** -7)
