"""What `lmi tune` may change, for this host, and what the configuration check and the memory plan
rule out before any server starts.

A knob is a list of settings (dicts of property overrides); its first setting is always {} (the
base properties as they are). A candidate takes one setting from each knob. The order of the
candidates is the order halving measures them in when the budget cannot measure all: the base
first, then each knob's settings alone (one factor at a time) alternating with random mixes.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
from dataclasses import dataclass
from typing import Mapping, Sequence

import msgspec

from container import config as cfgmod
from container import planner
from container.keys import KEYS_BY_NAME, ConfigError

SEQS = (4, 8, 16, 32, 64)  # option.max_rolling_batch_size (max_num_seqs)
BATCHED_TOKENS = (256, 512, 1024, 2048, 4096)  # option.max_rolling_batch_prefill_tokens
TARGET_TPOT_KEY = "option.target_tpot_ms"
# option.target_tpot_ms tried as these fractions of the --tpot-p90 target: a step cap below the p90
# target leaves room for the steps a prefill chunk makes longer
TPOT_CAP_FRACTIONS = (0.6, 0.8)


@dataclass(frozen=True)
class Candidate:
    name: str
    overrides: tuple[tuple[str, str], ...]  # property key, value; () is the base configuration

    @property
    def properties(self) -> dict[str, str]:
        return dict(self.overrides)


@dataclass(frozen=True)
class Host:
    num_gpus: int
    num_cpus: int
    cpu_flags: frozenset[str]
    gpu_capability: float | None = None  # the smallest compute capability; None when not known or no GPU


@dataclass(frozen=True)
class Pruned:
    candidate: Candidate
    reason: str


def knobs(host: Host, *, concurrency: int | None, tpot_target_s: float | None,
          only: Sequence[str] | None = None) -> dict[str, list[dict[str, str]]]:
    """Each knob's settings on this host. only: the knob names to search (None: all)."""
    seqs = [s for s in SEQS if concurrency is None or s < concurrency]
    if concurrency is not None:
        seqs.append(concurrency)  # more rows than clients cannot fill: one value stands for them all
    found = {
        "max_num_seqs": [{}] + [{"option.max_rolling_batch_size": str(s)} for s in seqs],
        "max_num_batched_tokens": [{}] + [{"option.max_rolling_batch_prefill_tokens": str(t)} for t in BATCHED_TOKENS],
        "scheduling": [{}, {"option.async_scheduling": "false"}, {"option.num_scheduler_steps": "4"},
                       {"option.speculative_method": "ngram", "option.num_speculative_tokens": "3"}],
        "quantize": [{}] + [{"option.quantize": q} for q in _quantize_methods(host)],
        "dtype": [{}] + [{"option.dtype": d} for d in (("bf16", "fp16") if host.num_gpus else ("bf16", "fp32"))],
    }
    if TARGET_TPOT_KEY in KEYS_BY_NAME and tpot_target_s is not None:
        found["target_tpot"] = [{}] + [{TARGET_TPOT_KEY: f"{tpot_target_s * 1000 * f:g}"} for f in TPOT_CAP_FRACTIONS]
    layouts = _layouts(host)
    if layouts:
        found["layout"] = [{}] + layouts
    if only:
        unknown = sorted(set(only) - set(found))
        if unknown:
            raise ValueError(f"--knobs {','.join(unknown)}: not a knob on this host; knobs: {', '.join(found)}")
        found = {k: v for k, v in found.items() if k in only}
    return found


def not_searched(host: Host, tpot_target_s: float | None) -> dict[str, str]:
    """The knobs left out on this host, and why (said before the search starts)."""
    why = {}
    if not _layouts(host):
        why["layout"] = ("one GPU: no split" if host.num_gpus else f"a CPU host of {host.num_cpus} cores: copies "
                         "would halve each one's cores; CPU tensor parallelism is not searched")
    if TARGET_TPOT_KEY not in KEYS_BY_NAME:
        why["target_tpot"] = f"this build has no {TARGET_TPOT_KEY}"
    elif tpot_target_s is None:
        why["target_tpot"] = "no --tpot-p90 to derive it from"
    return why


def _quantize_methods(host: Host) -> list[str]:
    if host.num_gpus:
        return ["int8", "int4"] + (["fp8"] if host.gpu_capability is not None and host.gpu_capability >= 8.9 else [])
    # int8_dynamic: PyTorch's x86 int8 GEMM (needs VNNI to be worth it)
    return ["int8", "int4"] + (["int8_dynamic"] if "avx512_vnni" in host.cpu_flags or "avx_vnni" in host.cpu_flags
                               else [])


def _layouts(host: Host) -> list[dict[str, str]]:
    """Copies vs tensor parallelism: on GPU hosts every split of the GPUs; on CPU hosts two copies
    only with 8 cores or more (each copy pins an equal share; on fewer, halving the cores of a
    memory-bound decode step loses more than a second batch gains)."""
    if host.num_gpus >= 2:
        splits = [tp for tp in (1, 2, 4, 8) if tp <= host.num_gpus and host.num_gpus % tp == 0]
        return [{"option.tensor_parallel_degree": str(tp), "maxWorkers": str(host.num_gpus // tp)}
                for tp in splits if not (tp == 1 and host.num_gpus == 1)]
    return [{"maxWorkers": "2"}] if not host.num_gpus and host.num_cpus >= 8 else []


def candidates(knob_settings: Mapping[str, list[dict[str, str]]], seed: int = 0) -> list[Candidate]:
    """The base, then one factor at a time alternating with random mixes; every combination once.
    The knobs' order is their priority (max_num_seqs first)."""
    names = list(knob_settings)
    combos = list(itertools.product(*(range(len(knob_settings[n])) for n in names)))
    base = combos[0]
    # one factor at a time, round robin over the knobs: every knob's first alternative before any second
    single = sorted((c for c in combos if sum(i != 0 for i in c) == 1), key=lambda c: (max(c), c[::-1]))
    mixes = [c for c in combos if sum(i != 0 for i in c) > 1]
    random.Random(seed).shuffle(mixes)
    order = [base] + [c for pair in itertools.zip_longest(single, mixes) for c in pair if c is not None]
    return [_make(names, knob_settings, c) for c in order]


def _make(names: list[str], knob_settings: Mapping[str, list[dict[str, str]]], choice: tuple[int, ...]) -> Candidate:
    overrides: dict[str, str] = {}
    for name, i in zip(names, choice):
        overrides.update(knob_settings[name][i])
    return Candidate(label(overrides), tuple(overrides.items()))


_SHORT = {"option.max_rolling_batch_size": "seqs", "option.max_rolling_batch_prefill_tokens": "tokens",
          "option.num_scheduler_steps": "steps", "option.speculative_method": "spec", "option.quantize": "q",
          "option.dtype": "dtype", TARGET_TPOT_KEY: "tpot_ms", "option.tensor_parallel_degree": "tp",
          "maxWorkers": "copies"}


def label(overrides: Mapping[str, str]) -> str:
    """A short name: `seqs=16 tokens=512 sync q=int8`; `defaults` for no overrides."""
    parts = []
    for key, value in overrides.items():
        if key == "option.async_scheduling":
            parts.append("sync" if value == "false" else "async")
        elif key == "option.num_speculative_tokens":
            continue  # said by spec=ngram
        else:
            parts.append(f"{_SHORT.get(key, key.removeprefix('option.'))}={value}")
    return " ".join(parts) or "defaults"


@dataclass
class Checker:
    """Builds each candidate's configuration as `lmi serve` would and plans its memory as `lmi plan`
    would, for the workload's longest sequence: what fails either never starts a server."""

    base: Mapping[str, str]
    local_dir: str
    env: Mapping[str, str]
    host: Host
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self):
        resolved = cfgmod.resolve(dict(self.base), self.env)
        self.spec = cfgmod.read_spec(self.local_dir, resolved["option.max_model_len"])
        self.shape = planner.read_model_shape(self.local_dir, spec=self.spec)
        self.machine = planner.this_machine(self.host.num_gpus)

    def problem(self, cand: Candidate) -> tuple[str | None, bytes]:
        """(why it cannot run here or None, the built configuration as JSON without its dtype's reason)."""
        try:
            resolved = cfgmod.resolve({**self.base, **cand.properties}, self.env)
            built = cfgmod.build(resolved, local_dir=self.local_dir, spec=self.spec, num_gpus=self.host.num_gpus,
                                 num_cpus=self.host.num_cpus, port=8080, cpu=self.host.cpu_flags, env=self.env)
        except (ConfigError, ValueError) as exc:  # CapacityError is a ConfigError
            return f"refused by the configuration check: {exc}", b""
        if self.machine is not None:
            kind = built.scheduler.engine_kind
            work = planner.workload(resolved, self.shape, self.machine, kind, prompt_tokens=self.prompt_tokens,
                                    output_tokens=self.output_tokens)
            from engines.weights.memory_plan import plan

            result = plan(self.shape, self.machine, work)
            if not result.fits:
                return f"the memory plan: {result.problems[0]}", b""
        same = msgspec.structs.replace(built, model=msgspec.structs.replace(built.model, dtype_why=None))
        return None, msgspec.json.encode(same)


def prune(cands: Sequence[Candidate], checker: Checker) -> tuple[list[Candidate], list[Pruned]]:
    """(the candidates that can run, each configuration once; the others with the reason)."""
    kept: list[Candidate] = []
    pruned: list[Pruned] = []
    seen: dict[bytes, int] = {}  # built configuration -> its place in kept
    for cand in cands:
        why, built = _quietly(checker.problem, cand)
        if why is None and built in seen:
            first = kept[seen[built]]
            if len(cand.overrides) < len(first.overrides):  # the same, said with fewer keys: keep that wording
                kept[seen[built]], cand, first = cand, first, cand
            why = f"the same configuration as {first.name}"
        if why is not None:
            pruned.append(Pruned(cand, why))
            continue
        seen[built] = len(kept)
        kept.append(cand)
    return kept, pruned


def _quietly(fn, *args):
    """fn(*args) without the configuration's start-up log lines (a line per candidate otherwise)."""
    logger = logging.getLogger("container")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        return fn(*args)
    finally:
        logger.setLevel(level)


def this_host() -> Host:
    from engines.devices import cpu_flags

    num_gpus = cfgmod.count_gpus(os.environ)
    capability = None
    if num_gpus:
        out = cfgmod.query_gpus("compute_cap")
        capability = min(float(v) for v in out) if out else None
    return Host(num_gpus, os.cpu_count() or 1, frozenset(cpu_flags()), capability)
