"""Native Llama-family model code against HF transformers; the safetensors loader; the registry."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from container.model_maker import make_model
from engines.dist import SingleProcess
from engines.weights.loader import build_model, checkpoint_files
from engines.models.gemma import GemmaForCausalLM
from engines.models.llama import LlamaForCausalLM
from engines.models.moe import MoeForCausalLM, SparseMoE
from engines.models.registry import NATIVE, fallback_reason, model_class
from engines.spec import ModelSpec
from engines.worker.padded_cache import GROW, PaddedKVCache

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
PAD = 0
PROMPTS = [[1, 17, 203], [1, 44, 5, 900, 61, 62, 7, 8, 9], [1, 300, 301, 302, 303, 304]]
DECODE = [[11, 21, 31], [12, 22, 1000]]  # two decode steps, one token per row
ATOL = 1e-4

VARIANTS = {
    "llama": ("llama", None),
    "mistral": ("mistral", None),
    "qwen2": ("qwen2", None),
    "qwen3": ("qwen3", None),  # q/k norms (perturbed: a norm loaded wrong shows)
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),  # 4 attention heads in tiny: plain MHA
    "llama-bias": ("llama", {"attention_bias": True}),  # q/k/v and o biases
    "llama-head-dim": ("llama", {"head_dim": 32}),  # head_dim != hidden / heads
    "llama-rope-theta": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    "mixtral": ("mixtral", None),
    "qwen2-moe": ("qwen2-moe", None),
    # a dense layer (mlp_only_layers), three experts of four per token, their weights renormalised
    "qwen2-moe-mixed": ("qwen2-moe", {"mlp_only_layers": [1], "num_experts_per_tok": 3, "norm_topk_prob": True}),
}


def perturb_checkpoint(model_dir: Path, seed: int) -> None:
    """Random init leaves norms at 1 and biases at 0, where a mix-up would not show: randomise them."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.3 * torch.randn(t.shape, generator=g)
        elif name.endswith(".bias"):
            tensors[name] = 0.3 * torch.randn(t.shape, generator=g)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Made lazily, once per variant, for the whole module."""
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            arch, overrides = VARIANTS[variant]
            out = tmp_path_factory.mktemp("models") / variant
            make_model(str(out), arch=arch, size="tiny", seed=len(made) + 3, overrides=overrides)
            perturb_checkpoint(out, seed=len(made) + 100)
            made[variant] = out
        return made[variant]

    return get


def load_native(model_dir: Path):
    spec = ModelSpec.read(str(model_dir), 1024)
    return build_model(model_class(spec), spec, str(model_dir), SingleProcess(), torch.float32, CPU, progress=False)


def forward(model, cache: PaddedKVCache, ids: torch.Tensor) -> torch.Tensor:
    """As ModelRunner._forward: positions count from each row's first real token."""
    t = ids.shape[1]
    cols = torch.arange(cache.width, cache.width + t).view(1, -1)
    positions = (cols - cache.pads.view(-1, 1)).clamp(min=0)
    cache.begin_forward(t)
    try:
        return model(ids, positions, cache)
    finally:
        cache.end_forward()


def native_logits(model, prompts, decode_steps) -> list[torch.Tensor]:
    """Last-token logits [B, V] of a left-padded prefill, then of each decode step."""
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, pads[i]:] = torch.tensor(p)
    cache = PaddedKVCache.empty(model.spec.num_layers, len(prompts), model.num_kv_heads, model.head_dim,
                                pads, width + GROW, torch.float32, CPU)
    out = [forward(model, cache, ids)]
    for step in decode_steps:
        out.append(forward(model, cache, torch.tensor(step).view(-1, 1)))
    return out


@torch.no_grad()
def hf_logits(hf, prompts, decode_steps) -> list[torch.Tensor]:
    """The same, each prompt alone through HF on its whole sequence."""
    out = []
    for n in range(len(decode_steps) + 1):
        rows = []
        for i, p in enumerate(prompts):
            seq = p + [step[i] for step in decode_steps[:n]]
            rows.append(hf(torch.tensor([seq])).logits[0, -1].float())
        out.append(torch.stack(rows))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_model_matches_hf_on_padded_prefill_and_decode(model_dirs, variant):
    model_dir = model_dirs(variant)
    cfg = AutoConfig.from_pretrained(model_dir)
    arch, overrides = VARIANTS[variant]
    assert cfg.model_type == arch.replace("-", "_")
    for key, value in (overrides or {}).items():
        actual = getattr(cfg, key)
        assert actual == value if not isinstance(value, dict) else value.items() <= actual.items()
    model = load_native(model_dir)
    assert isinstance(model, LlamaForCausalLM)
    assert model.num_kv_heads == cfg.num_key_value_heads
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    ours = native_logits(model, PROMPTS, DECODE)
    ref = hf_logits(hf, PROMPTS, DECODE)
    assert len(ours) == len(ref) == 3
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape == (len(PROMPTS), cfg.vocab_size)
        assert a.dtype == torch.float32
        diff = (a - b).abs().max().item()
        assert diff < ATOL, f"{variant} step {step}: max abs diff {diff}"
    assert ref[0].std() > 0.1  # logits that are not flat: the comparison means something


def test_native_logits_do_not_depend_on_the_batch(model_dirs):
    model = load_native(model_dirs("llama"))
    batched = native_logits(model, PROMPTS, DECODE)
    for i, p in enumerate(PROMPTS):
        alone = native_logits(model, [p], [[step[i]] for step in DECODE])
        for a, b in zip(batched, alone):
            assert (a[i] - b[0]).abs().max().item() < ATOL


def test_sharded_checkpoint_loads_to_identical_logits(model_dirs, tmp_path):
    src = model_dirs("llama")
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    index = sharded / "model.safetensors.index.json"
    assert index.is_file()
    assert not (sharded / "model.safetensors").exists()
    weight_map = json.loads(index.read_text())["weight_map"]
    shard_names = sorted(set(weight_map.values()))
    assert len(shard_names) > 2

    files = checkpoint_files(str(sharded))
    assert files == [os.path.join(str(sharded), name) for name in shard_names]
    assert all(os.path.isfile(f) for f in files)
    assert checkpoint_files(str(src)) == [os.path.join(str(src), "model.safetensors")]

    single = native_logits(load_native(src), PROMPTS, DECODE)
    multi = native_logits(load_native(sharded), PROMPTS, DECODE)
    for a, b in zip(single, multi):
        assert torch.equal(a, b)


def copy_without(src: Path, dst: Path, drop: set[str]) -> None:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    assert drop <= set(tensors)
    save_file({k: v for k, v in tensors.items() if k not in drop}, dst / "model.safetensors",
              metadata={"format": "pt"})


def test_checkpoint_missing_the_final_norm_raises(model_dirs, tmp_path):
    broken = tmp_path / "broken"
    copy_without(model_dirs("llama"), broken, {"model.norm.weight"})
    with pytest.raises(ValueError, match=r"norm\.weight"):
        load_native(broken)


def test_checkpoint_missing_a_projection_raises_naming_its_layer(model_dirs, tmp_path):
    broken = tmp_path / "broken"
    copy_without(model_dirs("llama"), broken, {"model.layers.1.self_attn.k_proj.weight"})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.") as info:
        load_native(broken)
    assert "layers.0" not in str(info.value)


def test_checkpoint_missing_the_lm_head_raises(model_dirs, tmp_path):
    broken = tmp_path / "broken"
    copy_without(model_dirs("llama"), broken, {"lm_head.weight"})
    with pytest.raises(ValueError, match=r"lm_head"):
        load_native(broken)


def test_no_checkpoint_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        checkpoint_files(str(tmp_path))


def spec_of(architecture: str) -> ModelSpec:
    return ModelSpec.from_dicts({"architectures": [architecture], "hidden_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4})


def test_registry_maps_each_native_architecture_to_its_code():
    from engines.models.falcon import FalconForCausalLM
    from engines.models.neox import GPTNeoXForCausalLM

    assert set(NATIVE) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "MixtralForCausalLM",
                           "Qwen2MoeForCausalLM", "GPTNeoXForCausalLM", "FalconForCausalLM"}
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert model_class(spec_of(arch)) is LlamaForCausalLM
    assert model_class(spec_of("Gemma2ForCausalLM")) is GemmaForCausalLM
    assert model_class(spec_of("GPTNeoXForCausalLM")) is GPTNeoXForCausalLM
    assert model_class(spec_of("FalconForCausalLM")) is FalconForCausalLM
    for arch in ("GPT2LMHeadModel", "llamaforcausallm", ""):
        assert model_class(spec_of(arch)) is None


@pytest.mark.parametrize("float32_weights", [True, False])
def test_moe_graph_safe_path_equals_the_grouped_one(float32_weights):
    """run_all_experts (what a captured CUDA graph replays) = run_experts (eager), on CPU."""
    g = torch.Generator().manual_seed(5)
    moe = SparseMoE(32, 6, 2, 48, SingleProcess(), renormalize=not float32_weights, float32_weights=float32_weights)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(9, 32, generator=g)
    weights, experts = moe.route(x)
    grouped, dense = moe.run_experts(x, weights, experts), moe.run_all_experts(x, weights, experts)
    assert (grouped - dense).abs().max().item() < 1e-5
    assert grouped.abs().max().item() > 0.1


QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "silu", "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
             "use_sliding_window": False, "sliding_window": 64}


@pytest.mark.parametrize("setting,reason", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' (our Qwen2MoeForCausalLM code has SiLU-gated experts)"),
    ({"num_experts": None}, "config.json lacks num_experts"),
    ({"model_type": "qwen3_moe"}, "model_type 'qwen3_moe' (our MoE code knows Mixtral's and Qwen2-MoE's layouts)"),
    ({"use_sliding_window": True},
     "use_sliding_window=true without layer_types (Qwen2-MoE's own layer rule is not implemented)"),
])
def test_moe_settings_our_code_cannot_honour_fall_back_by_name(setting, reason):
    assert model_class(ModelSpec.from_dicts(QWEN2_MOE)) is MoeForCausalLM
    assert fallback_reason(ModelSpec.from_dicts({**QWEN2_MOE, **setting})) == reason


def test_model_code_does_not_use_transformers():
    files = sorted(Path(p) for p in glob.glob(str(ROOT / "engines" / "models" / "*.py"))) + sorted(Path(p) for p in glob.glob(str(ROOT / "engines" / "layers" / "*.py")))
    assert len(files) >= 6  # llama.py and the five layer modules at least
    for path in files:
        source = path.read_text(encoding="utf-8")
        assert not re.search(r"^\s*(from|import) transformers", source, re.M), path
