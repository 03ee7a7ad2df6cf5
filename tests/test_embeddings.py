"""Embeddings, reranking, scores and classification (docs/embeddings.md): the pooling engine's vectors against
sentence-transformers' and the cross-encoder's own logits, through real servers and real clients (the
OpenAI SDK, TEI's and vLLM's request forms, LMI's /invocations); the task's detection and refusals."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import time

import numpy as np
import pytest
import requests
import torch

from container.config import build, resolve
from container.keys import ConfigError
from container.encoder_maker import wordpiece_tokenizer, write_sentence_transformers
from engines.config import ENGINE_POOLING, TASK_CLASSIFICATION, TASK_EMBEDDING, TASK_GENERATION, ModelConfig
from engines.pooling.engine import groups_by_length
from engines.pooling.model import PoolingModel, finish_vectors, pool
from engines.pooling.spec import PoolingSpecError, detect_task, read_pooling_spec
from tests.support import Server

TEXTS = ["The river ran past the old mill.", "hello", "A cat sat on the warm stone wall and watched the birds.",
         "Numbers: 1, 2, 3 and symbols like % or & too"]
LONG = " ".join(["the quiet river carried boats down to the sea"] * 30)  # ~300 tokens: over the 128-token limit
KINDS = ("bert-embed", "qwen3-embed", "bert-rerank", "bert-classify")
PROPS = "option.dtype=fp32\nhttp_workers=1\noption.max_client_batch_size=8\n"


@pytest.fixture(scope="module")
def servers(encoders, tmp_path_factory):
    """One server per checkpoint, started together (their engines load side by side)."""
    tmp = tmp_path_factory.mktemp("servers")
    started = {kind: Server(tmp, PROPS, encoders[kind]) for kind in KINDS}
    try:
        for srv in started.values():
            srv.wait_ready()
        yield started
    finally:  # stopped together too (each drains and stops its engine)
        with concurrent.futures.ThreadPoolExecutor(len(started)) as pool:
            codes = dict(zip(started, pool.map(lambda srv: srv.stop(), started.values())))
    assert set(codes.values()) == {0}, codes


@pytest.fixture(scope="module")
def st(encoders):
    from sentence_transformers import SentenceTransformer

    return {kind: SentenceTransformer(str(encoders[kind]), device="cpu") for kind in ("bert-embed", "qwen3-embed")}


def client(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


# -- the checkpoint's facts and the task ----------------------------------------------------------------------------

def test_the_spec_is_read_from_sentence_transformers_files(encoders):
    bert = read_pooling_spec(str(encoders["bert-embed"]), TASK_EMBEDDING)
    assert (bert.pooling, bert.normalize, bert.is_causal, bert.max_input_tokens, bert.dimensions) == \
        ("mean", True, False, 128, 64)
    qwen = read_pooling_spec(str(encoders["qwen3-embed"]), TASK_EMBEDDING)
    assert (qwen.pooling, qwen.normalize, qwen.is_causal) == ("lasttoken", True, True)
    classify = read_pooling_spec(str(encoders["bert-classify"]), TASK_CLASSIFICATION)
    assert classify.labels == ["negative", "neutral", "positive"] and classify.dimensions == 3
    assert [detect_task(str(encoders[k])) for k in KINDS] == [TASK_EMBEDDING, TASK_EMBEDDING, TASK_CLASSIFICATION,
                                                              TASK_CLASSIFICATION]


def test_checkpoints_that_cannot_be_served_are_refused_at_start(encoders, tmp_path, tiny_model):
    dense = tmp_path / "dense"
    shutil.copytree(encoders["bert-embed"], dense)
    modules = json.loads((dense / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(PoolingSpecError, match="Dense module"):
        read_pooling_spec(str(dense), TASK_EMBEDDING)
    with pytest.raises(PoolingSpecError, match="ForSequenceClassification"):
        read_pooling_spec(str(encoders["bert-embed"]), TASK_CLASSIFICATION)

    def config(props: dict, model) -> object:
        return build(resolve(props, {}), local_dir=str(model), spec=None, num_gpus=0, num_cpus=2, port=8080)

    with pytest.raises(ConfigError, match="option.task=fill-mask: lmi-serve serves text-generation, text-embedding"):
        resolve({"option.task": "fill-mask"}, {})
    with pytest.raises(ConfigError, match="BertModel is an encoder, which cannot generate text"):
        config({"option.task": "text-generation"}, encoders["bert-embed"])
    with pytest.raises(ConfigError, match="option.rolling_batch=lmi-dist is a text-generation setting"):
        config({"option.rolling_batch": "lmi-dist"}, encoders["bert-embed"])
    with pytest.raises(ConfigError, match="option.tensor_parallel_degree=2: a text-embedding model runs in one"):
        config({"option.tensor_parallel_degree": "2"}, encoders["bert-embed"])
    served = config({"option.task": "embedding"}, encoders["bert-embed"])  # vLLM's name for it
    assert (served.scheduler.engine_kind, served.model.task) == (ENGINE_POOLING, TASK_EMBEDDING)
    assert config({}, encoders["bert-rerank"]).model.task == TASK_CLASSIFICATION  # detected
    assert config({}, tiny_model).model.task == TASK_GENERATION
    assert config({}, tiny_model).model.pooling is None
    assert resolve({}, {"HF_TASK": "text-embedding"})["option.task"] == TASK_EMBEDDING


def test_lmi_config_names_the_tasks_served_for_one_it_does_not_serve(encoders, tmp_path):
    from tests.test_cli import lmi

    props = tmp_path / "serving.properties"
    props.write_text("option.task=fill-mask\n")
    result = lmi("config", "--properties", str(props), "--model-dir", str(encoders["bert-embed"]))
    assert result.returncode != 0
    assert "option.task=fill-mask: lmi-serve serves text-generation, text-embedding" in result.stderr
    planned = lmi("plan", "--model-dir", str(encoders["bert-rerank"]))  # no KV cache to plan for it
    assert planned.returncode == 0 and "task: text-classification (the pooling engine): weights" in planned.stdout


@pytest.mark.parametrize("mode", ["cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken"])
def test_pooling_equals_sentence_transformers_pooling(mode):
    from sentence_transformers.models import Pooling

    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16)  # [b, L, H]
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 1 + [0] * 6])  # right padding
    theirs = Pooling(16, pooling_mode=mode)({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
    torch.testing.assert_close(pool(hidden, mask, mode), theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["roberta", "modernbert"])
def test_other_encoders_embed_as_sentence_transformers_does(arch, tmp_path):
    """RoBERTa (positions after the padding index) and ModernBERT (CLS pooling here), in this process."""
    import transformers
    from sentence_transformers import SentenceTransformer

    tok = wordpiece_tokenizer(64)
    shape = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, pad_token_id=tok.pad_token_id)
    if arch == "roberta":
        config = transformers.RobertaConfig(**shape, max_position_embeddings=66, type_vocab_size=1)
    else:
        config = transformers.ModernBertConfig(**shape, max_position_embeddings=64, cls_token_id=tok.cls_token_id,
                                               sep_token_id=tok.sep_token_id, bos_token_id=tok.cls_token_id,
                                               eos_token_id=tok.sep_token_id)
    torch.manual_seed(0)
    transformers.AutoModel.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    write_sentence_transformers(str(tmp_path), 32, "cls" if arch == "modernbert" else "mean", 64)
    spec = read_pooling_spec(str(tmp_path), detect_task(str(tmp_path)))
    assert (spec.task, spec.max_input_tokens) == (TASK_EMBEDDING, 64)
    model = PoolingModel(ModelConfig(local_dir=str(tmp_path), pooling=spec, task=spec.task))
    model.load()
    ids = [e.ids for e in tok.backend_tokenizer.encode_batch(TEXTS)]
    ours = finish_vectors(model.run(ids), None, spec.normalize).numpy()
    np.testing.assert_allclose(ours, SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS), atol=1e-5)


def test_groups_by_length_keep_the_padded_size_within_the_budget():
    batch = [("r", i, [0] * n, []) for i, n in enumerate([5, 100, 7, 3, 60, 6])]
    groups = groups_by_length(batch, 128)
    assert [[len(item[2]) for item in g] for g in groups] == [[3, 5, 6, 7], [60], [100]]
    assert all(len(g) * len(g[-1][2]) <= 128 for g in groups)
    assert sorted(item[1] for g in groups for item in g) == list(range(6))


# -- embeddings -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["bert-embed", "qwen3-embed"])
def test_embeddings_equal_sentence_transformers_through_every_route(servers, st, kind):
    srv, want = servers[kind], st[kind].encode(TEXTS + [LONG], convert_to_numpy=True)
    sdk = client(srv).embeddings.create(model=kind, input=TEXTS + [LONG])  # the SDK asks for base64
    got = np.array([d.embedding for d in sdk.data])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert [d.index for d in sdk.data] == list(range(5)) and sdk.usage.prompt_tokens > 128
    floats = client(srv).embeddings.create(model=kind, input=TEXTS, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in floats.data], want[:4], atol=1e-5)
    tei = srv.post({"inputs": TEXTS}, "/embed")
    assert tei.status_code == 200, tei.text
    np.testing.assert_allclose(tei.json(), want[:4], atol=1e-5)
    lmi = srv.post({"inputs": TEXTS[0]}, "/invocations")
    np.testing.assert_allclose(lmi.json(), want[:1], atol=1e-5)
    # alone, or batched with others by the engine: the same vectors
    with concurrent.futures.ThreadPoolExecutor(len(TEXTS)) as pool:
        alone = list(pool.map(lambda text: srv.post({"inputs": text}, "/embed").json()[0], TEXTS))
    np.testing.assert_allclose(alone, got[:4], atol=1e-6)


def test_dimensions_cut_then_normalise(servers, st):
    srv, full = servers["bert-embed"], st["bert-embed"].encode(TEXTS[:2], convert_to_tensor=True)
    want = torch.nn.functional.normalize(full[:, :16], dim=1).numpy()
    sdk = client(srv).embeddings.create(model="bert-embed", input=TEXTS[:2], dimensions=16)
    assert [len(d.embedding) for d in sdk.data] == [16, 16]
    np.testing.assert_allclose([d.embedding for d in sdk.data], want, atol=1e-5)
    raw = srv.post({"inputs": TEXTS[:1], "normalize": False, "dimensions": 16}, "/embed").json()
    assert abs(float(np.linalg.norm(raw[0])) - 1.0) > 1e-3  # TEI's normalize=false: the cut as it is


def test_token_id_inputs_and_truncation(servers, st, encoders):
    from transformers import AutoTokenizer

    srv, tok = servers["bert-embed"], AutoTokenizer.from_pretrained(str(encoders["bert-embed"]))
    ids = tok(TEXTS[0])["input_ids"]
    sdk = client(srv).embeddings.create(model="bert-embed", input=[ids], encoding_format="float")
    np.testing.assert_allclose(sdk.data[0].embedding, st["bert-embed"].encode([TEXTS[0]])[0], atol=1e-5)
    refused = srv.post({"input": LONG, "truncate": False}, "/v1/embeddings")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate"
    assert "more than this model's maximum of 128" in refused.json()["error"]["message"]


# -- reranking, scores, classification --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cross_logits(encoders):
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(encoders["bert-rerank"]), device="cpu")
    return lambda query, docs: model.predict([(query, d) for d in docs], activation_fn=torch.nn.Identity()).tolist()


def test_rerank_scores_are_the_cross_encoders_logits_in_order(servers, cross_logits):
    srv, query = servers["bert-rerank"], "where does the river go"
    logits = cross_logits(query, TEXTS + [LONG])
    order = sorted(range(5), key=lambda i: -logits[i])
    raw = srv.post({"query": query, "texts": TEXTS + [LONG], "raw_scores": True, "return_text": True}, "/rerank")
    assert [r["index"] for r in raw.json()] == order
    np.testing.assert_allclose([r["score"] for r in raw.json()], [logits[i] for i in order], atol=1e-5)
    assert [r["text"] for r in raw.json()] == [(TEXTS + [LONG])[i] for i in order]
    sigmoid = [1 / (1 + np.exp(-x)) for x in logits]
    tei = srv.post({"query": query, "texts": TEXTS}, "/rerank").json()
    np.testing.assert_allclose([r["score"] for r in tei], sorted(sigmoid[:4], reverse=True), atol=1e-5)
    assert "text" not in tei[0]
    for path in ("/rerank", "/v1/rerank"):  # Cohere's and Jina's form, as vLLM serves it
        jina = srv.post({"model": "bert-rerank", "query": query, "documents": [{"text": t} for t in TEXTS],
                         "top_n": 2}, path).json()
        top = sorted(range(4), key=lambda i: -sigmoid[i])[:2]
        assert [r["index"] for r in jina["results"]] == top
        assert [r["document"]["text"] for r in jina["results"]] == [TEXTS[i] for i in top]
        np.testing.assert_allclose([r["relevance_score"] for r in jina["results"]], [sigmoid[i] for i in top],
                                   atol=1e-5)


def test_score_pairs_one_to_many_and_many_to_many(servers, cross_logits, st):
    srv = servers["bert-rerank"]
    body = srv.post({"model": "bert-rerank", "text_1": "a cat", "text_2": TEXTS}, "/v1/score").json()
    want = [1 / (1 + np.exp(-x)) for x in cross_logits("a cat", TEXTS)]
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5)
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["usage"]["prompt_tokens"] > 0
    pairs = srv.post({"text_1": TEXTS[:2], "text_2": TEXTS[2:]}, "/v1/score").json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]],
                               [1 / (1 + np.exp(-cross_logits(TEXTS[i], [TEXTS[i + 2]])[0])) for i in (0, 1)],
                               atol=1e-5)
    # an embedding model scores by the cosine of the two embeddings (vLLM's bi-encoder scoring)
    vecs = st["bert-embed"].encode(TEXTS[:2])
    cos = servers["bert-embed"].post({"text_1": TEXTS[0], "text_2": [TEXTS[1]]}, "/v1/score").json()
    assert cos["data"][0]["score"] == pytest.approx(float(np.dot(vecs[0], vecs[1])), abs=1e-5)


def test_classification_labels_and_probabilities(servers, encoders):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = str(encoders["bert-classify"])
    model, tok = AutoModelForSequenceClassification.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        probs = model(**tok(TEXTS[:2], padding=True, return_tensors="pt")).logits.softmax(-1)
    labels = ["negative", "neutral", "positive"]
    srv = servers["bert-classify"]
    one = srv.post({"inputs": TEXTS[0]}).json()
    assert one[0]["label"] == labels[int(probs[0].argmax())]
    assert one[0]["score"] == pytest.approx(float(probs[0].max()), abs=1e-5)
    top2 = srv.post({"inputs": TEXTS[:2], "parameters": {"top_k": 2}}).json()
    for row, p in zip(top2, probs):
        best = p.argsort(descending=True)[:2].tolist()
        assert [r["label"] for r in row] == [labels[i] for i in best]
        np.testing.assert_allclose([r["score"] for r in row], p[best].numpy(), atol=1e-5)


# -- bad input: a 400 naming the problem, never a 500 -------------------------------------------------------------------

BAD = [
    ("bert-embed", "/v1/embeddings", {"input": []}, "input is empty"),
    ("bert-embed", "/v1/embeddings", {"input": ["a"] * 9}, "at most 8 per request (option.max_client_batch_size)"),
    ("bert-embed", "/v1/embeddings", {"input": 5}, "input must be a string"),
    ("bert-embed", "/v1/embeddings", {"input": [[1, 99999]]}, "token-id inputs must hold"),
    ("bert-embed", "/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions must be an integer from 1 to 64"),
    ("bert-embed", "/v1/embeddings", {"input": "a", "dimensions": 65}, "dimensions must be an integer from 1 to 64"),
    ("bert-embed", "/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format must be float"),
    ("bert-embed", "/v1/embeddings", {"input": "a", "priority": 1}, "priority is not a field this route takes"),
    ("bert-embed", "/v1/embeddings", {}, "input is required"),
    ("bert-embed", "/embed", {"inputs": "a", "truncation_direction": "Left"}, "truncation_direction='Left'"),
    ("bert-embed", "/embed", {"inputs": "a", "normalize": "yes"}, "normalize must be true or false"),
    ("bert-embed", "/invocations", {"inputs": "a", "parameters": {"max_new_tokens": 5}},
     "parameters.max_new_tokens is not a field"),
    ("bert-embed", "/invocations", {"prompt": "a"}, "\"inputs\""),
    ("bert-embed", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     "chat is not available: this model serves text-embedding"),
    ("bert-embed", "/v1/completions", {"prompt": "hi"}, "text generation is not available"),
    ("bert-embed", "/generate", {"inputs": "hi"}, "text generation is not available"),
    ("bert-embed", "/v1/responses", {"input": "hi"}, "text generation is not available"),
    ("bert-embed", "/rerank", {"query": 5, "texts": ["a"]}, "query must be a string"),
    ("bert-rerank", "/v1/embeddings", {"input": "a"}, "embeddings is not available: this model serves "
                                                      "text-classification"),
    ("bert-rerank", "/rerank", {"query": "q", "texts": []}, "texts is empty"),
    ("bert-rerank", "/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n must be a positive integer"),
    ("bert-rerank", "/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1 has 2 texts"),
    ("bert-rerank", "/v1/score", {"text_1": "a", "text_2": ["x " * 300], "truncate": False},
     "more than this model's maximum"),
    ("bert-classify", "/rerank", {"query": "q", "texts": ["a"]}, "this classifier has 3 labels"),
    ("bert-classify", "/invocations", {"inputs": "a", "parameters": {"top_k": 4}}, "top_k must be an integer"),
]


@pytest.mark.parametrize("kind,path,body,message", BAD, ids=[f"{k}{p}-{i}" for i, (k, p, *_) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_problem(servers, kind, path, body, message):
    resp = requests.post(servers[kind].url + path, json=body, timeout=30)
    assert resp.status_code == 400, (resp.status_code, resp.text)
    error = resp.json().get("error")
    text = error["message"] if isinstance(error, dict) else error
    assert message in text, text


def test_the_engine_batches_answers_and_refuses_by_message(encoders):
    """The pooling engine in this process: Encode in, Encoded out; what it cannot serve answered at once."""
    import threading

    from engines.config import LmiConfig, SchedulerConfig
    from engines.pooling.engine import PoolingEngine
    from engines.protocol import Abort, Add, Encode, Encoded, Output
    from engines.sampling_params import SamplingParams

    spec = read_pooling_spec(str(encoders["bert-embed"]), TASK_EMBEDDING)
    config = LmiConfig(model=ModelConfig(local_dir=str(encoders["bert-embed"]), task=TASK_EMBEDDING, pooling=spec),
                       scheduler=SchedulerConfig(engine_kind=ENGINE_POOLING, job_queue_size=4, max_num_seqs=2))
    out: list = []
    engine = PoolingEngine(config, out.extend)
    engine.submit(Add("gen", [2, 3], SamplingParams(max_new_tokens=2)))
    engine.submit(Encode("long", [[5] * 129]))
    engine.submit(Encode("full", [[5]] * 5))
    assert [(o.request_id, o.error_code) for o in out] == [("gen", 400), ("long", 400), ("full", 503)]
    assert isinstance(out[0], Output) and "not text generation: use /v1/embeddings" in out[0].error
    out.clear()
    engine.load()
    engine.submit(Encode("gone", [[2, 40, 3]]))
    engine.submit(Abort("gone"))  # before its turn: never computed, never answered
    engine.submit(Encode("three", [[2, 40, 3], [2, 41, 42, 43, 3], [2, 3]], dimensions=8))  # two batches of two
    stop = threading.Event()
    loop = threading.Thread(target=engine.run, args=(stop,))
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while not out and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        loop.join(timeout=5)
    (reply,) = out
    assert isinstance(reply, Encoded) and reply.request_id == "three" and reply.error_code is None
    vectors = [np.frombuffer(v, dtype="<f4") for v in reply.vectors]
    assert [v.shape for v in vectors] == [(8,)] * 3 and np.allclose([np.linalg.norm(v) for v in vectors], 1.0)
    assert engine.num_batches == 2
