"""Attention backends and the paged runner's step, without a server."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engines.attention.base import SeqSlice, select_backend
from engines.attention.torch_backend import TorchPagedBackend
from engines.config import ModelConfig
from engines.core.scheduler import NewRequestData, SchedulerOutput
from engines.sampling_params import SamplingParams
from engines.worker.model_runner import ModelRunner
from engines.worker.paged_runner import PagedRunner, token_buckets

BS = 4


def _backend(num_blocks=16, heads=2, dim=8, layers=1, dtype=torch.float32) -> TorchPagedBackend:
    b = TorchPagedBackend(layers, heads, dim, BS, dtype, torch.device("cpu"))
    b.allocate(num_blocks, 4, 8)  # up to 4 decodes of up to 8 blocks
    return b


def test_torch_metadata_of_a_mixed_step():
    # a decode at position 5 (blocks 3, 7), a 3-token prefill chunk at positions 2..4 (blocks 9, 2), a decode at 0
    seqs = [SeqSlice(0, 1, 6, [3, 7]), SeqSlice(1, 3, 5, [9, 2]), SeqSlice(4, 1, 1, [5])]
    meta = _backend().build_metadata(seqs)
    assert meta.slot_mapping.tolist() == [7 * BS + 1, 9 * BS + 2, 9 * BS + 3, 2 * BS + 0, 5 * BS + 0]
    assert meta.block_table.tolist() == [[3, 7], [5, 0]]  # padded with block 0, masked by the lengths
    assert meta.context_lens.tolist() == [6, 1]
    assert meta.decode_rows.tolist() == [0, 4]
    (start, n, ctx, blocks), = meta.prefills
    assert (start, n, ctx, blocks.tolist()) == (1, 3, 5, [9, 2])


def test_torch_metadata_of_a_decode_only_step_takes_the_static_path():
    backend = _backend()
    assert (backend.decode_buckets, backend.width_buckets, backend.scratch_block) == ([1, 2, 4], [1, 2, 4, 8], 16)
    # two decodes padded to four rows; 3 blocks padded to the width bucket of 4
    meta = backend.build_metadata([SeqSlice(0, 1, 3, [1]), SeqSlice(1, 1, 9, [4, 5, 6])], num_tokens=4)
    assert meta.decode_rows is None and meta.prefills == ()
    assert meta.block_table.tolist() == [[1, 0, 0, 0], [4, 5, 6, 0], [16, 0, 0, 0], [16, 0, 0, 0]]
    assert meta.context_lens.tolist() == [3, 9, 1, 1]
    assert meta.slot_mapping.tolist() == [1 * BS + 2, 6 * BS + 0, 16 * BS, 16 * BS]  # padding: the scratch block


def test_padding_tokens_of_a_mixed_step_get_zeros_and_touch_only_the_scratch_block():
    torch.manual_seed(0)
    backend = _backend()
    before = backend.keys[0].clone()
    seqs = [SeqSlice(0, 2, 2, [3]), SeqSlice(2, 1, 1, [5])]
    q, k, v = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    out = backend.forward(0, q, k, v, backend.build_metadata(seqs, num_tokens=5))[0]
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
    done = {"a": 0, "b": 0}
    # step 1: a prefills 7, b prefills 3; step 2: a decodes, b prefills 5 more; steps 3-4: both decode
    for chunk in ({"a": 7, "b": 3}, {"a": 1, "b": 5}, {"a": 1, "b": 1}, {"a": 1, "b": 1}):
        seqs, qs, ks, vs, start = [], [], [], [], 0
        for s, n in chunk.items():
            lo, hi = done[s], done[s] + n
            seqs.append(SeqSlice(start, n, hi, tables[s]))
            qs.append(full_q[s][lo:hi]), ks.append(full_k[s][lo:hi]), vs.append(full_v[s][lo:hi])
            start += n
        meta = backend.build_metadata(seqs)
        out = backend.forward(0, torch.cat(qs)[None], torch.cat(ks)[None], torch.cat(vs)[None], meta)[0]
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
    with pytest.raises(ValueError, match="must be one of auto, torch, flash_attn"):
        select_backend("xformers", cpu)


PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 20, 21], [1] + list(range(100, 140))]


@pytest.fixture(scope="module")
def fp32_runner(tiny_model):
    runner = ModelRunner(ModelConfig(local_dir=str(tiny_model), dtype="fp32"), 1024, device=torch.device("cpu"))
    runner.load()
    return runner


def _plan(prompts, tables):
    plan = SchedulerOutput()
    for i, p in enumerate(prompts):
        plan.new_requests.append(NewRequestData(f"r{i}", p, len(p), tables[i], 0, SamplingParams()))
        plan.add(f"r{i}", len(p))
    return plan


def test_the_runner_step_samples_what_the_padded_runner_computes_and_padding_changes_nothing(fp32_runner):
    expected = torch.log_softmax(fp32_runner.prefill(PROMPTS)[0], -1)
    paged = PagedRunner(fp32_runner)
    paged.allocate(64, 16, 4, 1024)
    assert paged.buckets[-1] == 1024 and paged.backend.scratch_block == 64
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
            paged.buckets, paged.backend.decode_buckets = [49], [3]
        paged.execute(_plan(PROMPTS, tables))
        plan = SchedulerOutput()
        for i, p in enumerate(PROMPTS):
            plan.add(f"r{i}", 1)
        second = paged.execute(plan)
        assert [len(paged.states[f"r{i}"].token_ids) for i in range(3)] == [len(p) + 2 for p in PROMPTS]
        outs.append(second.samples)
    assert [s.token_ids for s in outs[0]] == [s.token_ids for s in outs[1]]
    assert [s.log_probs[0] for s in outs[0]] == pytest.approx([s.log_probs[0] for s in outs[1]], abs=1e-5)


def test_warm_up_runs_every_bucket(fp32_runner, monkeypatch):
    paged = PagedRunner(fp32_runner)
    paged.allocate(8, 16, 20, 64)
    sizes = []
    real = fp32_runner.model.forward

    def spy(ids, positions, backend, meta, logits_index):
        sizes.append((ids.shape[1], logits_index.shape[0]))
        return real(ids, positions, backend, meta, logits_index)

    monkeypatch.setattr(fp32_runner.model, "forward", spy)
    paged.warm_up_buckets()
    # every decode step size (the buckets up to max_num_seqs=20), with as many sampled rows; larger
    # prefill steps make their shapes on first use
    assert sizes == [(s, s) for s in token_buckets(20)] == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (20, 20)]
