"""The load-optimised checkpoint cache (option.load_cache_dir), on the real loader and real files."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from engines.spec import ModelSpec
from engines.config import ModelConfig
from engines.weights.load_cache import ALIGN, cache_paths
from engines.worker.model_runner import ModelRunner

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 20, 21]]


def load(model_dir, cache_dir=None) -> ModelRunner:
    # aten: the linears keep their weights as parameters, which the assertions compare with the cache's
    config = ModelConfig(local_dir=str(model_dir), dtype="fp32", load_cache_dir=cache_dir and str(cache_dir),
                         cpu_linear="aten")
    runner = ModelRunner(config, ModelSpec.read(str(model_dir), 1024))
    runner.load()
    return runner


def same_weights(a: ModelRunner, b: ModelRunner) -> bool:
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    return copy


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "engines.weights.loader"]


def test_first_load_writes_the_cache_and_the_next_reads_it(model_copy, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    reference = load(model_copy)
    first = load(model_copy, tmp_path / "cache")
    bin_path, index_path = cache_paths(str(tmp_path / "cache"), str(model_copy), torch.float32, 0, 1)
    assert any(m.startswith(f"load cache {bin_path}: no cache yet") for m in messages(caplog))
    index = json.loads(open(index_path).read())["tensors"]
    assert set(index) == set(dict(reference.model.named_parameters()))
    assert all(e["offset"] % ALIGN == 0 for e in index.values())
    # 205,120 fp32 parameters, each tensor at a 4 KiB boundary
    assert sum(e["nbytes"] for e in index.values()) == 205_120 * 4
    caplog.clear()
    second = load(model_copy, tmp_path / "cache")
    assert any(m.startswith("loaded ") and f"from the load cache {bin_path}" in m for m in messages(caplog))
    assert same_weights(first, reference) and same_weights(second, reference)
    logits, _ = second.prefill(PROMPTS)
    assert torch.equal(logits, reference.prefill(PROMPTS)[0])


def test_a_corrupted_cache_is_detected_and_rebuilt(model_copy, tmp_path, caplog):
    reference = load(model_copy, tmp_path / "cache")
    bin_path, index_path = cache_paths(str(tmp_path / "cache"), str(model_copy), torch.float32, 0, 1)
    entry = json.loads(open(index_path).read())["tensors"]["norm.weight"]
    with open(bin_path, "r+b") as f:  # flip one byte of one tensor
        f.seek(entry["offset"] + 5)
        byte = f.read(1)
        f.seek(entry["offset"] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    caplog.set_level(logging.INFO)
    rebuilt = load(model_copy, tmp_path / "cache")
    size = json.loads(open(index_path).read())["file_bytes"]  # the tiny model's file is one 16 MiB piece
    assert any(m.startswith(f"load cache {bin_path}: corrupt: CRC-32 mismatch in bytes 0-{size} (")
               and m.endswith("…); loading the safetensors files and rebuilding it") for m in messages(caplog))
    assert same_weights(rebuilt, reference)
    caplog.clear()
    again = load(model_copy, tmp_path / "cache")  # the rebuilt cache is whole again
    assert any(f"from the load cache {bin_path}" in m for m in messages(caplog))
    assert same_weights(again, reference)


def test_a_truncated_cache_is_detected(model_copy, tmp_path, caplog):
    load(model_copy, tmp_path / "cache")
    bin_path, _ = cache_paths(str(tmp_path / "cache"), str(model_copy), torch.float32, 0, 1)
    with open(bin_path, "r+b") as f:
        f.truncate(1000)
    caplog.set_level(logging.INFO)
    load(model_copy, tmp_path / "cache")
    assert any(m.startswith(f"load cache {bin_path}: truncated: 1000 bytes") for m in messages(caplog))


def test_a_changed_checkpoint_makes_the_cache_stale(model_copy, tmp_path, caplog):
    from container.model_maker import make_model

    load(model_copy, tmp_path / "cache")
    make_model(str(model_copy), seed=1)  # new weights, same shapes
    caplog.set_level(logging.INFO)
    fresh = load(model_copy, tmp_path / "cache")
    bin_path, _ = cache_paths(str(tmp_path / "cache"), str(model_copy), torch.float32, 0, 1)
    assert f"load cache {bin_path}: stale: the checkpoint files changed; loading the safetensors files and " \
           "rebuilding it" in messages(caplog)
    assert same_weights(fresh, load(model_copy))


def test_a_server_restarted_with_a_load_cache_reads_it(tiny_model, tmp_path, start_server, hf):
    properties = f"option.load_cache_dir={tmp_path / 'cache'}\noption.dtype=fp32\noption.max_rolling_batch_size=4\n"
    first = start_server(properties, tiny_model)
    assert "load cache written: " in first.log()
    assert first.stop() == 0
    second = start_server(properties, tiny_model)
    assert "from the load cache" in second.log()
    body = second.post({"inputs": "The river ran", "parameters": {"max_new_tokens": 12, "details": True}}).json()
    assert [t["id"] for t in body["details"]["tokens"]] == hf("The river ran", 12)


def test_pieces_are_checked_one_by_one_and_a_bad_piece_names_its_tensors(model_copy, tmp_path, caplog, monkeypatch):
    from engines.weights import load_cache

    monkeypatch.setattr(load_cache, "CHUNK", 64 << 10)  # the tiny model's 0.8 MB file in 13 pieces
    reference = load(model_copy, tmp_path / "cache")
    bin_path, index_path = cache_paths(str(tmp_path / "cache"), str(model_copy), torch.float32, 0, 1)
    index = json.loads(open(index_path).read())
    assert index["chunk_bytes"] == 64 << 10 and len(index["chunk_crc32"]) == -(-index["file_bytes"] // (64 << 10))
    caplog.set_level(logging.INFO)
    whole = load(model_copy, tmp_path / "cache")
    assert any(f"from the load cache {bin_path}" in m for m in messages(caplog)) and same_weights(whole, reference)
    offset = index["tensors"]["norm.weight"]["offset"]
    with open(bin_path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    caplog.clear()
    rebuilt = load(model_copy, tmp_path / "cache")
    start = offset // (64 << 10) * (64 << 10)
    [line] = [m for m in messages(caplog) if "corrupt" in m]
    assert line.startswith(f"load cache {bin_path}: corrupt: CRC-32 mismatch in bytes {start}-{start + (64 << 10)} (")
    assert "norm.weight" in line and same_weights(rebuilt, reference)


def test_weights_are_copy_on_write_views_of_the_cache_file(model_copy, tmp_path):
    load(model_copy, tmp_path / "cache")
    bin_path, _ = cache_paths(str(tmp_path / "cache"), str(model_copy), torch.float32, 0, 1)
    before = open(bin_path, "rb").read()
    runner = load(model_copy, tmp_path / "cache")
    for p in runner.model.parameters():
        p.data.add_(1.0)  # a write to a weight stays in this process
    del runner
    assert open(bin_path, "rb").read() == before


def test_a_cache_in_the_previous_format_is_rebuilt(model_copy, tmp_path, caplog):
    reference = load(model_copy, tmp_path / "cache")
    _, index_path = cache_paths(str(tmp_path / "cache"), str(model_copy), torch.float32, 0, 1)
    index = json.loads(open(index_path).read())
    del index["format"]
    open(index_path, "w").write(json.dumps(index))
    caplog.set_level(logging.INFO)
    rebuilt = load(model_copy, tmp_path / "cache")
    assert any("written in format 1, this version reads 2; loading the safetensors files" in m
               for m in messages(caplog))
    assert same_weights(rebuilt, reference)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cache_loads_to_cuda_through_pinned_staging_buffers(model_copy, tmp_path, monkeypatch):
    import copy

    from engines.weights import load_cache

    monkeypatch.setattr(load_cache, "STAGING_BYTES", 4096)  # many round trips through both buffers
    reference = load(model_copy, tmp_path / "cache")
    bin_path, index_path = cache_paths(str(tmp_path / "cache"), str(model_copy), torch.float32, 0, 1)
    model = copy.deepcopy(reference.model).to("cuda")
    for p in model.parameters():
        p.data.zero_()
    source = json.loads(open(index_path).read())["source"]
    assert load_cache.load(model, bin_path, index_path, source) == json.loads(open(index_path).read())["file_bytes"]
    ref = dict(reference.model.named_parameters())
    for name, p in model.named_parameters():
        assert p.device.type == "cuda" and torch.equal(p.cpu(), ref[name]), name
