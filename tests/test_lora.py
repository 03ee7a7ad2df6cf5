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
    "all-r2": dict(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]),
}
IN_MODEL_DIR = ("attn-r4", "mlp-r8-rs")  # under MODEL_DIR/adapters; all-r2 comes from elsewhere


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
    banks = LoraBanks(model, max_loras=3, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    for slot, name in enumerate(ADAPTERS, start=1):
        adapter = read_peft_adapter(str(adapters[name][0]))
        assert adapter.name == name and adapter.rank == ADAPTERS[name]["r"]
        banks.load(slot, adapter)
    torch.manual_seed(0)
    config = json.loads((tiny_model / "config.json").read_text())  # (the linears' weights may be packed kernels)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    # rows 0 and 2 base, rows 3 and 5 "attn-r4", rows 4 and 6 "mlp-r8-rs", rows 1 and 7 "all-r2"
    slot_of_row = [0, 3, 0, 1, 2, 1, 2, 3]
    step = LoraStep()
    step.set(slot_of_row, len(slot_of_row), torch.device("cpu"))
    names = [None] + list(ADAPTERS)
    for layer in range(len(model.layers)):
        for ours, parts, width in (("qkv_proj", ["q_proj", "k_proj", "v_proj"], hidden), ("o_proj", ["o_proj"], hidden),
                                   ("gate_up_proj", ["gate_proj", "up_proj"], hidden),
                                   ("down_proj", ["down_proj"], inter)):
            x = torch.randn(len(slot_of_row), width)
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
    """The tiny model's directory with two adapters under adapters/<name> (as DJL LMI lays them out)."""
    import shutil

    d = tmp_path_factory.mktemp("lora-model") / "tiny-llama"
    shutil.copytree(tiny_model, d)
    for name in IN_MODEL_DIR:
        shutil.copytree(adapters[name][0], d / "adapters" / name)
    return d


def _peft_greedy(peft_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = peft_model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                  dtype=torch.long), max_new_tokens=n, do_sample=False, pad_token_id=0)
    ids = out[0, len(prompt):].tolist()
    return ids[: ids.index(2) + 1] if 2 in ids else ids  # the tiny model's EOS


PROMPTS = [[1] + [(5 * i + 7) % 900 + 3 for i in range(n)] for n in (6, 19, 33)]


def _lora_options(adapters, max_loras: int) -> dict:
    """option.enable_lora with the two adapters of the model dir and all-r2 from option.adapters."""
    return {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": 8, "max_cpu_loras": max_loras,
            "adapters": {"all-r2": str(adapters["all-r2"][0])}}


@pytest.mark.parametrize("kind,sched,max_loras", [
    ("paged", {}, 3), ("paged", {"max_num_batched_tokens": 16}, 1), ("rolling", {}, 1),
    ("paged", {"graphs": True}, 2), ("paged", {"cpu_compile": True}, 2)],
    ids=["paged-whole-prompts", "paged-chunked-one-slot", "padded-one-slot", "paged-decode-graphs",
         "paged-cpu-compile"])
def test_a_batch_mixing_the_base_model_and_three_adapters_gives_peft_greedy_tokens(lora_model, adapters, hf, kind,
                                                                                   sched, max_loras, monkeypatch):
    """Every prompt once per model (base, each adapter), joining mid-flight in one engine; the same
    prompt under the base model and an adapter must not share prefix-cache blocks. With one slot the
    adapters take turns in it (least recently used out), each request keeping it while it runs. Decode
    steps replayed over the static buffers (what a CUDA graph reads; on CPU run eagerly) or compiled
    run the LoRA path's static form: every slot a segment of the bucket's size."""
    from engines.sampling_params import SamplingParams
    from tests.support import drive_engine, output_tokens

    sched = dict(sched)
    if sched.pop("graphs", False):
        from engines.worker import paged_runner
        from engines.loop.paged_engine import PagedEngine
        from engines.worker.step_buffers import StepBuffers

        monkeypatch.setattr(PagedEngine, "_decode_mode", lambda self: (paged_runner.DECODE_GRAPHS, "test"))
        monkeypatch.setattr(StepBuffers, "STAGE_ON_CPU", True)
    if sched.get("cpu_compile"):  # dynamo's code cache may hold another test's model's graph (without the LoRA
        torch._dynamo.reset()    # hooks) whose guards a new model passes when it reuses a freed model's id
    engine = local_engine(lora_model, kind, lora=_lora_options(adapters, max_loras), max_num_seqs=8, **sched)
    if kind == "paged":
        assert engine.paged.target.decode_mode == ("graphs" if max_loras == 2 and not sched else
                                                   "inductor" if sched.get("cpu_compile") else "eager")
    assert engine.runner.lora.slots == dict(list({"attn-r4": 1, "mlp-r8-rs": 2, "all-r2": 3}.items())[:max_loras])
    loads = []
    activate = engine.runner.lora.activate
    engine.runner.lora.activate = lambda slot, name: (loads.append((slot, name)), activate(slot, name))
    if kind == "paged":
        check = engine.scheduler.schedule
        engine.scheduler.schedule = lambda *a: (engine.scheduler.check_invariants(), check(*a))[1]
    names = [None] + list(ADAPTERS)
    requests = [(f"{name}-{i}", p, SamplingParams(max_new_tokens=8), name)
                for i, p in enumerate(PROMPTS) for name in names]
    outs = drive_engine(engine, requests, join_every=2)
    for rid, prompt, _, name in requests:
        want = hf(prompt, 8) if name is None else _peft_greedy(adapters[name][1], prompt, 8)
        assert output_tokens(outs[rid]) == want, rid
    if kind == "paged":
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        engine.scheduler.check_invariants()
    assert not engine.adapters.slots.num_holders  # every slot given back
    # placed at start: attn-r4, then mlp-r8-rs; the others had their turn in a slot after (the paged
    # scheduler lets the requests of a resident adapter go first: each loaded once; the padded engine
    # admits in order)
    if max_loras == 3:
        assert loads == []
    elif max_loras == 2:
        assert {n for _, n in loads} >= {"all-r2"}, loads
    else:
        assert {s for s, _ in loads} == {1} and {n for _, n in loads} >= {"mlp-r8-rs", "all-r2"}, loads
        assert kind == "rolling" or len(loads) == 2, loads


def test_adapters_registered_and_unregistered_at_run_time_between_steps(lora_model, adapters, hf):
    """An adapter registered while requests run serves the next step; one asked to go while a request
    uses it goes (and the caller hears so) only after that request ends, new requests for it refused
    meanwhile; bad registrations are a 400 naming the problem, unknown names a 404."""
    from engines.protocol import ADAPTER_REGISTER, ADAPTER_UNREGISTER, AdapterCommand, AdapterReply, Add
    from engines.sampling_params import SamplingParams

    engine = local_engine(lora_model, "paged", lora={"enable_lora": True, "max_loras": 1, "max_lora_rank": 8,
                                                     "max_cpu_loras": 1}, max_num_seqs=8)
    sent = []
    engine._publish = sent.extend
    replies = lambda: {o.request_id: (o.status, o.message) for o in sent if isinstance(o, AdapterReply)}  # noqa: E731
    prompt, params = PROMPTS[1], SamplingParams(max_new_tokens=8)
    engine.add(Add("base", prompt, params))
    engine.add(Add("a", prompt, params, "attn-r4"))
    engine.step()
    engine.command(AdapterCommand("reg", ADAPTER_REGISTER, "all-r2", str(adapters["all-r2"][0])))
    assert replies()["reg"] == (200, "Adapter all-r2 registered")
    engine.add(Add("new", prompt, params, "all-r2"))
    engine.command(AdapterCommand("unreg", ADAPTER_UNREGISTER, "attn-r4"))
    assert "unreg" not in replies()  # "a" still uses it
    engine.add(Add("late", prompt, params, "attn-r4"))
    engine.command(AdapterCommand("dup", ADAPTER_REGISTER, "all-r2", str(adapters["all-r2"][0])))
    engine.command(AdapterCommand("missing", ADAPTER_REGISTER, "gone", "/nonexistent/adapter"))
    engine.command(AdapterCommand("pin", ADAPTER_REGISTER, "pinned", str(adapters["mlp-r8-rs"][0]), pin=True))
    engine.command(AdapterCommand("unknown", ADAPTER_UNREGISTER, "nope"))
    got = replies()
    assert got["dup"][0] == 400 and "already registered" in got["dup"][1]
    assert got["missing"][0] == 400 and got["missing"][1].startswith("LoRA adapter 'gone' from /nonexistent/adapter "
                                                                      "cannot be served")
    assert got["pin"] == (400, "cannot pin 'pinned': every one of the 1 LoRA slots is held (option.max_loras)")
    assert got["unknown"] == (404, "no LoRA adapter named 'nope'; this server serves: attn-r4, mlp-r8-rs, all-r2")
    while engine.has_work():
        engine.step()
        engine.scheduler.check_invariants()
    order = [o.request_id for o in sent if isinstance(o, AdapterReply) or o.finished]
    assert order.index("a") < order.index("unreg"), order
    assert replies()["unreg"] == (200, "Adapter attn-r4 unregistered")
    outs = {}
    for o in sent:
        if not isinstance(o, AdapterReply):
            outs.setdefault(o.request_id, []).append(o)
    late = outs["late"][0]
    assert (late.error_code, late.error) == (404, "LoRA adapter 'attn-r4' is being unregistered")
    tokens = {rid: [t for o in outs[rid] for t in o.token_ids] for rid in ("base", "a", "new")}
    assert tokens == {"base": hf(prompt, 8), "a": _peft_greedy(adapters["attn-r4"][1], prompt, 8),
                      "new": _peft_greedy(adapters["all-r2"][1], prompt, 8)}
    assert [a.name for a in engine.measure().adapters] == ["mlp-r8-rs", "all-r2"]
    assert "attn-r4" not in engine.runner.lora.sources and engine.runner.lora.slots == {"all-r2": 1}
    info = {a.name: a for a in engine.measure().adapters}["all-r2"]
    assert (info.requests, info.prompt_tokens, info.generated_tokens, info.slot) == (1, len(prompt), 8, 1)


def test_the_server_serves_adapters_by_lmi_and_tgi_names(start_server, lora_model, adapters, hf, moto_endpoint,
                                                         tmp_path):
    """A real server with option.enable_lora: DJL LMI's top-level "adapters" (one per list input, null
    for the base model) and TGI's adapter_id; an unknown name is a 404 naming the served ones. all-r2
    comes from S3 (a real S3-compatible server on loopback) through option.adapters, and again under
    another name through vLLM's route at run time."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket="lmi-lora")
    for path in adapters["all-r2"][0].iterdir():
        s3.upload_file(str(path), "lmi-lora", f"all-r2/{path.name}")
    env = {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}
    server = start_server("option.rolling_batch=lmi-dist\noption.dtype=fp32\noption.enable_lora=true\noption.max_loras=2\n"
                          f"option.max_lora_rank=8\noption.adapters=all-r2=s3://lmi-lora/all-r2/\n"
                          f"download_dir={tmp_path / 'downloads'}\n", lora_model, env=env)
    assert "LoRA adapters (rank, slot): attn-r4 (r=4, slot 1), mlp-r8-rs (r=8, slot 2), all-r2 (r=2, slot -)" \
        in server.log()
    resp = server.post({"lora_name": "s3-copy", "lora_path": "s3://lmi-lora/all-r2/"}, path="/v1/load_lora_adapter")
    assert resp.status_code == 200, resp.text
    resp = server.post({"lora_name": "x", "lora_path": "s3://lmi-lora/nothing-here/"}, path="/v1/load_lora_adapter")
    assert resp.status_code == 400 and "no objects under s3://lmi-lora/nothing-here/" in resp.json()["error"]["message"]
    resp = server.post(None, path="/adapters?name=z&src=/x&rank=4")
    assert resp.status_code == 400 and resp.json()["error"].startswith("unknown adapter option(s) rank")
    ids = hf.tokenizer("A small bird")["input_ids"]
    for name in ("all-r2", "s3-copy"):
        got = server.post({"inputs": "A small bird", "adapters": name, "parameters": {"max_new_tokens": 6,
                                                                                      "details": True}}).json()
        assert [t["id"] for t in got["details"]["tokens"]] == _peft_greedy(adapters["all-r2"][1], ids, 6), name
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
    assert resp.json()["error"] == "no LoRA adapter named 'nope'; this server serves: attn-r4, mlp-r8-rs, all-r2, " \
                                   "s3-copy"
    resp = server.post({"inputs": ["a", "b"], "adapters": ["attn-r4"]})
    assert resp.status_code == 400 and '"adapters" holds 1 names for 2 inputs' in resp.json()["error"]
    # OpenAI: `model` naming an adapter (vLLM's convention), and /v1/models listing them
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny-llama", "attn-r4", "mlp-r8-rs", "all-r2", "s3-copy"]
    done = client.completions.create(model="attn-r4", prompt=texts[0], max_tokens=6, temperature=0)
    want = _peft_greedy(adapters["attn-r4"][1], hf.tokenizer(texts[0])["input_ids"], 6)
    assert done.model == "attn-r4" and done.choices[0].text == hf.decode(want)
    with pytest.raises(openai.NotFoundError, match="this server serves `tiny-llama`, `attn-r4`, `mlp-r8-rs`, "
                                                   "`all-r2`, `s3-copy`"):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)


@pytest.mark.parametrize("kind", ["paged", "rolling"])
def test_tensor_parallel_2_gives_peft_greedy_tokens(lora_model, adapters, hf, tmp_path, kind):
    """Under mpirun -np 2: each rank's banks hold its shards (q heads, the KV heads it keeps, its gate/up
    rows, its o/down input columns), base and adapter rows in one batch; a third adapter registered at
    run time on both ranks, the three taking turns in two slots."""
    from tests.support import run_tp2_job

    names = [None, "attn-r4", "mlp-r8-rs", "all-r2", "attn-r4", "all-r2"]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[2], PROMPTS[2], PROMPTS[0]]
    got = run_tp2_job(tmp_path, {"prompts": prompts, "new_tokens": 8, "adapters": names, "engine": kind,
                                 "register": {"all-r2": str(adapters["all-r2"][0])},
                                 "lora": {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 2}},
                      [str(lora_model)])
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        want = hf(prompt, 8) if name is None else _peft_greedy(adapters[name][1], prompt, 8)
        assert got[str(lora_model)][i] == want, (i, name)


def test_adapters_registered_at_run_time_while_traffic_flows(start_server, lora_model, adapters, hf):
    """A real server under traffic (base and attn-r4 requests, checked token for token) while all-r2
    is registered through DJL's route and mlp-r8-rs again as "mlp-copy" through vLLM's: both serve
    through every convention at once, are listed, and are counted per adapter on /metrics.
    Unregistering mlp-copy while a long request uses it answers only after that request ended, new
    requests for it refused meanwhile. No request is lost or answered wrongly."""
    import threading
    import time
    from collections import Counter

    import openai
    import requests

    server = start_server("option.rolling_batch=lmi-dist\noption.dtype=fp32\noption.enable_lora=true\n"
                          "option.max_loras=2\noption.max_lora_rank=8\n", lora_model)
    text = "The river ran"
    ids = hf.tokenizer(text)["input_ids"]
    want = {None: hf(ids, 6), **{name: _peft_greedy(model, ids, 6) for name, (_, model) in adapters.items()}}
    stop, failures, counts = threading.Event(), [], Counter()

    def traffic(adapter):
        while not stop.is_set():
            body = {"inputs": text, "parameters": {"max_new_tokens": 6, "details": True}}
            resp = server.post(body if adapter is None else {**body, "adapters": adapter})
            if resp.status_code != 200 or [t["id"] for t in resp.json()["details"]["tokens"]] != want[adapter]:
                failures.append((adapter, resp.status_code, resp.text[:300]))
            counts[adapter] += 1

    def wait_for(condition, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    threads = [threading.Thread(target=traffic, args=(a,)) for a in (None, "attn-r4")]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: min(counts[None], counts["attn-r4"]) >= 2, "traffic")
        resp = requests.post(server.url + "/models/tiny-llama/adapters",
                             params={"name": "all-r2", "src": str(adapters["all-r2"][0])}, timeout=60)
        assert (resp.status_code, resp.json()) == (200, {"status": "Adapter all-r2 registered"})
        resp = requests.post(server.url + "/v1/load_lora_adapter", timeout=60,
                             json={"lora_name": "mlp-copy", "lora_path": str(adapters["mlp-r8-rs"][0])})
        assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'mlp-copy' added successfully.")
        tgi = server.post({"inputs": text, "parameters": {"adapter_id": "all-r2", "max_new_tokens": 6, "details": True}},
                          path="/generate").json()
        assert [t["id"] for t in tgi["details"]["tokens"]] == want["all-r2"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        done = client.completions.create(model="mlp-copy", prompt=text, max_tokens=6, temperature=0)
        assert done.choices[0].text == hf.decode(want["mlp-r8-rs"])
        assert [m.id for m in client.models.list().data] == ["tiny-llama", "attn-r4", "mlp-r8-rs", "all-r2", "mlp-copy"]
        listed = requests.get(server.url + "/models/tiny-llama/adapters", timeout=10).json()["adapters"]
        assert [(a["name"], a["src"], a["rank"]) for a in listed] == [
            ("attn-r4", str(lora_model / "adapters" / "attn-r4"), 4), ("mlp-r8-rs", str(lora_model / "adapters" /
                                                                                     "mlp-r8-rs"), 8),
            ("all-r2", str(adapters["all-r2"][0]), 2), ("mlp-copy", str(adapters["mlp-r8-rs"][0]), 8)]
        # refusals: a name taken, another model, a source that is not there
        resp = requests.post(server.url + "/adapters", params={"name": "all-r2", "src": str(adapters["all-r2"][0])})
        assert resp.status_code == 400 and "a LoRA adapter named 'all-r2' is already registered" in resp.json()["error"]
        resp = requests.get(server.url + "/models/other/adapters")
        assert (resp.status_code, resp.json()["error"]) == (404, "Model or workflow not found: other; this server "
                                                                 "serves tiny-llama")
        resp = requests.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such"})
        assert resp.status_code == 400 and resp.json()["error"]["message"] == \
            "LoRA adapter 'x': model directory /no/such does not exist."

        # unregistering an adapter in use waits for its request
        stream = requests.post(server.url + "/invocations", stream=True, timeout=120, json={
            "inputs": text, "adapters": "mlp-copy", "stream": True,
            "parameters": {"max_new_tokens": 800, "ignore_eos": True}})
        assert stream.status_code == 200
        lines = stream.iter_lines()
        tokens = [json.loads(next(lines))["token"]["id"]]  # it runs, holding its slot
        gone = {}
        deleting = threading.Thread(target=lambda: gone.update(resp=requests.delete(
            server.url + "/models/tiny-llama/adapters/mlp-copy", timeout=120)))
        deleting.start()
        described = lambda: requests.get(server.url + "/adapters/mlp-copy", timeout=10).json()  # noqa: E731
        wait_for(lambda: described()["unregistering"], "the engine to take the unregistration")
        refused = server.post({"inputs": text, "adapters": "mlp-copy"})
        assert (refused.status_code, refused.json()["error"]) == (404, "LoRA adapter 'mlp-copy' is being unregistered")
        tokens += [json.loads(next(lines))["token"]["id"] for _ in range(5)]
        assert deleting.is_alive()  # 794 tokens still to come: it waits for them
        tokens += [json.loads(line)["token"]["id"] for line in lines if line]
        deleting.join(timeout=120)
        assert len(tokens) == 800 and tokens[:len(want["mlp-r8-rs"])] == want["mlp-r8-rs"]
        assert (gone["resp"].status_code, gone["resp"].json()) == (200, {"status": "Adapter mlp-copy unregistered"})
        assert [m.id for m in client.models.list().data] == ["tiny-llama", "attn-r4", "mlp-r8-rs", "all-r2"]
        resp = requests.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "all-r2"}, timeout=60)
        assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'all-r2' removed successfully.")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not failures, failures[:3]
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert f'lmi_lora_requests_total{{adapter="attn-r4"}} {float(counts["attn-r4"])}' in metrics
    assert f'lmi_lora_generated_tokens_total{{adapter="attn-r4"}} {float(6 * counts["attn-r4"])}' in metrics
    assert 'lmi_lora_requests_total{adapter="all-r2"}' not in metrics  # unregistered
    assert "LoRA adapter all-r2 registered (r=2, from " in server.log()


@pytest.fixture(scope="module")
def lora_kernels(tmp_path_factory):
    """The CPU LoRA kernel as loaded, and a portable build without AVX512-BF16 where the CPU has it."""
    from engines.kernels import cpu_attention, cpu_lora

    builds = {"native": cpu_lora.load()}
    assert builds["native"] is not None
    if "avx512_bf16" in cpu_attention.cpu_flags():
        target = tmp_path_factory.mktemp("lora-kernel") / "portable.so"
        cpu_attention.build(cpu_attention.compiler(), target, ("-mno-avx512bf16",), source=cpu_lora.SOURCE)
        builds["portable"] = cpu_lora.bind(target)
    return builds


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["f32", "bf16"])
def test_the_cpu_kernel_adds_what_the_batched_matmuls_compute(lora_kernels, dtype, atol):
    """Against LoraBank.delta (its twin): rows of three slots with slot 2 unused between them, base rows,
    segments of 5 (not a multiple of the kernel's group of 4) with padding, an input width with a
    tail (not a multiple of 32), an output width with a partial block (not a multiple of 64), and x rows
    with a stride (a slice of a wider tensor); y is added to, in place."""
    from engines.kernels import cpu_lora

    torch.manual_seed(3)
    n, k, width, out = 12, 100, 24, 150
    a, bt = torch.randn(5, width, k, dtype=dtype) / 4, torch.randn(5, width, out, dtype=dtype) / 4
    slots = [1, 0, 3, 3, 1, 4, 0, 1, 3, 1, 1, 0]
    step = LoraStep(4)
    step.set(slots, n, torch.device("cpu"))
    assert (step.lo, step.hi, step.segment) == (1, 5, 5)
    x = torch.randn(n, k + 7, dtype=dtype)[:, 3:3 + k]
    y0 = torch.randn(n, out, dtype=dtype)
    bank = types.SimpleNamespace(A=a, Bt=bt)
    want = y0.float() + LoraBank.delta(bank, x.float().contiguous(), step) if dtype == torch.float32 else \
        y0.float() + LoraBank.delta(types.SimpleNamespace(A=a.float(), Bt=bt.float()), x.float(), step)
    for name, lib in lora_kernels.items():
        y = y0.clone()
        cpu_lora.add_delta(x, y, a, bt, step, lib=lib)
        torch.testing.assert_close(y.float(), want, atol=atol, rtol=atol, msg=name)
        assert torch.equal(y[[1, 6, 11]], y0[[1, 6, 11]]), name  # base rows untouched


def test_a_name_without_a_slot_fails_naming_the_rank() -> None:
    """The runner's guard (the engine refuses unknown names before scheduling them): an AssertionError that
    names the adapter and this rank, not an AttributeError on the way there."""
    from types import SimpleNamespace

    from engines.worker.paged_runner import PagedRunner

    paged = PagedRunner.__new__(PagedRunner)
    paged.runner = SimpleNamespace(lora=SimpleNamespace(slots={"a": 1}), comm=SimpleNamespace(rank=1))
    assert (paged._lora_slot(None), paged._lora_slot("a")) == (0, 1)
    with pytest.raises(AssertionError, match="LoRA adapter 'b' has no slot on rank 1"):
        paged._lora_slot("b")
