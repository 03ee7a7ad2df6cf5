"""`lmi serve | make-model | config`: the command line (console script `lmi`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from container import config as cfgmod
from container.artifacts import ArtifactError, resolve_model
from container.keys import ConfigError
from container.properties import PropertiesError, read_properties

log = logging.getLogger("container.cli")


def _properties(path: str | None, model_dir: str | None) -> dict[str, str]:
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"--properties {path}: no such file")
        return read_properties(path)
    if model_dir and os.path.isfile(os.path.join(model_dir, "serving.properties")):
        return read_properties(os.path.join(model_dir, "serving.properties"))
    return {}


def _resolve(args) -> cfgmod.ResolvedConfig:
    resolved = cfgmod.resolve(_properties(args.properties, args.model_dir), os.environ)
    for warning in resolved.warnings:
        log.warning("%s", warning)
    return resolved


def cmd_serve(args) -> int:
    from container.launcher import Launcher

    resolved = _resolve(args)
    local_dir = resolve_model(resolved["option.model_id"], args.model_dir, revision=resolved["option.revision"],
                              download_dir=resolved["download_dir"] or cfgmod.default_download_dir(os.environ))
    config = cfgmod.build(resolved, local_dir=local_dir, architecture=cfgmod.read_architecture(local_dir),
                          num_gpus=cfgmod.count_gpus(os.environ), num_cpus=os.cpu_count() or 1,
                          port=cfgmod.resolve_port(args.port, os.environ))
    log.info("configuration:\n  %s", "\n  ".join(cfgmod.describe(resolved)))
    log.info("engine: %s, model: %s", config.scheduler.engine_kind, local_dir)
    return Launcher(config, host=args.host).run()


def cmd_config(args) -> int:
    resolved = _resolve(args)
    for line in cfgmod.describe(resolved):
        print(line)
    model_id = resolved["option.model_id"]
    is_remote = bool(model_id) and (model_id.startswith("s3://") or not os.path.exists(os.path.expanduser(model_id)))
    local_dir = None if is_remote else resolve_model(model_id, args.model_dir, download_dir="")
    architecture = cfgmod.read_architecture(local_dir)
    num_gpus = cfgmod.count_gpus(os.environ)
    build = dict(local_dir=local_dir or "", architecture=architecture, num_cpus=os.cpu_count() or 1,
                 port=cfgmod.resolve_port(args.port, os.environ))
    try:
        config = cfgmod.build(resolved, num_gpus=num_gpus, **build)
    except cfgmod.CapacityError as exc:
        # valid for a bigger machine: say what this one lacks, then show the resolution there
        print(f"warning: on this machine: {exc}", file=sys.stderr)
        config = cfgmod.build(resolved, num_gpus=resolved["option.tensor_parallel_degree"], **build)
    where = " (architecture not known before download)" if is_remote else ""
    print(f"engine: {config.scheduler.engine_kind}{where}; tensor_parallel_degree: "
          f"{config.parallel.tensor_parallel_degree}; mpi: {config.parallel.use_mpi}; dtype: {config.model.dtype}")
    return 0


def cmd_make_model(args) -> int:
    from container.model_maker import make_model

    overrides = {k: v for k, v in {"num_key_value_heads": args.num_kv_heads, "num_attention_heads": args.num_heads,
                                   "num_hidden_layers": args.num_layers, "hidden_size": args.hidden_size}.items()
                 if v is not None}
    card = make_model(args.out_dir, arch=args.arch, size=args.size, seed=args.seed, overrides=overrides)
    print(f"wrote {card['architecture']} ({card['num_parameters']:,} parameters, median top-1 logit margin "
          f"{card['median_top1_margin']}) to {args.out_dir}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmi", description="lmi-serve: LMI-style LLM inference server")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn in (("serve", cmd_serve), ("config", cmd_config)):
        s = sub.add_parser(name)
        s.add_argument("--properties", help="serving.properties file (default: MODEL_DIR/serving.properties)")
        s.add_argument("--model-dir", help="model directory (default for option.model_id)")
        s.add_argument("--port", type=int, help="port (default: SAGEMAKER_BIND_TO_PORT or 8080)")
        s.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
        s.set_defaults(fn=fn)
    m = sub.add_parser("make-model", help="a random-weight model + tokenizer trained on local text")
    m.add_argument("out_dir")
    m.add_argument("--arch", default="llama", choices=("llama", "mistral", "qwen2", "gpt2"))
    m.add_argument("--size", default="tiny", choices=("tiny", "small"))
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--num-kv-heads", type=int)
    m.add_argument("--num-heads", type=int)
    m.add_argument("--num-layers", type=int)
    m.add_argument("--hidden-size", type=int)
    m.set_defaults(fn=cmd_make_model)
    return p


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
