"""PaddedKVCache: exact shapes and contents of concatenate / filter / growth, the forward mask, and
batch algebra on a real model's cache giving the same logits as each prompt alone."""

from __future__ import annotations

import pytest
import torch

from engines.spec import ModelSpec
from engines.config import ModelConfig
from engines.worker.model_runner import ModelRunner
from engines.attention.step import LayerOptions
from engines.worker.padded_cache import GROW, PaddedKVCache

LAYERS, HEADS, DIM = 2, 2, 4


def make_cache(pads: list[int], width: int, capacity: int | None = None, seed: int = 0) -> PaddedKVCache:
    """Random K/V over every column (pads included); capacity defaults to width + GROW."""
    g = torch.Generator().manual_seed(seed)
    shape = (len(pads), HEADS, capacity or width + GROW, DIM)
    keys = [torch.randn(shape, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(shape, generator=g) for _ in range(LAYERS)]
    return PaddedKVCache(keys, values, torch.tensor(pads, dtype=torch.long), width)


def real_parts(cache: PaddedKVCache) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per row, per layer: (K, V) of the real (non-pad) columns, cloned."""
    out = []
    for row in range(cache.batch_size):
        pad = int(cache.pads[row])
        out.append([(cache.keys[l][row, :, pad:cache.width].clone(), cache.values[l][row, :, pad:cache.width].clone())
                    for l in range(LAYERS)])
    return out


def assert_rows_equal(cache: PaddedKVCache, expected_rows) -> None:
    assert cache.batch_size == len(expected_rows)
    for row, layers in enumerate(expected_rows):
        pad = int(cache.pads[row])
        for l, (k, v) in enumerate(layers):
            assert cache.width - pad == k.shape[1], (row, l)
            assert torch.equal(cache.keys[l][row, :, pad:cache.width], k), (row, l)
            assert torch.equal(cache.values[l][row, :, pad:cache.width], v), (row, l)


# -- concatenate --------------------------------------------------------------------------------
@pytest.mark.parametrize("narrow_first", [True, False])
def test_concatenate_right_aligns_rows_at_the_wider_width(narrow_first):
    narrow = make_cache([0, 2], width=3, seed=1)  # lengths 3, 1
    wide = make_cache([1, 0, 4], width=5, seed=2)  # lengths 4, 5, 1
    first, second = (narrow, wide) if narrow_first else (wide, narrow)
    expected = real_parts(first) + real_parts(second)
    expected_lengths = first.lengths().tolist() + second.lengths().tolist()

    merged = first.concatenate(second)

    assert merged.width == 5
    assert merged.batch_size == 5
    expected_pads = [2, 4, 1, 0, 4] if narrow_first else [1, 0, 4, 2, 4]
    assert merged.pads.tolist() == expected_pads
    assert merged.pads.dtype == torch.long
    assert merged.lengths().tolist() == expected_lengths
    assert merged.capacity >= merged.width
    for store in (merged.keys, merged.values):
        assert len(store) == LAYERS
        assert all(t.shape == (5, HEADS, merged.capacity, DIM) for t in store)
    assert_rows_equal(merged, expected)
    assert merged.num_tokens() == 5 * 5


def test_concatenate_equal_widths_keeps_pads():
    a = make_cache([0, 1], width=4, seed=3)
    b = make_cache([2], width=4, seed=4)
    expected = real_parts(a) + real_parts(b)
    merged = a.concatenate(b)
    assert merged.width == 4
    assert merged.pads.tolist() == [0, 1, 2]
    assert_rows_equal(merged, expected)


# -- filter ---------------------------------------------------------------------------------------
def test_filter_keeps_rows_in_the_given_order_and_trims_common_left_padding():
    cache = make_cache([3, 1, 0, 2], width=6, seed=5)
    before = real_parts(cache)
    old_keys = [k.clone() for k in cache.keys]
    old_values = [v.clone() for v in cache.values]

    kept = cache.filter([3, 0])  # pads 2 and 3: the common padding is 2

    assert kept.batch_size == 2
    assert kept.width == 4
    assert kept.pads.tolist() == [0, 1]
    assert kept.lengths().tolist() == [4, 3]
    assert kept.capacity >= kept.width
    assert_rows_equal(kept, [before[3], before[0]])
    # the whole trimmed window (the remaining pad column included) is the old columns [2, 6)
    for l in range(LAYERS):
        assert torch.equal(kept.keys[l][:, :, :4], old_keys[l][[3, 0], :, 2:6])
        assert torch.equal(kept.values[l][:, :, :4], old_values[l][[3, 0], :, 2:6])


def test_filter_without_common_padding_trims_nothing():
    cache = make_cache([3, 1, 0, 2], width=6, seed=6)
    before = real_parts(cache)
    kept = cache.filter([2, 1])
    assert kept.width == 6
    assert kept.pads.tolist() == [0, 1]
    assert_rows_equal(kept, [before[2], before[1]])


def test_filter_a_single_padded_row_trims_all_of_its_padding():
    cache = make_cache([3, 1, 0, 2], width=6, seed=7)
    before = real_parts(cache)
    kept = cache.filter([0])
    assert kept.width == 3
    assert kept.pads.tolist() == [0]
    assert_rows_equal(kept, [before[0]])


def test_filter_to_zero_rows_then_concatenate_a_new_batch():
    cache = make_cache([1, 0], width=4, seed=8)
    empty = cache.filter([])
    assert empty.batch_size == 0
    assert empty.width == 0
    assert empty.pads.tolist() == []
    assert empty.num_tokens() == 0
    assert all(t.shape[0] == 0 for t in empty.keys + empty.values)

    new = make_cache([0, 2], width=3, seed=9)
    expected = real_parts(new)
    merged = empty.concatenate(new)
    assert merged.width == 3
    assert merged.pads.tolist() == [0, 2]
    assert_rows_equal(merged, expected)


# -- growth and the mask -------------------------------------------------------------------------
def test_begin_forward_grows_the_capacity_and_keeps_contents():
    cache = make_cache([1, 0], width=5, capacity=6, seed=10)
    before = real_parts(cache)
    old_keys = [k[:, :, :5].clone() for k in cache.keys]
    cache.begin_forward(3)  # needs 8 columns > 6
    assert cache.capacity >= 8
    assert cache.width == 5
    for l in range(LAYERS):
        assert torch.equal(cache.keys[l][:, :, :5], old_keys[l])
        assert cache.keys[l].shape == (2, HEADS, cache.capacity, DIM)
    assert_rows_equal(cache, before)
    q = torch.randn(2, 3, HEADS, DIM)
    k = torch.randn(2, 3, HEADS, DIM)
    v = torch.randn(2, 3, HEADS, DIM)
    cache.forward(0, q, k, v)
    cache.end_forward()
    assert cache.width == 8
    assert torch.equal(cache.keys[0][:, :, :5], old_keys[0])
    assert torch.equal(cache.keys[0][:, :, 5:8], k.transpose(1, 2))
    assert torch.equal(cache.values[0][:, :, 5:8], v.transpose(1, 2))


def test_no_growth_when_the_capacity_suffices():
    cache = make_cache([0], width=2, capacity=10)
    keys = cache.keys[0]
    cache.begin_forward(8)
    assert cache.keys[0] is keys
    assert cache.capacity == 10


def expected_mask(pads: list[int], width: int, t: int, window: int | None = None) -> torch.Tensor:
    total = width + t
    m = torch.zeros(len(pads), 1, t, total, dtype=torch.bool)
    for b, pad in enumerate(pads):
        for i in range(t):
            q = width + i
            for k in range(total):
                if q < pad:  # a padding query (prefill only) sees just itself
                    m[b, 0, i, k] = k == q
                else:
                    m[b, 0, i, k] = pad <= k <= q and (window is None or k > q - window)
    return m


@pytest.mark.parametrize("pads,width,t", [
    ([2, 0, 4], 0, 5),  # prefill of a left-padded batch
    ([2, 0, 4], 5, 1),  # decode
    ([2, 0, 4], 5, 3),  # several new tokens on a cache
])
def test_mask_is_causal_hides_pads_and_has_no_empty_row(pads, width, t):
    """One mask per window the layers use: here layer 1 slides over 3 positions."""
    layers = [LayerOptions(DIM ** -0.5)] + [LayerOptions(DIM ** -0.5, window=3)] * (LAYERS - 1)
    cache = PaddedKVCache.empty(LAYERS, len(pads), HEADS, DIM, pads, 16, torch.float32, torch.device("cpu"), layers)
    cache.width = width
    cache.begin_forward(t)
    assert set(cache._masks) == {None, 3}
    for window, mask in cache._masks.items():
        assert mask.dtype == torch.bool
        assert mask.shape == (len(pads), 1, t, width + t)
        assert torch.equal(mask, expected_mask(pads, width, t, window))
        assert mask.any(dim=-1).all()  # no all-False query row
    cache.end_forward()
    assert cache._masks == {}
    assert cache.width == width + t


def attention_reference(q, keys, values):
    """Plain softmax attention of one row: q [T, Hq, D], keys/values [H, N, D] (no mask: all real)."""
    scores = torch.einsum("thd,hnd->htn", q, keys) / DIM ** 0.5
    return torch.einsum("htn,hnd->thd", scores.softmax(-1), values)


def test_attention_after_concatenate_ignores_whatever_fresh_memory_holds(monkeypatch):
    """`concatenate` allocates with new_empty: the pad columns hold whatever memory held before
    (on a reused block that may be NaN or inf). The output of every row must not depend on it."""
    a = make_cache([0, 2], width=3, seed=11)
    b = make_cache([1, 0], width=5, seed=12)
    expected = real_parts(a) + real_parts(b)
    real_new_empty = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):
        return real_new_empty(self, *args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)
    merged = a.concatenate(b)
    monkeypatch.undo()

    g = torch.Generator().manual_seed(13)
    q = torch.randn(4, 1, HEADS, DIM, generator=g)
    k = torch.randn(4, 1, HEADS, DIM, generator=g)
    v = torch.randn(4, 1, HEADS, DIM, generator=g)
    merged.begin_forward(1)
    out = merged.forward(0, q, k, v)
    merged.end_forward()
    nan_rows = [row for row in range(4) if not torch.isfinite(out[row]).all()]
    assert nan_rows == [], f"garbage in the left-pad columns leaked into the attention of rows {nan_rows}"
    for row, layers in enumerate(expected):
        rk, rv = layers[0]
        ref = attention_reference(q[row], torch.cat([rk, k[row].transpose(0, 1)], 1),
                                  torch.cat([rv, v[row].transpose(0, 1)], 1))
        torch.testing.assert_close(out[row], ref, rtol=1e-5, atol=1e-5)


def test_attend_matches_plain_attention_per_row_and_writes_the_new_columns():
    cache = make_cache([2, 0], width=4, seed=14)
    before = real_parts(cache)
    g = torch.Generator().manual_seed(15)
    q = torch.randn(2, 2, HEADS * 2, DIM, generator=g)  # GQA: 4 query heads on 2 KV heads
    k = torch.randn(2, 2, HEADS, DIM, generator=g)
    v = torch.randn(2, 2, HEADS, DIM, generator=g)
    cache.begin_forward(2)
    out = cache.forward(1, q, k, v)
    cache.end_forward()
    assert out.shape == (2, 2, HEADS * 2, DIM)
    for row in range(2):
        rk, rv = before[row][1]
        keys = torch.cat([rk, k[row].transpose(0, 1)], 1).repeat_interleave(2, dim=0)
        values = torch.cat([rv, v[row].transpose(0, 1)], 1).repeat_interleave(2, dim=0)
        n = keys.shape[1]
        for i in range(2):  # causal among the two new tokens
            ref = attention_reference(q[row, i:i + 1], keys[:, : n - 1 + i], values[:, : n - 1 + i])
            torch.testing.assert_close(out[row, i:i + 1], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.keys[1][:, :, 4:6], k.transpose(1, 2))


# -- on a real model --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner(tiny_model):
    r = ModelRunner(ModelConfig(local_dir=str(tiny_model), dtype="fp32"), ModelSpec.read(str(tiny_model), 1024),
                    device=torch.device("cpu"))
    r.load()
    assert r.is_native
    return r


P1 = [1, 17, 203]
P2 = [1, 44, 5, 900, 61, 62, 7]
P3 = [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310]
TOL = dict(rtol=0, atol=1e-4)


def alone(runner, prompt, decode_tokens):
    """Logits after the prefill, then after each decode token, for one prompt on its own."""
    logits, cache = runner.prefill([prompt])
    out = [logits[0]]
    for tok in decode_tokens:
        out.append(runner.decode(cache, [tok])[0])
    return out


def test_concatenate_and_filter_of_real_caches_equal_each_prompt_alone(runner):
    ref1 = alone(runner, P1, [11, 12, 13])
    ref2 = alone(runner, P2, [21, 22, 23])
    ref3 = alone(runner, P3, [31, 32])

    logits, batch = runner.prefill([P1, P2])
    assert batch.pads.tolist() == [4, 0]
    torch.testing.assert_close(logits[0], ref1[0], **TOL)
    torch.testing.assert_close(logits[1], ref2[0], **TOL)
    logits = runner.decode(batch, [11, 21])
    torch.testing.assert_close(logits[0], ref1[1], **TOL)
    torch.testing.assert_close(logits[1], ref2[1], **TOL)

    logits3, newcomer = runner.prefill([P3])
    torch.testing.assert_close(logits3[0], ref3[0], **TOL)
    merged = batch.concatenate(newcomer)  # widths 8 and 12
    assert merged.width == 12
    assert merged.pads.tolist() == [8, 4, 0]
    logits = runner.decode(merged, [12, 22, 31])
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[0], ref1[2], **TOL)
    torch.testing.assert_close(logits[1], ref2[2], **TOL)
    torch.testing.assert_close(logits[2], ref3[1], **TOL)

    kept = merged.filter([2, 0])  # drop P2: P3 has no padding, nothing trimmed
    assert kept.width == 13
    assert kept.pads.tolist() == [0, 8]
    logits = runner.decode(kept, [32, 13])
    torch.testing.assert_close(logits[0], ref3[2], **TOL)
    torch.testing.assert_close(logits[1], ref1[3], **TOL)


def test_filter_that_trims_padding_of_a_real_cache_keeps_logits(runner):
    ref1 = alone(runner, P1, [11, 12])
    logits, batch = runner.prefill([P1, P3])
    runner.decode(batch, [11, 31])
    kept = batch.filter([0])  # P1 alone: its 9 columns of padding go
    assert kept.width == 4
    assert kept.pads.tolist() == [0]
    logits = runner.decode(kept, [12])
    torch.testing.assert_close(logits[0], ref1[2], **TOL)
