"""The CPU fused ops (engines/kernels/cpu_ops.c): rotary embedding bit for bit torch_ops' (in place, on
views of a fused qkv row), residual add + RMSNorm torch_ops' up to the order of its sum of squares, and
the cases the C does not take handed to torch_ops."""

from __future__ import annotations

import pytest
import torch

from engines.kernels import cpu_ops, torch_ops

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="the CPU fused ops did not build here")

COS, SIN = torch_ops.rotary_tables(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), 4096)


def _qkv(rows: int, dtype, seed: int = 0):
    """q [rows, 12, 64] and k [rows, 4, 64]: views of one fused qkv output, as the attention layer splits it."""
    qkv = torch.randn(rows, 1280, generator=torch.Generator().manual_seed(seed)).to(dtype)
    q, k, _ = qkv.split([768, 256, 256], -1)
    return q.view(rows, 12, 64), k.view(rows, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 130])  # 130: spread over threads
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_rotary_is_torch_ops_bit_for_bit_in_place(dtype, rows, rot_dim) -> None:
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(rows))
    q, k = _qkv(rows, dtype)
    want_q, want_k = torch_ops.rotary_embedding(positions, q, k, COS, SIN, rot_dim=rot_dim)
    got_q, got_k = cpu_ops.rotary_embedding(positions.int(), q, k, COS, SIN, rot_dim=rot_dim)  # int32 positions too
    assert got_q is q and got_k is k  # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9, 100])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_is_torch_ops_up_to_its_sum_order(dtype, rows, with_residual) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 768, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, 768, generator=gen).to(dtype) if with_residual else None
    weight = (torch.rand(768, generator=gen) + 0.5).to(dtype)
    want_y, want_r = torch_ops.add_rms_norm(x, residual, weight, 1e-5)
    got_y, got_r = cpu_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert got_y.dtype == dtype and got_y.shape == x.shape
    assert torch.equal(got_r, want_r) and (got_r is x) == (residual is None)  # the sum is exact: one rounding
    if dtype == torch.float32:
        torch.testing.assert_close(got_y, want_y, atol=0, rtol=4e-6)
    else:  # a last-bit change in the float32 mean may move a bf16 rounding by one step, rarely
        steps = (got_y.float() - want_y.float()).abs() / want_y.float().abs().clamp(min=1e-30)
        assert (steps <= 2 ** -7).all() and (got_y != want_y).float().mean() < 0.01


def test_a_float32_norm_weight_with_bf16_activations_multiplies_as_torch_does() -> None:
    x = torch.randn(3, 64).to(torch.bfloat16)
    weight = torch.rand(64) + 0.5
    want, _ = torch_ops.add_rms_norm(x, None, weight, 1e-6)
    got, _ = cpu_ops.add_rms_norm(x, None, weight, 1e-6)
    assert got.dtype == want.dtype == torch.bfloat16  # the float32 product, rounded to bf16
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)


def test_what_the_c_does_not_take_runs_in_torch_ops() -> None:
    x, weight = torch.randn(3, 64), torch.rand(64)
    for args, kwargs in (((x, None, weight, 1e-6), {"gemma": True}), ((x.half(), None, weight.half(), 1e-6), {})):
        want, got = torch_ops.add_rms_norm(*args, **kwargs), cpu_ops.add_rms_norm(*args, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    q, k = _qkv(4, torch.float32)
    positions = torch.arange(4)
    want = torch_ops.rotary_embedding(positions, q, k, COS, SIN, interleaved=True)
    got = cpu_ops.rotary_embedding(positions, q, k, COS, SIN, interleaved=True)
    assert got[0] is not q and all(torch.equal(a, b) for a, b in zip(got, want))  # new tensors: torch_ops'


def test_the_cpu_selects_the_c_kernels_for_the_model_it_loads(tiny_model) -> None:
    from engines.layers.fused import describe, fused_ops_of, is_triton, select
    from tests.support import local_engine

    assert select("cpu", triton=False) is cpu_ops and not is_triton(cpu_ops)
    assert describe(cpu_ops).startswith("C kernels for the norm and rotary")
    engine = local_engine(tiny_model, "paged")
    assert fused_ops_of(engine.runner.model) is cpu_ops
