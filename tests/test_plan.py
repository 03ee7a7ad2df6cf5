"""`lmi plan`: figures checked against numbers computed by hand (the formulas are in each comment).

Real configs of Llama-2-7B/13B/70B and Mistral-7B are written as config.json (the parameters are
then counted from the shape); the Falcon-40B shape comes with a safetensors header (no tensor data),
and the tiny model is a real checkpoint made by `lmi make-model`, counted from its headers.
"""

from __future__ import annotations

import json
import struct

import pytest

from container.instances import instance
from container.planner import estimate_parameters, read_model_shape
from engines.weights.memory_plan import GIB, Machine, Workload, plan
from tests.test_cli import lmi

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, max_position_embeddings=4096,
             torch_dtype="float16", tie_word_embeddings=False)
CONFIGS = {
    "llama-2-7b": dict(LLAMA, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                       num_key_value_heads=32, num_hidden_layers=32),
    "llama-2-13b": dict(LLAMA, hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                        num_key_value_heads=40, num_hidden_layers=40),
    "llama-2-70b": dict(LLAMA, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                        num_key_value_heads=8, num_hidden_layers=80),
    "mistral-7b": dict(LLAMA, model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=4096,
                       intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
                       max_position_embeddings=32768, sliding_window=4096),
}
# parameters = V·H·2 (embeddings + LM head) + L·(H·hd·(2·heads + 2·kv_heads) + 3·H·I + 2·H) + H
PARAMETERS = {"llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
              "mistral-7b": 7_241_732_096}


def write_model(root, name: str, config: dict, header: dict | None = None):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if header is not None:  # a safetensors header with no tensor data behind it: the planner reads no more
        raw = json.dumps(header).encode()
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return d


def workload(shape, tp: int, dtype: str = "fp16", **kw) -> Workload:
    return Workload(dtype=dtype, tensor_parallel_degree=tp, max_num_seqs=32, max_num_batched_tokens=1024,
                    max_model_len=shape.max_model_len, prompt_tokens=shape.max_model_len - 30, output_tokens=30, **kw)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    return {name: read_model_shape(str(write_model(root, name, cfg))) for name, cfg in CONFIGS.items()}


def test_parameters_counted_from_the_config(shapes):
    assert {name: s.num_parameters for name, s in shapes.items()} == PARAMETERS


# (model, TP, instance) → weights per rank (fp16), KV bytes per token per rank, KV tokens (paged: whole blocks of
# 16); usable = int(GiB·0.9); headroom = 1 GiB + 1024·2·(2H + (2·heads/TP + 2·kv/TP)·hd + 3·I/TP) + 2·32·V·4;
# KV tokens = (usable − weights − headroom) // per token // 16 · 16; None: does not fit.
FIGURES = [
    # weights/rank = (P − norms − L·2·H·hd·kv)/TP + norms + L·2·H·hd·kv_local, × 2 bytes;
    # kv/token = 2·L·kv_local·hd·2
    ("llama-2-7b", 1, "ml.g5.12xlarge", 13_476_831_232, 524_288, 16_240),
    ("llama-2-7b", 2, "ml.g5.12xlarge", 6_738_681_856, 262_144, 58_368),
    ("llama-2-7b", 4, "ml.g5.12xlarge", 3_369_607_168, 131_072, 142_656),
    ("llama-2-7b", 8, "ml.g5.48xlarge", 1_685_069_824, 65_536, 311_216),
    ("llama-2-7b", 8, "ml.p4d.24xlarge", 1_685_069_824, 65_536, 547_152),
    ("llama-2-13b", 1, "ml.g5.12xlarge", 26_031_728_640, 819_200, None),
    ("llama-2-13b", 1, "ml.p4d.24xlarge", 26_031_728_640, 819_200, 13_904),
    ("llama-2-13b", 2, "ml.g5.12xlarge", 13_016_279_040, 409_600, 21_984),
    ("llama-2-13b", 4, "ml.g5.48xlarge", 6_508_554_240, 204_800, 75_920),
    ("llama-2-13b", 8, "ml.p4d.24xlarge", 3_254_691_840, 102_400, 334_768),
    ("llama-2-70b", 2, "ml.p4d.24xlarge", 68_977_967_104, 163_840, None),
    ("llama-2-70b", 4, "ml.g5.12xlarge", 34_490_302_464, 81_920, None),
    ("llama-2-70b", 4, "ml.p4d.24xlarge", 34_490_302_464, 81_920, 36_560),
    ("llama-2-70b", 8, "ml.g5.48xlarge", 17_246_470_144, 40_960, 117_280),
    ("llama-2-70b", 8, "ml.p4d.24xlarge", 17_246_470_144, 40_960, 494_768),
    ("mistral-7b", 1, "ml.g5.12xlarge", 14_483_464_192, 131_072, 57_232),
    ("mistral-7b", 2, "ml.g5.12xlarge", 7_241_998_336, 65_536, 225_792),
    ("mistral-7b", 4, "ml.g5.48xlarge", 3_621_265_408, 32_768, 562_912),
    # 8 KV heads over 8 ranks: one each, no replication
    ("mistral-7b", 8, "ml.p4d.24xlarge", 1_810_898_944, 16_384, 2_180_864),
]


@pytest.mark.parametrize("name,tp,machine,weights,per_token,kv_tokens", FIGURES,
                         ids=[f"{f[0]}-tp{f[1]}-{f[2]}" for f in FIGURES])
def test_figures_match_the_hand_computed_ones(shapes, name, tp, machine, weights, per_token, kv_tokens):
    p = plan(shapes[name], instance(machine), workload(shapes[name], tp))
    assert (p.weight_bytes, p.kv_bytes_per_token) == (weights, per_token)
    if kv_tokens is None:
        assert not p.fits and p.problems[0].startswith("does not fit: the weights need")
    else:
        assert p.fits, p.problems
        assert p.kv_tokens == kv_tokens
        assert p.max_concurrent_seqs == kv_tokens // shapes[name].max_model_len


def test_llama_70b_does_not_fit_at_tp4_on_4x24_and_fits_at_tp8_on_8x40(shapes):
    shape = shapes["llama-2-70b"]
    small = plan(shape, instance("ml.g5.12xlarge"), workload(shape, 4))
    assert small.problems == [
        "does not fit: the weights need 32.12 GiB per rank in fp16 at tensor_parallel_degree=4 (+ 1.09 GiB "
        "headroom), but 21.60 GiB of 24.00 GiB per GPU is usable at gpu_memory_utilization=0.9; raise "
        "option.tensor_parallel_degree or use a bigger instance"]
    assert small.smallest_tp is None  # 8 ranks are needed, and ml.g5.12xlarge has 4 GPUs
    big = plan(shape, instance("ml.p4d.24xlarge"), workload(shape, 8))
    assert big.fits and big.kv_tokens == 494_768 and big.max_concurrent_seqs == 120
    assert big.smallest_tp == 4  # 34.49 GB of weights per rank fit 36 GiB usable
    assert big.notes == []  # 120 sequences ≥ max_rolling_batch_size=32; 494,768 tokens ≥ 1,024 per step


def test_a_tp_that_does_not_fit_names_the_smallest_that_does(shapes):
    shape = shapes["llama-2-13b"]
    p = plan(shape, instance("ml.g5.12xlarge"), workload(shape, 1))
    assert p.smallest_tp == 2
    assert p.problems[0].endswith("(option.tensor_parallel_degree=2 fits)")


def test_unreachable_batch_size_is_said_with_the_number_to_change(shapes):
    shape = shapes["llama-2-7b"]
    p = plan(shape, instance("ml.g5.12xlarge"), workload(shape, 1))
    assert p.fits and p.max_concurrent_seqs == 3  # 16,240 tokens // 4,096
    assert p.notes == ["option.max_rolling_batch_size=32 cannot be reached: 3 sequences of 4,096 tokens fit; "
                       "set it to 3 or shorten the sequences"]


def test_a_kv_cache_shorter_than_one_sequence_does_not_fit(shapes):
    shape = shapes["llama-2-13b"]
    p = plan(shape, Machine("1 x 28 GiB", 1, 28 * GIB), workload(shape, 1))
    # usable int(28 GiB · 0.9) = 27,058,293,964; − 26,031,728,640 − 1,229,783,040 < 0: no KV at all
    assert p.kv_tokens == 0 and p.problems[0].startswith("does not fit: the weights need")
    p = plan(shape, Machine("1 x 30 GiB", 1, 30 * GIB), workload(shape, 1))
    # int(30 GiB · 0.9) = 28,991,029,248 − 26,031,728,640 − 1,229,783,040 = 1,729,517,568;
    # // 819,200 = 2,111 tokens → 2,096 in whole blocks
    assert p.kv_tokens == 2_096
    assert p.problems == ["does not fit: the KV cache holds 2,096 tokens per rank, less than one sequence of "
                          "max_model_len=4,096; set option.max_model_len to 2,096 or less, or make room: "
                          "option.gpu_memory_utilization, option.tensor_parallel_degree, "
                          "option.max_rolling_batch_prefill_tokens"]


def test_tp_must_divide_the_heads(shapes):
    with pytest.raises(ValueError, match="tensor_parallel_degree=3 does not divide .* use one of 1, 2, 4, 8"):
        plan(shapes["llama-2-70b"], instance("ml.p4d.24xlarge"), workload(shapes["llama-2-70b"], 3))


def falcon_40b_header() -> dict:
    """Falcon-40B's tensors (new decoder architecture: 128 heads, 8 KV heads of 64, fused QKV, tied LM head)."""
    h, layers, vocab = 8192, 60, 65024
    tensors = {"transformer.word_embeddings.weight": [vocab, h], "transformer.ln_f.weight": [h],
               "transformer.ln_f.bias": [h]}
    for i in range(layers):
        p = f"transformer.h.{i}."
        tensors.update({p + "ln_attn.weight": [h], p + "ln_attn.bias": [h], p + "ln_mlp.weight": [h],
                        p + "ln_mlp.bias": [h], p + "self_attention.query_key_value.weight": [(128 + 16) * 64, h],
                        p + "self_attention.dense.weight": [h, h], p + "mlp.dense_h_to_4h.weight": [4 * h, h],
                        p + "mlp.dense_4h_to_h.weight": [h, 4 * h]})
    return {name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]} for name, shape in tensors.items()}


def test_falcon_40b_shape_counted_from_its_safetensors_header(tmp_path):
    config = dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=8192, num_attention_heads=128,
                  num_kv_heads=8, num_hidden_layers=60, vocab_size=65024, new_decoder_architecture=True,
                  max_position_embeddings=2048, torch_dtype="bfloat16")
    shape = read_model_shape(str(write_model(tmp_path, "falcon-40b", config, falcon_40b_header())))
    # V·H + 60·(4·H norms + H·144·64 + H·H + 2·H·4H) + 2·H
    assert (shape.num_parameters, shape.replicated_parameters) == (41_303_293_952, 1_982_464)
    assert (shape.num_kv_heads, shape.head_dim, shape.intermediate_size) == (8, 64, 32768)
    p = plan(shape, instance("ml.g5.48xlarge"), workload(shape, 8))
    assert (p.weight_bytes, p.kv_bytes_per_token, p.kv_tokens) == (10_329_292_800, 15_360, 762_352)
    assert plan(shape, instance("ml.g5.48xlarge"), workload(shape, 2)).smallest_tp == 4


def test_tiny_model_counted_from_its_checkpoint(tiny_model):
    shape = read_model_shape(str(tiny_model))
    # V=1024, H=64, L=2, 4 heads, 2 KV heads of 16, I=128: 1024·64·2 + 2·(64·16·12 + 3·64·128 + 128) + 64
    assert (shape.num_parameters, shape.replicated_parameters, shape.max_model_len) == (205_120, 320, 1024)
    config = json.loads((tiny_model / "config.json").read_text())
    assert estimate_parameters(config, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                               intermediate_size=128, vocab_size=1024) == (205_120, 320)
    assert shape.weight_bytes_per_rank(1, 2) == 410_240
    # TP 2: (205,120 − 320 − 2·4,096)/2 + 320 + 4,096 (one KV head per rank) = 102,720 parameters
    assert shape.weight_bytes_per_rank(2, 2) == 205_440
    assert shape.kv_bytes_per_token(1, 2) == 256  # 2 · 2 layers · 2 KV heads · 16 · 2 bytes
    p = plan(shape, Machine("16 GiB RAM", 0, 16 * GIB), workload(shape, 1, dtype="bf16"))
    # CPU default: max_num_seqs · max_model_len · 256 = 32 · 1,024 · 256 bytes (under a quarter of RAM)
    assert (p.kv_bytes, p.kv_tokens, p.max_concurrent_seqs) == (8_388_608, 32_768, 32)


def test_small_model_figures(tmp_path):
    from container.model_maker import SIZES

    cfg = dict(LLAMA, vocab_size=1024, **SIZES["small"])  # what `lmi make-model --size small` writes
    shape = read_model_shape(str(write_model(tmp_path, "small", cfg)))
    # 1024·768·2 + 12·(768·64·(24 + 8) + 3·768·3072 + 1536) + 768
    assert shape.num_parameters == 105_401_088
    p = plan(shape, instance("ml.g5.12xlarge"), workload(shape, 1))
    assert (p.weight_bytes, p.kv_bytes_per_token, p.kv_tokens) == (210_802_176, 12_288, 1_780_736)
    # TP 4 over 4 KV heads: one each; 4 · 768 · 64 · 2 · 12 / 4 ... = 52,729,344 bytes
    assert plan(shape, instance("ml.g5.12xlarge"), workload(shape, 4)).weight_bytes == 52_729_344


def test_lmi_plan_command(tmp_path):
    model = write_model(tmp_path, "llama-2-70b", CONFIGS["llama-2-70b"])
    props = tmp_path / "serving.properties"
    props.write_text("engine=MPI\noption.tensor_parallel_degree=4\n")
    small = lmi("plan", "--properties", str(props), "--model-dir", str(model), "--instance", "ml.g5.12xlarge")
    assert small.returncode == 1, small.stderr
    assert "smallest tensor_parallel_degree that fits  none" in small.stdout
    last = small.stdout.strip().splitlines()[-1]
    assert last.startswith("plan: ") and last.endswith("raise option.tensor_parallel_degree or use a bigger instance")
    props.write_text("engine=MPI\noption.tensor_parallel_degree=8\n")
    big = lmi("plan", str(model), "--properties", str(props), "--gpus", "8", "--gpu-memory", "40", "--json")
    assert big.returncode == 0, big.stderr
    body = json.loads(big.stdout)
    assert (body["fits"], body["kv_tokens"], body["weight_bytes"]) == (True, 494_768, 17_246_470_144)
    assert body["summary"] == ("plan: LlamaForCausalLM 68.98 B parameters, fp16, TP 8 on 8 x 40 GiB GPUs: weights "
                               "16.06 GiB/rank, KV cache 494,768 tokens (40,960 bytes/token/rank), 120 sequences of "
                               "4,096 tokens; fits")
    unknown = lmi("plan", str(model), "--instance", "ml.x9.huge")
    assert unknown.returncode == 2 and "unknown instance type 'ml.x9.huge'" in unknown.stderr


def test_lmi_help_lists_every_command():
    out = lmi("--help").stdout
    listed = {line.split()[0]: line for line in out.splitlines() if line.startswith("    ") and line.split()}
    assert list(listed) == ["serve", "config", "plan", "make-model", "tune"], out
    assert all(len(line.split(maxsplit=1)) == 2 for line in listed.values()), out  # a one-line description each


def test_an_explicit_cpu_kv_cache_is_served_as_asked_with_a_note(tiny_model):
    shape = read_model_shape(str(tiny_model))
    p = plan(shape, Machine("16 GiB RAM", 0, 16 * GIB), workload(shape, 1, dtype="fp32", kv_cache_bytes=300 * 1024))
    # 307,200 bytes // 512 bytes per token (fp32) = 600 tokens → 37 whole blocks of 16 = 592
    assert p.fits and p.kv_tokens == 592
    assert p.notes[0] == ("option.kv_cache_memory holds 592 tokens, less than one sequence of max_model_len=1,024: "
                          "longer requests are refused with 507")


def test_a_hub_id_that_cannot_be_fetched_is_one_line(tmp_path):
    result = lmi("plan", "nobody/no-such-model", "--instance", "ml.g5.xlarge",
                 env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(
        "lmi plan: error: cannot fetch config.json of 'nobody/no-such-model' from the hub: "), errors
