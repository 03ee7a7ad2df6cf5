"""Model families, each a small random checkpoint written as its hub checkpoints are (container/
model_maker.FAMILIES): greedy output of the paged and padded engines equals transformers' `generate`
token for token; a family we do not implement natively runs on the fallback, by name, and is right
there too; the EOS set of generation_config.json stops every engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from container.model_maker import make_model
from engines.models.registry import fallback_reason, paged_fallback
from engines.spec import ModelSpec
from engines.sampling_params import SamplingParams
from tests.support import drive_engine, local_engine, output_tokens, run_tp2_job

# prompt lengths straddle a 16-token block and the 24-token windows of the windowed families
PROMPTS = [[1] + [(7 * i + 3) % 1000 + 3 for i in range(n)] for n in (5, 17, 40)]
NEW_TOKENS = 12

NATIVE = [("llama", "legacy"), ("llama3", "legacy"), ("llama3", "parameters"), ("mistral", "legacy"),
          ("mistral-window", "legacy"), ("qwen2", "legacy"), ("qwen2.5", "legacy"), ("qwen3", "legacy"),
          ("phi3", "legacy"), ("phi3", "parameters"), ("gemma", "legacy"), ("gemma2", "legacy"),
          ("mixtral", "legacy"), ("qwen2-moe", "legacy"), ("falcon", "legacy"), ("falcon", "parameters"),
          ("falcon-7b", "legacy"), ("neox", "legacy"), ("neox", "parameters")]
FALLBACK = ["gpt2", "opt", "bloom"]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, rope_form: str) -> Path:
        if (arch, rope_form) not in made:
            out = tmp_path_factory.mktemp("families") / f"{arch}-{rope_form}"
            make_model(str(out), arch=arch, size="tiny", seed=11, rope_form=rope_form)
            made[arch, rope_form] = out
        return made[arch, rope_form]

    return get


def hf_greedy(model_dir: Path, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy `generate`, one prompt at a time, cut after the first EOS of the set its
    generation config names."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    outs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        cut = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        outs.append(ids[:cut])
    return outs


def engine_greedy(model_dir: Path, kind: str, prompts=PROMPTS, new_tokens: int = NEW_TOKENS,
                  **sched) -> list[list[int]]:
    """The engine's greedy tokens with the prompts joining one step apart (batched mid-flight); the
    dynamic engine's as one batch."""
    if kind == "dynamic":
        from engines.config import ModelConfig
        from engines.dynamic.generator import HFGenerator
        from engines.protocol import Add

        config = ModelConfig(local_dir=str(model_dir), dtype="fp32")
        gen = HFGenerator(config, ModelSpec.of(config))
        gen.load()
        outs = gen.generate([Add(f"r{i}", p, SamplingParams(max_new_tokens=new_tokens)) for i, p in enumerate(prompts)])
        return [o.token_ids for o in outs]
    engine = local_engine(model_dir, kind, **sched)
    requests = [(f"r{i}", p, SamplingParams(max_new_tokens=new_tokens)) for i, p in enumerate(prompts)]
    outputs = drive_engine(engine, requests)
    engine.stop_ranks() if kind == "paged" else None
    return [output_tokens(outputs[f"r{i}"]) for i in range(len(prompts))]


@pytest.mark.parametrize("arch,rope_form", NATIVE, ids=[f"{a}-{f}" for a, f in NATIVE])
def test_native_families_give_hf_greedy_tokens_in_both_engines(family_dir, arch, rope_form):
    model_dir = family_dir(arch, rope_form)
    assert fallback_reason(ModelSpec.read(str(model_dir))) is None
    expected = hf_greedy(model_dir)
    assert all(len(ids) == NEW_TOKENS for ids in expected)  # no early EOS: every token compared
    assert engine_greedy(model_dir, "paged") == expected
    assert engine_greedy(model_dir, "rolling") == expected


def test_the_falcon_40b_layout_serves_hf_greedy_tokens_on_our_code_and_on_transformers_own_cache(family_dir):
    """The new decoder (grouped KV heads, parallel attention, two LayerNorms, no biases, no ALiBi) from
    a config that also carries an `intermediate_size` Falcon never reads (its MLP is ffn_hidden_size):
    our code sizes the MLP as transformers does, and the padded engine's fallback takes transformers'
    cache, which holds K and V repeated for every query head. (TP=2: the TP2 run below.)"""
    model_dir = family_dir("falcon", "legacy")
    cfg = json.loads((model_dir / "config.json").read_text())
    assert (cfg["new_decoder_architecture"], cfg["num_kv_heads"], cfg["num_attention_heads"], cfg["parallel_attn"],
            cfg["bias"], cfg["alibi"]) == (True, 2, 4, True, False, False)
    assert cfg["intermediate_size"] != cfg["ffn_hidden_size"]
    assert ModelSpec.read(str(model_dir)).intermediate_size == cfg["ffn_hidden_size"]
    expected = hf_greedy(model_dir)
    for kind in ("paged", "rolling"):
        assert engine_greedy(model_dir, kind) == expected, kind
    assert engine_greedy(model_dir, "rolling", trust_remote_code=True) == expected


# the other layers of the NeoX decoder: sequential blocks, per-head q/k/v, biases, one norm, ties, GeLU forms
VARIANTS = {
    "falcon-sequential": ("falcon-7b", {"parallel_attn": False, "multi_query": False, "bias": True}),
    "falcon-one-norm": ("falcon", {"num_ln_in_parallel_attn": 1, "tie_word_embeddings": True}),
    "neox-sequential": ("neox", {"use_parallel_residual": False, "hidden_act": "gelu_new", "rotary_pct": 0.5}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_falcon_and_neox_variants_give_hf_greedy_tokens(tmp_path, variant):
    arch, overrides = VARIANTS[variant]
    make_model(str(tmp_path), arch=arch, size="tiny", seed=11, overrides=overrides, rope_form="legacy")
    assert fallback_reason(ModelSpec.read(str(tmp_path))) is None
    expected = hf_greedy(tmp_path)
    assert all(len(ids) == NEW_TOKENS for ids in expected)
    assert engine_greedy(tmp_path, "paged") == expected


@pytest.mark.parametrize("arch", FALLBACK)
def test_other_families_run_on_the_fallback_by_name_and_right(family_dir, arch):
    """GPT-2 and OPT route their attention through transformers' attention interface: transformers'
    model on our KV cache, in the paged engine and the padded one. BLOOM's does not (ALiBi, its own
    attention): transformers' own cache, padded engine only, and the paged engine says why."""
    model_dir = family_dir(arch, "legacy")
    spec = ModelSpec.read(str(model_dir))
    assert fallback_reason(spec) == f"no native implementation of {spec.architecture}"
    expected = hf_greedy(model_dir)
    assert engine_greedy(model_dir, "rolling") == expected
    assert paged_fallback(spec) == (arch != "bloom")
    if arch != "bloom":
        assert engine_greedy(model_dir, "paged") == expected
    else:
        with pytest.raises(ValueError, match="the paged engine needs our model code or a transformers model whose "
                                             "attention goes through transformers' attention interface"):
            local_engine(model_dir, "paged")


@pytest.mark.parametrize("arch", ["llama3", "mistral-window", "gemma2", "phi3"])
def test_transformers_model_code_on_our_kv_cache_gives_hf_greedy_tokens(family_dir, arch):
    """option.model_impl=transformers on families we implement: transformers' model, its attention
    through our paged KV cache (rope scaling, GQA, windows, softcaps as transformers asks for them)."""
    model_dir = family_dir(arch, "legacy")
    expected = hf_greedy(model_dir)
    engine = local_engine(model_dir, "paged", model_impl="transformers")
    assert not engine.runner.is_native and engine.runner.owns_kv
    outputs = drive_engine(engine, [(f"r{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS))
                                    for i, p in enumerate(PROMPTS)])
    assert [output_tokens(outputs[f"r{i}"]) for i in range(len(PROMPTS))] == expected
    engine.stop_ranks()


def test_the_fallback_attends_as_transformers_asks_layer_by_layer(tmp_path):
    """GPT-2 scaling each layer's scores by 1/(layer + 1) and not by 1/sqrt(head_dim): what transformers'
    attention asks for at load is what our backends apply (the spec knows neither setting)."""
    model_dir = tmp_path / "gpt2-scaled"
    make_model(str(model_dir), arch="gpt2", size="tiny", seed=4,
               overrides={"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True})
    engine = local_engine(model_dir, "paged")
    assert [o.scale for o in engine.runner.layer_options] == [1.0, 0.5]
    engine.stop_ranks()
    expected = hf_greedy(model_dir)
    assert engine_greedy(model_dir, "paged") == expected and engine_greedy(model_dir, "rolling") == expected


def test_both_rope_forms_give_one_spec(family_dir):
    for arch in ("llama3", "phi3"):
        legacy, new = (ModelSpec.read(str(family_dir(arch, form))) for form in ("legacy", "parameters"))
        assert "rope_scaling" in legacy.config and "rope_parameters" in new.config
        assert legacy.rope == new.rope and legacy.rope.kind == {"llama3": "llama3", "phi3": "longrope"}[arch]


@pytest.mark.parametrize("kind", ["paged", "rolling", "dynamic"])
def test_every_engine_stops_on_each_eos_of_the_generation_config(family_dir, tmp_path, kind):
    """A Llama-3 style EOS list: the second id is a token the model emits mid-answer, so a stop on it
    shows; config.json keeps the single id (generation_config.json wins)."""
    src = family_dir("llama3", "legacy")
    model_dir = tmp_path / "llama3-eos"
    model_dir.mkdir()
    for f in src.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    free = hf_greedy(src, PROMPTS[:1])[0]
    stop = free[3]
    assert stop not in free[:3]
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], stop]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    assert ModelSpec.read(str(model_dir)).eos_token_ids == (2, stop)
    expected = hf_greedy(model_dir, PROMPTS[:1])
    assert expected == [free[:4]]
    assert engine_greedy(model_dir, kind, PROMPTS[:1]) == expected


@pytest.mark.parametrize("setting,reason", [
    ({"mlp_bias": True}, "mlp_bias=true (our MLPs have no biases)"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' (our LlamaForCausalLM code has SiLU-gated MLPs)"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping (not applied by our code for this architecture)"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 512},
     "rope_type 'dynamic' past max_position_embeddings=512 (max_model_len 1024): transformers rescales its base "
     "with each sequence's length"),
    ({"rope_scaling": {"rope_type": "mystery"}}, "rope_type 'mystery' is not implemented natively"),
])
def test_a_setting_our_code_cannot_honour_falls_back_by_name(setting, reason):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "max_position_embeddings": 1024, "hidden_act": "silu"}
    assert fallback_reason(ModelSpec.from_dicts(cfg)) is None
    assert fallback_reason(ModelSpec.from_dicts({**cfg, **setting}, max_model_len=1024)) == reason


@pytest.mark.parametrize("arch,setting,reason", [
    ("FalconForCausalLM", {"alibi": True}, "alibi=true (ALiBi position biases: our attention backends have none)"),
    ("FalconForCausalLM", {"new_decoder_architecture": True, "parallel_attn": False},
     "new_decoder_architecture with parallel_attn=false (a layer transformers' Falcon does not define)"),
    ("FalconForCausalLM", {"activation": "relu"}, "hidden_act 'relu' (our FalconForCausalLM code has GeLU MLPs)"),
    ("GPTNeoXForCausalLM", {"hidden_act": "silu"}, "hidden_act 'silu' (our GPTNeoXForCausalLM code has GeLU MLPs)"),
])
def test_falcon_and_neox_settings_our_code_cannot_honour_fall_back_by_name(arch, setting, reason):
    cfg = {"architectures": [arch], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    assert fallback_reason(ModelSpec.from_dicts(cfg)) is None
    assert fallback_reason(ModelSpec.from_dicts({**cfg, **setting})) == reason


def test_hub_falcon_and_pythia_configs_read_with_their_config_classes_defaults():
    """Keys the hub configs leave out take the transformers config classes' defaults: Falcon-7B's
    (`n_head`, no `num_kv_heads` read: one KV head; tied head), Pythia's (no `rotary_pct` → 1/4)."""
    falcon = ModelSpec.from_dicts({"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 4544,
                                   "n_head": 71, "n_layer": 32, "multi_query": True, "parallel_attn": True})
    assert (falcon.num_kv_heads, falcon.head_dim, falcon.rotary_dim) == (1, 64, 64)
    assert falcon.tie_word_embeddings and falcon.norm_eps == 1e-5 and falcon.intermediate_size == 4 * 4544
    falcon_40b = ModelSpec.from_dicts({"architectures": ["FalconForCausalLM"], "model_type": "falcon",
                                       "hidden_size": 8192, "n_head": 128, "n_head_kv": 8, "n_layer": 60,
                                       "new_decoder_architecture": True, "layer_norm_epsilon": 1e-5})
    assert (falcon_40b.num_kv_heads, falcon_40b.head_dim) == (8, 64)
    pythia = ModelSpec.from_dicts({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
                                   "hidden_size": 512, "num_attention_heads": 8, "num_hidden_layers": 6,
                                   "rotary_emb_base": 10000, "intermediate_size": 2048})
    assert (pythia.rotary_dim, pythia.rope.theta, pythia.norm_eps, pythia.tie_word_embeddings) == (16, 10000.0, 1e-5,
                                                                                                 False)


# the native families whose heads (and KV heads, or one KV head replicated) split over two ranks
TP2 = [("llama3", "legacy"), ("mistral-window", "legacy"), ("qwen2.5", "legacy"), ("qwen3", "legacy"),
       ("phi3", "legacy"), ("gemma2", "legacy"), ("mixtral", "legacy"), ("qwen2-moe", "legacy"),
       ("falcon", "legacy"), ("falcon-7b", "legacy"), ("neox", "legacy")]


def test_native_families_at_tp2_give_hf_greedy_tokens(family_dir, tmp_path):
    """One `mpirun -np 2` runs the paged engine at TP=2 on every family in turn (tests/tp_families.py).
    Falcon-40B's form with biases too: the q/k/v groups split one KV head per rank, the column-
    parallel biases sharded, the row-parallel ones added once."""
    biased = tmp_path / "falcon-bias"
    make_model(str(biased), arch="falcon", size="tiny", seed=5, overrides={"bias": True})
    dirs = [str(family_dir(arch, form)) for arch, form in TP2] + [str(biased)]
    got = run_tp2_job(tmp_path, {"prompts": PROMPTS, "new_tokens": NEW_TOKENS}, dirs)
    for arch, model_dir in zip([a for a, _ in TP2] + ["falcon-bias"], dirs):
        assert got[model_dir] == hf_greedy(Path(model_dir)), arch


# gpt2: the fallback on our paged KV (prompt lookup only: a draft model runs on our model code)
SPEED = [(arch, method) for arch in ("qwen3", "gemma2", "mixtral", "neox") for method in ("ngram", "draft")] + \
    [("gpt2", "ngram")]


@pytest.mark.parametrize("arch,method", SPEED, ids=[f"{a}-{m}" for a, m in SPEED])
def test_prefix_caching_and_speculation_give_hf_greedy_tokens(family_dir, arch, method):
    """Speculation (prompt lookup, or the model as its own draft) with prefix caching on: the prompts
    run twice, the second time from cached blocks, greedy equal to transformers' both times. (The
    random GPT-2 never continues as its prompt did: its guesses are all rejected.)"""
    model_dir = family_dir(arch, "legacy")
    prompts = PROMPTS + [[1] + [5, 6, 7, 8, 9] * 6]  # a repetitive one: prompt lookup finds matches
    expected = hf_greedy(model_dir, prompts)
    extra = {"speculative_model": str(model_dir)} if method == "draft" else {}
    engine = local_engine(model_dir, "paged", enable_prefix_caching=True, speculative_method=method,
                          num_speculative_tokens=3, **extra)
    for round_ in ("cold", "cached"):
        outputs = drive_engine(engine, [(f"{round_}{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS))
                                        for i, p in enumerate(prompts)], join_every=2)
        assert [output_tokens(outputs[f"{round_}{i}"]) for i in range(len(prompts))] == expected, round_
    metrics = engine.metrics()
    # at least every whole block of each prompt, the second time (the first time shares some too)
    assert metrics["prefix_cache_hit_tokens"] >= sum((len(p) - 1) // 16 * 16 for p in prompts) > 0
    assert metrics["spec_proposed_tokens"] > 0 and (metrics["spec_accepted_tokens"] > 0 or arch == "gpt2")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.stop_ranks()


def test_a_sliding_window_model_gives_back_the_blocks_behind_its_window(family_dir):
    """Mistral with a 24-token window, every layer sliding: as requests decode, their first blocks go
    back to the pool and other requests write into them, while the owners' outputs stay HF's. In a
    pool too small for the requests' whole sequences, nobody is preempted."""
    model_dir = family_dir("mistral-window", "legacy")
    prompts = [[1] + [(5 * i + 11 * j) % 1000 + 3 for j in range(38 + 6 * i)] for i in range(4)]
    new_tokens = 30
    expected = hf_greedy(model_dir, prompts, new_tokens)
    engine = local_engine(model_dir, "paged", kv_cache_memory=f"{16 * 512 * 16}B")  # 16 blocks of 16 tokens
    assert engine.blocks.window == 24 and engine.blocks.num_blocks == 16
    need = sum(-(-(len(p) + new_tokens) // 16) for p in prompts)
    assert need > engine.blocks.num_blocks  # the whole sequences would not fit at once
    released = []
    step = engine.step

    def step_and_count():
        step()
        released.append(sum(r.num_released_blocks for r in engine.scheduler.running))
        engine.scheduler.check_invariants()
    engine.step = step_and_count
    outputs = drive_engine(engine, [(f"r{i}", p, SamplingParams(max_new_tokens=new_tokens))
                                    for i, p in enumerate(prompts)])
    assert [output_tokens(outputs[f"r{i}"]) for i in range(len(prompts))] == expected
    assert max(released) >= 8 and engine.scheduler.num_preemptions == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.stop_ranks()
