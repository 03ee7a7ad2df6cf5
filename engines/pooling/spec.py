"""An embedding or classification checkpoint's facts (engines/config.py PoolingSpec), read once at start
from its files; no torch (the launcher and the HTTP workers read them too).

    config.json                          architecture, model type, id2label, max_position_embeddings
    modules.json                         sentence-transformers' pipeline: Transformer → Pooling → Normalize
    1_Pooling/config.json                the pooling mode (pooling_mode_* flags)
    sentence_bert_config.json            max_seq_length
    tokenizer_config.json                model_max_length (when sentence-transformers does not say)

Without sentence-transformers' files an encoder is pooled as sentence-transformers pools a plain
transformers model (the mean of its tokens, not normalised), a decoder as vLLM does (its last token,
normalised).
"""

from __future__ import annotations

import json
import os

from engines.config import TASK_CLASSIFICATION, TASK_EMBEDDING, TASK_GENERATION, PoolingSpec

# model types that are bidirectional encoders: they embed or classify, never generate
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "modernbert", "distilbert", "electra",
                           "mpnet", "deberta", "deberta-v2", "albert", "nomic_bert", "new", "jina_bert",
                           "xlm-roberta-xl", "ernie", "megatron-bert", "mobilebert", "luke", "bge-m3"})
# model types whose position ids start after the padding index (max_position_embeddings counts those)
OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert", "xlm-roberta-xl", "luke"})
# sentence-transformers' pooling flags → our modes (one flag set, as most checkpoints have)
POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "pooling_mode_lasttoken": "lasttoken"}
POOLING_MODES = frozenset(POOLING_FLAGS.values())
# sentence-transformers' modules we run (the transformer itself, its pooling, unit length)
MODULES = {"Transformer": "transformer", "Pooling": "pooling", "Normalize": "normalize"}
NO_LIMIT = 1_000_000  # tokenizer_config's model_max_length above this means "not set" (transformers' 1e30)


class PoolingSpecError(ValueError):
    """The checkpoint cannot be served for its task; the sentence says why (a start-up refusal)."""


def read_json(path: str) -> dict | list | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def architecture_of(config: dict) -> str:
    archs = config.get("architectures") or []
    return archs[0] if archs else ""


def is_encoder(config: dict) -> bool:
    return config.get("model_type") in ENCODER_TYPES


def detect_task(model_dir: str, config: dict | None = None) -> str:
    """The task a checkpoint serves when option.task is unset: a classifier (…ForSequenceClassification),
    a sentence-transformers model (modules.json) or an encoder embeds; anything else generates. config:
    its config.json when the caller has read it."""
    if config is None:
        config = read_json(os.path.join(model_dir, "config.json")) or {}
    if architecture_of(config).endswith("ForSequenceClassification"):
        return TASK_CLASSIFICATION
    if os.path.isfile(os.path.join(model_dir, "modules.json")) or is_encoder(config):
        return TASK_EMBEDDING
    return TASK_GENERATION


def read_pooling_spec(model_dir: str, task: str, max_model_len: int | None = None) -> PoolingSpec:
    """The spec of the checkpoint in `model_dir` for `task`; PoolingSpecError when it cannot serve it."""
    config = read_json(os.path.join(model_dir, "config.json"))
    if not isinstance(config, dict):
        raise PoolingSpecError(f"no config.json in {model_dir}")
    arch = architecture_of(config) or config.get("model_type", "")
    causal = not is_encoder(config)
    if task == TASK_CLASSIFICATION:
        if not arch.endswith("ForSequenceClassification"):
            raise PoolingSpecError(f"option.task=text-classification needs a …ForSequenceClassification checkpoint "
                                   f"(a classifier or a cross-encoder); this one is {arch}")
        labels = _labels(config)
        return PoolingSpec(task=task, architecture=arch, is_causal=causal, pooling="", normalize=False,
                           max_input_tokens=max_input_tokens(model_dir, config, max_model_len),
                           dimensions=len(labels), labels=labels)
    pooling, normalize = _sentence_transformers_pipeline(model_dir, causal)
    hidden = config.get("hidden_size") or config.get("d_model") or config.get("dim") or 0
    return PoolingSpec(task=task, architecture=arch, is_causal=causal, pooling=pooling, normalize=normalize,
                       max_input_tokens=max_input_tokens(model_dir, config, max_model_len), dimensions=int(hidden))


def _labels(config: dict) -> list[str]:
    id2label = config.get("id2label") or {}
    num = int(config.get("num_labels") or len(id2label) or 1)
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num)]


def _sentence_transformers_pipeline(model_dir: str, causal: bool) -> tuple[str, bool]:
    """(pooling mode, normalize) from modules.json and its Pooling module's config; the defaults without them."""
    modules = read_json(os.path.join(model_dir, "modules.json"))
    if not modules:
        return ("lasttoken", True) if causal else ("mean", False)
    kinds = []
    pooling_dir = None
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in MODULES:
            raise PoolingSpecError(f"modules.json has a {kind} module ({module.get('path') or module.get('name')}); "
                                   f"lmi-serve runs sentence-transformers pipelines of {', '.join(MODULES)} only")
        kinds.append(kind)
        if kind == "Pooling":
            pooling_dir = os.path.join(model_dir, module.get("path") or "")
    pooling = ("lasttoken" if causal else "mean") if pooling_dir is None else _pooling_mode(pooling_dir)
    return pooling, "Normalize" in kinds


def _pooling_mode(pooling_dir: str) -> str:
    cfg = read_json(os.path.join(pooling_dir, "config.json")) or {}
    mode = cfg.get("pooling_mode")  # newer sentence-transformers write the mode by name too
    flags = [name for flag, name in POOLING_FLAGS.items() if cfg.get(flag)]
    others = [flag for flag, on in cfg.items() if flag.startswith("pooling_mode_") and flag not in POOLING_FLAGS and on]
    if others or len(flags) > 1:
        raise PoolingSpecError(f"{pooling_dir}/config.json asks for {', '.join(others + flags)} pooling; lmi-serve "
                               f"pools by one of {', '.join(sorted(POOLING_MODES))}")
    if flags:
        return flags[0]
    if mode in POOLING_MODES:
        return mode
    raise PoolingSpecError(f"{pooling_dir}/config.json names no pooling mode lmi-serve runs "
                           f"({', '.join(sorted(POOLING_MODES))})")


def max_input_tokens(model_dir: str, config: dict, max_model_len: int | None) -> int:
    """The most tokens an input may have: sentence-transformers' max_seq_length, else the tokenizer's
    model_max_length, else the position table's size (less RoBERTa's offset); at most option.max_model_len."""
    st = read_json(os.path.join(model_dir, "sentence_bert_config.json")) or {}
    tok = read_json(os.path.join(model_dir, "tokenizer_config.json")) or {}
    limit = st.get("max_seq_length")
    if not limit and isinstance(tok.get("model_max_length"), (int, float)) and tok["model_max_length"] < NO_LIMIT:
        limit = int(tok["model_max_length"])
    if not limit:
        positions = int(config.get("max_position_embeddings") or config.get("n_positions") or 512)
        if config.get("model_type") in OFFSET_POSITIONS:
            positions -= int(config.get("pad_token_id") or 0) + 1
        limit = positions
    return min(int(limit), max_model_len) if max_model_len else int(limit)
