"""The paged attention Triton kernel (engines/kernels/paged_attention.py) against its PyTorch oracle,
on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 from conftest.py), and the oracle
against SDPA. Every step is built to trip a kernel that reads what it must not: block-table entries
past each sequence's end are random (valid) ids, blocks nobody owns and the slots past each
context's end hold NaN, padding tokens' queries are NaN, and `out` starts as a sentinel that tokens
past the last sequence must keep."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")

from engines.kernels.paged_attention import choose_tiles, paged_attention, reference_paged_attention  # noqa: E402

# CUDA tensors where the kernel is compiled (conftest.py sets TRITON_INTERPRET only without CUDA)
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
SENTINEL = 123.0
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


class Step(NamedTuple):
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [Hkv, NB, BS, D]
    v_cache: torch.Tensor
    query_start: torch.Tensor  # [S + 1]
    seq_lens: torch.Tensor  # [S]
    block_table: torch.Tensor  # [S, W]
    num_seqs: int
    num_real: int  # tokens of the sequences; the rest of the T are padding


def make_step(specs, *, group=2, head_dim=64, block_size=16, kv_heads=2, dtype=torch.float32, pad_seqs=0,
              pad_tokens=3, meta=torch.int32, seed=0) -> Step:
    """specs: (q_len, seq_len) per sequence; then `pad_seqs` padding decodes (q_len 1, seq_len 1 on a
    scratch block) and `pad_tokens` tokens past the last sequence."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-ctx // block_size) for _, ctx in specs]
    num_blocks = sum(needs) + 3  # + the scratch block + two poisoned blocks nobody owns
    ids = torch.randperm(num_blocks, generator=gen)
    owned, scratch, poisoned = ids[:sum(needs)], ids[sum(needs)], ids[sum(needs) + 1:]
    rows = len(specs) + pad_seqs
    table = torch.randint(0, num_blocks, (rows, max(needs, default=1) + 2), generator=gen)  # garbage, but valid
    k = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    v = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    k[:, poisoned] = v[:, poisoned] = float("nan")
    at = 0
    for i, ((_, ctx), need) in enumerate(zip(specs, needs)):
        table[i, :need] = owned[at:at + need]
        k[:, owned[at + need - 1], ctx - (need - 1) * block_size:] = float("nan")  # slots past the context
        v[:, owned[at + need - 1], ctx - (need - 1) * block_size:] = float("nan")
        at += need
    table[len(specs):, 0] = scratch
    q_lens = [n for n, _ in specs] + [1] * pad_seqs
    query_start = [0]
    for n in q_lens:
        query_start.append(query_start[-1] + n)
    q = torch.randn(query_start[-1] + pad_tokens, kv_heads * group, head_dim, generator=gen)
    q[query_start[-1]:] = float("nan")
    lens = [ctx for _, ctx in specs] + [1] * pad_seqs
    return Step(q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype),
                torch.tensor(query_start, dtype=meta, device=DEVICE), torch.tensor(lens, dtype=meta, device=DEVICE),
                table.to(DEVICE, meta), rows, query_start[-1])


def run_kernel(step: Step, **kwargs) -> torch.Tensor:
    out = torch.full_like(step.q, SENTINEL)
    paged_attention(step.q, step.k_cache, step.v_cache, out, step.query_start, step.seq_lens, step.block_table,
                    step.num_seqs, step.q.shape[-1] ** -0.5, **kwargs)
    return out


def check(step: Step, **kwargs) -> torch.Tensor:
    """The kernel matches the oracle on the sequences' tokens and leaves the padding tokens alone."""
    out = run_kernel(step, **kwargs)
    ref = reference_paged_attention(step.q, step.k_cache, step.v_cache, step.query_start, step.seq_lens,
                                    step.block_table, step.num_seqs, step.q.shape[-1] ** -0.5, **kwargs)
    n = step.num_real
    assert not out[:n].isnan().any()
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=ATOL[step.q.dtype], rtol=0)
    assert (out[n:] == SENTINEL).all()
    return out


MIXED = [(1, 37), (1, 9), (3, 21), (5, 50), (2, 2), (1, 1), (60, 90)]  # decodes, short chunks, a prefill chunk


def test_choose_tiles():
    assert choose_tiles(256, 256, 1, 128) == (16, 16, 64, 1, 128, 4, 3)  # decodes: the smallest tl.dot
    assert choose_tiles(256, 256, 8, 128)[:3] == (16, 2, 64)  # a GQA group fills the rows
    prefill = choose_tiles(2048, 1, 1, 128)
    assert (prefill.block_m, prefill.block_n, prefill.num_warps) == (128, 64, 8)  # wgmma-sized
    assert choose_tiles(2048, 1, 4, 80)[:5] == (128, 32, 64, 4, 128)  # head_dim padded to 128
    assert choose_tiles(2048, 1, 2, 256)[:3] == (64, 32, 32)
    assert choose_tiles(2048, 1, 2, 128, elem_size=4)[:3] == (64, 32, 32)
    assert choose_tiles(40, 8, 4, 64)[:2] == (32, 8)  # short chunks: 20 rows per sequence
    assert choose_tiles(8, 8, 64, 256, elem_size=4)[:2] == (64, 1)  # a group never splits


def test_reference_matches_sdpa():
    """The oracle against SDPA on contiguous K/V: causal after 30 cached tokens, and with a window."""
    step = make_step([(20, 50)], group=2, head_dim=32, block_size=8)
    keys = step.k_cache[:, step.block_table[0, :7].long()].reshape(2, 56, 32)[:, :50]  # [Hkv, 50, D]
    values = step.v_cache[:, step.block_table[0, :7].long()].reshape(2, 56, 32)[:, :50]
    back = torch.arange(30, 50, device=DEVICE).view(-1, 1) - torch.arange(50, device=DEVICE).view(1, -1)
    for window, mask in ((0, back >= 0), (7, (back >= 0) & (back < 7))):
        want = torch.nn.functional.scaled_dot_product_attention(step.q[:20].transpose(0, 1), keys, values,
                                                                attn_mask=mask, enable_gqa=True).transpose(0, 1)
        got = reference_paged_attention(*step[:6], 1, 32 ** -0.5, window=window)
        torch.testing.assert_close(got[:20], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("group", [1, 4])
def test_kernel_matches_sdpa_on_a_prefill(group):
    """A whole prompt in one chunk (is_causal) against SDPA on a contiguous copy."""
    step = make_step([(45, 45)], group=group, head_dim=64, block_size=16)
    keys = step.k_cache[:, step.block_table[0, :3].long()].reshape(2, 48, 64)[:, :45]
    values = step.v_cache[:, step.block_table[0, :3].long()].reshape(2, 48, 64)[:, :45]
    want = torch.nn.functional.scaled_dot_product_attention(step.q[:45].transpose(0, 1), keys, values,
                                                            is_causal=True, enable_gqa=group > 1).transpose(0, 1)
    torch.testing.assert_close(run_kernel(step)[:45], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [16, 64, 80])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_batch_with_padding_sequences(group, head_dim, block_size):
    specs = [(1, 1), (1, 17), (1, 64), (1, 100), (1, 33)]
    check(make_step(specs, group=group, head_dim=head_dim, block_size=block_size, pad_seqs=3))


# every (group, head_dim, block_size), alternately in float32 and bfloat16 (each value meets both)
MIXED_CASES = [(*case, (torch.float32, torch.bfloat16)[i % 2])
               for i, case in enumerate(itertools.product([1, 2, 4], [16, 64, 80], [1, 16, 32]))]


@pytest.mark.parametrize("group, head_dim, block_size, dtype", MIXED_CASES)
def test_mixed_step(group, head_dim, block_size, dtype):
    check(make_step(MIXED, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype, pad_seqs=2))


@pytest.mark.parametrize("head_dim, block_size", [(256, 16), (96, 256), (128, 8), (32, 2)])
def test_other_head_dims_and_block_sizes(head_dim, block_size):
    check(make_step(MIXED[2:], group=2, head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16))


@pytest.mark.parametrize("window, softcap", [(1, 0.0), (5, 0.0), (32, 0.0), (0, 3.0), (0, 30.0), (6, 2.0)])
def test_window_and_softcap(window, softcap):
    check(make_step(MIXED, group=2, head_dim=32, block_size=8), window=window, softcap=softcap)


def test_window_semantics():
    """window 1 attends exactly the token's own key; a window longer than any context changes nothing."""
    step = make_step(MIXED, group=2, head_dim=32, block_size=4)
    out = run_kernel(step, window=1)
    for i, (n, ctx) in enumerate(MIXED):
        a = int(step.query_start[i])
        pos = torch.arange(ctx - n, ctx, device=DEVICE)
        own = step.v_cache[:, step.block_table[i, pos // 4].long(), pos % 4]  # [Hkv, n, D]
        assert torch.equal(out[a:a + n], own.repeat_interleave(2, 0).transpose(0, 1))
    assert torch.equal(run_kernel(step, window=1000), run_kernel(step))


def test_int64_metadata_matches_int32():
    a = make_step(MIXED, meta=torch.int32, seed=3, pad_seqs=2)
    b = make_step(MIXED, meta=torch.int64, seed=3, pad_seqs=2)
    assert torch.equal(check(a), check(b))


def test_garbage_past_the_end_changes_nothing():
    """Block-table entries past each sequence's blocks, and the padding sequences' rows past the
    scratch block, are replaced by other valid ids: the output is bit for bit the same."""
    step = make_step(MIXED, pad_seqs=2, seed=5)
    table = step.block_table.clone()
    for i, (_, ctx) in enumerate(MIXED + [(1, 1)] * 2):
        need = -(-ctx // 16)
        table[i, need:] = torch.randint(0, step.k_cache.shape[1], (table.shape[1] - need,), device=DEVICE)
    assert torch.equal(run_kernel(step), run_kernel(step._replace(block_table=table)))


def test_only_the_first_num_seqs_sequences():
    """Metadata longer than num_seqs (a fixed-size bucket): the later sequences' tokens are untouched."""
    step = make_step(MIXED, seed=7)
    first = step._replace(num_seqs=4, num_real=int(step.query_start[4]))
    check(first)  # tokens of sequences 4.. keep the sentinel
    assert (run_kernel(step._replace(num_seqs=0)) == SENTINEL).all()


def test_long_prefill_chunk():
    check(make_step([(1, 20), (300, 340), (4, 12)], group=2, head_dim=64, block_size=16, dtype=torch.bfloat16))


@pytest.mark.parametrize("seed", range(12))
def test_random_mixes(seed):
    rnd = random.Random(seed)
    specs = []
    for _ in range(rnd.randint(1, 6)):
        n = rnd.choice([1, 1, 1, rnd.randint(2, 8), rnd.randint(9, 40)])
        specs.append((n, n + rnd.choice([0, rnd.randint(0, 60)])))
    window = rnd.choice([0, 0, rnd.randint(1, 40)])
    softcap = rnd.choice([0.0, 0.0, rnd.uniform(1.0, 20.0)])
    check(make_step(specs, group=rnd.choice([1, 2, 3, 4, 8]), head_dim=rnd.choice([16, 32, 64, 80, 96, 128]),
                    block_size=rnd.choice([1, 2, 8, 16, 32, 256]), kv_heads=rnd.choice([1, 2]),
                    dtype=rnd.choice([torch.float32, torch.bfloat16, torch.float16]), pad_seqs=rnd.randint(0, 2),
                    pad_tokens=rnd.randint(0, 5), meta=rnd.choice([torch.int32, torch.int64]), seed=seed),
          window=window, softcap=softcap)


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engines.kernels.paged_attention import _paged_attention_kernel as kernel, choose_tiles
for dtype, meta, tokens, seqs, group, dim, softcap in [("bf16", "i32", 256, 256, 4, 128, False),
        ("bf16", "i64", 2048, 1, 8, 128, True), ("fp16", "i32", 2300, 250, 4, 80, False),
        ("bf16", "i32", 2048, 1, 2, 256, False), ("fp32", "i64", 2048, 1, 4, 128, True)]:
    t = choose_tiles(tokens, seqs, group, dim, 4 if dtype == "fp32" else 2)
    sig = {name: "i32" for name in kernel.arg_names}
    sig.update(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype, o_ptr="*" + dtype, qs_ptr="*" + meta,
               lens_ptr="*" + meta, table_ptr="*" + meta, qk_scale="fp32", softcap="fp32")
    consts = dict(G=group, G_PAD=t.g_pad, BLOCK_Q=t.block_q, BLOCK_N=t.block_n, D=dim, D_PAD=t.d_pad, BLOCK_SIZE=16,
                  SOFTCAP=softcap, PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST=False, STAGES=t.num_stages)
    sig.update({name: "constexpr" for name in consts})
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if name.endswith("_ptr") or (name.startswith("stride") and name != "stride_table")}
    compiled = triton.compile(ASTSource(kernel, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=t.num_warps, num_stages=t.num_stages))
    assert compiled.asm["cubin"] and "cp.async" in compiled.asm["ptx"], (dtype, t)
print("ok")
"""


def test_compiles_for_hopper_without_a_gpu():
    """What the interpreter never checks: the kernel goes through Triton's compiler and ptxas for
    sm_90 (in a process without TRITON_INTERPRET), with its K/V loads pipelined (cp.async)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", COMPILE], cwd=Path(__file__).parent.parent, env=env,
                            capture_output=True, text=True, timeout=300)
    if "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("no ptxas")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
