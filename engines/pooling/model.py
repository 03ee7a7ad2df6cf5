"""The pooling engine's model: a transformers encoder (BERT, RoBERTa/XLM-R, ModernBERT...) or decoder
(Qwen3-Embedding...) run over a padded batch, then pooled into one vector per input (embeddings), or its
classification head's logits (classifiers, cross-encoders).

A batch is right-padded to its longest input; the attention mask keeps the pads out of every real
token's attention, and pooling reads only real tokens:

    ids   [b, L]   a0 a1 a2 a3        mask  1 1 1 1        cls        → a0
                   b0 b1 ·  ·               1 1 0 0        lasttoken  → a3, b1 (the last 1 of each row)
                                                           mean / max → over the 1s only
"""

from __future__ import annotations

import inspect
import logging

import torch

from engines.config import TASK_CLASSIFICATION, ModelConfig, PoolingSpec
from engines.weights.loader import torch_dtype

log = logging.getLogger(__name__)


class PoolingModel:
    def __init__(self, model: ModelConfig):
        if model.pooling is None:
            raise ValueError(f"no pooling spec for {model.local_dir}: the launcher reads it from the checkpoint")
        self.config = model
        self.spec: PoolingSpec = model.pooling
        self.model = None
        self.takes_token_types = False
        self.pad_id = 0
        self.device = torch.device("cpu")

    def load(self) -> None:
        from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

        cfg = AutoConfig.from_pretrained(self.config.local_dir, trust_remote_code=self.config.trust_remote_code)
        dtype = torch_dtype(self.config.dtype, str(getattr(cfg, "dtype", None) or "float32"))
        cls = AutoModelForSequenceClassification if self.spec.task == TASK_CLASSIFICATION else AutoModel
        if torch.cuda.is_available():
            self.device = torch.device("cuda")
        self.model = cls.from_pretrained(self.config.local_dir, dtype=dtype, attn_implementation="sdpa",
                                         trust_remote_code=self.config.trust_remote_code).to(self.device).eval()
        # BERT's segment embeddings (a pair's second text is segment 1); RoBERTa-likes have one segment
        self.takes_token_types = "token_type_ids" in inspect.signature(self.model.forward).parameters and \
            int(getattr(cfg, "type_vocab_size", 0) or 0) > 1
        self.pad_id = int(getattr(cfg, "pad_token_id", None) or 0)
        log.info("pooling model: %s (%s) in %s on %s; %s, inputs up to %d tokens", self.spec.architecture,
                 self.spec.task, dtype, self.device,
                 f"{len(self.spec.labels)} labels" if self.spec.task == TASK_CLASSIFICATION else
                 f"{self.spec.pooling} pooling{', normalised' if self.spec.normalize else ''}",
                 self.spec.max_input_tokens)

    @torch.inference_mode()
    def run(self, inputs: list[list[int]], token_types: list[list[int]] | None = None) -> torch.Tensor:
        """One padded batch → [b, dimensions] float32 on the CPU: pooled hidden states (not yet normalised:
        the engine cuts them to the caller's dimensions first), or classification logits."""
        width = max(len(ids) for ids in inputs)
        ids = torch.full((len(inputs), width), self.pad_id, dtype=torch.long)  # [b, L]
        mask = torch.zeros((len(inputs), width), dtype=torch.long)  # [b, L]
        types = torch.zeros((len(inputs), width), dtype=torch.long) if token_types and self.takes_token_types else None
        for row, seq in enumerate(inputs):
            ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, :len(seq)] = 1
            if types is not None:
                types[row, :len(seq)] = torch.tensor(token_types[row], dtype=torch.long)
        kwargs = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        if types is not None:
            kwargs["token_type_ids"] = types.to(self.device)
        out = self.model(**kwargs)
        if self.spec.task == TASK_CLASSIFICATION:
            return out.logits.float().cpu()  # [b, num_labels]
        return pool(out.last_hidden_state, kwargs["attention_mask"], self.spec.pooling).float().cpu()


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [b, L, H], mask [b, L] (1: a real token) → [b, H], as sentence-transformers' Pooling computes it."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        # the last real token of each row (right padding: the row's length - 1)
        last = mask.sum(dim=1) - 1  # [b]
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # [b, L, 1]
    if mode == "max":
        return hidden.masked_fill(weights == 0, -1e9).max(dim=1).values
    total = (hidden * weights).sum(dim=1)  # [b, H]
    count = weights.sum(dim=1).clamp(min=1e-9)  # [b, 1]
    if mode == "mean":
        return total / count
    if mode == "mean_sqrt_len_tokens":
        return total / count.sqrt()
    raise ValueError(f"unknown pooling mode {mode!r}")


def finish_vectors(vectors: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """[b, H] → [b, dimensions]: the first `dimensions` values (Matryoshka), then unit length when asked."""
    if dimensions:
        vectors = vectors[:, :dimensions]
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
    return vectors
