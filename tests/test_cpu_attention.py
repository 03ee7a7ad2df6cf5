"""The CPU decode kernel (engines/kernels/cpu_attention.c) against its torch twin (decode_attention):
float32 and bf16, head dims with constant-length loops (64, 128) and without (80), MHA and GQA
groups of 1 to 8, sliding windows and softcaps, strided q and block tables, rows of every length
(one token, part of a block, exact blocks); the backend that carries it over mixed steps; how auto
chooses it; the build cache (processes building at once, no compiler); and the paged engine with it
gives HF `generate`'s greedy tokens."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engines.attention.step import LayerOptions
from engines.attention.registry import select_backend
from engines.attention.cpu_backend import CpuPagedBackend
from engines.attention.torch_backend import TorchPagedBackend, decode_attention
from engines.kernels import cpu_attention
from engines.sampling_params import SamplingParams
from tests.support import compare_backends_over_mixed_steps, drive_engine, output_tokens, paged_engine

CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _case(dtype, dim, hkv, group, block_size=16, rows=6, width=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = rows * width + 4
    k_cache = torch.randn(hkv, num_blocks, block_size, dim, generator=gen).to(dtype)
    v_cache = torch.randn(hkv, num_blocks, block_size, dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: rows * width].view(rows, width)
    table = torch.cat([table, table], 1)[:, :width]  # a strided view, as a step's [:, :width] slice
    # one token, part of a block, exactly one block, a full table, and two at random
    lens = torch.tensor([1, 5, block_size, width * block_size] + torch.randint(1, width * block_size + 1, (rows - 4,),
                                                                              generator=gen).tolist())
    q = torch.randn(rows, 2 * hkv * group, dim, generator=gen).to(dtype)[:, ::2]  # head stride 2 * dim
    return q, k_cache, v_cache, table, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dim", [64, 128, 80])
@pytest.mark.parametrize("hkv, group", [(4, 1), (4, 3), (2, 4), (1, 8)])
@pytest.mark.parametrize("opts", [LayerOptions(0.125), LayerOptions(0.3, window=20), LayerOptions(0.1, softcap=5.0)],
                         ids=["plain", "window", "softcap"])
def test_the_kernel_matches_its_torch_twin(dtype, dim, hkv, group, opts):
    q, k_cache, v_cache, table, lens = _case(dtype, dim, hkv, group)
    got = cpu_attention.paged_decode(q, k_cache, v_cache, table, lens, opts)
    assert got.dtype == dtype and got.shape == q.shape
    # the twin in float32 on the same (bf16-rounded) inputs: the kernel accumulates in float32, so its
    # bf16 output is within one bf16 rounding of the exact value
    want = decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, opts)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-3, 2 ** -8)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@pytest.fixture(scope="module")
def portable_build(tmp_path_factory):
    """The kernel built without AVX512-BF16 (the widening path every CPU runs), when this CPU has it
    and the default build takes the vdpbf16ps path instead."""
    if "avx512_bf16" not in cpu_attention.cpu_flags():
        pytest.skip("this CPU has no AVX512-BF16: the default build is the portable one")
    target = tmp_path_factory.mktemp("kernel") / "portable.so"
    cpu_attention.build(cpu_attention.compiler(), target, ("-mno-avx512bf16",))
    return cpu_attention.bind(target)


@pytest.mark.parametrize("dim", [64, 128, 80])
@pytest.mark.parametrize("opts", [LayerOptions(0.125), LayerOptions(0.3, window=20, softcap=5.0)],
                         ids=["plain", "window"])
def test_the_portable_bf16_path_matches_its_torch_twin(portable_build, dim, opts):
    q, k_cache, v_cache, table, lens = _case(torch.bfloat16, dim, 2, 3)
    got = cpu_attention.paged_decode(q, k_cache, v_cache, table, lens, opts, lib=portable_build)
    want = decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, opts)
    torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=2 ** -8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rows_never_read_past_their_length(dtype):
    """Positions past a row's length and blocks past its last are poisoned (NaN): no output sees them."""
    q, k_cache, v_cache, table, lens = _case(dtype, 64, 2, 2)
    k_poisoned, v_poisoned = k_cache.clone(), v_cache.clone()
    for row, length in enumerate(lens.tolist()):
        for pos in range(length, table.shape[1] * 16):
            block, offset = table[row, pos // 16], pos % 16
            k_poisoned[:, block, offset], v_poisoned[:, block, offset] = float("nan"), float("nan")
    # a window starts past position 0: the positions before it are poisoned too
    opts = LayerOptions(0.125, window=7)
    for row, length in enumerate(lens.tolist()):
        for pos in range(max(0, length - 7)):
            block, offset = table[row, pos // 16], pos % 16
            k_poisoned[:, block, offset], v_poisoned[:, block, offset] = float("nan"), float("nan")
    got = cpu_attention.paged_decode(q, k_poisoned, v_poisoned, table, lens, opts)
    assert not got.isnan().any()
    want = decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, opts)
    torch.testing.assert_close(got.float(), want, atol=1e-5 if dtype == torch.float32 else 1e-3,
                               rtol=1e-5 if dtype == torch.float32 else 2 ** -8)


@pytest.mark.parametrize("heads, dim, dtype, atol", [((8, 2), 64, torch.float32, 1e-5),
                                                     ((6, 2), 128, torch.bfloat16, 2e-2)], ids=["gqa4-f32", "gqa3-bf16"])
def test_the_backend_matches_the_torch_backend_over_mixed_steps(heads, dim, dtype, atol):
    compare_backends_over_mixed_steps(TorchPagedBackend, CpuPagedBackend, CPU, dtype, 16, atol=atol, heads=heads,
                                      dim=dim)


def test_auto_chooses_it_on_cpu_for_float32_and_bf16_models():
    assert select_backend("auto", CPU, dtype=torch.bfloat16) is CpuPagedBackend
    assert select_backend("auto", CPU, dtype=torch.float32) is CpuPagedBackend
    assert select_backend("auto", CPU, dtype=torch.float16) is TorchPagedBackend
    assert select_backend("auto", CPU, torch.float8_e4m3fn, torch.bfloat16) is TorchPagedBackend  # fp8 KV: torch
    assert select_backend("cpu", CPU) is CpuPagedBackend
    with pytest.raises(ValueError, match="option.attention_backend=cpu runs float32 and bf16 models on CPU, not "
                                         "torch.float16"):
        CpuPagedBackend(1, 2, 64, 16, torch.float16, CPU)
    with pytest.raises(ValueError, match="needs the torch attention backend"):
        CpuPagedBackend(1, 2, 64, 16, torch.bfloat16, CPU, kv_dtype=torch.float8_e4m3fn)


def test_without_a_compiler_auto_chooses_torch_and_cpu_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_attention, "compiler", lambda: None)
    monkeypatch.setattr(cpu_attention, "_failure", [])
    cpu_attention.load.cache_clear()
    try:
        assert cpu_attention.load() is None and cpu_attention.why() == "no C compiler (cc or gcc) on PATH"
        assert select_backend("auto", CPU, dtype=torch.bfloat16) is TorchPagedBackend
        with pytest.raises(ValueError, match=r"its kernel did not build \(no C compiler \(cc or gcc\) on PATH\); "
                                             "option.attention_backend=torch runs without it"):
            CpuPagedBackend(1, 2, 64, 16, torch.bfloat16, CPU)
    finally:
        cpu_attention.load.cache_clear()


def test_processes_building_at_once_share_one_cached_object(tmp_path):
    """Two processes with an empty cache (a fresh HOME) build and load at once (tensor-parallel ranks
    do): both compute the right output, one object is left, no partial file."""
    script = ("import torch\n"
              "from engines.kernels import cpu_attention\n"
              "from engines.attention.base import LayerOptions\n"
              "from engines.attention.torch_backend import decode_attention\n"
              "from tests.test_cpu_attention import _case\n"
              "args = _case(torch.float32, 64, 2, 2)\n"
              "got = cpu_attention.paged_decode(*args, LayerOptions(0.125))\n"
              "torch.testing.assert_close(got, decode_attention(*args, LayerOptions(0.125)), atol=1e-5, rtol=1e-5)\n"
              "print(cpu_attention.load()._name)\n")
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    built = sorted(os.listdir(tmp_path / ".cache" / "lmi-serve" / "kernels"))
    assert len(built) == 1 and built[0].startswith("cpu_attention-") and built[0].endswith(".so"), built
    assert {out.strip() for out, _ in outs} == {str(tmp_path / ".cache" / "lmi-serve" / "kernels" / built[0])}


PROMPTS = [[1] + [5, 6, 7, 8, 9] * 2 + list(range(20, 24 + 3 * i)) for i in range(6)]


@pytest.mark.parametrize("sched", [{}, {"speculative_method": "ngram", "num_speculative_tokens": 3,
                                         "max_num_batched_tokens": 16}], ids=["async", "ngram-chunked"])
def test_the_paged_engine_with_it_gives_hf_greedy_tokens(tiny_model, hf, sched):
    """auto on CPU: requests joining every two steps (decode buckets), and with n-gram proposals and
    16-token steps (verification rows in mixed steps, prompts in chunks)."""
    engine = paged_engine(tiny_model, **sched)
    assert engine.paged.backend.name == "cpu"
    outs = drive_engine(engine, [(f"g{i}", p, SamplingParams(max_new_tokens=10, ignore_eos=True))
                                 for i, p in enumerate(PROMPTS)], join_every=2)
    for i, p in enumerate(PROMPTS):
        assert output_tokens(outs[f"g{i}"]) == hf(p, 10), i
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_row_of_no_context_is_zeros():
    q, k_cache, v_cache, table, lens = _case(torch.bfloat16, 64, 2, 2)
    lens[1] = 0
    got = cpu_attention.paged_decode(q, k_cache, v_cache, table, lens, LayerOptions(0.125))
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    want = decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, LayerOptions(0.125))
    torch.testing.assert_close(got[[0, 2, 3]].float(), want[[0, 2, 3]], atol=1e-3, rtol=2 ** -8)
