"""Pre-quantised checkpoints (engines/weights/quant_checkpoint.py, engines/weights/quant_load.py): each format of the tiny
model (tests/quant_ckpt.py writes them) served by our engines gives the greedy tokens of its oracle:
transformers itself on the same file for compressed-tensors (it decompresses them), and for GPTQ, AWQ
and fp8 (whose libraries do not install here) transformers on the checkpoint dequantised by the plain
decoder below, written independently of engines/layers/quant_formats.py."""

from __future__ import annotations

import functools
import json
import logging
import os

import pytest
import torch

from engines.layers.quant import Fp8Policy, Fp8Weight, Int4Weight, Int8Weight
from tests import quant_ckpt
from tests.support import drive_engine, hf_oracle, local_engine, output_tokens

PROMPTS = [[1] + [(7 * i + 3) % 1000 + 3 for i in range(n)] for n in (5, 17, 40)]
NEW_TOKENS = 10


def _engine_tokens(model_dir, kind: str = "paged", **kw) -> tuple[list[list[int]], object]:
    from engines.sampling_params import SamplingParams

    # the kernels named: auto may run 4-bit weights on bf16 activations (tests/test_cpu_linear.py), and the
    # references dequantise in the model dtype
    engine = local_engine(model_dir, kind, **{"cpu_linear": "aten", **kw})
    outputs = drive_engine(engine, [(f"r{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS))
                                    for i, p in enumerate(PROMPTS)])
    return [output_tokens(outputs[f"r{i}"]) for i in range(len(PROMPTS))], engine.runner.model


@functools.cache
def _oracle_tokens(model_dir) -> list[list[int]]:
    generate = hf_oracle(str(model_dir))
    return [generate(p, NEW_TOKENS) for p in PROMPTS]


def _reference_tokens(quantised) -> list[list[int]]:
    """transformers on the plain-decoded copy of `quantised` (written once, next to it)."""
    reference = f"{quantised}-reference"
    if not os.path.isdir(reference):
        _dequantised_copy(str(quantised), reference)
    return _oracle_tokens(reference)


# -- a plain decoder: one value at a time out of each int32 word ---------------------------------------
def _field(words: torch.Tensor, slot: int, bits: int) -> torch.Tensor:
    return (words.long() & 0xFFFFFFFF) >> (bits * slot) & ((1 << bits) - 1)


def _reference_weight(cfg: dict, t: dict[str, torch.Tensor]) -> torch.Tensor:
    method = cfg["quant_method"]
    if method == "fp8":
        bo, bi = cfg["weight_block_size"]
        s = t["weight_scale_inv"].repeat_interleave(bo, 0).repeat_interleave(bi, 1)
        return t["weight"].float() * s
    bits = cfg["bits"]
    per = 32 // bits
    qw, qz, scales = t["qweight"], t["qzeros"], t["scales"].float()  # scales [G, out]
    if method == "gptq":
        q = torch.empty(qw.shape[0] * per, qw.shape[1], dtype=torch.long)  # [in, out]
        z = torch.empty(qz.shape[0], qz.shape[1] * per, dtype=torch.long)  # [G, out]
        for j in range(per):
            q[j::per] = _field(qw, j, bits)
            z[:, j::per] = _field(qz, j, bits)
        if cfg.get("checkpoint_format", "gptq") == "gptq":
            z = (z + 1) % (1 << bits)
        g = t["g_idx"].long()
    else:  # awq: slot j of word c is output 8c + order[j]
        q = torch.empty(qw.shape[0], qw.shape[1] * 8, dtype=torch.long)
        z = torch.empty(qz.shape[0], qz.shape[1] * 8, dtype=torch.long)
        for j, o in enumerate(quant_ckpt.AWQ_ORDER):
            q[:, o::8] = _field(qw, j, 4)
            z[:, o::8] = _field(qz, j, 4)
        g = torch.arange(q.shape[0]) // cfg["group_size"]
    return ((q - z[g]).float() * scales[g]).t()  # [out, in]


def _dequantised_copy(quantised: str, out: str) -> str:
    """The checkpoint with every quantised linear replaced by its plain-decoded float32 weight."""
    from safetensors.torch import load_file

    with open(os.path.join(quantised, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)["quantization_config"]
    state = load_file(os.path.join(quantised, "model.safetensors"))
    prefixes = {n.rsplit(".", 1)[0] for n in state if n.endswith((".qweight", ".weight_scale_inv"))}
    dense = {n: v for n, v in state.items() if n.rsplit(".", 1)[0] not in prefixes}
    for p in prefixes:
        dense[p + ".weight"] = _reference_weight(cfg, {n.rsplit(".", 1)[1]: v for n, v in state.items()
                                                       if n.rsplit(".", 1)[0] == p})
    quant_ckpt._write(quantised, out, dense, None)
    return out


WRITERS = {
    "gptq-int4-sym": lambda src, out: quant_ckpt.write_gptq(src, out, bits=4, group=32, sym=True),
    "gptq_v2-int4-asym-g64": lambda src, out: quant_ckpt.write_gptq(src, out, bits=4, group=64, sym=False,
                                                                    version="gptq_v2"),
    "gptq-int8-channel": lambda src, out: quant_ckpt.write_gptq(src, out, bits=8, group=-1, sym=True),
    "awq-int4": lambda src, out: quant_ckpt.write_awq(src, out, group=32),
    "gptq-act-order": lambda src, out: quant_ckpt.write_gptq(src, out, bits=4, group=32, desc_act=True),
    "fp8-block": lambda src, out: quant_ckpt.write_fp8(src, out, block=(32, 32)),
}
PACKED_AS = {"gptq-int4-sym": Int4Weight, "gptq_v2-int4-asym-g64": Int4Weight, "gptq-int8-channel": Int8Weight,
             "awq-int4": Int4Weight, "gptq-act-order": torch.Tensor, "fp8-block": torch.Tensor}


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantised")
    made = {}
    for name, write in WRITERS.items():
        write(str(tiny_model), str(root / name))
        made[name] = root / name
    return made


@pytest.mark.parametrize("name", list(WRITERS))
def test_gptq_awq_fp8_give_the_dequantised_reference_greedy_tokens(checkpoints, caplog, name) -> None:
    with caplog.at_level(logging.INFO):
        tokens, model = _engine_tokens(checkpoints[name])
    assert isinstance(model.layers[0].mlp.down_proj.weight, PACKED_AS[name])
    assert isinstance(model.layers[1].self_attn.qkv_proj.weight, PACKED_AS[name])  # q, k, v fused
    if PACKED_AS[name] is torch.Tensor:
        assert any("dequantising its weights to torch.float32 on load" in r.getMessage() for r in caplog.records)
    assert tokens == _reference_tokens(checkpoints[name])


def test_the_padded_engine_serves_a_gptq_checkpoint(checkpoints) -> None:
    tokens, model = _engine_tokens(checkpoints["gptq-int4-sym"], kind="rolling")
    assert isinstance(model.layers[0].self_attn.o_proj.weight, Int4Weight)
    assert tokens == _reference_tokens(checkpoints["gptq-int4-sym"])


CT_SCHEMES = {"w4a16": Int4Weight, "w8-channel": Int8Weight, "fp8-channel": torch.Tensor}


@pytest.mark.parametrize("scheme", list(CT_SCHEMES))
def test_compressed_tensors_give_transformers_greedy_tokens_on_the_same_file(tiny_model, tmp_path, caplog,
                                                                              scheme) -> None:
    pytest.importorskip("compressed_tensors")
    out = tmp_path / scheme
    quant_ckpt.write_compressed_tensors(str(tiny_model), str(out), scheme)
    with caplog.at_level(logging.INFO):
        tokens, model = _engine_tokens(out, quantize="compressed-tensors")
    assert isinstance(model.layers[0].mlp.gate_up_proj.weight, CT_SCHEMES[scheme])
    if scheme.startswith("fp8"):
        assert any("fp8 weights: no fp8 GEMM on CPU (fp8 runs on CUDA GPUs of compute capability 8.9+)" in r.getMessage()
                   for r in caplog.records)
    assert tokens == _oracle_tokens(out)  # transformers decompresses the file with compressed_tensors


def test_an_fp8_checkpoint_loads_as_fp8_where_the_fp8_gemm_runs(tiny_model, tmp_path, monkeypatch, caplog) -> None:
    """Its CUDA path (compute capability 8.9+) on CPU tensors: every linear an Fp8Weight holding the
    file's own e4m3 codes and per-channel scales (a fused q/k/v: each part's rows with their scales);
    its greedy tokens against transformers' (weights decompressed, activations unquantised, so
    fp8 activations may part from it late). Block-scaled fp8 still dequantises, saying why."""
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file

    monkeypatch.setattr(Fp8Policy, "allow_cpu", True)
    out = tmp_path / "fp8-channel"
    quant_ckpt.write_compressed_tensors(str(tiny_model), str(out), "fp8-channel")
    tokens, model = _engine_tokens(out, quantize="compressed-tensors")
    file = load_file(str(out / "model.safetensors"))
    down, qkv = model.layers[0].mlp.down_proj.weight, model.layers[1].self_attn.qkv_proj.weight
    assert isinstance(down, Fp8Weight) and isinstance(qkv, Fp8Weight)
    name = "model.layers.0.mlp.down_proj"
    assert torch.equal(down.qweight.view(torch.uint8), file[name + ".weight"].view(torch.uint8))
    assert torch.equal(down.scales[0], file[name + ".weight_scale"].float().view(-1))
    parts = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    assert torch.equal(qkv.scales[0], torch.cat([file[p + ".weight_scale"].float().view(-1) for p in parts]))
    oracle = _oracle_tokens(out)
    agree = [next((i for i, (a, b) in enumerate(zip(t, o)) if a != b), len(o)) for t, o in zip(tokens, oracle)]
    print(f"fp8 checkpoint: greedy tokens equal to transformers' for the first {agree} of {NEW_TOKENS}")
    assert sum(agree) >= len(PROMPTS) * NEW_TOKENS // 2, agree
    with caplog.at_level(logging.WARNING):
        _, model = _engine_tokens(quant_ckpt_dir(tiny_model, tmp_path, "fp8-block"))
    assert isinstance(model.layers[0].mlp.down_proj.weight, torch.Tensor)
    assert any("block-scaled fp8 (one scale per 32x32 block): the fp8 kernel takes one scale per output row"
               in r.getMessage() for r in caplog.records)


def quant_ckpt_dir(tiny_model, tmp_path, name: str):
    WRITERS[name](str(tiny_model), str(tmp_path / name))
    return tmp_path / name


def test_asymmetric_compressed_tensors_match_the_librarys_own_decompression(tiny_model, tmp_path) -> None:
    """transformers 5.24 cannot load this file (its packed zero points mismatch the shapes it
    expects), so the oracle is compressed_tensors' own unpack + dequantize, run through HF generate."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    out = tmp_path / "w4a16-asym"
    quant_ckpt.write_compressed_tensors(str(tiny_model), str(out), "w4a16-asym")
    tokens, model = _engine_tokens(out)
    assert isinstance(model.layers[0].mlp.down_proj.weight, Int4Weight)
    state = load_file(str(out / "model.safetensors"))
    dense = {n: v for n, v in state.items() if not n.rsplit(".", 1)[1].startswith("weight_")}
    for name in [n for n in state if n.endswith(".weight_packed")]:
        p = name[: -len(".weight_packed")]
        shape = torch.Size(state[p + ".weight_shape"].tolist())
        q = unpack_from_int32(state[name], 4, shape).float()  # signed
        zp = unpack_from_int32(state[p + ".weight_zero_point"], 4, (shape[0], state[p + ".weight_scale"].shape[1]),
                               packed_dim=0).float()
        g = torch.arange(shape[1]) // 32
        dense[p + ".weight"] = (q - zp[:, g]) * state[p + ".weight_scale"][:, g]
    quant_ckpt._write(str(out), str(tmp_path / "ref"), dense, None)
    assert tokens == _oracle_tokens(tmp_path / "ref")


def test_refusals_name_what_runs_instead(tiny_model, checkpoints, tmp_path) -> None:
    from engines.weights.quant_checkpoint import read_checkpoint_quant

    with pytest.raises(ValueError, match=r"pre-quantised with bitsandbytes' NF4/FP4/int8 layouts .* does not load; "
                                         r"serve the unquantised"):
        read_checkpoint_quant({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})
    with pytest.raises(ValueError, match="quantised activations"):
        read_checkpoint_quant({"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                                       "config_groups": {"g": {"weights": {"num_bits": 8},
                                                                               "input_activations": {"num_bits": 8}}}}})
    with pytest.raises(ValueError, match=r"option.quantize=int8: this checkpoint is already quantised with gptq .*"
                                         r"set option.quantize=gptq or unset it"):
        local_engine(checkpoints["gptq-int4-sym"], "paged", quantize="int8")
    with pytest.raises(ValueError, match=r"option.quantize=awq loads a checkpoint pre-quantised with awq, and this "
                                         r"one's config.json has no quantization_config"):
        local_engine(tiny_model, "paged", quantize="awq")


def test_a_tp_shard_inside_a_group_is_refused() -> None:
    from engines.weights.quant_load import _group_columns

    scales = torch.ones(8, 4)  # 4 groups of 32 inputs
    assert _group_columns(scales, (slice(0, 8), slice(64, 128)), 32, "x").shape == (8, 2)
    with pytest.raises(ValueError, match=r"x: this rank's input columns 48:96 split a quantisation group of 32"):
        _group_columns(scales, (slice(0, 8), slice(48, 96)), 32, "x")


def test_a_shard_the_int4_kernel_cannot_take_is_dequantised_alone() -> None:
    from engines.layers.quant_formats import dequantize
    from engines.weights.quant_load import pack_shard

    torch.manual_seed(3)
    q = torch.randint(0, 16, (40, 64), dtype=torch.uint8)  # 40 outputs: not a multiple of 16
    s, z = torch.rand(40, 2) / 10, torch.randint(0, 16, (40, 2)).float()
    weight, how = pack_shard(q, s, z, 32, 4, torch.float32)
    assert how == "dequantised" and torch.equal(weight, dequantize(q, s, z, 32))
    packed, how = pack_shard(q[:32], s[:32], z[:32], 32, 4, torch.float32)
    x = torch.randn(3, 64)
    assert how == "int4" and torch.allclose(packed(x), x @ dequantize(q[:32], s[:32], z[:32], 32).t(), atol=1e-4)


def test_gptq_and_compressed_tensors_at_tp2_give_the_reference_greedy_tokens(tiny_model, checkpoints,
                                                                             tmp_path) -> None:
    """One mpirun job, two models: each rank packs its shard (column-parallel rows; row-parallel input
    halves, whole groups each) and the TP=2 tokens are the oracle's."""
    from tests.support import run_tp2_job

    pytest.importorskip("compressed_tensors")
    ct = tmp_path / "ct-w4a16"
    quant_ckpt.write_compressed_tensors(str(tiny_model), str(ct), "w4a16")
    dirs = [str(checkpoints["gptq-int4-sym"]), str(ct)]
    got = run_tp2_job(tmp_path, {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "cpu_linear": "aten"}, dirs)
    assert got[dirs[0]] == _reference_tokens(dirs[0])
    assert got[dirs[1]] == _oracle_tokens(ct)


@pytest.mark.parametrize("name", ["gptq-int4-sym", "fp8-block"])
def test_plan_counts_the_bytes_the_engine_holds(checkpoints, name) -> None:
    from container.planner import read_model_shape

    shape = read_model_shape(str(checkpoints[name]))
    assert shape.checkpoint_quant.method == name.split("-")[0]
    assert (shape.num_parameters, shape.linear_parameters) == (205_120, 73_728)  # as the fp32 model's
    planned = shape.weight_bytes_per_rank(1, 2, packs=name != "fp8-block")  # fp8 dequantises on CPU
    held = local_engine(checkpoints[name], "paged", dtype="bf16").runner.weight_bytes
    assert abs(planned - held) <= 0.01 * held, (planned, held)
