"""engines/kernels/fused_ops against their PyTorch twins (engines/kernels/torch_ops) (under Triton's interpreter without a GPU).

Tolerances: float32 2e-6 (summation order, rsqrt/exp implementations; gelu_tanh atol 2e-5: the
reference's 1 + tanh(u) cancels for negative gates, so an ulp of tanh moves the output by about
3e-8 * |gate * up|, which is up to ~1e-5 at the scales used); bf16/fp16 two rounding steps of
the dtype (a rounding of an intermediate that lands the other side of a tie moves the result by about
one step). Beyond tolerances, half-precision outputs must equal the reference bit for bit almost
everywhere (where not tiny): that checks the kernels round where the reference rounds.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engines.kernels import fused_ops as ops
from engines.kernels import torch_ops as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (2e-6, 2e-6), torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (1e-3, 2e-3)}  # atol, rtol
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, scope="module")
def gpu_bf16_rounding():
    """Triton's interpreter truncates float32 → bfloat16 where the GPU (cvt.rn.bf16.f32) and torch round
    to nearest even; make the interpreter round like the GPU so the tests check the GPU's numerics."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(data, src, dst, rounding_mode)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_convert_float", convert)
        yield


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, *, atol: float | None = None) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    default_atol, rtol = TOL[ref.dtype]
    atol = default_atol if atol is None else atol
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    significant = ref.abs() >= 0.05  # gelu's far tail is float32 noise in the reference itself
    if ref.dtype != torch.float32 and significant.sum() >= 64:
        same = (out == ref)[significant].float().mean().item()
        assert same >= 0.99, f"rounding differs from the reference's ({same:.3f} equal)"


# --------------------------------------------------------------------------------------------------
# add_rms_norm
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("hidden", [64, 80, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, rows, hidden, with_residual):
    x = randn(rows, hidden, dtype=dtype, seed=1, scale=3.0)
    residual = randn(rows, hidden, dtype=dtype, seed=2, scale=3.0) if with_residual else None
    weight = randn(hidden, dtype=dtype, seed=3)
    inputs = [t.clone() for t in (x, residual, weight) if t is not None]
    y, r = ops.add_rms_norm(x, residual, weight, 1e-6)
    ref_y, ref_r = ref.add_rms_norm(x, residual, weight, 1e-6)
    assert_matches(y, ref_y)
    assert torch.equal(r, ref_r)
    if residual is None:
        assert r is x
    for before, after in zip(inputs, [t for t in (x, residual, weight) if t is not None]):
        assert torch.equal(before, after)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [80, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_gemma(dtype, hidden, with_residual):
    x = randn(3, hidden, dtype=dtype, seed=4, scale=3.0)
    residual = randn(3, hidden, dtype=dtype, seed=5) if with_residual else None
    weight = randn(hidden, dtype=dtype, seed=6, scale=0.3)
    y, r = ops.add_rms_norm(x, residual, weight, 1e-6, gemma=True)
    ref_y, ref_r = ref.add_rms_norm(x, residual, weight, 1e-6, gemma=True)
    assert_matches(y, ref_y)
    assert torch.equal(r, ref_r)


def test_add_rms_norm_strided_and_batched():
    """Leading dims are flattened; rows may be strided (a column slice of a wider tensor)."""
    wide = randn(2, 3, 96, dtype=torch.bfloat16, seed=7)
    x = wide[..., :80]
    residual = randn(2, 3, 80, dtype=torch.bfloat16, seed=8)
    weight = randn(80, dtype=torch.bfloat16, seed=9)
    y, r = ops.add_rms_norm(x, residual, weight, 1e-5)
    ref_y, ref_r = ref.add_rms_norm(x, residual, weight, 1e-5)
    assert_matches(y, ref_y)
    assert torch.equal(r, ref_r)


def test_add_rms_norm_float32_weight():
    """A float32 weight with bf16 activations: the product is rounded once, to x.dtype."""
    x, weight = randn(3, 80, dtype=torch.bfloat16, seed=13), randn(80, dtype=torch.float32, seed=14)
    y, _ = ops.add_rms_norm(x, None, weight, 1e-6)
    assert_matches(y, ref.add_rms_norm(x, None, weight, 1e-6)[0])


def test_add_rms_norm_float16():
    x, residual = randn(3, 80, dtype=torch.float16, seed=10), randn(3, 80, dtype=torch.float16, seed=11)
    weight = randn(80, dtype=torch.float16, seed=12)
    y, r = ops.add_rms_norm(x, residual, weight, 1e-6)
    ref_y, ref_r = ref.add_rms_norm(x, residual, weight, 1e-6)
    assert_matches(y, ref_y)
    assert torch.equal(r, ref_r)


# --------------------------------------------------------------------------------------------------
# rotary_embedding
# --------------------------------------------------------------------------------------------------

MAX_POSITIONS = 97


def rotary_case(rows: int, q_heads: int, k_heads: int, head_dim: int, rot_dim: int, dtype: torch.dtype,
                interleaved: bool, seed: int):
    """A fused qkv tensor, q and k views split from it, positions out of order and repeated, tables."""
    qkv = randn(rows, (q_heads + 2 * k_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, _ = qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
    q, k = q.view(rows, q_heads, head_dim), k.view(rows, k_heads, head_dim)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, MAX_POSITIONS, (rows,), generator=g)
    positions[rows // 2:] = positions[:rows - rows // 2].flip(0)  # repeats, descending runs
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    cos, sin = ref.rotary_tables(inv_freq, MAX_POSITIONS, interleaved=interleaved)
    return qkv, q, k, positions.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("head_dim", [16, 64, 80])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding(dtype, rows, head_dim, partial, interleaved):
    check_rotary(dtype, rows, head_dim, partial, interleaved)


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_many_rows(partial, interleaved):
    check_rotary(torch.bfloat16, 64, 80, partial, interleaved)


def check_rotary(dtype, rows, head_dim, partial, interleaved):
    rot_dim = head_dim // 4 if partial else head_dim
    qkv, q, k, positions, cos, sin = rotary_case(rows, 4, 2, head_dim, rot_dim, dtype, interleaved, seed=rows)
    ref_q, ref_k = ref.rotary_embedding(positions, q, k, cos, sin, interleaved=interleaved)
    v_before, others = qkv[:, 6 * head_dim:].clone(), [t.clone() for t in (positions, cos, sin)]
    out_q, out_k = ops.rotary_embedding(positions, q, k, cos, sin, interleaved=interleaved)
    assert out_q is q and out_k is k  # in place
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    assert torch.equal(q[..., rot_dim:], ref_q[..., rot_dim:])  # pass-through dims untouched
    assert torch.equal(qkv[:, 6 * head_dim:], v_before)
    for before, after in zip(others, (positions, cos, sin)):
        assert torch.equal(before, after)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_contiguous_int32_rot_dim_argument(interleaved):
    """Separate contiguous q/k, strided int32 positions, tables wider than rot_dim (only rot_dim columns
    used)."""
    _, q, k, positions, cos, sin = rotary_case(5, 3, 1, 32, 32, torch.float32, interleaved, seed=20)
    q, k, positions = q.contiguous(), k.contiguous(), positions.to(torch.int32)
    positions = torch.stack([positions, positions + 1], dim=-1)[:, 0]
    assert positions.stride(0) == 2
    ref_q, ref_k = ref.rotary_embedding(positions, q, k, cos, sin, rot_dim=16,
                                                  interleaved=interleaved)
    ops.rotary_embedding(positions, q, k, cos, sin, rot_dim=16, interleaved=interleaved)
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)


def test_rotary_embedding_float16():
    _, q, k, positions, cos, sin = rotary_case(3, 4, 2, 64, 64, torch.float16, False, seed=21)
    ref_q, ref_k = ref.rotary_embedding(positions, q, k, cos, sin)
    ops.rotary_embedding(positions, q, k, cos, sin)
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)


def test_rotary_embedding_rejects_bad_rot_dim():
    _, q, k, positions, cos, sin = rotary_case(2, 2, 2, 16, 16, torch.float32, False, seed=22)
    with pytest.raises(ValueError):
        ops.rotary_embedding(positions, q, k, cos, sin, rot_dim=15)


# --------------------------------------------------------------------------------------------------
# silu_and_mul / gelu_tanh_and_mul
# --------------------------------------------------------------------------------------------------

ACTIVATIONS = [(ops.silu_and_mul, ref.silu_and_mul),
               (ops.gelu_tanh_and_mul, ref.gelu_tanh_and_mul)]


def act_atol(fn, dtype: torch.dtype) -> float | None:
    return 2e-5 if fn is ops.gelu_tanh_and_mul and dtype == torch.float32 else None


@pytest.mark.parametrize("fn, reference", ACTIVATIONS, ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("inter", [64, 100, 11008 // 8])
def test_act_and_mul(fn, reference, dtype, rows, inter):
    x = randn(rows, 2 * inter, dtype=dtype, seed=inter + rows, scale=3.0)
    before = x.clone()
    out = fn(x)
    assert_matches(out, reference(x), atol=act_atol(fn, dtype))
    assert torch.equal(x, before)


@pytest.mark.parametrize("fn, reference", ACTIVATIONS, ids=["silu", "gelu_tanh"])
def test_act_and_mul_batched_strided_float16(fn, reference):
    wide = randn(2, 3, 2 * 100 + 8, dtype=torch.float16, seed=30, scale=3.0)
    x = wide[..., :200]
    assert_matches(fn(x), reference(x))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy under the interpreter
@pytest.mark.parametrize("fn, reference", ACTIVATIONS, ids=["silu", "gelu_tanh"])
def test_act_and_mul_extremes(fn, reference):
    """Large magnitudes (exp overflow/underflow inside the activation) stay finite and match."""
    gate = torch.tensor([-100.0, -30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0, 100.0], device=DEVICE)
    x = torch.cat([gate, torch.full_like(gate, 2.0)])[None]
    assert_matches(fn(x), reference(x), atol=act_atol(fn, torch.float32))


def test_empty_inputs():
    x = torch.empty(0, 64, device=DEVICE)
    y, r = ops.add_rms_norm(x, None, torch.ones(64, device=DEVICE), 1e-6)
    assert y.shape == (0, 64) and r is x
    assert ops.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    q, k = torch.empty(0, 2, 16, device=DEVICE), torch.empty(0, 1, 16, device=DEVICE)
    cos = sin = torch.ones(4, 16, device=DEVICE)
    assert ops.rotary_embedding(torch.empty(0, dtype=torch.long, device=DEVICE), q, k, cos, sin)[0] is q
