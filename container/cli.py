"""`lmi serve | config | plan | make-model`: the command line (console script `lmi`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from container import config as cfgmod
from engines.weights.artifacts import ArtifactError, resolve_model
from container.keys import KEY_ALIASES, ConfigError
from container.encoder_maker import ENCODER_KINDS, ENCODER_SIZES
from container.tasks import resolve_task
from container.model_maker import ARCHITECTURES, DTYPES, SIZES
from container.properties import PropertiesError, read_properties, read_vllm_yaml
from engines.process.startup import TIMELINE, process_age
from engines.config import TASK_GENERATION

log = logging.getLogger("container.cli")


def _properties(path: str | None, model_dir: str | None, yaml_path: str | None = None) -> dict[str, str]:
    """serving.properties (--properties, or the model dir's), merged with a vLLM-style YAML config
    (--config): both are the file layer; a key both set to different values is an error."""
    props: dict[str, str] = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"--properties {path}: no such file")
        props = read_properties(path)
    elif model_dir and os.path.isfile(os.path.join(model_dir, "serving.properties")):
        props = read_properties(os.path.join(model_dir, "serving.properties"))
    if yaml_path:
        if not os.path.isfile(yaml_path):
            raise ConfigError(f"--config {yaml_path}: no such file")
        for key, value in read_vllm_yaml(yaml_path).items():
            target = KEY_ALIASES.get(key, key)
            same = [k for k in props if KEY_ALIASES.get(k, k) == target]
            if same and props[same[0]].strip() != value.strip():
                raise ConfigError(f"{target} is set in serving.properties ({same[0]}={props[same[0]]!r}) and in "
                                  f"{yaml_path} ({value!r}); set it in one of them")
            props.setdefault(same[0] if same else key, value)
    return props


def _resolve(args) -> cfgmod.ResolvedConfig:
    resolved = cfgmod.resolve(_properties(args.properties, args.model_dir, getattr(args, "config", None)), os.environ)
    try:
        handler = cfgmod.custom_handler(resolved, args.model_dir)
    except ConfigError:  # (said when the configuration is built)
        handler = None
    for warning in resolved.warnings:
        if handler is not None and warning.startswith("unknown key "):  # a custom handler's own keys
            warning = warning.split(" is ignored")[0] + ": not one of lmi-serve's keys; passed to the custom handler"
        log.warning("%s", warning)
    return resolved


def has_startup_model(resolved: cfgmod.ResolvedConfig, model_dir: str | None) -> bool:
    """Whether the server starts with a model: always, except in SageMaker's multi-model mode with no
    option.model_id and a model dir holding neither config.json nor model.py (models come by POST /models)."""
    if not resolved["multi_model"] or resolved["option.model_id"]:
        return True
    return bool(model_dir) and any(os.path.isfile(os.path.join(model_dir, f)) for f in ("config.json", "model.py"))


def container_settings(resolved: cfgmod.ResolvedConfig, server, download_dir: str, **startup):
    from container.launcher import Container

    return Container(server, multi_model=resolved["multi_model"], url_pattern=resolved["model_url_pattern"],
                     allow_custom_code=resolved["allow_custom_code"],
                     max_models_memory=resolved["option.max_models_memory"], download_dir=download_dir, **startup)


def cmd_serve(args) -> int:
    from container.launcher import Launcher

    TIMELINE.record("imports", process_age(), "interpreter and launcher modules")
    started = time.perf_counter()
    resolved = _resolve(args)
    configuring = time.perf_counter() - started
    download_dir = resolved["download_dir"] or cfgmod.default_download_dir(os.environ)
    if not has_startup_model(resolved, args.model_dir):
        server = cfgmod.server_config(resolved, "", cfgmod.resolve_port(args.port, os.environ))
        log.info("multi-model mode: no model yet; models registered through POST /models must match "
                 "model_url_pattern=%s", resolved["model_url_pattern"])
        return Launcher(None, host=args.host, container=container_settings(resolved, server, download_dir)).run()
    with TIMELINE.phase("model_resolve"):
        local_dir = resolve_model(resolved["option.model_id"], args.model_dir, revision=resolved["option.revision"],
                                  download_dir=download_dir)
        adapters = {name: resolve_model(src, None, download_dir=download_dir)  # option.adapters: S3, hub, local
                    for name, src in (resolved["option.adapters"] or {}).items()}
    started = time.perf_counter()
    spec = cfgmod.read_spec(local_dir, resolved["option.max_model_len"])
    num_gpus = cfgmod.count_gpus(os.environ)
    config = cfgmod.build(resolved, local_dir=local_dir, spec=spec, num_gpus=num_gpus, num_cpus=os.cpu_count() or 1,
                          port=cfgmod.resolve_port(args.port, os.environ), adapters=adapters,
                          download_dir=download_dir, gpu_bf16=cfgmod.gpu_supports_bf16() if num_gpus else None)
    TIMELINE.record("configuration", configuring + time.perf_counter() - started, "serving.properties, environment")
    log.info("configuration:\n  %s", "\n  ".join(cfgmod.describe(resolved)))
    log.info("engine: %s, model: %s", config.scheduler.engine_kind, local_dir)
    log.info("listening on http://%s:%d (/ping, /invocations, /v1/chat/completions, /metrics)",
             args.host, config.server.port)
    # (a custom handler loads what it wants; a pooling model keeps no KV cache to plan)
    problem = _check_plan(resolved, config, spec) if config.model.entry_point is None and config.model.pooling is None \
        else None
    if problem:
        log.error("lmi-serve did not start: %s", problem)
        return 2
    from container.placement import gpu_memory_bytes
    from container.registration import need_bytes

    need = need_bytes(config, resolved, spec, gpu_memory_bytes(cfgmod.count_gpus(os.environ)))
    log.info("model %s: %s", config.server.served_model_name, local_dir)
    return Launcher(config, host=args.host, container=container_settings(
        resolved, config.server, download_dir, startup_url=resolved["option.model_id"] or local_dir,
        startup_need_bytes=need)).run()


def _check_plan(resolved: cfgmod.ResolvedConfig, config, spec) -> str | None:
    """Log the memory plan's summary for this machine; the "does not fit" line when it cannot fit."""
    from container import planner
    from engines.weights.memory_plan import plan

    machine = planner.this_machine(cfgmod.count_gpus(os.environ))
    try:
        shape = planner.read_model_shape(config.model.local_dir, spec=spec)
    except (OSError, ValueError) as exc:
        log.warning("no memory plan: %s", exc)
        return None
    if machine is None:
        log.warning("no memory plan: this machine's GPU memory is unknown (nvidia-smi did not answer)")
        return None
    result = plan(shape, machine, planner.workload(resolved, shape, machine, config.scheduler.engine_kind))
    log.info("%s", planner.summary(result))
    return result.problems[0] if result.problems else None


def cmd_config(args) -> int:
    if getattr(args, "server", None):
        return _print_models(args.server)
    resolved = _resolve(args)
    for line in cfgmod.describe(resolved):
        print(line)
    if not has_startup_model(resolved, args.model_dir):
        print(f"models: none at start (multi-model mode: registered through POST /models; model_url_pattern="
              f"{resolved['model_url_pattern']}, allow_custom_code={resolved['allow_custom_code']}, budget: "
              f"{resolved['option.max_models_memory'] or 'the whole machine'}); a running server's: lmi config "
              "--server URL")
        return 0
    model_id = resolved["option.model_id"]
    is_remote = bool(model_id) and (model_id.startswith("s3://") or not os.path.exists(os.path.expanduser(model_id)))
    local_dir = None if is_remote else resolve_model(model_id, args.model_dir, download_dir="")
    spec = cfgmod.read_spec(local_dir, resolved["option.max_model_len"])
    num_gpus = cfgmod.count_gpus(os.environ)
    build = dict(local_dir=local_dir or "", spec=spec, num_cpus=os.cpu_count() or 1,
                 port=cfgmod.resolve_port(args.port, os.environ))
    try:
        config = cfgmod.build(resolved, num_gpus=num_gpus, **build)
    except cfgmod.CapacityError as exc:
        # valid for a bigger machine: say what this one lacks, then show the resolution there
        print(f"warning: on this machine: {exc}", file=sys.stderr)
        if resolved["option.pipeline_parallel_degree"] > 1:  # CPU ranks: as on a host with enough cores
            config = cfgmod.build(resolved, num_gpus=0, **{**build, "num_cpus": 1 << 16})
        else:
            config = cfgmod.build(resolved, num_gpus=resolved["option.tensor_parallel_degree"], **build)
    runs_on = ([f"cpu cores {','.join(map(str, c))}" for c in config.parallel.copy_cores] or
               [f"gpu {','.join(d)}" for d in config.parallel.copy_devices] or
               ["all devices" if num_gpus else "all cores"])
    print(f"models: {config.server.served_model_name} ({config.scheduler.engine_kind}, {'; '.join(runs_on)}); "
          "more may be registered at run time (POST /models, docs/multi-model.md)")
    where = " (architecture not known before download)" if is_remote else ""
    print(f"engine: {config.scheduler.engine_kind}{where}; tensor_parallel_degree: "
          f"{config.parallel.tensor_parallel_degree}; mpi: {config.parallel.use_mpi}; dtype: {config.model.dtype}"
          + (f" ({config.model.dtype_why})" if config.model.dtype_why else "")
          + (f"; pipeline_parallel_degree: {config.parallel.pipeline_parallel_degree}"
             if config.parallel.pipeline_parallel_degree > 1 else "")
          + (f"; copies: {config.parallel.copies}" if config.parallel.copies > 1 else "")
          + (f"; custom handler: {config.model.entry_point}" if config.model.entry_point else ""))
    return 0


def _print_models(url: str) -> int:
    """A running server's models: each one's state, engine, copies and where it runs (GET /models)."""
    import requests

    url = url.rstrip("/")
    listing = requests.get(f"{url}/models", timeout=10)
    listing.raise_for_status()
    for m in listing.json()["models"]:
        d = requests.get(f"{url}/models/{m['modelName']}", timeout=10).json()
        print(f"{d['modelName']}: {d['status']}, {d['engine']}, {d['workers']} copy(ies) on {d['devices']}, "
              f"{d['memoryBytes'] / 2**30:.2f} GiB of the budget, from {d['modelUrl']}")
    return 0


def cmd_plan(args) -> int:
    from container import instances, planner
    from engines.weights.memory_plan import Machine, available_ram, plan
    from engines.spec import ModelSpec

    resolved = _resolve(args)
    model_dir = planner.config_dir(args.model or resolved["option.model_id"] or args.model_dir,
                                   resolved["option.revision"])
    spec = ModelSpec.read(model_dir, resolved["option.max_model_len"])
    shape = planner.read_model_shape(model_dir, spec=spec)
    if args.instance:
        machine = instances.instance(args.instance)
    elif args.gpus or args.gpu_memory:
        if not (args.gpus and args.gpu_memory):
            raise ValueError("--gpus and --gpu-memory go together (e.g. --gpus 4 --gpu-memory 24)")
        machine = instances.gpus(args.gpus, args.gpu_memory)
    elif args.cpu:
        machine = Machine("this machine's RAM", 0, available_ram())
    else:
        machine = planner.this_machine(cfgmod.count_gpus(os.environ))
        if machine is None:
            raise ValueError("this machine's GPU memory is unknown: give --instance or --gpus N --gpu-memory GiB")
    if (task := resolve_task(resolved, model_dir)) != TASK_GENERATION:  # embeddings, scores: no KV cache to plan
        weights = shape.weight_bytes_per_rank(1, 4 if resolved["option.dtype"] == "fp32" else 2)
        print(f"task: {task} (the pooling engine): weights {weights / 2**20:,.1f} MiB in "
              f"{resolved['option.dtype'] or 'the default dtype (bf16 size shown)'}; no KV cache: memory is the "
              "weights and one batch's activations (max_rolling_batch_prefill_tokens tokens)")
        return 0
    kind = cfgmod.select_engine(resolved, spec)
    print(f"model code: {cfgmod.model_code(resolved, spec)}; engine: {kind}",
          file=sys.stderr if args.json else sys.stdout)
    result = plan(shape, machine, planner.workload(resolved, shape, machine, kind, prompt_tokens=args.prompt_tokens,
                                                   output_tokens=args.output_tokens))
    print(planner.to_json(result) if args.json else "\n".join(planner.table(result)))
    return 0 if result.fits else 1


def cmd_make_model(args) -> int:
    from container.model_maker import make_draft, make_model

    if args.draft_of:
        card = make_draft(args.draft_of, args.out_dir, args.num_layers or 2)
        print(f"wrote a {card['num_hidden_layers']}-layer draft of {args.draft_of} ({card['num_parameters']:,} "
              f"parameters) to {args.out_dir}")
        return 0
    if args.arch in ENCODER_KINDS:  # embedding, reranking, classification checkpoints
        from container.encoder_maker import ENCODER_SIZES, make_encoder

        if args.size not in ENCODER_SIZES:
            raise SystemExit(f"lmi make-model: --arch {args.arch} comes in sizes {', '.join(ENCODER_SIZES)}")
        card = make_encoder(args.out_dir, args.arch, size=args.size, seed=args.seed)
        print(f"wrote {card['architecture']} ({args.arch}, {card['num_parameters']:,} parameters) to {args.out_dir}")
        return 0
    overrides = {k: v for k, v in {"num_key_value_heads": args.num_kv_heads, "num_attention_heads": args.num_heads,
                                   "num_hidden_layers": args.num_layers, "hidden_size": args.hidden_size}.items()
                 if v is not None}
    card = make_model(args.out_dir, arch=args.arch, size=args.size, seed=args.seed, overrides=overrides,
                      dtype=args.dtype, copy=args.copy)
    print(f"wrote {card['architecture']} ({card['num_parameters']:,} parameters, median top-1 logit margin "
          f"{card['median_top1_margin']}) to {args.out_dir}")
    return 0


def cmd_tune(args) -> int:
    from container.tune.command import run

    return run(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmi", description="lmi-serve: LMI-style LLM inference server",
                                formatter_class=_CommandListFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, fn, what in COMMANDS:
        s = sub.add_parser(name, help=what, description=what)
        s.add_argument("--properties", help="serving.properties file (default: MODEL_DIR/serving.properties)")
        s.add_argument("--config", help="a vLLM-style YAML config of engine arguments (vllm serve --config), "
                                        "beside serving.properties")
        s.add_argument("--model-dir", help="model directory (default for option.model_id)")
        if name == "config":
            s.add_argument("--server", help="list a running server's models instead (its URL, e.g. "
                                            "http://localhost:8080)")
        if name == "plan":
            _plan_arguments(s)
        else:
            s.add_argument("--port", type=int, help="port (default: SAGEMAKER_BIND_TO_PORT or 8080)")
            s.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
        s.set_defaults(fn=fn)
    m = sub.add_parser("make-model", help=MAKE_MODEL, description=MAKE_MODEL)
    m.add_argument("out_dir")
    m.add_argument("--arch", default="llama", choices=ARCHITECTURES + ENCODER_KINDS)
    m.add_argument("--size", default="tiny", choices=list(dict.fromkeys([*SIZES, *ENCODER_SIZES])))
    m.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="dtype of the written weights (default float32)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--num-kv-heads", type=int)
    m.add_argument("--num-heads", type=int)
    m.add_argument("--num-layers", type=int)
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--copy", action="store_true",
                   help="a model whose greedy output repeats its input's last token (benchmarks of speculative "
                        "decoding)")
    m.add_argument("--draft-of", metavar="MODEL_DIR",
                   help="write a draft model for speculative decoding instead: MODEL_DIR's embeddings, first "
                        "--num-layers layers (default 2), final norm and LM head")
    m.set_defaults(fn=cmd_make_model)
    from container.tune.command import add_arguments as tune_arguments

    t = sub.add_parser("tune", help=TUNE, description=TUNE)
    tune_arguments(t)
    t.set_defaults(fn=cmd_tune)
    return p


class _CommandListFormatter(argparse.HelpFormatter):
    """Every command and its description on one line (argparse measures sub-commands without
    their indent, so a long name like make-model would get a line of its own)."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=24, width=100)

    def add_argument(self, action) -> None:
        super().add_argument(action)
        self._action_max_length = max(self._action_max_length, len("    make-model") + 2)


def _plan_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("model", nargs="?", help="a model directory or hub id (default: option.model_id or --model-dir)")
    machine = s.add_mutually_exclusive_group()
    machine.add_argument("--instance", help="a SageMaker instance type, e.g. ml.g5.12xlarge")
    machine.add_argument("--gpus", type=int, help="number of GPUs (with --gpu-memory)")
    machine.add_argument("--cpu", action="store_true", help="plan for this machine's RAM")
    s.add_argument("--gpu-memory", type=float, help="GiB per GPU (with --gpus)")
    s.add_argument("--prompt-tokens", type=int, help="prompt length of a sequence (default: max_model_len - output)")
    s.add_argument("--output-tokens", type=int, help="output length of a sequence (default: option.max_new_tokens)")
    s.add_argument("--json", action="store_true", help="the plan as JSON, for tools")


COMMANDS = (
    ("serve", cmd_serve, "start the server: the engine (under mpirun for engine=MPI) and the HTTP workers"),
    ("config", cmd_config, "print the resolved configuration, where each value came from, and the engine"),
    ("plan", cmd_plan, "will it fit? weights, KV cache and sequences per rank, without loading weights"),
)
MAKE_MODEL = "write a random-weight model and a tokenizer trained on local text, as safetensors"
TUNE = "serve candidate configurations and write the fastest that meets latency targets"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s lmi %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, PropertiesError, ArtifactError, ValueError) as exc:
        print(f"lmi {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
