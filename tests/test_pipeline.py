"""Pipeline parallelism (option.pipeline_parallel_degree): the stages' layer split, and whole engines
whose ranks form stages of tensor-parallel groups under mpirun, against transformers' greedy tokens."""

from __future__ import annotations

import pytest

from container.model_maker import make_model
from engines.dist import stage_layers
from tests.support import run_tp2_job
from tests.test_families import NEW_TOKENS, PROMPTS, hf_greedy


def test_stages_split_the_layers_evenly_the_first_taking_the_rest():
    assert [stage_layers(7, 3, s) for s in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    assert [stage_layers(4, 2, s) for s in range(2)] == [range(0, 2), range(2, 4)]
    assert [stage_layers(2, 2, s) for s in range(2)] == [range(0, 1), range(1, 2)]
    with pytest.raises(ValueError, match="pipeline_parallel_degree=3 exceeds the model's 2 layers"):
        stage_layers(2, 3, 0)


@pytest.fixture(scope="module")
def stage_models(tmp_path_factory):
    """Llama (3 layers: stages of 2 and 1) and GPT-NeoX (parallel residual, its own names)."""
    root = tmp_path_factory.mktemp("pipeline")
    made = {"llama": root / "llama", "neox": root / "neox"}
    make_model(str(made["llama"]), arch="llama3", size="tiny", seed=21, overrides={"num_hidden_layers": 3})
    make_model(str(made["neox"]), arch="neox", size="tiny", seed=22)
    return {arch: str(path) for arch, path in made.items()}


@pytest.mark.parametrize("tp,ranks", [(1, 2), (2, 4)], ids=["pp2", "tp2xpp2"])
def test_pipeline_stages_give_hf_greedy_tokens(stage_models, tmp_path, tp, ranks):
    """The paged engine over `ranks` ranks in stages of `tp` (PP = ranks / tp): the hidden states go stage
    to stage, the last stage's logits back to rank 0, which samples; greedy equal to transformers'."""
    dirs = list(stage_models.values())
    got = run_tp2_job(tmp_path, {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "tp": tp}, dirs, ranks=ranks)
    held = {"llama": [0, 1], "neox": [0]}  # 3 layers: stages of 2 and 1; 2 layers: 1 each
    for arch, model_dir in stage_models.items():
        assert got["layers:" + model_dir] == held[arch], arch
        assert got[model_dir] == hf_greedy(model_dir), arch
