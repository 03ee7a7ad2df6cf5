"""The CPU linear kernels chosen by measurement (engines/layers/cpu_linear.py): each kernel computes
what F.linear computes, the choice follows the measured times, every linear (the LM head too) gets
the chosen kernel, and the engine's greedy tokens stay HF generate's with each of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engines.layers import cpu_linear
from engines.layers.cpu_linear import OneDnnWeight, UpcastWeight, choose_cpu_linear, fastest
from engines.layers.linear import linear
from engines.layers.quant import Int4Weight, Int8Weight
from tests.support import drive_engine, hf_oracle, local_engine, output_tokens


def _operands(dtype, rows=5, k=64, n=96):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype),
            torch.randn(n, generator=gen).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_weight_computes_what_f_linear_does(dtype) -> None:
    x, w, b = _operands(dtype)
    packed = OneDnnWeight(w)
    assert (packed.out_features, packed.in_features, packed.packed_bytes) == (96, 64, w.numel() * w.element_size())
    want = nn.functional.linear(x, w) + b
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(linear(x, packed, b), want, **tol)
    torch.testing.assert_close(linear(x[None], packed, b)[0], want, **tol)  # [batch, rows, in] as the models call


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
        for p in self.parameters():
            p.data = torch.randn(p.shape).to(dtype)

    def forward(self, x):
        return self.lm_head(self.down(self.up(x)))


@pytest.mark.parametrize("dtype, winner", [(torch.float32, "onednn"), (torch.float32, "aten"),
                                           (torch.bfloat16, "upcast")])
def test_the_measured_fastest_kernel_replaces_every_linear(dtype, winner) -> None:
    model = _Tiny(dtype)
    x = torch.randn(3, 64).to(dtype)
    want = model(x)
    measured_rows = []

    def timer(kernel, in_features, dt, rows):
        measured_rows.append(rows)
        name = getattr(kernel, "method", "aten")
        return 1.0 if name == winner else 2.0

    [(kind, name, times, shape)] = choose_cpu_linear(model, dtype, "auto", rows=16, timer=timer)
    assert (kind, name, shape) == ("dense", winner, (128, 64))
    assert set(times) == ({"aten", "onednn", "upcast"} if dtype == torch.bfloat16 else {"aten", "onednn"})
    assert set(measured_rows) == {1, 16}
    for m in (model.up, model.down, model.lm_head):
        assert getattr(m.weight, "method", "aten") == winner
        assert isinstance(m.weight, nn.Parameter) == (winner == "aten")  # aten: the parameters stay
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.5, rtol=0.05)
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


@pytest.mark.parametrize("kernel", ["aten", "onednn"])
def test_paged_engine_greedy_equals_hf_with_each_fp32_kernel(tiny_model, kernel) -> None:
    from engines.sampling_params import SamplingParams

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
    for kernel in ("aten", "onednn", "upcast"):
        engine = local_engine(tiny_model, "paged", dtype="bf16", cpu_linear=kernel)
        outputs = drive_engine(engine, [(f"r{i}", p, SamplingParams(max_new_tokens=10, ignore_eos=True))
                                        for i, p in enumerate(prompts)])
        tokens[kernel] = [output_tokens(outputs[f"r{i}"]) for i in range(len(prompts))]
    assert tokens["onednn"] == tokens["aten"] == tokens["upcast"]
