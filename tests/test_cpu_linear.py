"""The CPU linear kernels chosen by measurement (engines/layers/cpu_linear.py): each kernel computes
what F.linear computes, the choice follows the measured times, every linear (the LM head too) gets
the chosen kernel, and the engine's greedy tokens stay HF generate's with each of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engines.kernels import cpu_gemm
from engines.layers import cpu_linear
from engines.layers.cpu_linear import GemmWeight, OneDnnWeight, UpcastWeight, choose_cpu_linear, fastest, onednn_packs
from engines.layers.linear import linear
from engines.layers.quant import Int4Weight, Int8Weight
from tests.support import drive_engine, hf_oracle, local_engine, output_tokens


def _operands(dtype, rows=5, k=64, n=96):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype),
            torch.randn(n, generator=gen).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_weight_computes_what_f_linear_does(dtype) -> None:
    if not onednn_packs(dtype):
        pytest.skip(f"oneDNN does not reorder {dtype} weights on this CPU (no AVX512 BW/VL/DQ nor AVX-NE-CONVERT)")
    x, w, b = _operands(dtype)
    packed = OneDnnWeight(w)
    assert (packed.out_features, packed.in_features, packed.packed_bytes) == (96, 64, w.numel() * w.element_size())
    want = nn.functional.linear(x, w) + b
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(linear(x, packed, b), want, **tol)
    torch.testing.assert_close(linear(x[None], packed, b)[0], want, **tol)  # [batch, rows, in] as the models call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (37, 100), (5, 33)])
def test_our_dense_kernel_computes_what_f_linear_does(dtype, out_features, in_features) -> None:
    if not cpu_gemm.vectorised_here(dtype):
        pytest.skip(f"our dense kernel has no {dtype} loops on this CPU")
    gen = torch.Generator().manual_seed(in_features)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    kernel = GemmWeight(w)
    assert kernel.packed_bytes == kernel.packed.numel() * kernel.packed.element_size() >= w.numel() * w.element_size()
    x = torch.randn(19, in_features, generator=gen).to(dtype)
    for rows in (1, 3, 8, 9, 19):  # a lone row, whole 8-row tiles, remainders; 5 and 37 columns: a part block
        want = x[:rows].double() @ w.double().t()
        got = linear(x[:rows], kernel)
        assert got.dtype == dtype
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=8e-3)  # bf16: its rounding
        torch.testing.assert_close(got.double(), want, **tol)
    assert torch.equal(linear(x[None, :3], kernel)[0], linear(x[:3], kernel))  # [batch, rows, in] as the models call


def test_upcast_weight_is_the_float32_product_rounded_to_bf16() -> None:
    x, w, _ = _operands(torch.bfloat16)
    y = linear(x, UpcastWeight(w))
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, nn.functional.linear(x.float(), w.float()).to(torch.bfloat16))


@pytest.mark.parametrize("cls", [Int8Weight, Int4Weight])
def test_quantised_weights_computing_in_bf16_share_their_values(cls) -> None:
    x, w, _ = _operands(torch.float32, k=128, n=64)
    native = cls(w)
    in_bf16 = native.compute_in(torch.bfloat16)
    assert native.compute_in(torch.float32) is native
    scales = "scales" if cls is Int8Weight else "scales_zeros"
    assert getattr(native, scales).dtype == torch.float32 and getattr(in_bf16, scales).dtype == torch.bfloat16
    packed = "qweight" if cls is Int8Weight else "packed"
    assert getattr(in_bf16, packed) is getattr(native, packed)  # the values are shared, not copied
    y = in_bf16(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, native(x), atol=0.15, rtol=0.03)  # bf16 activations: rounding only


def test_fastest_weighs_one_row_and_a_batch_alike() -> None:
    # a: best at 1 row, 3x worse at the batch; b: 1.5x worse at 1 row, best at the batch
    assert fastest({"a": (1.0, 30.0), "b": (1.5, 10.0)}) == "b"
    assert fastest({"a": (1.0, 12.0), "b": (1.5, 10.0)}) == "a"


class _Tiny(nn.Module):
    """Two linears and an LM head, as the model code lays them out."""

    def __init__(self, dtype):
        from engines.dist import SingleProcess
        from engines.layers.embedding import ParallelLMHead
        from engines.layers.linear import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        comm = SingleProcess()
        self.up = ColumnParallelLinear(64, [128], comm)
        self.down = RowParallelLinear(128, 64, comm)
        self.lm_head = ParallelLMHead(32, 64, comm)
        gen = torch.Generator().manual_seed(0)  # the same weights every run
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen).to(dtype)

    def forward(self, x):
        return self.lm_head(self.down(self.up(x)))


@pytest.mark.parametrize("dtype, winner", [(torch.float32, "onednn"), (torch.float32, "aten"),
                                           (torch.bfloat16, "upcast"), (torch.bfloat16, "lmi")])
def test_the_measured_fastest_kernel_replaces_every_linear(dtype, winner) -> None:
    model = _Tiny(dtype)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = model(x)
    measured_rows = []

    def timer(kernel, in_features, dt, rows):
        measured_rows.append(rows)
        name = getattr(kernel, "method", "aten")
        return 1.0 if name == winner else 2.0

    ours = {"lmi"} if cpu_gemm.vectorised_here(dtype) else set()  # our kernel: where its vector loops run
    onednn = {"onednn"} if onednn_packs(dtype) else set()
    if winner not in ours | onednn | {"aten", "upcast"}:
        pytest.skip(f"no {winner} kernel for {dtype} on this CPU")
    [(kind, name, times, shape)] = choose_cpu_linear(model, dtype, "auto", rows=16, timer=timer)
    assert (kind, name, shape) == ("dense", winner, (128, 64))
    assert set(times) == {"aten"} | onednn | ours | ({"upcast"} if dtype == torch.bfloat16 else set())
    assert set(measured_rows) == {1, 16}
    for m in (model.up, model.down, model.lm_head):
        assert getattr(m.weight, "method", "aten") == winner
        assert isinstance(m.weight, nn.Parameter) == (winner == "aten")  # aten: the parameters stay
    scale = want.abs().max().item()  # outputs in the hundreds: float32 sums summed in another order
    tol = dict(atol=1e-6 * scale, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.5, rtol=0.05)
    torch.testing.assert_close(model(x), want, **tol)
    assert "CPU linear kernel for dense weights: " + winner in cpu_linear.describe(kind, name, times, shape)


def test_a_named_kernel_is_used_without_measuring_and_a_wrong_one_refused() -> None:
    model = _Tiny(torch.float32)
    [(_, name, times, _)] = choose_cpu_linear(model, torch.float32, "onednn", timer=pytest.fail)
    assert (name, times) == ("onednn", {}) and model.up.weight.method == "onednn"
    with pytest.raises(ValueError, match="option.cpu_linear=upcast cannot multiply torch.float32 weights"):
        choose_cpu_linear(_Tiny(torch.float32), torch.float32, "upcast")


def test_quantised_linears_and_the_dense_lm_head_are_chosen_apart() -> None:
    from engines.layers.quant import quantize_linears

    model = _Tiny(torch.float32)
    quantize_linears(model, "int8")
    chosen = choose_cpu_linear(model, torch.float32, "auto",
                               timer=lambda k, i, d, r: 1.0 if getattr(k, "scales", None) is not None
                               and k.scales.dtype == torch.bfloat16 or getattr(k, "method", "") == "onednn" else 2.0)
    assert [(kind, name) for kind, name, _, _ in chosen] == [("int8", "bf16"), ("dense", "onednn")]
    assert model.up.weight.scales.dtype == torch.bfloat16 and model.lm_head.weight.method == "onednn"


@pytest.mark.parametrize("kernel", ["aten", "onednn", "lmi"])
def test_paged_engine_greedy_equals_hf_with_each_fp32_kernel(tiny_model, kernel) -> None:
    from engines.sampling_params import SamplingParams

    if kernel == "lmi" and not cpu_gemm.vectorised_here(torch.float32):
        pytest.skip("our dense kernel is no candidate on this CPU (no AVX2 + FMA)")
    oracle = hf_oracle(tiny_model)
    engine = local_engine(tiny_model, "paged", cpu_linear=kernel)
    assert engine.runner.model.layers[0].mlp.down_proj.weight is not None
    assert getattr(engine.runner.model.layers[0].mlp.down_proj.weight, "method", "aten") == kernel
    prompts = [[5, 17, 42, 8, 99], [7, 300, 12], list(range(20, 44))]
    outputs = drive_engine(engine, [(f"r{i}", p, SamplingParams(max_new_tokens=10, ignore_eos=True))
                                    for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        want = oracle(p, 10)
        assert output_tokens(outputs[f"r{i}"])[:len(want)] == want


def test_paged_engine_bf16_tokens_are_the_same_with_each_kernel(tiny_model) -> None:
    from engines.sampling_params import SamplingParams

    prompts = [[5, 17, 42, 8, 99], [7, 300, 12], list(range(20, 44))]
    tokens = {}
    kernels = ("aten", "upcast") + (("onednn",) if onednn_packs(torch.bfloat16) else ()) + \
        (("lmi",) if cpu_gemm.vectorised_here(torch.bfloat16) else ())
    for kernel in kernels:
        engine = local_engine(tiny_model, "paged", dtype="bf16", cpu_linear=kernel)
        outputs = drive_engine(engine, [(f"r{i}", p, SamplingParams(max_new_tokens=10, ignore_eos=True))
                                        for i, p in enumerate(prompts)])
        tokens[kernel] = [output_tokens(outputs[f"r{i}"]) for i in range(len(prompts))]
    assert all(tokens[k] == tokens["aten"] for k in kernels)


# int8_dynamic: cpu_qlinear's kernel against torch._int_mm's path (the same arithmetic, so the same bits)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features, in_features", [(96, 128), (37, 100), (8, 3072)])
def test_int8_kernel_gives_the_int_mm_paths_bits(dtype, out_features, in_features) -> None:
    from engines.kernels import cpu_qlinear
    from engines.layers.quant import Int8DynamicWeight

    assert cpu_qlinear.load() is not None, "the int8 kernel did not build here"
    gen = torch.Generator().manual_seed(out_features)
    torch_path = Int8DynamicWeight(torch.randn(out_features, in_features, generator=gen) * 0.05, per_row=True)
    kernel = torch_path.with_kernel(64)
    assert kernel._rows is torch_path._rows and torch_path.kernel_rows == 0  # shared rows, the original as it was
    x = torch.randn(17, in_features, generator=gen) * 3
    x[2] = 0.0  # a zero row (the smallest step)
    x[5, 7] = 1e4  # an outlier: its row's step only
    x = x.to(dtype)
    for rows in (1, 3, 4, 5, 17):  # every tile shape: whole 4 x 4 tiles, a lone row, remainders
        want = torch_path(x[:rows])
        got = kernel(x[:rows])
        assert got.dtype == dtype and torch.equal(got, want), rows
    assert torch.equal(kernel(x[None, :4])[0], torch_path(x[:4]))  # [batch, rows, in] as the models call


def test_int8_kernel_takes_the_calls_of_the_row_counts_it_won_at() -> None:
    from engines.layers.quant import quantize_linears

    model = _Tiny(torch.float32)
    quantize_linears(model, "int8_dynamic")
    if not cpu_linear.int8_kernel_runs(model.up.weight, torch.float32):
        pytest.skip("int8_dynamic takes per-tensor activation scales on this CPU (no VNNI): no kernel to choose")
    x = torch.randn(3, 64)
    want = model(x)
    rows_timed = []

    def timer(kernel, in_features, dtype, rows):  # the kernel wins up to 8 rows, then at 32 again
        if getattr(kernel, "kernel_rows", 0):
            rows_timed.append(rows)
            return {1: 1.0, 4: 1.0, 8: 1.0, 16: 3.0, 32: 1.0}[rows]
        return 2.0  # int_mm (and the dense LM head's kernels)

    chosen = choose_cpu_linear(model, torch.float32, "auto", timer=timer)
    [(kind, name, times, shape)] = [c for c in chosen if c[0] == "int8_dynamic"]
    assert (name, shape) == ("lmi up to 8 rows, int_mm above", (128, 64)) and sorted(set(rows_timed)) == [1, 4, 8, 16, 32]
    assert times["int_mm"] == (2.0,) * 5
    assert model.up.weight.kernel_rows == model.down.weight.kernel_rows == 8
    assert torch.equal(model(x), want)
    line = cpu_linear.describe(kind, name, times, shape)
    assert "int8_dynamic weights: lmi up to 8 rows, int_mm above (measured on a [1 | 4 | 8 | 16 | 32, 64]" in line
    assert "lmi 1000.000 / 1000.000 / 1000.000 / 3000.000 / 1000.000 ms" in line

    model = _Tiny(torch.float32)  # a kernel slower at one row is not used at all
    quantize_linears(model, "int8_dynamic")
    chosen = choose_cpu_linear(model, torch.float32, "auto", timer=lambda k, i, d, r: 3.0 if getattr(k, "kernel_rows", 0) else 2.0)
    assert [c[1] for c in chosen if c[0] == "int8_dynamic"] == ["int_mm"] and model.up.weight.kernel_rows == 0


def test_paged_engine_int8_dynamic_tokens_are_the_same_with_the_kernel_and_without(tiny_model) -> None:
    from engines.layers.quant import Int8DynamicWeight
    from engines.sampling_params import SamplingParams

    engine = local_engine(tiny_model, "paged", quantize="int8_dynamic", cpu_linear="aten")  # named: int_mm only
    weights = [m for m in engine.runner.model.modules() if isinstance(getattr(m, "weight", None), Int8DynamicWeight)]
    if not weights[0].weight.per_row:
        pytest.skip("int8_dynamic takes per-tensor activation scales on this CPU (no VNNI): no kernel to choose")
    assert all(m.weight.kernel_rows == 0 for m in weights)
    prompts = [[5, 17, 42, 8, 99], [7, 300, 12], list(range(20, 44))]
    tokens = []
    for max_rows in (0, 64):  # int_mm for every call, then the kernel for every call (prefill included)
        for m in weights:
            m.weight = m.weight.with_kernel(max_rows)
        outputs = drive_engine(engine, [(f"{max_rows}-{i}", p, SamplingParams(max_new_tokens=10, ignore_eos=True))
                                        for i, p in enumerate(prompts)])
        tokens.append([output_tokens(outputs[f"{max_rows}-{i}"]) for i in range(len(prompts))])
    assert tokens[0] == tokens[1] and all(len(t) == 10 for t in tokens[0])


# int4: cpu_qlinear's W4A8 kernel (int8 activations per row x int4 groups), measured against PyTorch's

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features, in_features", [(96, 256), (37, 96), (8, 160)])
def test_w4a8_kernel_computes_its_reference_arithmetic(dtype, out_features, in_features) -> None:
    from engines.kernels import cpu_qlinear
    from engines.layers.quant import int4_dequantize, int4_quantize

    assert cpu_qlinear.load() is not None, "the int8 kernels did not build here"
    gen = torch.Generator().manual_seed(in_features)
    q, scales, zeros = int4_quantize(torch.randn(out_features, in_features, generator=gen) * 0.05, 32, dtype)
    packed = cpu_qlinear.pack_int4(q, scales, zeros)
    x = torch.randn(17, in_features, generator=gen) * 3
    x[2] = 0.0
    x[5, 7] = 1e4
    x = x.to(dtype)
    for rows in (1, 3, 4, 5, 17):  # a lone row, whole tiles of 4, remainders
        got = cpu_qlinear.w4a8(x[:rows], packed)
        assert got.dtype == dtype
        want = cpu_qlinear.w4a8_reference(x[:rows], q, scales, zeros)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)  # bf16: its rounding
        torch.testing.assert_close(got.float(), want, **tol)
    # and it is the int4 weight's product, up to the activations' 8 bits (the outlier row aside)
    rows = [0, 1, 3, 4]
    exact = x[rows].float() @ int4_dequantize(q, scales, zeros, 32).t()
    err = (cpu_qlinear.w4a8(x[rows], packed).float() - exact).abs().max() / exact.abs().max()
    assert err < 0.03


@pytest.mark.parametrize("winner", ["w4a8", "native"])
def test_int4_takes_the_measured_kernel_and_drops_the_other_layout(winner) -> None:
    from engines.layers.quant import Int4A8Weight, quantize_linears

    from engines.kernels import cpu_qlinear

    if not cpu_qlinear.vnni_here():
        pytest.skip("the W4A8 kernel is a candidate on CPUs with AVX-512 VNNI only")
    model = _Tiny(torch.float32)
    quantize_linears(model, "int4")
    assert model.up.weight.w4a8 is not None  # both layouts until the choice
    assert "w4a8" in {c.name for c in cpu_linear.candidates(model.up.weight, torch.float32)}
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    before = model(x)
    chosen = choose_cpu_linear(model, torch.float32, "auto",
                               timer=lambda k, i, d, r: 1.0 if getattr(k, "activations", "") == "int8 per token"
                               and winner == "w4a8" or winner == "native" and isinstance(k, type(model.up.weight))
                               and k.scales_zeros.dtype == torch.float32 else 2.0)
    assert [name for kind, name, _, _ in chosen if kind == "int4"] == [winner]
    for m in (model.up, model.down):
        assert isinstance(m.weight, Int4A8Weight) == (winner == "w4a8")
        assert winner == "w4a8" or m.weight.w4a8 is None  # PyTorch's kernel: the W4A8 layout is gone
    torch.testing.assert_close(model(x), before, atol=0.05 * before.abs().max().item(), rtol=0.05)
