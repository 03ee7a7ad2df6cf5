"""Embeddings, reranking, scores and classification, for a model whose task (option.task, or detected) is
text-embedding or text-classification (docs/embeddings.md):

    POST /v1/embeddings     OpenAI's (encoding_format float | base64, dimensions)          embeddings
    POST /embed             TEI's (normalize, truncate, dimensions) → [[float]]             embeddings
    POST /rerank            TEI's (query, texts, raw_scores, return_text) → [{index, score}]
                            or Cohere's / Jina's (query, documents, top_n, return_documents) → {results}
    POST /v1/rerank         Cohere's / Jina's, as vLLM serves it                              scores
    POST /v1/score          vLLM's (text_1, text_2: one to one, one to many, many to many)    scores
    POST /invocations       LMI's {"inputs", "parameters"} → vectors, or labels with their scores

A score is a cross-encoder's logit through a sigmoid (raw_scores: the logit), or, on an embedding model,
the cosine similarity of the two texts' embeddings (vLLM's bi-encoder scoring).
"""

from __future__ import annotations

import base64
import time

import numpy as np
from flask import Blueprint, Response, g

from engines.config import TASK_CLASSIFICATION, TASK_EMBEDDING
from handlers.errors import bad_request
from handlers.pooling import (check_count, check_dimensions, cosine, encode, flag, scores, sigmoid, text_list)
from handlers.refusals import refuse_wrong_task
from handlers.routes.openai import model_body
from handlers.service import Service, json_response

routes = Blueprint("pooling", __name__)

SCORING = (TASK_CLASSIFICATION, TASK_EMBEDDING)


def _inputs(service: Service, texts: list, truncate: bool, what: str = "input"):
    """Texts → (ids, token types); OpenAI's token-id inputs (lists of ints) as they are, within the limit."""
    inputs = service.encoder_inputs()
    if texts and isinstance(texts[0], list):
        vocab = service.tokenizer.vocab_size
        for i, ids in enumerate(texts):
            if len(ids) > inputs.max_tokens or min(ids) < 0 or max(ids) >= vocab:
                raise bad_request(f"input {i}: token-id inputs must hold 1 to {inputs.max_tokens} ids from 0 to "
                                  f"{vocab - 1}", "input")
        return texts, None
    ids, types = inputs.texts(texts, truncate, what)
    return ids, types if service.config.model.pooling.task == TASK_CLASSIFICATION else None


def _embed(service: Service, texts: list, body: dict, *, normalize: bool | None, param: str) -> tuple[list, int]:
    """The embeddings of `texts` and how many tokens they took."""
    check_count(len(texts), service.config.server.max_client_batch_size, "input", param)
    ids, _ = _inputs(service, texts, flag(body, "truncate", True))
    dims = check_dimensions(body.get("dimensions"), service.config.model.pooling)
    return encode(service, ids, dimensions=dims, normalize=normalize, request_id=g.request_id), sum(map(len, ids))


@routes.post("/v1/embeddings")
def openai_embeddings():
    body, service = model_body()
    refuse_wrong_task(service.task, TASK_EMBEDDING, "embeddings")
    _refuse_unknown(body, {"model", "input", "encoding_format", "dimensions", "user", "truncate"})
    if "input" not in body:
        raise bad_request("input is required", "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request(f"encoding_format must be float or base64, not {fmt!r}", "encoding_format")
    vectors, tokens = _embed(service, text_list(body["input"], "input", allow_ids=True), body, normalize=None,
                             param="input")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()}
            for i, v in enumerate(vectors)]
    return json_response({"object": "list", "data": data, "model": service.model_name,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


@routes.post("/embed")
def tei_embed():
    body, service = model_body()
    refuse_wrong_task(service.task, TASK_EMBEDDING, "embeddings")
    _refuse_unknown(body, {"inputs", "normalize", "truncate", "truncation_direction", "dimensions", "prompt_name",
                           "model"})
    _refuse_left(body)
    if body.get("prompt_name") is not None:
        raise bad_request("prompt_name is not supported: send the prompt as part of the input", "prompt_name")
    vectors, _ = _embed(service, text_list(body.get("inputs"), "inputs"), body, param="inputs",
                        normalize=flag(body, "normalize", True))
    return json_response([v.tolist() for v in vectors])


@routes.post("/rerank")
def rerank():
    body, service = model_body()
    if "texts" in body:  # TEI's form
        return _tei_rerank(service, body)
    return _jina_rerank(service, body)


@routes.post("/v1/rerank")
def v1_rerank():
    body, service = model_body()
    return _jina_rerank(service, body)


def _tei_rerank(service: Service, body: dict) -> Response:
    _refuse_unknown(body, {"query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction", "model"})
    _refuse_left(body)
    query, texts = _query(body), text_list(body.get("texts"), "texts")
    found, _ = _score_pairs(service, [query] * len(texts), texts, body, raw=flag(body, "raw_scores", False),
                            param="texts")
    ranked = sorted(range(len(texts)), key=lambda i: -found[i])
    text = flag(body, "return_text", False)
    return json_response([{"index": i, "score": found[i], **({"text": texts[i]} if text else {})} for i in ranked])


def _jina_rerank(service: Service, body: dict) -> Response:
    _refuse_unknown(body, {"query", "documents", "top_n", "return_documents", "model", "truncate"})
    query, docs = _query(body), body.get("documents")
    if isinstance(docs, list):
        docs = [d.get("text") if isinstance(d, dict) else d for d in docs]
    texts = text_list(docs, "documents")
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise bad_request(f"top_n must be a positive integer, not {top_n!r}", "top_n")
    found, tokens = _score_pairs(service, [query] * len(texts), texts, body, raw=False, param="documents")
    ranked = sorted(range(len(texts)), key=lambda i: -found[i])[:top_n]
    docs_too = flag(body, "return_documents", True)
    results = [{"index": i, **({"document": {"text": texts[i]}} if docs_too else {}), "relevance_score": found[i]}
               for i in ranked]
    return json_response({"id": f"rerank-{g.request_id}", "model": service.model_name, "results": results,
                          "usage": {"total_tokens": tokens}})


@routes.post("/v1/score")
def v1_score():
    body, service = model_body()
    _refuse_unknown(body, {"model", "text_1", "text_2", "truncate"})
    left, right = text_list(body.get("text_1"), "text_1"), text_list(body.get("text_2"), "text_2")
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise bad_request(f"text_1 has {len(left)} texts and text_2 {len(right)}: send one text_1, or as many as "
                          "text_2 (pairs in order)", "text_1")
    found, tokens = _score_pairs(service, left, right, body, raw=False, param="text_2")
    return json_response({"id": f"score-{g.request_id}", "object": "list", "created": int(time.time()),
                          "model": service.model_name,
                          "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(found)],
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})


def _score_pairs(service: Service, left: list[str], right: list[str], body: dict, *, raw: bool,
                 param: str) -> tuple[list[float], int]:
    """Each (left, right) pair's score and the tokens read: a cross-encoder reads the pair as one input, a
    bi-encoder embeds both sides (each distinct text once) and compares them."""
    refuse_wrong_task(service.task, SCORING, "scoring")
    check_count(len(right), service.config.server.max_client_batch_size, param.rstrip("s"), param)
    truncate = flag(body, "truncate", True)
    if service.task == TASK_CLASSIFICATION:
        ids, types = _inputs(service, list(zip(left, right)), truncate, "pair")
        return scores(service, encode(service, ids, types, request_id=g.request_id), raw), sum(map(len, ids))
    distinct = list(dict.fromkeys(left + right))
    ids, _ = _inputs(service, distinct, truncate)
    vectors = dict(zip(distinct, encode(service, ids, request_id=g.request_id)))
    return [cosine(vectors[a], vectors[b]) for a, b in zip(left, right)], sum(map(len, ids))


def invocations(service: Service, body) -> Response:
    """LMI's /invocations on a pooling model: {"inputs": text | [texts], "parameters": {...}} → one vector per
    input (embeddings), or per input its label and score (classification; top_k: the k best of each)."""
    if not isinstance(body, dict) or "inputs" not in body:
        raise bad_request("the body must be a JSON object with \"inputs\": a string or a list of strings", "inputs")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise bad_request("parameters must be a JSON object", "parameters")
    single = isinstance(body["inputs"], str)
    texts = text_list(body["inputs"], "inputs")
    if service.task == TASK_EMBEDDING:
        _refuse_unknown(params, {"truncate", "normalize", "dimensions"}, "parameters.")
        vectors, _ = _embed(service, texts, params, normalize=params.get("normalize"), param="inputs")
        return json_response([v.tolist() for v in vectors])
    _refuse_unknown(params, {"truncate", "top_k"}, "parameters.")
    check_count(len(texts), service.config.server.max_client_batch_size, "input", "inputs")
    ids, types = _inputs(service, texts, flag(params, "truncate", True))
    top_k = params.get("top_k")
    labels = service.config.model.pooling.labels
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= len(labels)):
        raise bad_request(f"parameters.top_k must be an integer from 1 to {len(labels)}, not {top_k!r}", "top_k")
    out = [_labelled(v, labels, top_k or 1) for v in encode(service, ids, types, request_id=g.request_id)]
    if top_k is None:  # transformers' pipeline: the best label of each input, in a list
        return json_response([best[0] for best in out])
    return json_response(out[0] if single else out)


def _labelled(logits: np.ndarray, labels: list[str], k: int) -> list[dict]:
    """The k most probable labels: softmax over several labels, a sigmoid over one (transformers' pipeline)."""
    if len(labels) == 1:
        probs = [sigmoid(float(logits[0]))]
    else:
        e = np.exp(logits.astype(np.float64) - logits.max())
        probs = (e / e.sum()).tolist()
    order = sorted(range(len(labels)), key=lambda i: -probs[i])[:k]
    return [{"label": labels[i], "score": float(probs[i])} for i in order]


def _query(body: dict) -> str:
    query = body.get("query")
    if not isinstance(query, str):
        raise bad_request("query must be a string", "query")
    return query


def _refuse_left(body: dict) -> None:
    direction = body.get("truncation_direction")
    if direction is not None and str(direction).lower() != "right":
        raise bad_request(f"truncation_direction={direction!r} is not supported: inputs are truncated at the end "
                          "(Right)", "truncation_direction")


def _refuse_unknown(body: dict, known: set[str], prefix: str = "") -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"{prefix}{unknown[0]} is not a field this route takes (it takes "
                          f"{', '.join(sorted(prefix + k for k in known))})", unknown[0])
