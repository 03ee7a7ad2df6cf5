"""`lmi config` and `lmi make-model` as real subprocesses."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import LMI, ROOT

EXAMPLES = sorted((ROOT / "serving.properties.examples").glob("*.properties"))
EXPECTED_ENGINE = {"falcon-40b-dynamic": "dynamic", "falcon-40b-rolling": "rolling", "falcon-40b-paged": "paged",
                   "tiny-dynamic": "dynamic", "tiny-rolling": "rolling", "tiny-paged": "paged",
                   "embedding": "pooling", "reranker": "pooling"}
EXAMPLE_MODEL = {"embedding": "bert-embed", "reranker": "bert-rerank"}  # (conftest's encoders); others: tiny_model


def lmi(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "HF_MODEL"))}
    return subprocess.run([*LMI, *args], cwd=ROOT, env=dict(clean, **(env or {})), capture_output=True,
                          text=True, timeout=60)


def test_every_example_is_listed():
    assert {p.stem for p in EXAMPLES} == set(EXPECTED_ENGINE)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_lmi_config_resolves_every_example(path, tiny_model, encoders):
    model = encoders[EXAMPLE_MODEL[path.stem]] if path.stem in EXAMPLE_MODEL else tiny_model
    result = lmi("config", "--properties", str(path), "--model-dir", str(model))
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"engine: {EXPECTED_ENGINE[path.stem]}"), last
    assert "[file]" in result.stdout


def test_lmi_config_shows_sources(tmp_path, tiny_model):
    props = tmp_path / "serving.properties"
    props.write_text("engine=Python\nbatch_size=2\n")
    result = lmi("config", "--properties", str(props), "--model-dir", str(tiny_model),
                 env={"OPTION_DTYPE": "fp32", "SERVING_JOB_QUEUE_SIZE": "7"})
    lines = {line.split("=")[0].strip(): line for line in result.stdout.splitlines() if "=" in line}
    assert lines["batch_size"].endswith("[file]")
    assert "fp32" in lines["option.dtype"] and lines["option.dtype"].endswith("[env (OPTION_DTYPE)]")
    assert "7" in lines["job_queue_size"] and "SERVING_JOB_QUEUE_SIZE" in lines["job_queue_size"]
    assert lines["max_batch_delay"].endswith("[default]")


def test_a_vllm_yaml_config_works_beside_serving_properties(tmp_path, tiny_model):
    """`lmi serve|config --config FILE.yaml` as `vllm serve --config`: vLLM's spellings, dashes or
    underscores, mapped through the same aliases, shown with their provenance."""
    props = tmp_path / "serving.properties"
    props.write_text("engine=Python\noption.dtype=fp32\n")
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text("max-num-seqs: 12\nmax_num_batched_tokens: 256\nenable-prefix-caching: true\n"
                   "tensor-parallel-size: 1\nmax-model-len: 512\n")
    result = lmi("config", "--properties", str(props), "--config", str(cfg), "--model-dir", str(tiny_model))
    assert result.returncode == 0, result.stderr
    lines = {line.split("=")[0].strip(): line for line in result.stdout.splitlines() if "=" in line}
    assert "12" in lines["option.max_rolling_batch_size"] and "option.max_num_seqs" in lines["option.max_rolling_batch_size"]
    assert "256" in lines["option.max_rolling_batch_prefill_tokens"]
    assert "True" in lines["option.enable_prefix_caching"] or "true" in lines["option.enable_prefix_caching"]
    assert "512" in lines["option.max_model_len"] and lines["option.dtype"].endswith("[file]")
    # the same key in both with different values: one clear line
    cfg.write_text("dtype: bf16\n")
    result = lmi("config", "--properties", str(props), "--config", str(cfg), "--model-dir", str(tiny_model))
    assert result.returncode != 0
    assert "option.dtype is set in serving.properties (option.dtype='fp32') and in" in result.stderr
    cfg.write_text("- a list\n")
    result = lmi("config", "--config", str(cfg), "--model-dir", str(tiny_model))
    assert result.returncode != 0 and "a vLLM config is a mapping of engine arguments" in result.stderr


def test_misspelt_key_warns_with_the_closest_key(tmp_path, tiny_model):
    props = tmp_path / "serving.properties"
    props.write_text("option.rolling_bach=auto\n")
    result = lmi("config", "--properties", str(props), "--model-dir", str(tiny_model))
    assert result.returncode == 0
    assert "did you mean option.rolling_batch" in result.stderr


def test_dynamic_batch_with_lmi_dist_exits_with_one_clear_line(tmp_path, tiny_model):
    props = tmp_path / "serving.properties"
    props.write_text("batch_size=4\noption.rolling_batch=lmi-dist\n")
    result = lmi("config", "--properties", str(props), "--model-dir", str(tiny_model))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert errors == ["lmi config: error: batch_size=4 with option.rolling_batch=lmi-dist: dynamic batching and "
                      "rolling batch exclude each other; set batch_size=1 or option.rolling_batch=disable"]


def test_invalid_value_exits_non_zero_naming_key_and_value(tmp_path, tiny_model):
    props = tmp_path / "serving.properties"
    props.write_text("option.max_rolling_batch_size=lots\n")
    result = lmi("serve", "--properties", str(props), "--model-dir", str(tiny_model))
    assert result.returncode == 2
    assert "option.max_rolling_batch_size='lots' is invalid: expected an integer" in result.stderr


def test_make_model_is_deterministic_for_a_seed(tmp_path, tiny_model):
    again = tmp_path / "again"
    other = tmp_path / "other"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two processes at once (each imports torch)
        made = list(pool.map(lambda args: lmi("make-model", *args),
                             [(str(again),), (str(other), "--seed", "1", "--num-kv-heads", "1")]))
    assert [m.returncode for m in made] == [0, 0], [m.stderr[-2000:] for m in made]

    def digest(d: Path) -> str:
        return hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()

    assert digest(again) == digest(tiny_model)
    assert (again / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    assert digest(other) != digest(tiny_model)
    assert json.loads((other / "config.json").read_text())["num_key_value_heads"] == 1
    card = json.loads((again / "lmi_model_card.json").read_text())
    assert card["architecture"] == "LlamaForCausalLM" and card["seed"] == 0
    # the margin that keeps greedy comparisons stable: far above float32 noise (~1e-5 here)
    assert card["median_top1_margin"] > 0.1


@pytest.mark.parametrize("doc", ["serving.properties.examples/README.md", "docs/configuration.md"])
def test_docs_list_every_key_with_its_default(doc):
    from container.keys import KEYS

    text = (ROOT / doc).read_text()
    for key in KEYS:
        default = "unset" if key.default is None else str(key.default)
        assert f"| `{key.name}` | {default} |" in text, key.name


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = readme.split("```bash\n")
    commands = [b.split("\n```")[0].strip() for b in blocks[1:3]]
    assert "lmi serve" in commands[0] and "pytest" in commands[1]
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert commands[1] in ci_lines
