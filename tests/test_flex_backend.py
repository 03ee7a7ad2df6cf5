"""The FlexAttention backend (engines/attention/flex_backend.py) against the torch backend, on CPU
where flex_attention runs unfused (its mask_mod applied to every slot of the cache, so a mask that
lets a wrong slot through shows), and compiled on CUDA when there is one: mixed steps, GQA, prefill
chunks longer than a query row after cached context, blocks shared by two sequences (prefix
caching), decode steps padded with pad sequences through metadata built once for a captured graph,
stale block-table entries; and the paged engine's greedy tokens equal HF `generate`."""

from __future__ import annotations

import pytest
import torch

from engines.attention.step import ForwardBatch, SeqChunk
from engines.attention.registry import select_backend
from engines.attention.flex_backend import PREFILL_ROW, FlexPagedBackend
from engines.attention.torch_backend import TorchPagedBackend
from engines.sampling_params import SamplingParams
from engines.worker import paged_runner
from engines.loop.paged_engine import PagedEngine
from engines.worker.step_buffers import StepBuffers
from tests.support import (
    compare_backends_over_mixed_steps,
    drive_engine,
    output_tokens,
    paged_engine,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("heads, dim, block_size, dtype, atol", [
    ((4, 4), 16, 16, torch.float32, 1e-5),
    ((8, 2), 64, 16, torch.float32, 1e-5),
    ((6, 2), 32, 32, torch.bfloat16, 2e-2),  # a group of 3 (not a power of two), 32-token blocks
], ids=["mha", "gqa4", "gqa3-bf16"])
def test_matches_the_torch_backend_over_mixed_steps(heads, dim, block_size, dtype, atol):
    compare_backends_over_mixed_steps(TorchPagedBackend, FlexPagedBackend, CPU, dtype, block_size, atol=atol,
                                      heads=heads, dim=dim)


def _backends(num_blocks: int) -> list:
    """(flex, torch) over one layer (2 kv heads of 16 dims, 16-token blocks), their caches holding the
    same random K/V (the scratch block's too)."""
    torch.manual_seed(0)
    pair = [cls(1, 2, 16, 16, torch.float32, CPU) for cls in (FlexPagedBackend, TorchPagedBackend)]
    for b in pair:
        b.allocate(num_blocks)
    for cache in ("keys", "values"):
        getattr(pair[0], cache)[0].normal_()
        getattr(pair[1], cache)[0].copy_(getattr(pair[0], cache)[0])
    return pair


def _compare(steps: list[list[SeqChunk]]) -> None:
    """Each step's chunks through the step buffers: flex gives torch's outputs for every real token,
    zeros for the padding."""
    flex, oracle = _backends(64)
    buffers = StepBuffers(2048, 4, 32, 16, flex.scratch_block, CPU)
    for i, chunks in enumerate(steps):
        view = buffers.write(ForwardBatch(chunks, []))
        gen = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(1, view.num_tokens, h, 16, generator=gen) for h in (4, 2, 2))
        outs = [b.forward(0, q, k, v, b.metadata(view))[0] for b in (flex, oracle)]
        real = sum(c.num_tokens for c in chunks)
        torch.testing.assert_close(outs[0][:real], outs[1][:real], atol=1e-5, rtol=1e-5)
        assert torch.count_nonzero(outs[0][real:]) == 0


def _chunk(start: int, n: int, table: list[int], speculative: bool = False) -> SeqChunk:
    return SeqChunk(start, n, table, [0] * n, speculative=speculative)


def test_prefill_chunks_longer_than_a_query_row_after_cached_context():
    """A 300-token chunk after 130 cached tokens (rows of 128, 128, 44) beside a decode, then proposals."""
    assert PREFILL_ROW == 128
    a, b = list(range(2, 30)), list(range(35, 50))
    _compare([[_chunk(0, 130, a), _chunk(0, 5, b)], [_chunk(130, 300, a), _chunk(5, 1, b)],
              [_chunk(430, 1, a), _chunk(6, 4, b, speculative=True)], [_chunk(431, 1, a), _chunk(10, 1, b)]])


def test_blocks_shared_by_two_sequences():
    """Prefix caching: b's first two blocks are a's (b computes from 32 on); each sequence reads a
    shared block at its own logical index."""
    a, b = [3, 5, 7, 11], [3, 5, 9, 12]
    _compare([[_chunk(0, 40, a)], [_chunk(40, 1, a), _chunk(32, 9, b)], [_chunk(41, 1, a), _chunk(41, 1, b)]])


def test_a_padded_decode_step_through_metadata_built_once_reads_only_each_sequence():
    """What a captured decode graph does: the bucket's metadata is built once from the buffers' static
    views, then replayed over steps the buffers hold later. Three decodes padded to four rows: the pad
    sequence reads its scratch slot (finite), every row visits its own blocks only, and block-table
    entries left past a sequence's end by an earlier, longer step (its own block among them) are
    neither visited nor seen."""
    flex, oracle = _backends(16)
    buffers = StepBuffers(256, 4, 8, 16, flex.scratch_block, CPU)
    static = flex.metadata(buffers.static_view(4), static=True)
    long_tables = [[3, 9, 4, 7, 5], [6, 1, 2, 8, 10], [11, 12, 13, 14, 15]]
    buffers.write(ForwardBatch([SeqChunk(0, 70, t, [0] * 70) for t in long_tables], []))  # leaves them in the table
    for i, (tables, lens) in enumerate([([[9], [1, 6], [0, 11, 12]], [10, 20, 40]),
                                        ([[9, 3], [2], [4, 7, 5]], [17, 1, 33])]):
        batch = ForwardBatch([SeqChunk(n - 1, 1, t, [0]) for t, n in zip(tables, lens)], [0, 1, 2])
        view = buffers.write(batch)
        assert view.num_seqs == 4 and view.block_table[0, 1:3].tolist() == ([9, 4] if i == 0 else [3, 4])
        gen = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(1, 4, h, 16, generator=gen) for h in (4, 2, 2))
        out = flex.forward(0, q, k, v, static)[0]
        want = oracle.forward(0, q, k, v, oracle.metadata(view))[0]
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[3], v[0, 3].repeat_interleave(2, 0))  # the pad token's own V, at the scratch slot
        mask = static.decode.block_mask
        visited = [mask.kv_indices[r, 0, 0, :mask.kv_num_blocks[r, 0, 0]].tolist() for r in range(4)]
        assert visited == tables + [[flex.scratch_block]]


def test_select_backend_and_block_size():
    assert select_backend("flex", CPU) is FlexPagedBackend and FlexPagedBackend.preferred_block_size == 16


@pytest.fixture
def decode_graphs(monkeypatch):
    """Decode steps through StepGraphs (on CPU: eagerly over the static views, as a graph replays them)."""
    monkeypatch.setattr(PagedEngine, "_decode_mode", lambda self: (paged_runner.DECODE_GRAPHS, "test"))
    monkeypatch.setattr(StepBuffers, "STAGE_ON_CPU", True)


PROMPTS = [[1] + [5, 6, 7, 8, 9] * 2 + list(range(20, 24 + 3 * i)) for i in range(6)]


@pytest.mark.parametrize("sched", [{}, {"speculative_method": "ngram", "num_speculative_tokens": 3,
                                         "max_num_batched_tokens": 16}], ids=["async", "ngram-chunked"])
def test_the_paged_engine_with_flex_gives_hf_greedy_tokens(tiny_model, hf, decode_graphs, sched):
    """Requests joining every two steps (decode buckets 1, 2, 4, replayed over static views), and
    with n-gram proposals and 16-token steps: verification rows and prompts in chunks."""
    engine = paged_engine(tiny_model, attention_backend="flex", **sched)
    assert engine.paged.backend.name == "flex" and engine.paged.target.decode_mode == "graphs"
    outs = drive_engine(engine, [(f"g{i}", p, SamplingParams(max_new_tokens=10, ignore_eos=True))
                                 for i, p in enumerate(PROMPTS)], join_every=2)
    for i, p in enumerate(PROMPTS):
        assert output_tokens(outs[f"g{i}"]) == hf(p, 10), i
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    if sched:
        assert engine.metrics()["spec_accepted_tokens"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
def test_compiled_on_cuda_matches_the_torch_backend_over_mixed_steps(dtype, atol):
    compare_backends_over_mixed_steps(TorchPagedBackend, FlexPagedBackend, torch.device("cuda"), dtype, 16,
                                      atol=atol)
