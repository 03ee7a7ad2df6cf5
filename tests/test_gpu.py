"""CUDA paths: run wherever a GPU is available, skipped elsewhere (the CPU suite covers the logic)."""

from __future__ import annotations

import pytest
import torch

from engines.spec import ModelSpec
from engines.attention.step import LayerOptions
from engines.attention.registry import flash_attn_available
from engines.config import ModelConfig
from engines.core.plan import NewRequest, StepPlan
from engines.sampling_params import SamplingParams
from engines.worker.model_runner import ModelRunner
from engines.worker.paged_runner import PagedRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 20, 21], [1] + list(range(100, 140))]


def _runner(model_dir, device: str) -> ModelRunner:
    runner = ModelRunner(ModelConfig(local_dir=str(model_dir), dtype="fp32"), ModelSpec.read(str(model_dir), 1024),
                         device=torch.device(device))
    runner.load()
    return runner


def test_padded_prefill_and_decode_on_cuda_match_cpu(tiny_model):
    outs = {}
    for device in ("cpu", "cuda"):
        runner = _runner(tiny_model, device)
        logits, cache = runner.prefill(PROMPTS)
        step = runner.decode(cache, logits.argmax(-1).tolist())
        outs[device] = (logits.cpu(), step.cpu())
    assert torch.allclose(outs["cpu"][0], outs["cuda"][0], atol=1e-3)
    assert torch.allclose(outs["cpu"][1], outs["cuda"][1], atol=1e-3)


def test_paged_step_on_cuda_matches_cpu(tiny_model):
    outs = {}
    for device in ("cpu", "cuda"):
        paged = PagedRunner(_runner(tiny_model, device))
        paged.allocate(64, 16, 4, 1024)
        plan = StepPlan()
        for i, p in enumerate(PROMPTS):
            plan.new_requests.append(NewRequest(f"r{i}", p, len(p), [4 * i, 4 * i + 1, 4 * i + 2], 0,
                                                SamplingParams()))
            plan.add(f"r{i}", len(p))
        samples = paged.execute(plan).samples
        outs[device] = ([s.token_ids for s in samples], torch.tensor([s.log_probs for s in samples]))
    assert outs["cpu"][0] == outs["cuda"][0]
    assert torch.allclose(outs["cpu"][1], outs["cuda"][1], atol=1e-3)


@pytest.mark.skipif(not flash_attn_available(torch.device("cuda")) if torch.cuda.is_available() else True,
                    reason="needs flash-attn")
def test_flash_attn_backend_matches_the_torch_backend_over_mixed_steps():
    """Prefill chunks, decodes and padding over several steps: the same outputs within bf16 tolerance."""
    from engines.attention.flash_backend import FlashAttnBackend
    from engines.attention.torch_backend import TorchPagedBackend
    from tests.support import compare_backends_over_mixed_steps

    compare_backends_over_mixed_steps(TorchPagedBackend, FlashAttnBackend, torch.device("cuda"), torch.bfloat16,
                                      256, atol=2e-2)
    compare_backends_over_mixed_steps(TorchPagedBackend, FlashAttnBackend, torch.device("cuda"), torch.bfloat16,
                                      256, atol=2e-2, layer=LayerOptions(0.3, window=40, softcap=20.0))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("layer", [None, LayerOptions(0.3, window=40, softcap=20.0)], ids=["plain", "window-softcap"])
def test_triton_backend_matches_the_torch_backend_over_mixed_steps(dtype, atol, layer):
    from engines.attention.torch_backend import TorchPagedBackend
    from engines.attention.triton_backend import TritonPagedBackend
    from tests.support import compare_backends_over_mixed_steps

    compare_backends_over_mixed_steps(TorchPagedBackend, TritonPagedBackend, torch.device("cuda"), dtype, 16,
                                      atol=atol, layer=layer)


def test_cuda_kv_cache_leaves_the_profiled_activation_peak_free(tiny_model):
    """The paged engine sizes its cache after a profiling forward: with gpu_memory_utilization=0.5,
    half the GPU is in use once the cache is allocated (weights, context, cache), within 2%."""
    from engines.config import LmiConfig, SchedulerConfig
    from engines.loop.paged_engine import PagedEngine

    config = LmiConfig(model=ModelConfig(local_dir=str(tiny_model), dtype="fp16"),
                       scheduler=SchedulerConfig(gpu_memory_utilization=0.5))
    engine = PagedEngine(config, publish=lambda outputs: None)
    engine.load()
    assert engine.runner.warm_up(1024) > 0  # the profiling forward measures a peak
    free, total = torch.cuda.mem_get_info()
    assert abs((total - free) - 0.5 * total) < 0.02 * total


def _paged_engine(tiny_model, **sched):
    from engines.config import ENGINE_PAGED, LmiConfig, SchedulerConfig
    from engines.loop.paged_engine import PagedEngine

    sched = {"max_num_seqs": 8, "gpu_memory_utilization": 0.3, **sched}
    config = LmiConfig(model=ModelConfig(local_dir=str(tiny_model), dtype="fp32"),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_PAGED, **sched))
    engine = PagedEngine(config, publish=lambda outputs: None)
    engine.load()
    return engine


def test_decode_cuda_graph_replay_equals_the_eager_step(tiny_model):
    """Each bucket's graph against the eager model on the same buffers, cache contents and inputs."""
    from engines.attention.step import ForwardBatch, SeqChunk

    engine = _paged_engine(tiny_model)
    paged = engine.paged.target
    assert paged.decode_mode == "graphs" and paged.graphs.buckets == paged.buffers.decode_buckets
    for n in (1, 3, 8):
        batch = ForwardBatch([SeqChunk(4 + i, 1, [2 * i, 2 * i + 1], [7 + i]) for i in range(n)], list(range(n)))
        graph_logits = paged.forward(batch).clone()
        view = paged.buffers.write(batch)
        eager = paged._run_model(view, paged.backend.metadata(view))[:n]
        torch.testing.assert_close(graph_logits, eager, atol=1e-3, rtol=1e-3)


def test_greedy_with_cuda_graphs_equals_enforce_eager(tiny_model):
    from engines.protocol import Add

    results = {}
    for eager in (False, True):
        engine = _paged_engine(tiny_model, enforce_eager=eager)
        assert engine.paged.target.decode_mode == ("eager" if eager else "graphs")
        outputs: dict[str, list[int]] = {}
        engine.publish = lambda outs: [outputs.setdefault(o.request_id, []).extend(o.token_ids) for o in outs]
        for i in range(6):  # crossing the 1, 2, 4, 8 buckets as requests join
            engine.add(Add(f"r{i}", [1] + list(range(10 + i, 20 + 3 * i)), SamplingParams(max_new_tokens=12 + i)))
            engine.step()
        while engine.has_work():
            engine.step()
        results[eager] = outputs
    assert results[False] == results[True]


@pytest.mark.parametrize("sched", [dict(attention_backend="torch"), dict(attention_backend="triton"),
                                   dict(attention_backend="flex"), dict(enforce_eager=True),
                                   dict(speculative_method="ngram", num_speculative_tokens=3),
                                   dict(speculative_method="draft", speculative_model="self", num_speculative_tokens=3),
                                   dict(num_scheduler_steps=4), dict(async_scheduling=True),
                                   dict(async_scheduling=False)],
                         ids=["torch", "triton", "flex", "eager", "ngram", "draft", "multi_step", "async", "sync"])
def test_the_paged_engine_on_cuda_gives_hf_greedy_tokens(tiny_model, hf, sched):
    """The CUDA paths: each attention backend, graphs on and off, verification rows, a multi-step run
    replaying the decode graphs with the sampled ids fed on the device, pipelined steps."""
    from engines.protocol import Add

    if sched.get("speculative_model") == "self":
        sched = dict(sched, speculative_model=str(tiny_model))
    engine = _paged_engine(tiny_model, **sched)
    outputs: dict[str, list[int]] = {}
    engine.publish = lambda outs: [outputs.setdefault(o.request_id, []).extend(o.token_ids) for o in outs]
    prompts = [[1] + [5, 6, 7, 8] * 3 + list(range(10 + i, 20 + 3 * i)) for i in range(6)]
    for i, p in enumerate(prompts):  # joining one by one: decode buckets 1, 2, 4, 8
        engine.add(Add(f"r{i}", p, SamplingParams(max_new_tokens=16)))
        engine.step()
    while engine.has_work():
        engine.step()
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == hf(p, 16), i
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    if "num_scheduler_steps" in sched:
        assert engine.num_multi_steps > 0 and engine.paged.target.decode_mode == "graphs"
    if "speculative_method" in sched:
        assert engine.metrics()["spec_accepted_tokens"] > 0


def test_64_concurrent_requests_on_cuda_with_default_settings_give_hf_greedy_tokens(tiny_model, hf):
    """The default engine (graphs, the auto backend, async scheduling) with 64 requests at once."""
    from engines.protocol import Add

    engine = _paged_engine(tiny_model, max_num_seqs=64)
    outputs: dict[str, list[int]] = {}
    engine.publish = lambda outs: [outputs.setdefault(o.request_id, []).extend(o.token_ids) for o in outs]
    prompts = [[1] + list(range(10 + i, 14 + i + i % 7)) for i in range(64)]
    for i, p in enumerate(prompts):
        engine.add(Add(f"r{i}", p, SamplingParams(max_new_tokens=24, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == hf(p, 24), i
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_kv_tiers_on_cuda_write_through_pinned_copies_and_load_back(tiny_model, hf, tmp_path):
    """The KV tiers' CUDA path (docs/kv-tiers.md): blocks gathered on a stream of their own, copied
    to pinned memory and written once the copy is done; a second engine (an empty pool) loads them
    back to the device: every full block of each prompt from the host tier, HF's tokens."""
    from engines.protocol import Add

    opts = dict(enable_prefix_caching=True, kv_offload_memory="32MiB", kv_offload_memory_dir=str(tmp_path / "shm"),
                kv_offload_dir=str(tmp_path / "disk"))
    prompts = [[1] + [(7 * i + 5 * n) % 900 + 3 for i in range(n)] for n in (40, 47, 55)]
    for round_ in ("write", "read"):
        engine = _paged_engine(tiny_model, **opts)
        outputs: dict[str, list[int]] = {}
        engine.publish = lambda outs: [outputs.setdefault(o.request_id, []).extend(o.token_ids) for o in outs]
        for i, p in enumerate(prompts):
            engine.add(Add(f"{round_}{i}", p, SamplingParams(max_new_tokens=8)))
            engine.step()
        while engine.has_work():
            engine.step()
        assert [outputs[f"{round_}{i}"] for i in range(len(prompts))] == [hf(p, 8) for p in prompts], round_
        metrics = engine.metrics()
        engine.stop_ranks()  # (the last save's files written)
    assert metrics["kv_tier_host_hit_tokens"] == sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert metrics["kv_tier_disk_blocks"] == metrics["kv_tier_host_blocks"] > 0
