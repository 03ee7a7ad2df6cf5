"""Run under `mpirun -np 2`: the paged engine (or the job's "engine") at TP=2 on each model directory given, in turn, and
rank 0 writes each one's greedy tokens to a JSON file (tests/test_families.py compares them with
transformers' `generate`). One mpirun for every family: each model's ranks load, serve the
prompts and stop, then the next model loads. The job's optional "quantize" is option.quantize ("cpu_linear":
option.cpu_linear); its
optional "lora" holds ModelConfig's LoRA fields, "tp" the ranks of a pipeline stage (fewer than the
ranks: pipeline parallelism), "backend" the communicator's (make_communicator; "gloo" runs the GPU
path's torch.distributed code on CPU), "scheduler" more SchedulerConfig fields (speed features),
"register" adapters (name → directory) registered at run time before the prompts, "adapters"
each prompt's adapter (null: the base), "rounds" lists of prompts run one after another instead of
"prompts", and "metrics" true: rank 0's /metrics figures too ("metrics:DIR").

    python -m tests.tp_families OUT.json PROMPTS.json DIR [DIR ...]
"""

from __future__ import annotations

import json
import os
import sys


def main(out_path: str, prompts_path: str, model_dirs: list[str]) -> None:
    from engines.config import ENGINE_PAGED, LmiConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from engines.dist import make_communicator, rank_info
    from engines.protocol import ADAPTER_REGISTER, AdapterCommand
    from engines.sampling_params import SamplingParams
    from engines.process.serve import run_shard
    from engines.loop.paged_engine import PagedEngine
    from engines.loop.rolling_engine import RollingEngine
    from tests.support import drive_engine, output_tokens

    with open(prompts_path, encoding="utf-8") as f:
        job = json.load(f)
    info = rank_info(os.environ)
    tp = job.get("tp", info.world_size)  # fewer than the ranks: pipeline stages of `tp` ranks each
    comm = make_communicator(info, tp, job.get("backend"))  # "gloo": torch.distributed, the GPU path's code
    results = {}
    for model_dir in model_dirs:
        config = LmiConfig(model=ModelConfig(local_dir=model_dir, dtype="fp32", quantize=job.get("quantize"),
                                             cpu_linear=job.get("cpu_linear", "auto"),
                                             **job.get("lora", {})),
                           scheduler=SchedulerConfig(engine_kind=job.get("engine", ENGINE_PAGED),
                                                     **{"kv_cache_memory": "4MiB", "max_num_seqs": 4,
                                                        **job.get("scheduler", {})}),
                           parallel=ParallelConfig(use_mpi=True, tensor_parallel_degree=tp))
        if comm.rank:
            run_shard(config, comm)  # returns when rank 0 stops the ranks
            continue
        engine = (PagedEngine if config.scheduler.engine_kind == ENGINE_PAGED else RollingEngine)(
            config, lambda outs: None, comm)
        engine.load()
        for name, path in job.get("register", {}).items():
            engine.command(AdapterCommand(f"register-{name}", ADAPTER_REGISTER, name, path))
        results[model_dir] = []
        for prompts in job.get("rounds") or [job["prompts"]]:  # rounds: one after another
            adapters = job.get("adapters") or [None] * len(prompts)
            grammars = job.get("grammars") or [None] * len(prompts)  # each prompt's constraint (None: free)
            outputs = drive_engine(engine, [(f"r{i}", p, SamplingParams(max_new_tokens=job["new_tokens"], grammar=g),
                                             a) for i, (p, a, g) in enumerate(zip(prompts, adapters, grammars))])
            results[model_dir] += [output_tokens(outputs[f"r{i}"]) for i in range(len(prompts))]
        if job.get("metrics"):
            results["metrics:" + model_dir] = engine.metrics()
        engine.stop_ranks()
        if comm.tp.pipeline is not None:  # the layers rank 0 holds (the later stages hold the rest)
            results["layers:" + model_dir] = list(engine.runner.model.held)
    if comm.rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(results, f)
    comm.close()  # torch.distributed: its threads ended before the interpreter's


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
