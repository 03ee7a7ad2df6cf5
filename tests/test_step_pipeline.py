"""The paged engine's step as a pipeline on persistent buffers, run on CPU the way a GPU runs it:
the decode graphs' static buffers and buckets replayed eagerly (capture is the only CUDA-only
part), the Triton attention kernel and fused ops under Triton's interpreter, pipelined steps that
feed sampled tokens on the device. Every view a forward reads is checked for out-of-range
indices, and greedy output equals HF `generate`. Also: the scheduling modes and their refusals."""

from __future__ import annotations

import pytest
import torch

from engines.attention.step import LayerOptions
from engines.config import SchedulerConfig
from engines.core.modes import scheduling_mode
from engines.kernels import fused_ops
from engines.layers.fused import fused_ops_of, is_triton, use_fused_ops
from engines.sampling_params import SamplingParams
from engines.worker import paged_runner
from engines.loop.paged_engine import PagedEngine
from engines.worker.step_buffers import StepBuffers
from engines.worker.step_graphs import StepGraphs
from tests.support import paged_engine as make_engine
from tests.support import compare_backends_over_mixed_steps, drive_engine, output_tokens

PROMPTS = [[1] + [5, 6, 7, 8, 9] * 2 + list(range(20, 24 + 3 * i)) for i in range(6)]


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Decode steps through StepGraphs (eagerly over its static views on CPU), the step buffers staged
    as on CUDA (two host sets, each section copied to the device set), every view checked, replays
    counted."""
    counts = {"replays": 0, "views": 0}
    monkeypatch.setattr(PagedEngine, "_decode_mode", lambda self: (paged_runner.DECODE_GRAPHS, "test"))
    monkeypatch.setattr(StepBuffers, "STAGE_ON_CPU", True)
    write, replay = StepBuffers.write, StepGraphs.replay

    def checked_write(self, batch, fed_tokens=None):
        view = write(self, batch, fed_tokens)
        self.check(view, self.scratch_block, 1024)
        counts["views"] += 1
        return view

    def counted_replay(self, rows):
        counts["replays"] += 1
        return replay(self, rows)

    monkeypatch.setattr(StepBuffers, "write", checked_write)
    monkeypatch.setattr(StepGraphs, "replay", counted_replay)
    return counts


def triton_ops(engine: PagedEngine) -> None:
    """The fused Triton ops (under the interpreter) for the engine's model's norms, rotary and MLP."""
    use_fused_ops(engine.runner.model, fused_ops)


def greedy_equals_hf(engine: PagedEngine, hf, max_new: int = 12, join_every: int = 2) -> None:
    """Requests joining every `join_every` steps (decode batches of 1 to 4 rows: buckets 1, 2, 4)."""
    outs = drive_engine(engine, [(f"g{i}", p, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
                                 for i, p in enumerate(PROMPTS)], join_every)
    for i, p in enumerate(PROMPTS):
        assert output_tokens(outs[f"g{i}"]) == hf(p, max_new), i
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("sched", [dict(), dict(async_scheduling=False), dict(num_scheduler_steps=4),
                                   dict(speculative_method="ngram", num_speculative_tokens=3)],
                         ids=["async", "sync", "multi_step", "ngram"])
def test_decode_graphs_on_static_buffers_give_hf_greedy_tokens(tiny_model, hf, graphs_on_cpu, sched):
    engine = make_engine(tiny_model, **sched)
    paged = engine.paged.target
    assert paged.decode_mode == "graphs" and paged.graphs.buckets == [1, 2, 4]
    assert len(paged.buffers._host_sets) == 2 and paged.buffers._host_sets[0] is not paged.buffers.device_set
    graphs_on_cpu["replays"] = 0  # (the warm-up ran before the capture)
    greedy_equals_hf(engine, hf)
    assert graphs_on_cpu["replays"] > (0 if "speculative_method" in sched else 10)  # proposals: mixed steps


def test_the_cuda_default_runs_on_cpu_triton_attention_fused_ops_graphs_pipelined(tiny_model, hf, graphs_on_cpu):
    """What a GPU without flash-attn runs by default, each piece on CPU: the Triton paged-attention
    kernel in every layer (prefill chunks, decodes, pad sequences), the fused Triton norms, rotary
    and SiLU x mul, decode steps replayed over the graphs' static buffers, pipelined steps."""
    engine = make_engine(tiny_model, attention_backend="triton", max_num_batched_tokens=16)
    triton_ops(engine)
    assert engine.paged.backend.name == "triton" and engine.mode.pipelined and is_triton(fused_ops_of(engine.runner.model))
    greedy_equals_hf(engine, hf, max_new=8)
    assert graphs_on_cpu["replays"] > 5


def test_the_triton_backend_verifies_proposals_and_chunks_prompts(tiny_model, hf):
    engine = make_engine(tiny_model, attention_backend="triton", speculative_method="ngram",
                         num_speculative_tokens=3, max_num_batched_tokens=16)
    greedy_equals_hf(engine, hf, max_new=10)
    assert engine.metrics()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("layer", [None, LayerOptions(0.3, window=5, softcap=20.0), LayerOptions(0.25, window=17)],
                         ids=["plain", "window-softcap", "window"])
def test_the_triton_backend_matches_the_torch_backend_over_mixed_steps(layer):
    """Also with a sliding window shorter than a block or a little longer, and Gemma-2's softcap."""
    from engines.attention.torch_backend import TorchPagedBackend
    from engines.attention.triton_backend import TritonPagedBackend

    compare_backends_over_mixed_steps(TorchPagedBackend, TritonPagedBackend, torch.device("cpu"), torch.float32, 16,
                                      atol=1e-5, heads=(4, 2), dim=16, layer=layer)


# -- scheduling modes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings,name,pipelined,step_kind", [
    (dict(), "async", True, "one"), (dict(async_scheduling=True), "async", True, "one"),
    (dict(async_scheduling=False), "sync", False, "one"),
    (dict(speculative_method="ngram"), "speculative (ngram)", False, "speculative"),
    (dict(num_scheduler_steps=4), "multi-step (4)", False, "multi-step"),
    (dict(num_scheduler_steps=4, async_scheduling=False), "multi-step (4)", False, "multi-step")])
def test_the_scheduling_mode_is_chosen_once_from_the_settings(settings, name, pipelined, step_kind):
    from engines.worker.step_kinds import STEP_KINDS

    mode = scheduling_mode(SchedulerConfig(**settings))
    assert (mode.name, mode.pipelined, mode.step_kind) == (name, pipelined, step_kind) and mode.why
    assert STEP_KINDS[mode.step_kind].name == step_kind  # the runner's strategy for it


def test_a_plan_its_step_kind_was_not_chosen_for_fails_loudly():
    """Proposals to a runner that does not verify, several steps to one that runs one: the step fails
    (its requests get a 424), nothing is silently dropped."""
    from types import SimpleNamespace

    from engines.worker.step_kinds import OneStep, Speculative

    with pytest.raises(AssertionError, match="a plan of 3 steps, and the runner runs one at a time"):
        Speculative().launch(None, SimpleNamespace(num_steps=3))
    with pytest.raises(AssertionError, match=r"proposals to verify for \['r1'\], and speculative decoding is off"):
        OneStep().verify(None, SimpleNamespace(spec_ids=["r1"]), None)


@pytest.mark.parametrize("settings,message", [
    (dict(speculative_method="ngram", async_scheduling=True),
     "option.async_scheduling=true with option.speculative_method=ngram: that mode runs one plan at a time"),
    (dict(num_scheduler_steps=8, async_scheduling=True),
     "option.async_scheduling=true with option.num_scheduler_steps=8: that mode runs one plan at a time"),
    (dict(speculative_method="draft", num_scheduler_steps=2),
     "option.speculative_method=draft with option.num_scheduler_steps=2: speculative decoding and multi-step")])
def test_a_combination_that_cannot_work_is_refused_not_changed(settings, message):
    with pytest.raises(ValueError, match=message):
        scheduling_mode(SchedulerConfig(**settings))
