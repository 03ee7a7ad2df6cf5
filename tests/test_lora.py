"""LoRA adapters' compute core (engines/layers/lora.py): PEFT adapters written by peft itself read
into per-linear slot banks of our model, and one batch whose rows use the base model and two
adapters (different ranks, target modules, rsLoRA scaling) gets, row by row, exactly the delta
peft's own LoRA layers add (`PeftModel`, not merged); the tensor-parallel shards of a bank add up to
the whole; adapters lmi-serve cannot serve exactly are refused naming the field."""

from __future__ import annotations

import json
import re
import types

import pytest
import torch

from engines.layers.lora import LoraBank, LoraBanks, LoraStep, read_peft_adapter
from tests.support import local_engine

peft = pytest.importorskip("peft")

ADAPTERS = {  # name → LoraConfig arguments
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "mlp-r8-rs": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj", "k_proj"],
                      use_rslora=True),
}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """Each adapter written by peft with random A and B (init_lora_weights=False: B is not zero), and
    the PeftModel of each, on the float32 tiny model."""
    from transformers import AutoModelForCausalLM

    root, made = tmp_path_factory.mktemp("adapters"), {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **kw))
        model.save_pretrained(str(root / name))
        made[name] = (root / name, model)
    return made


def _peft_delta(model, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
    owner = "self_attn" if module[0] in "qkvo" else "mlp"
    wrapped = getattr(getattr(model.base_model.model.model.layers[layer], owner), module)
    base = wrapped.base_layer if hasattr(wrapped, "base_layer") else wrapped
    with torch.no_grad():
        return wrapped(x) - base(x)


def test_a_mixed_batch_gets_each_rows_adapter_delta_as_peft_computes_it(tiny_model, adapters):
    model = local_engine(tiny_model, "paged").runner.model
    banks = LoraBanks(model, max_loras=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    for slot, name in enumerate(ADAPTERS, start=1):
        adapter = read_peft_adapter(str(adapters[name][0]))
        assert adapter.name == name and adapter.rank == ADAPTERS[name]["r"]
        banks.load(slot, adapter)
    torch.manual_seed(0)
    hidden = model.layers[0].self_attn.qkv_proj.weight.shape[1]
    inter = model.layers[0].mlp.down_proj.weight.shape[1]
    # rows 0-1 base, rows 2 and 4 "attn-r4", rows 3 and 5 "mlp-r8-rs"
    slot_of_row = [0, 0, 1, 2, 1, 2]
    step = LoraStep()
    step.set(slot_of_row, len(slot_of_row), torch.device("cpu"))
    names = [None] + list(ADAPTERS)
    for layer in range(len(model.layers)):
        for ours, parts, width in (("qkv_proj", ["q_proj", "k_proj", "v_proj"], hidden), ("o_proj", ["o_proj"], hidden),
                                   ("gate_up_proj", ["gate_proj", "up_proj"], hidden),
                                   ("down_proj", ["down_proj"], inter)):
            x = torch.randn(6, width)
            got = banks.banks[(layer, ours)].delta(x, step)
            for row, slot in enumerate(slot_of_row):
                if slot == 0:
                    want = torch.zeros(got.shape[1])
                else:
                    peft_model = adapters[names[slot]][1]
                    want = torch.cat([_peft_delta(peft_model, layer, m, x[row:row + 1])[0] for m in parts])
                torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5,
                                           msg=f"layer {layer} {ours} row {row} ({names[slot]})")


def test_tensor_parallel_shards_add_up_to_the_whole():
    """A column-parallel bank's two shards (its rows of each fused part) side by side, and a row-
    parallel bank's partial deltas (each rank's input columns) summed, equal the whole bank's delta."""
    torch.manual_seed(1)
    a_q, b_q, a_k, b_k = torch.randn(4, 16), torch.randn(8, 4), torch.randn(4, 16), torch.randn(6, 4)

    def column(rows, part_sizes):
        linear = types.SimpleNamespace(weight=torch.empty(sum(part_sizes), 16), part_sizes=part_sizes)
        bank = LoraBank(linear, 1, 4, rows, torch.float32, torch.device("cpu"))
        bank.load(1, 0, a_q, b_q, None)
        bank.load(1, 1, a_k, b_k, None)
        return bank

    x = torch.randn(3, 16)
    step = LoraStep()
    step.set([1, 0, 1], 3, torch.device("cpu"))  # the middle row: the base model
    whole = column([None, None], [8, 6]).delta(x, step)
    assert torch.equal(whole[1], torch.zeros(14))
    halves = [column([(0, 4), (0, 3)], [4, 3]).delta(x, step), column([(4, 8), (3, 6)], [4, 3]).delta(x, step)]
    torch.testing.assert_close(torch.cat([halves[0][:, :4], halves[1][:, :4], halves[0][:, 4:], halves[1][:, 4:]], 1),
                               whole)

    a_o, b_o = torch.randn(4, 16), torch.randn(10, 4)

    def row(cols):
        bank = LoraBank(types.SimpleNamespace(weight=torch.empty(10, 16 if cols is None else 8)), 1, 4, [None],
                        torch.float32, torch.device("cpu"))
        bank.load(1, 0, a_o, b_o, cols)
        return bank

    torch.testing.assert_close(row((0, 8)).delta(x[:, :8], step) + row((8, 16)).delta(x[:, 8:], step),
                               row(None).delta(x, step))


def test_adapters_it_cannot_serve_exactly_are_refused(adapters, tmp_path, tiny_model):
    src = adapters["attn-r4"][0]
    for field, value in (("bias", "all"), ("use_dora", True), ("modules_to_save", ["lm_head"]),
                         ("rank_pattern", {"q_proj": 2})):
        bad = tmp_path / field
        bad.mkdir()
        cfg = json.loads((src / "adapter_config.json").read_text())
        cfg[field] = value
        (bad / "adapter_config.json").write_text(json.dumps(cfg))
        (bad / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=f"LoRA adapter '{field}' .*{re.escape(f'{field}={value!r}')} in "
                                             "adapter_config.json is not supported"):
            read_peft_adapter(str(bad))
    model = local_engine(tiny_model, "paged").runner.model
    banks = LoraBanks(model, max_loras=1, max_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="rank 8, above option.max_lora_rank=4"):
        banks.load(1, read_peft_adapter(str(adapters["mlp-r8-rs"][0])))


@pytest.fixture(scope="module")
def lora_model(tiny_model, adapters, tmp_path_factory):
    """The tiny model's directory with both adapters under adapters/<name> (as DJL LMI lays them out)."""
    import shutil

    d = tmp_path_factory.mktemp("lora-model") / "tiny-llama"
    shutil.copytree(tiny_model, d)
    for name, (path, _) in adapters.items():
        shutil.copytree(path, d / "adapters" / name)
    return d


def _peft_greedy(peft_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = peft_model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                  dtype=torch.long), max_new_tokens=n, do_sample=False, pad_token_id=0)
    ids = out[0, len(prompt):].tolist()
    return ids[: ids.index(2) + 1] if 2 in ids else ids  # the tiny model's EOS


PROMPTS = [[1] + [(5 * i + 7) % 900 + 3 for i in range(n)] for n in (6, 19, 33)]


@pytest.mark.parametrize("sched", [{}, {"max_num_batched_tokens": 16}], ids=["whole-prompts", "chunked"])
def test_a_batch_mixing_the_base_model_and_two_adapters_gives_peft_greedy_tokens(lora_model, adapters, hf, sched):
    """Every prompt once per model (base, each adapter), joining mid-flight in one paged engine; the same
    prompt under the base model and an adapter must not share prefix-cache blocks."""
    from engines.sampling_params import SamplingParams
    from tests.support import drive_engine, output_tokens

    engine = local_engine(lora_model, "paged", lora={"enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
                          max_num_seqs=8, **sched)
    assert engine.runner.lora.slots == {"attn-r4": 1, "mlp-r8-rs": 2}
    names = [None] + list(ADAPTERS)
    requests = [(f"{name}-{i}", p, SamplingParams(max_new_tokens=8), name)
                for i, p in enumerate(PROMPTS) for name in names]
    outs = drive_engine(engine, requests, join_every=2)
    for rid, prompt, _, name in requests:
        want = hf(prompt, 8) if name is None else _peft_greedy(adapters[name][1], prompt, 8)
        assert output_tokens(outs[rid]) == want, rid
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_an_unknown_adapter_is_a_404_naming_the_served_ones(lora_model):
    from engines.protocol import Add
    from engines.sampling_params import SamplingParams

    engine = local_engine(lora_model, "paged", lora={"enable_lora": True, "max_loras": 2, "max_lora_rank": 8})
    outs = []
    engine._publish = outs.extend
    engine.add(Add("r", [1, 5, 6], SamplingParams(max_new_tokens=2), "nope"))
    assert outs[0].error_code == 404 and outs[0].error == ("no LoRA adapter named 'nope'; this server serves: attn-r4, "
                                                           "mlp-r8-rs")
    with pytest.raises(ValueError, match="2 LoRA adapters under .* and option.max_loras=1: every adapter stays "
                                         "resident; raise option.max_loras"):
        local_engine(lora_model, "paged", lora={"enable_lora": True, "max_loras": 1, "max_lora_rank": 8})


def test_the_server_serves_adapters_by_lmi_and_tgi_names(start_server, lora_model, adapters, hf):
    """A real server with option.enable_lora: DJL LMI's top-level "adapters" (one per list input, null
    for the base model) and TGI's adapter_id; an unknown name is a 404 naming the served ones."""
    server = start_server("option.rolling_batch=lmi-dist\noption.dtype=fp32\noption.enable_lora=true\noption.max_loras=2\n"
                          "option.max_lora_rank=8\n", lora_model)
    assert "LoRA adapters (rank, slot): attn-r4 (r=4, slot 1), mlp-r8-rs (r=8, slot 2)" in server.log()
    texts = ["The river ran", "A small bird", "The river ran"]
    body = server.post({"inputs": texts, "adapters": ["attn-r4", None, "mlp-r8-rs"],
                        "parameters": {"max_new_tokens": 6, "details": True}}).json()
    for text, name, answer in zip(texts, ["attn-r4", None, "mlp-r8-rs"], body):
        ids = hf.tokenizer(text)["input_ids"]
        want = hf(ids, 6) if name is None else _peft_greedy(adapters[name][1], ids, 6)
        assert [t["id"] for t in answer["details"]["tokens"]] == want, name
    tgi = server.post({"inputs": texts[1], "parameters": {"adapter_id": "mlp-r8-rs", "max_new_tokens": 6,
                                                          "details": True}}, path="/generate").json()
    assert [t["id"] for t in tgi["details"]["tokens"]] == _peft_greedy(adapters["mlp-r8-rs"][1],
                                                                       hf.tokenizer(texts[1])["input_ids"], 6)
    resp = server.post({"inputs": "Hello", "adapters": "nope"})
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"] == "no LoRA adapter named 'nope'; this server serves: attn-r4, mlp-r8-rs"
    resp = server.post({"inputs": ["a", "b"], "adapters": ["attn-r4"]})
    assert resp.status_code == 400 and '"adapters" holds 1 names for 2 inputs' in resp.json()["error"]
    # OpenAI: `model` naming an adapter (vLLM's convention), and /v1/models listing them
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny-llama", "attn-r4", "mlp-r8-rs"]
    done = client.completions.create(model="attn-r4", prompt=texts[0], max_tokens=6, temperature=0)
    want = _peft_greedy(adapters["attn-r4"][1], hf.tokenizer(texts[0])["input_ids"], 6)
    assert done.model == "attn-r4" and done.choices[0].text == hf.decode(want)
    with pytest.raises(openai.NotFoundError, match="this server serves `tiny-llama`, `attn-r4`, `mlp-r8-rs`"):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)


def test_tensor_parallel_2_gives_peft_greedy_tokens(lora_model, adapters, hf, tmp_path):
    """Under mpirun -np 2: each rank's banks hold its shards (q heads, the KV heads it keeps, its gate/up
    rows, its o/down input columns), base and adapter rows in one batch."""
    from tests.support import run_tp2_job

    names = [None, "attn-r4", "mlp-r8-rs", "attn-r4"]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[2]]
    got = run_tp2_job(tmp_path, {"prompts": prompts, "new_tokens": 8, "adapters": names,
                                 "lora": {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}}, [str(lora_model)])
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        want = hf(prompt, 8) if name is None else _peft_greedy(adapters[name][1], prompt, 8)
        assert got[str(lora_model)][i] == want, (i, name)
