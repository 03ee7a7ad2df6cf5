"""Attention backends and the paged runner's step, without a server."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engines.spec import ModelSpec
from engines.attention.step import ForwardBatch, SeqChunk, token_buckets
from engines.attention.registry import select_backend
from engines.attention.torch_backend import TorchPagedBackend
from engines.config import ModelConfig
from engines.core.plan import NewRequest, StepPlan
from engines.sampling_params import SamplingParams
from engines.worker.model_runner import ModelRunner
from engines.worker.paged_runner import PagedRunner
from engines.worker.step_buffers import StepBuffers

BS = 4
CPU = torch.device("cpu")


def _backend(num_blocks=16, heads=2, dim=8, layers=1, dtype=torch.float32) -> TorchPagedBackend:
    b = TorchPagedBackend(layers, heads, dim, BS, dtype, CPU)
    b.allocate(num_blocks)
    return b


def _buffers(backend, max_tokens=64, max_seqs=4, max_blocks=8) -> StepBuffers:
    return StepBuffers(max_tokens, max_seqs, max_blocks, BS, backend.scratch_block, CPU)


def _chunk(start: int, n: int, blocks: list[int], **kw) -> SeqChunk:
    return SeqChunk(start, n, blocks, list(range(100 + start, 100 + start + n)), **kw)


def test_a_mixed_step_in_the_buffers_and_the_torch_metadata():
    # a decode at position 5 (blocks 3, 7), a 3-token prefill chunk at positions 2..4 (blocks 9, 2), a decode at 0
    backend = _backend()
    buffers = _buffers(backend)
    batch = ForwardBatch([_chunk(5, 1, [3, 7]), _chunk(2, 3, [9, 2]), _chunk(0, 1, [5])], [0, 3, 4])
    view = buffers.write(batch)
    assert (view.num_tokens, view.num_seqs, view.num_logits, view.decode_only) == (8, 3, 4, False)  # 5 tokens → 8
    assert view.input_ids.tolist() == [105, 102, 103, 104, 100, 0, 0, 0]
    assert view.positions.tolist() == [5, 2, 3, 4, 0, 0, 0, 0]
    pad = 16 * BS  # the scratch block's first slot
    assert view.slot_mapping.tolist() == [7 * BS + 1, 9 * BS + 2, 9 * BS + 3, 2 * BS + 0, 5 * BS + 0, pad, pad, pad]
    assert view.query_start.tolist() == [0, 1, 4, 5] and view.seq_lens.tolist() == [6, 5, 1]
    assert view.block_table[:, :2].tolist() == [[3, 7], [9, 2], [5, 0]]
    assert view.logits_indices.tolist() == [0, 3, 4, 0]  # padded to the decode bucket of 4 rows
    meta = backend.metadata(view)
    assert meta.block_table.tolist() == [[3, 7], [5, 0]]  # the decode rows, masked by their lengths
    assert meta.context_lens.tolist() == [6, 1] and meta.decode_rows.tolist() == [0, 4]
    (start, n, ctx, blocks), = meta.prefills
    assert (start, n, ctx, blocks.tolist()) == (1, 3, 5, [9, 2])


def test_a_decode_step_pads_to_a_bucket_of_sequences_on_the_scratch_block():
    backend = _backend()
    buffers = _buffers(backend)
    backend.warm_up(4, buffers.decode_buckets, buffers.width_buckets)
    assert (buffers.decode_buckets, buffers.width_buckets, backend.scratch_block) == ([1, 2, 4], [1, 2, 4, 8], 16)
    # three decodes padded to four rows; 3 blocks padded to the width bucket of 4
    view = buffers.write(ForwardBatch([_chunk(2, 1, [1]), _chunk(8, 1, [4, 5, 6]), _chunk(0, 1, [2])], [0, 1, 2]))
    assert (view.num_tokens, view.num_seqs, view.decode_only, view.width) == (4, 4, True, 3)
    assert view.query_start.tolist() == [0, 1, 2, 3, 4] and view.seq_lens.tolist() == [3, 9, 1, 1]
    assert view.slot_mapping.tolist() == [1 * BS + 2, 6 * BS + 0, 2 * BS, 16 * BS]  # padding: the scratch block
    assert view.block_table[3, 0].tolist() == 16
    meta = backend.metadata(view)
    assert meta.decode_rows is None and meta.prefills == ()
    assert meta.block_table.tolist() == [[1, 0, 0, 0], [4, 5, 6, 0], [2, 0, 0, 0], [16, 0, 0, 0]]
    assert meta.context_lens.tolist() == [3, 9, 1, 1]
    # a captured step reads the same views at the buffers' full width
    static = backend.metadata(buffers.static_view(4), static=True)
    assert static.block_table.shape == (4, 8) and static.block_table[:, :4].tolist() == meta.block_table.tolist()


def test_a_decode_step_leaves_its_graph_no_stale_index_from_a_larger_step():
    """A captured decode step reads its bucket's whole views: after a 44-token step wanting logits
    at rows 30..40, a decode step of three rows where one is a prompt chunk (no logits) must not
    leave row 40 where its graph picks logits rows."""
    backend = _backend()
    buffers = _buffers(backend)
    buffers.write(ForwardBatch([_chunk(0, 31, [1] * 8), _chunk(0, 13, [2] * 4)], [30, 43, 31, 40]))
    view = buffers.write(ForwardBatch([_chunk(3, 1, [3]), _chunk(9, 1, [4, 5, 6]), _chunk(2, 1, [7])], [0, 2]))
    static = buffers.static_view(view.num_seqs)
    assert view.num_seqs == 4 and static.logits_indices.tolist() == [0, 2, 0, 0]
    buffers.check(view, backend.num_blocks, 1024)


def test_a_token_fed_from_the_previous_step_lands_on_the_device_not_from_the_host():
    backend = _backend()
    buffers = _buffers(backend)
    sampled = torch.tensor([41, 42, 43])  # the previous step's sampled ids
    batch = ForwardBatch([SeqChunk(3, 1, [2], [], fed_row=2), SeqChunk(0, 2, [5], [7, 8]),
                          SeqChunk(6, 1, [1, 9], [], fed_row=0)], [0, 2, 3])
    view = buffers.write(batch, sampled)
    assert view.input_ids.tolist()[:4] == [43, 7, 8, 41]
    with pytest.raises(ValueError, match="fed from the previous step, which sampled nothing"):
        buffers.write(batch)
    with pytest.raises(ValueError, match="exceeds the buffers"):
        buffers.write(ForwardBatch([_chunk(0, 40, [1] * 10), _chunk(0, 40, [2] * 10)], [0]))


def test_padding_tokens_of_a_mixed_step_get_zeros_and_touch_only_the_scratch_block():
    torch.manual_seed(0)
    backend = _backend()
    buffers = _buffers(backend)
    before = backend.keys[0].clone()
    view = buffers.write(ForwardBatch([_chunk(0, 2, [3]), _chunk(0, 1, [5])], [1, 2]))  # 3 tokens → 4
    q, k, v = torch.randn(1, 4, 4, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    out = backend.forward(0, q, k, v, backend.metadata(view))[0]
    assert torch.count_nonzero(out[3:]) == 0 and torch.count_nonzero(out[:3]) > 0
    changed = (backend.keys[0] != before).any(dim=(0, 2, 3)).nonzero().view(-1).tolist()
    assert changed == [3, 5, 16]


def _reference(q, keys, values):
    """Causal attention of the last len(q) positions over a sequence's whole K/V (heads repeated)."""
    n, hq, d = q.shape
    ctx, hkv, _ = keys.shape
    k = keys.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, ctx, D]
    v = values.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    mask = torch.arange(ctx).view(1, -1) <= torch.arange(ctx - n, ctx).view(-1, 1)
    out = nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1)


def test_torch_backend_matches_dense_attention_over_several_steps():
    torch.manual_seed(0)
    backend = _backend(num_blocks=32, heads=2, dim=8)
    hq = 4
    tables = {"a": [5, 1, 9, 12], "b": [3, 30, 7, 8]}
    full_k = {s: torch.randn(16, 2, 8) for s in tables}
    full_v = {s: torch.randn(16, 2, 8) for s in tables}
    full_q = {s: torch.randn(16, hq, 8) for s in tables}
    buffers = _buffers(backend, max_blocks=4)
    done = {"a": 0, "b": 0}
    # step 1: a prefills 7, b prefills 3; step 2: a decodes, b prefills 5 more; steps 3-4: both decode
    for chunk in ({"a": 7, "b": 3}, {"a": 1, "b": 5}, {"a": 1, "b": 1}, {"a": 1, "b": 1}):
        chunks, qs, ks, vs = [], [], [], []
        for s, n in chunk.items():
            lo, hi = done[s], done[s] + n
            chunks.append(SeqChunk(lo, n, tables[s], [0] * n))
            qs.append(full_q[s][lo:hi]), ks.append(full_k[s][lo:hi]), vs.append(full_v[s][lo:hi])
        view = buffers.write(ForwardBatch(chunks, []))
        pad = view.num_tokens - sum(chunk.values())

        def padded(parts):
            t = torch.cat(parts)
            return torch.cat([t, t.new_zeros((pad,) + t.shape[1:])])[None]

        out = backend.forward(0, padded(qs), padded(ks), padded(vs), backend.metadata(view))[0]
        start = 0
        for s, n in chunk.items():
            hi = done[s] + n
            expected = _reference(full_q[s][done[s]:hi], full_k[s][:hi], full_v[s][:hi])
            torch.testing.assert_close(out[start:start + n], expected, atol=1e-5, rtol=1e-5)
            done[s], start = hi, start + n


def test_token_buckets_cover_every_size_with_little_padding():
    buckets = token_buckets(1024)
    assert buckets[0] == 1 and buckets[-1] == 1024 and buckets == sorted(set(buckets))
    assert buckets[:11] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    for n in range(1, 1025):
        size = next(b for b in buckets if b >= n)
        assert size - n <= max(7, size // 3), (n, size)
    assert token_buckets(20)[-1] == 20


def test_select_backend():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu) is TorchPagedBackend
    assert select_backend("torch", cpu) is TorchPagedBackend
    with pytest.raises(ValueError, match="flash_attn needs a CUDA device with the flash-attn package"):
        select_backend("flash_attn", cpu)
    with pytest.raises(ValueError, match="must be one of auto, flash_attn, triton, flex, cpu, torch"):
        select_backend("xformers", cpu)
    assert select_backend("triton", cpu).name == "triton"  # on CPU tensors under the interpreter (conftest)


PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 20, 21], [1] + list(range(100, 140))]


@pytest.fixture(scope="module")
def fp32_runner(tiny_model):
    runner = ModelRunner(ModelConfig(local_dir=str(tiny_model), dtype="fp32"), ModelSpec.read(str(tiny_model), 1024),
                         device=torch.device("cpu"))
    runner.load()
    return runner


def _plan(prompts, tables):
    plan = StepPlan()
    for i, p in enumerate(prompts):
        plan.new_requests.append(NewRequest(f"r{i}", p, len(p), tables[i], 0, SamplingParams()))
        plan.add(f"r{i}", len(p))
    return plan


def test_the_runner_step_samples_what_the_padded_runner_computes_and_padding_changes_nothing(fp32_runner):
    expected = torch.log_softmax(fp32_runner.prefill(PROMPTS)[0], -1)
    paged = PagedRunner(fp32_runner)
    paged.allocate(64, 16, 4, 1024)
    assert paged.buffers.token_buckets[-1] == 1024 and paged.backend.scratch_block == 64
    tables = [[4 * i, 4 * i + 1, 4 * i + 2] for i in range(len(PROMPTS))]
    result = paged.execute(_plan(PROMPTS, tables))  # 49 tokens, padded to 56; the runner samples (greedy)
    assert result.request_ids == ["r0", "r1", "r2"]
    assert [s.token_ids for s in result.samples] == [[t] for t in expected.argmax(-1).tolist()]
    assert [s.log_probs[0] for s in result.samples] == pytest.approx(expected.max(-1).values.tolist(), abs=1e-4)
    # one decode step each, on a fresh runner without padding vs with it (3 tokens → bucket 4); the
    # runner appended the tokens sampled by the first step to its own lists
    outs = []
    for pad in (False, True):
        paged = PagedRunner(fp32_runner)
        paged.allocate(64, 16, 4, 1024)
        if not pad:  # buckets that fit exactly: the steps run at their own sizes
            paged.buffers.token_buckets, paged.buffers.decode_buckets = [49], [3]
        paged.execute(_plan(PROMPTS, tables))
        plan = StepPlan()
        for i, p in enumerate(PROMPTS):
            plan.add(f"r{i}", 1)
        second = paged.execute(plan)
        assert [len(paged.states[f"r{i}"].token_ids) for i in range(3)] == [len(p) + 2 for p in PROMPTS]
        outs.append(second.samples)
    assert [s.token_ids for s in outs[0]] == [s.token_ids for s in outs[1]]
    assert [s.log_probs[0] for s in outs[0]] == pytest.approx([s.log_probs[0] for s in outs[1]], abs=1e-5)


def test_a_pipelined_step_is_launched_before_the_one_before_it_resolves(fp32_runner):
    """execute(plan k + 1, pipelined) → plan k's result; plan k + 1's decodes read the tokens plan k
    sampled on the device (the host lists lag one step), and give the sync runner's tokens."""
    tables = [[4 * i, 4 * i + 1, 4 * i + 2] for i in range(len(PROMPTS))]
    runs = {}
    for pipelined in (False, True):
        paged = PagedRunner(fp32_runner)
        paged.allocate(64, 16, 4, 1024)
        first = paged.execute(_plan(PROMPTS, tables), pipelined)  # the prompts: one token each
        got = [] if pipelined else [[s.token_ids for s in first.samples]]
        assert (first is None) == pipelined
        for _ in range(4):
            plan = StepPlan()
            for i in range(len(PROMPTS)):
                plan.add(f"r{i}", 1)
            result = paged.execute(plan, pipelined)
            got.append([s.token_ids for s in result.samples])
            # the host has every token of the results returned so far (pipelined: not the last step's)
            assert [len(paged.states[f"r{i}"].token_ids) for i in range(3)] == [len(p) + len(got) for p in PROMPTS]
        if pipelined:
            got.append([s.token_ids for s in paged.flush().samples])
            assert paged.flush() is None
        runs[pipelined] = got
    assert runs[True] == runs[False] and len(runs[True]) == 5


def test_warm_up_runs_every_decode_bucket(fp32_runner, monkeypatch):
    paged = PagedRunner(fp32_runner)
    paged.allocate(8, 16, 20, 64)
    sizes = []
    real = fp32_runner.model.forward

    def spy(ids, positions, backend, meta, logits_index):
        sizes.append((ids.shape[1], logits_index.shape[0]))
        return real(ids, positions, backend, meta, logits_index)

    monkeypatch.setattr(fp32_runner.model, "forward", spy)
    paged.warm_up_buckets()
    # every decode step size (the buckets up to max_num_seqs=20), with as many sampled rows; prefill
    # steps make their shapes on first use
    assert sizes == [(s, s) for s in token_buckets(20)] == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (20, 20)]
