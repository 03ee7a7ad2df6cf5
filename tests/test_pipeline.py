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


@pytest.mark.parametrize("tp,ranks,backend", [(1, 2, "mpi"), (2, 4, "mpi"), (2, 4, "gloo"), (2, 2, "gloo")],
                         ids=["pp2", "tp2xpp2", "tp2xpp2-torch-distributed", "tp2-torch-distributed"])
def test_pipeline_stages_give_hf_greedy_tokens(stage_models, tmp_path, tp, ranks, backend):
    """The paged engine over `ranks` ranks in stages of `tp` (PP = ranks / tp): the hidden states go stage
    to stage, the last stage's logits back to rank 0, which samples; greedy equal to transformers'. Over
    MPI (CPU ranks), and over torch.distributed with gloo: the code GPU ranks run with NCCL (process
    groups per stage, send/recv between stages)."""
    dirs = list(stage_models.values())
    got = run_tp2_job(tmp_path, {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "tp": tp, "backend": backend}, dirs,
                      ranks=ranks)
    held = {"llama": [0, 1], "neox": [0]}  # 3 layers: stages of 2 and 1; 2 layers: 1 each
    for arch, model_dir in stage_models.items():
        assert got.get("layers:" + model_dir) == (held[arch] if ranks > tp else None), arch
        assert got[model_dir] == hf_greedy(model_dir), arch


@pytest.mark.parametrize("scheduler", [{"speculative_method": "ngram", "enable_prefix_caching": True},
                                       {"num_scheduler_steps": 4}], ids=["ngram-prefix-caching", "multi-step"])
def test_pipeline_stages_with_speed_features_give_hf_greedy_tokens(stage_models, tmp_path, scheduler):
    """PP=2 with n-gram speculation (several logits rows per request go stage to stage and back) and prefix
    caching (each stage's cache holds its layers' blocks), and with multi-step decode: HF's tokens."""
    model_dir = stage_models["llama"]
    got = run_tp2_job(tmp_path, {"prompts": PROMPTS + PROMPTS[2:], "new_tokens": NEW_TOKENS, "tp": 1,
                                 "scheduler": scheduler}, [model_dir])
    assert got[model_dir] == hf_greedy(model_dir) + hf_greedy(model_dir)[2:]


def test_the_launcher_starts_every_stage_and_points_torch_distributed_at_the_leader(tmp_path):
    """mpirun gets tp x pp ranks and passes MASTER_ADDR / MASTER_PORT to the other hosts; the rendezvous is
    the hostfile's first host (the leader, rank 0's), one port per copy."""
    from container.launcher import EngineCopy, engine_command
    from engines.config import LmiConfig, ModelConfig, ParallelConfig, SchedulerConfig

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the leader first\n\nleader.example slots=2\nworker.example slots=2\n")
    config = LmiConfig(model=ModelConfig(local_dir="/m"), scheduler=SchedulerConfig(),
                       parallel=ParallelConfig(use_mpi=True, tensor_parallel_degree=2, pipeline_parallel_degree=2,
                                               hostfile=str(hostfile)))
    cmd = engine_command(config, "/run")
    assert cmd[cmd.index("-np") + 1] == "4"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"][-2:] == ["MASTER_ADDR", "MASTER_PORT"]
    env = EngineCopy(0, "/run", config).environment({"MASTER_PORT": "30000"})
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("leader.example", "30000")
    local = LmiConfig(model=config.model, scheduler=config.scheduler,
                      parallel=ParallelConfig(use_mpi=True, tensor_parallel_degree=2, copies=2))
    assert [EngineCopy(i, "/run", local).environment({})["MASTER_PORT"] for i in range(2)] == ["29511", "29512"]
    assert "MASTER_ADDR" not in EngineCopy(0, "/run", local).environment({})
