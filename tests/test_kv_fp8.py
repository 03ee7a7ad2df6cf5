"""option.kv_cache_dtype=fp8 / fp8_e5m2: the paged engine's K/V stored in one byte each by the torch
attention backend (the backend CUDA runs too; nothing in it is CUDA-only). The exact oracle: the
backend over an fp8 cache gives the same output, bit for bit, as over a model-dtype cache holding
K/V already rounded through fp8; then the engine end to end, the bytes it holds, and the refusals."""

from __future__ import annotations

import functools

import pytest
import torch

from container.config import ConfigError, build, resolve
from engines.attention.registry import select_backend
from engines.attention.torch_backend import TorchPagedBackend
from engines.sampling_params import SamplingParams
from tests.support import compare_backends_over_mixed_steps, drive_engine, local_engine, output_tokens
from tests.test_quantization import HELD_TEXT, _top1

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def rounded_through(fp8: torch.dtype) -> type[TorchPagedBackend]:
    class Rounded(TorchPagedBackend):
        """The oracle: a model-dtype cache fed K/V rounded to fp8 and back."""

        def forward(self, layer, q, k, v, meta):
            return super().forward(layer, q, k.to(fp8).to(k.dtype), v.to(fp8).to(v.dtype), meta)

    return Rounded


@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_cache_reads_back_exactly_the_rounded_values(name, dtype) -> None:
    fp8 = FP8[name]
    compare_backends_over_mixed_steps(rounded_through(fp8), functools.partial(TorchPagedBackend, kv_dtype=fp8),
                                      torch.device("cpu"), dtype, block_size=16, atol=0)


def test_fp8_cache_rounds_and_saturates() -> None:
    """Stored K differs from the model's by fp8's rounding; e4m3 saturates at ±448 (no NaN)."""
    backend = TorchPagedBackend(1, 1, 8, 4, torch.float32, torch.device("cpu"), kv_dtype=torch.float8_e4m3fn)
    backend.allocate(2)
    assert backend.keys[0].dtype == torch.float8_e4m3fn and backend.num_bytes == 2 * 3 * 4 * 8
    k = torch.tensor([[1000.0, -1000.0, 0.1, 3.0, 300.0, 1e-3, -2.5, 7.0]]).view(1, 1, 8)
    from engines.attention.torch_backend import store_kv

    store_kv(k, k, backend.keys[0], backend.values[0], torch.tensor([5]))
    stored = backend.keys[0].view(1, -1, 8)[0, 5].float()
    assert stored.tolist() == [448.0, -448.0, 0.1015625, 3.0, 288.0, 2.0**-9, -2.5, 7.0]  # 1e-3: the smallest subnormal


def test_auto_picks_the_torch_backend_for_an_fp8_cache_and_others_refuse() -> None:
    assert select_backend("auto", torch.device("cpu"), torch.float8_e4m3fn) is TorchPagedBackend
    from engines.attention.flex_backend import FlexPagedBackend

    with pytest.raises(ValueError, match="needs the torch attention backend"):
        FlexPagedBackend(1, 1, 8, 16, torch.float32, torch.device("cpu"), kv_dtype=torch.float8_e4m3fn)


@pytest.fixture(scope="module")
def held(tiny_model):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_model))(HELD_TEXT)["input_ids"]
    return ids, _top1(local_engine(tiny_model, "paged"), ids)


# Measured on the tiny random model (fp32): fp8 (e4m3) 1.000, fp8_e5m2 1.000 over the 118 held positions.
@pytest.mark.parametrize("name, floor", [("fp8", 0.97), ("fp8_e5m2", 0.95)])
def test_paged_engine_serves_with_an_fp8_cache_at_half_the_bytes(tiny_model, held, name, floor) -> None:
    ids, reference = held
    base = local_engine(tiny_model, "paged", dtype="bf16")
    engine = local_engine(tiny_model, "paged", dtype="bf16", kv_cache_dtype=name)
    assert engine.runner.kv_bytes_per_token * 2 == base.runner.kv_bytes_per_token
    assert engine.paged.backend.keys[0].dtype == FP8[name]
    agreement = (_top1(local_engine(tiny_model, "paged", kv_cache_dtype=name), ids) == reference).float().mean().item()
    print(f"{name}: teacher-forced top-1 agreement {agreement:.3f} over {len(ids)} positions")
    assert agreement >= floor
    # requests joining mid-flight, prefix caching on: prompts share their first 12 tokens
    prompts = [ids[:12], ids[:12] + ids[30:37], ids[:12] + ids[40:57]]
    engine = local_engine(tiny_model, "paged", kv_cache_dtype=name, enable_prefix_caching=True)
    outputs = drive_engine(engine, [(f"r{i}", p, SamplingParams(max_new_tokens=8)) for i, p in enumerate(prompts)])
    assert all(len(output_tokens(outputs[f"r{i}"])) == 8 for i in range(len(prompts)))


def _build(tiny_model, props: dict):
    cfg = resolve({"option.model_id": str(tiny_model), **props}, env={})
    return build(cfg, local_dir=str(tiny_model), spec=None, num_gpus=0, num_cpus=2, port=8080)


def test_an_fp8_cache_outside_the_paged_engine_or_its_torch_backend_is_refused(tiny_model) -> None:
    assert _build(tiny_model, {"option.kv_cache_dtype": "fp8"}).model.kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match=r"option.kv_cache_dtype=fp8 stores the paged engine's KV cache in fp8, "
                                          r"and this configuration runs the rolling engine"):
        _build(tiny_model, {"option.kv_cache_dtype": "fp8", "option.rolling_batch": "scheduler"})
    with pytest.raises(ConfigError, match=r"option.attention_backend=flex: the torch backend reads fp8 caches"):
        _build(tiny_model, {"option.kv_cache_dtype": "fp8_e5m2", "option.attention_backend": "flex"})
    with pytest.raises(ConfigError, match="option.kv_cache_dtype"):
        _build(tiny_model, {"option.kv_cache_dtype": "int8"})


def test_plan_counts_one_byte_per_kv_value(tiny_model) -> None:
    from container.planner import read_model_shape
    from engines.weights.memory_plan import Machine, Workload, plan

    shape = read_model_shape(str(tiny_model))
    machine = Machine("cpu", 0, 8 * 2**30)
    work = dict(dtype="bf16", tensor_parallel_degree=1, max_num_seqs=4, max_num_batched_tokens=256,
                max_model_len=256, prompt_tokens=128, output_tokens=128)
    bf16, fp8 = (plan(shape, machine, Workload(**work, kv_cache_dtype=k)) for k in ("auto", "fp8"))
    assert bf16.kv_bytes_per_token == 2 * fp8.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # K,V · layers · kv heads · dim · 2 B
