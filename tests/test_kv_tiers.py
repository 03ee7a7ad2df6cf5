"""KV tiers below the paged cache (docs/kv-tiers.md): blocks the pool evicts come back from the host
or disk tier instead of being recomputed, with greedy output equal to transformers' `generate`
under every feature; a torn or foreign tier is refused block by block and the request recomputed;
a restart finds the disk tier; the block files' format and budget."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from container.model_maker import make_model
from engines.core.block_manager import BlockManager, hash_block, pack_tokens
from engines.core.request import Request
from engines.sampling_params import SamplingParams
from engines.worker.block_files import BlockFiles, block_path
from tests.support import drive_engine, local_engine, output_tokens, run_tp2_job

NEW_TOKENS = 6
# 3-4 blocks of 16 each; the fillers after them take more than the 12-block pool holds, so that
# the prompts' blocks are evicted before the prompts come again
PROMPTS = [[1] + [(7 * i + 5 * n) % 900 + 3 for i in range(n)] for n in (40, 47, 55)]
FILLERS = [[1] + [(11 * i + 3 * n) % 900 + 3 for i in range(n)] for n in (41, 45, 49, 53, 57)]
POOL = "96KiB"  # the tiny llama's K/V: 512 bytes a token, 8 KiB a block: 12 blocks


def tiered(model_dir, tmp: Path, memory: bool = True, disk: bool = True, **kw):
    opts = {"enable_prefix_caching": True, "kv_cache_memory": POOL}
    if memory:
        opts |= {"kv_offload_memory": "32MiB", "kv_offload_memory_dir": str(tmp / "shm")}
    if disk:
        opts |= {"kv_offload_dir": str(tmp / "disk"), "kv_offload_disk": "64MiB"}
    return local_engine(model_dir, "paged", **{**opts, **kw})


def run(engine, prompts, tag: str, adapters=None) -> list[list[int]]:
    adapters = adapters or [None] * len(prompts)
    sp = SamplingParams(max_new_tokens=NEW_TOKENS)
    outputs = drive_engine(engine, [(f"{tag}{i}", p, sp, a) for i, (p, a) in enumerate(zip(prompts, adapters))])
    return [output_tokens(outputs[f"{tag}{i}"]) for i in range(len(prompts))]


def three_rounds(engine, prompts=PROMPTS, adapters=None) -> tuple[list, list]:
    """The prompts, fillers that push them out of the pool, the prompts again → both rounds' tokens."""
    first = run(engine, prompts, "first", adapters)
    run(engine, FILLERS, "filler")
    return first, run(engine, prompts, "again", adapters)


def tier_hits(engine, tier: str) -> int:
    return engine.metrics()[f"kv_tier_{tier}_hit_tokens"]


# -- the engine, against transformers ----------------------------------------------------------------
@pytest.mark.parametrize("memory,disk", [(True, True), (False, True), (True, False)], ids=["both", "disk", "host"])
def test_evicted_blocks_come_back_from_a_tier_with_hf_greedy_tokens(tiny_model, hf, tmp_path, memory, disk):
    engine = tiered(tiny_model, tmp_path, memory, disk)
    expected = [hf(p, NEW_TOKENS) for p in PROMPTS]
    first, again = three_rounds(engine)
    assert first == again == expected
    # every full block of each prompt (but a last token's) from the highest tier there is
    want = sum((len(p) - 1) // 16 * 16 for p in PROMPTS)
    assert tier_hits(engine, "host" if memory else "disk") == want
    assert engine.metrics()["kv_tiers_refused_blocks"] == 0
    engine.blocks.check_invariants([])
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("mode", [{"async_scheduling": False}, {"num_scheduler_steps": 4}], ids=["sync", "multi-step"])
def test_every_scheduling_mode(tiny_model, hf, tmp_path, mode):
    """The default (async: plan k + 1 made while plan k runs) is above; sync and multi-step plans
    carry the saves and see the loaded blocks too."""
    engine = tiered(tiny_model, tmp_path, **mode)
    first, again = three_rounds(engine)
    assert first == again == [hf(p, NEW_TOKENS) for p in PROMPTS]
    assert tier_hits(engine, "host") == sum((len(p) - 1) // 16 * 16 for p in PROMPTS)


def test_a_request_the_tiers_know_nothing_of_does_not_hold_back_those_behind_it(tiny_model, hf, tmp_path):
    """All at once in the queue: a new prompt first, then the prompts the tiers hold, each of those
    still finds every one of its blocks there."""
    from engines.protocol import Add

    engine = tiered(tiny_model, tmp_path)
    run(engine, PROMPTS, "first")
    run(engine, FILLERS, "filler")
    outputs: dict = {}
    engine.publish = lambda outs: [outputs.setdefault(o.request_id, []).append(o) for o in outs]
    sp = SamplingParams(max_new_tokens=NEW_TOKENS)
    for i, prompt in enumerate([[1] + [9] * 40] + PROMPTS):  # (the first: no block of it in any tier)
        engine.add(Add(f"q{i}", prompt, sp))
    while engine.has_work():
        engine.step()
    assert [output_tokens(outputs[f"q{i + 1}"]) for i in range(len(PROMPTS))] == [hf(p, NEW_TOKENS) for p in PROMPTS]
    assert tier_hits(engine, "host") == sum((len(p) - 1) // 16 * 16 for p in PROMPTS)


def test_a_preempted_request_comes_back_from_a_tier(tiny_model, hf, tmp_path):
    """Six requests outgrow the 12-block pool as they decode: the newest are preempted, their blocks
    evicted by the others, and when they come back their prompts' blocks load from the disk tier."""
    engine = tiered(tiny_model, tmp_path, memory=False)
    prompts = PROMPTS + FILLERS[:3]
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    outputs = drive_engine(engine, [(f"p{i}", p, sp) for i, p in enumerate(prompts)])
    assert [output_tokens(outputs[f"p{i}"]) for i in range(len(prompts))] == [hf(p, 40) for p in prompts]
    m = engine.metrics()
    assert m["preemptions"] > 0 and m["kv_tier_disk_hit_tokens"] > 0


def test_without_tiers_the_same_rounds_recompute(tiny_model, hf, tmp_path):
    """The control: the pool alone has forgotten the prompts by the third round."""
    engine = local_engine(tiny_model, "paged", enable_prefix_caching=True, kv_cache_memory=POOL)
    run(engine, PROMPTS, "first")
    run(engine, FILLERS, "filler")
    before = engine.metrics()["prefix_cache_hit_tokens"]
    assert run(engine, PROMPTS, "again") == [hf(p, NEW_TOKENS) for p in PROMPTS]
    assert engine.metrics()["prefix_cache_hit_tokens"] == before


def test_fp8_blocks_stay_fp8(tiny_model, tmp_path):
    """An fp8 cache's blocks go down and come back as their bytes: the same tokens as with no tiers
    (fp8 K/V is not transformers' arithmetic: the oracle is the pool alone)."""
    fp8 = {"kv_cache_dtype": "fp8", "kv_cache_memory": "24KiB"}  # a quarter of the bytes: the same 12 blocks
    plain = local_engine(tiny_model, "paged", enable_prefix_caching=True, **fp8)
    expected = run(plain, PROMPTS, "plain")
    engine = tiered(tiny_model, tmp_path, **fp8)
    assert engine.blocks.num_blocks == 12
    assert engine.paged.tiers.payload_len == 2 * 2 * 2 * 16 * 16  # K and V, 2 layers, 2 heads, 16 slots, 16 dims, 1 byte
    first, again = three_rounds(engine)
    assert first == again == expected
    assert tier_hits(engine, "host") > 0


def test_a_sliding_window_family_and_prompt_lookup(tmp_path_factory, tmp_path):
    """Mistral with a 24-token window (blocks behind it released as requests decode), and n-gram
    speculation: the blocks from a tier give transformers' tokens."""
    from tests.test_families import hf_greedy

    model_dir = tmp_path_factory.mktemp("families") / "mistral-window"
    make_model(str(model_dir), arch="mistral-window", size="tiny", seed=11, rope_form="legacy")
    prompts = PROMPTS + [[1] + [5, 6, 7, 8, 9] * 8]  # a repetitive one: prompt lookup finds matches
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    for name, extra in (("window", {}), ("ngram", {"speculative_method": "ngram", "num_speculative_tokens": 3})):
        engine = tiered(model_dir, tmp_path / name, **extra)
        assert engine.blocks.window == 24
        first, again = three_rounds(engine, prompts)
        assert first == again == expected, name
        assert tier_hits(engine, "host") > 0, name
        if extra:
            assert engine.metrics()["spec_accepted_tokens"] > 0


def test_lora_requests_take_only_their_adapters_blocks(tiny_model, tmp_path):
    """The same prompts under the base model and an adapter: each comes back from the tier with its
    own K/V (the adapter is in the chain's root), greedy equal to peft's."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, r=4, lora_alpha=8,
                                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.save_pretrained(str(tmp_path / "adapter"))
    expected = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)
        ids = out[0, len(prompt):].tolist()
        expected.append(ids[: ids.index(2) + 1] if 2 in ids else ids)
    lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 4, "adapters": {"a": str(tmp_path / "adapter")}}
    engine = tiered(tiny_model, tmp_path, lora=lora)
    base_tokens = run(engine, PROMPTS, "base")  # the base model's blocks of the same prompts, in the tiers first
    first, again = three_rounds(engine, adapters=["a"] * len(PROMPTS))
    assert first == again == expected != base_tokens
    assert tier_hits(engine, "host") == sum((len(p) - 1) // 16 * 16 for p in PROMPTS)


def test_tensor_parallel_2_each_rank_its_shard(tiny_model, hf, tmp_path):
    """Two ranks each write and load their own heads of every block (one folder per rank)."""
    opts = {"enable_prefix_caching": True, "kv_cache_memory": POOL, "kv_offload_memory": "32MiB",
            "kv_offload_memory_dir": str(tmp_path / "shm"), "kv_offload_dir": str(tmp_path / "disk")}
    got = run_tp2_job(tmp_path, {"rounds": [PROMPTS, FILLERS, PROMPTS], "new_tokens": NEW_TOKENS,
                                 "scheduler": opts, "metrics": True}, [str(tiny_model)])
    assert got[str(tiny_model)][-len(PROMPTS):] == [hf(p, NEW_TOKENS) for p in PROMPTS]
    assert got["metrics:" + str(tiny_model)]["kv_tier_host_hit_tokens"] == sum((len(p) - 1) // 16 * 16
                                                                              for p in PROMPTS)
    namespaces = os.listdir(tmp_path / "disk")
    assert len(namespaces) == 1 and sorted(os.listdir(tmp_path / "disk" / namespaces[0])) == ["r0", "r1"]


def test_a_tier_that_cannot_be_written_costs_only_its_hits(tiny_model, hf, tmp_path, caplog):
    """The host tier's folder removed under a serving engine (someone cleaned /dev/shm): writes
    fail, are logged and counted, and every request is still served, from the disk tier."""
    engine = tiered(tiny_model, tmp_path)
    run(engine, PROMPTS[:1], "first")
    shutil.rmtree(tmp_path / "shm")
    with caplog.at_level(logging.WARNING, logger="engines.worker.block_files"):
        first, again = three_rounds(engine, PROMPTS[1:])
    assert first == again == [hf(p, NEW_TOKENS) for p in PROMPTS[1:]]
    m = engine.metrics()
    assert m["kv_tier_host_write_errors"] > 0 and "cannot write" in caplog.text
    assert m["kv_tier_disk_hit_tokens"] == sum((len(p) - 1) // 16 * 16 for p in PROMPTS[1:])


# -- restarts, torn and foreign tiers ------------------------------------------------------------------
def disk_files(engine) -> dict[int, str]:
    tier = engine.paged.tiers.tiers[-1]
    return {int(name[:-3], 16): os.path.join(tier.folder, name) for name in os.listdir(tier.folder)}


def chain_hashes(tokens: list[int], size: int = 16) -> list[int]:
    """The prefix cache's hash of each full block of a base-model prompt (but a last token's)."""
    hashes, parent = [], None
    for i in range((len(tokens) - 1) // size):
        parent = hash_block(parent, pack_tokens(tokens[i * size:(i + 1) * size]))
        hashes.append(parent)
    return hashes


def test_a_restart_answers_from_the_disk_tier(tiny_model, hf, tmp_path):
    first = tiered(tiny_model, tmp_path, memory=False)
    assert run(first, PROMPTS, "before") == [hf(p, NEW_TOKENS) for p in PROMPTS]
    first.stop_ranks()
    again = tiered(tiny_model, tmp_path, memory=False)  # a new engine: an empty pool, the disk tier's files
    assert again.metrics()["kv_tier_disk_blocks"] == len(disk_files(again)) > 0
    assert run(again, PROMPTS, "after") == [hf(p, NEW_TOKENS) for p in PROMPTS]
    assert tier_hits(again, "disk") == sum((len(p) - 1) // 16 * 16 for p in PROMPTS)


def corrupt(path: str, how: str) -> None:
    data = open(path, "rb").read()
    if how == "truncated":
        data = data[:len(data) // 2]
    else:  # torn: the same length, other bytes in the payload
        data = data[:-100] + bytes(b ^ 0xFF for b in data[-100:])
    open(path, "wb").write(data)


@pytest.mark.parametrize("how", ["truncated", "torn"])
def test_a_torn_block_is_refused_and_recomputed(tiny_model, hf, tmp_path, caplog, how):
    """The second block of the longest prompt damaged on disk: refused (at start when its length
    gives it away, at load when only its checksum does), logged; the first block still loads, the
    rest is recomputed, and the tokens are transformers'."""
    prompt = PROMPTS[-1]
    first = tiered(tiny_model, tmp_path, memory=False)
    run(first, [prompt], "before")
    first.stop_ranks()
    second_block = chain_hashes(prompt)[1]
    corrupt(disk_files(first)[second_block], how)
    with caplog.at_level(logging.WARNING, logger="engines.worker.block_files"):
        again = tiered(tiny_model, tmp_path, memory=False)
        assert run(again, [prompt], "after") == [hf(prompt, NEW_TOKENS)]
    reason = "truncated" if how == "truncated" else "checksum"
    assert [r for r in caplog.records if f"{second_block:016x}.kv" in r.getMessage() and reason in r.getMessage()]
    m = again.metrics()
    assert m["kv_tier_disk_refused_blocks"] == 1 and m["kv_tier_disk_hit_tokens"] == 16
    assert m["kv_tiers_refused_blocks"] == (1 if how == "torn" else 0)  # adopted, then refused by the load
    assert second_block in disk_files(again)  # recomputed, and written down again


@pytest.mark.parametrize("other", ["model", "dtype"])
def test_a_foreign_tier_is_refused(tiny_model, hf, tmp_path, tmp_path_factory, caplog, other):
    """Files another model (other weights, same architecture and tokens) or another KV dtype wrote,
    put where this engine looks: every one refused, none loaded, the tokens transformers'."""
    if other == "model":
        foreign_dir = tmp_path_factory.mktemp("other") / "tiny-llama"
        make_model(str(foreign_dir), arch="llama", size="tiny", seed=1)
        foreign = tiered(foreign_dir, tmp_path / "foreign", memory=False)
    else:
        foreign = tiered(tiny_model, tmp_path / "foreign", memory=False, kv_cache_dtype="fp8", kv_cache_memory="24KiB")
    run(foreign, PROMPTS, "foreign")
    foreign.stop_ranks()
    ours = tiered(tiny_model, tmp_path, memory=False)
    folder = ours.paged.tiers.tiers[0].folder
    assert folder != foreign.paged.tiers.tiers[0].folder  # another namespace: another folder
    for path in disk_files(foreign).values():
        shutil.copy(path, folder)
    ours.stop_ranks()
    with caplog.at_level(logging.WARNING, logger="engines.worker.block_files"):
        again = tiered(tiny_model, tmp_path, memory=False)
        assert run(again, PROMPTS, "after") == [hf(p, NEW_TOKENS) for p in PROMPTS]
    copied = len(disk_files(foreign))
    assert again.metrics()["kv_tier_disk_refused_blocks"] == copied > 0
    assert len([r for r in caplog.records if "another model" in r.getMessage() or "namespace" in r.getMessage()]) \
        == copied
    assert again.metrics()["kv_tier_disk_hit_tokens"] == 0


# -- the parts -----------------------------------------------------------------------------------------
def test_block_files_check_every_field_and_keep_to_their_budget(tmp_path, caplog):
    ns = b"n" * 16
    files = BlockFiles("disk", str(tmp_path / "t"), ns, capacity=3 * 200)
    payload = memoryview(bytes(range(100)))
    for h in (1, 2, 3, 4):
        files.write(h, b"root", b"tok", payload)
    assert sorted(files.held) == [2, 3, 4] and not os.path.exists(block_path(files.folder, 1))  # least recent out
    assert files.read(2, b"root", b"tok", 100) == bytes(range(100))
    files.write(5, b"root", b"tok", payload)
    assert sorted(files.held) == [2, 4, 5]  # 2 was read: 3 was the least recently used
    with caplog.at_level(logging.WARNING):
        assert files.read(4, b"root", b"other", 100) is None  # a collision: other tokens
        assert files.read(5, b"root", b"tok", 99) is None  # another layout's length
    assert files.num_refused == 2 and "hash collision" in caplog.text
    open(os.path.join(files.folder, "0000000000000009.kv.1.tmp"), "wb").write(b"half")
    again = BlockFiles("disk", str(tmp_path / "t"), ns, capacity=3 * 200)
    again.scan()
    assert list(again.held) == [2] and os.listdir(files.folder) == ["0000000000000002.kv"]


def test_adopting_never_evicts_the_hit_and_forgetting_frees(tmp_path):
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    bm.new_cached = []
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=1), frozenset({0}), 0)
    assert bm.allocate(a, 5)
    bm.cache_full_blocks(a, 4)
    assert [b for b, _ in bm.take_new_cached()] == a.block_ids[:2] and bm.take_new_cached() == []
    bm.free(a)
    b = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_new_tokens=1), frozenset({0}), 0)
    hit, next_hash = bm.lookup(b)
    assert len(hit) == 2 and next_hash is not None
    wanted = bm.uncached_after(b, hit)
    assert [tb.hash for tb in wanted] == chain_hashes(b.all_token_ids, 2)[2:]
    taken = bm.adopt(b, hit, wanted)
    assert len(taken) == 2 and not set(taken) & set(hit)  # the two other blocks, not the hit's
    assert bm.lookup(b).block_ids == hit + taken
    bm.forget(taken[1:])
    assert bm.lookup(b).block_ids == hit + taken[:1]
    bm.check_invariants([])


def test_block_hashes_are_the_same_in_every_process():
    """Copies and restarts name blocks alike: not Python's per-process hash of bytes."""
    import subprocess
    import sys

    code = ("from engines.core.block_manager import hash_block, pack_tokens as p; "
            "print(hash_block(hash_block(None, p([1, 2])), p([3, 4])), hash_block(('lora', 'a'), p([1, 2])))")
    seen = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True).stdout for seed in ("1", "2")}
    assert len(seen) == 1 and len(seen.pop().split()) == 2


# -- copies behind one front end ------------------------------------------------------------------------
COPIES = ("engine=Python\noption.dtype=fp32\noption.kv_cache_memory=192KiB\nmaxWorkers=2\nhttp_workers=1\n"
          "option.enable_prefix_caching=true\noption.max_new_tokens=4\n")
WORDS = "river stone cloud market lantern harbor meadow signal copper willow thunder garden".split()


def conversation_turns(n_conversations: int, n_turns: int) -> list[str]:
    """Each conversation's prompt grows by a new question every turn (history + question, as chat
    clients send it); conversations take turns, so that with two copies each moves between them."""
    history = [f"Conversation {c}:" for c in range(n_conversations)]
    sent = []
    for t in range(n_turns):
        for c in range(n_conversations):
            words = [WORDS[(7 * c + 5 * t + 3 * i) % len(WORDS)] for i in range(24)]
            history[c] += f" Question {t}: " + " ".join(words) + "."
            sent.append(history[c])
    return sent


def served_hit_rate(server) -> tuple[float, str]:
    import requests

    for prompt in conversation_turns(3, 4):
        r = requests.post(server.url + "/invocations", json={"inputs": prompt}, timeout=60)
        assert r.status_code == 200, r.text
    text = requests.get(server.url + "/metrics", timeout=10).text
    total = lambda name: sum(float(line.split()[-1]) for line in text.splitlines()  # noqa: E731
                             if line.startswith(name + "_total{"))
    return total("lmi_prefix_cache_hit_tokens") / total("lmi_prefix_cache_query_tokens"), text


def test_two_copies_share_the_host_tier(tiny_model, start_server, tmp_path):
    """Two copies, three conversations alternating between them: with the shared host tier a turn
    finds its history whichever copy wrote it; without it, only when the same copy still holds it."""
    from tests.test_copies import metric, wait_for
    import requests

    tiers = f"option.kv_offload_memory=32MiB\noption.kv_offload_memory_dir={tmp_path / 'shm'}\n"
    rates = {}
    for name, props in (("without", COPIES), ("with", COPIES + tiers)):
        server = start_server(props, tiny_model)
        wait_for(lambda: all(metric(requests.get(server.url + "/metrics", timeout=10).text, "lmi_engine_ready", c)
                             == 1.0 for c in "01"), 60, "both copies ready")
        rates[name], text = served_hit_rate(server)
        assert server.stop() == 0
    assert rates["with"] >= 2 * rates["without"] and rates["with"] > 0.5, rates
    assert 'lmi_kv_tier_hit_tokens_total{copy="0",tier="host"}' in text
    assert 'lmi_kv_tier_hit_tokens_total{copy="1",tier="host"}' in text
    assert "host tier" in server.log() and str(tmp_path / "shm") in server.log()


def test_the_configurations_the_tiers_cannot_serve_are_refused(tiny_model, tmp_path):
    from container.keys import ConfigError
    from tests.test_copies import build

    tiers = {"option.kv_offload_memory": "16MiB", "option.kv_offload_memory_dir": str(tmp_path)}
    on = {"option.enable_prefix_caching": "true", **tiers}
    sched = build(on, tiny=tiny_model).scheduler
    assert (sched.kv_offload_memory, sched.kv_offload_memory_dir, sched.kv_offload_dir) == ("16MiB", str(tmp_path), None)
    with pytest.raises(ConfigError, match="set option.enable_prefix_caching=true"):
        build(tiers, tiny=tiny_model)
    with pytest.raises(ConfigError, match="keeps the paged engine's KV blocks, and this configuration runs the "
                                          "dynamic engine"):
        build({**on, "batch_size": "4", "option.rolling_batch": "disable"}, tiny=tiny_model)
    with pytest.raises(ConfigError, match="pipeline_parallel_degree=2: the KV tiers support tensor parallelism"):
        build({**on, "option.pipeline_parallel_degree": "2", "option.tensor_parallel_degree": "1"}, tiny=tiny_model)
    with pytest.raises(ConfigError, match=r"does not fit .*: its filesystem has \d+ MiB free \(docker run --shm-size"):
        build({**on, "option.kv_offload_memory": "9000000GiB"}, tiny=tiny_model)
    disk = build({"option.enable_prefix_caching": "true", "option.kv_offload_dir": str(tmp_path / "d")},
                 tiny=tiny_model).scheduler
    assert (disk.kv_offload_memory, disk.kv_offload_dir, disk.kv_offload_disk) == (None, str(tmp_path / "d"), "0.5")


def test_lmi_plan_counts_the_tiers(tiny_model, tmp_path):
    from container import config as cfgmod
    from container import planner
    from engines.weights.memory_plan import Machine, plan

    resolved = cfgmod.resolve({"option.enable_prefix_caching": "true", "option.kv_offload_memory": "3MiB",
                               "option.kv_offload_dir": str(tmp_path), "option.kv_offload_disk": "6MiB",
                               "option.dtype": "fp32"}, {})
    shape = planner.read_model_shape(str(tiny_model))
    p = plan(shape, Machine("cpu", 0, 8 * 2**30), planner.workload(resolved, shape, Machine("cpu", 0, 8 * 2**30),
                                                                    "paged"))
    assert p.kv_bytes_per_token == 512 and p.kv_tier_tokens == {"host": 3 * 2**20 // 512, "disk": 6 * 2**20 // 512}
    rows = [" ".join(row.split()) for row in planner.table(p)]
    assert "KV host tier below the pool 3.00 MiB: 6,144 tokens" in rows
    assert "KV disk tier below the pool 6.00 MiB: 12,288 tokens" in rows
