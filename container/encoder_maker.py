"""`lmi make-model --arch bert-embed|qwen3-embed|bert-rerank|bert-classify`: random-weight embedding,
reranking and classification checkpoints, written as their hub counterparts are (a BERT with a WordPiece
tokenizer; sentence-transformers' modules.json, 1_Pooling and 2_Normalize beside the weights).

    bert-embed      BertModel, mean pooling, normalised           (all-MiniLM-L6-v2's layout)
    qwen3-embed     Qwen3ForCausalLM, last-token pooling, normalised, EOS appended (Qwen3-Embedding's)
    bert-rerank     BertForSequenceClassification, one label       (a cross-encoder: ms-marco-MiniLM's)
    bert-classify   BertForSequenceClassification, three labels   (a sentiment classifier's)
"""

from __future__ import annotations

import json
import os

from container.model_maker import INIT_RANGE, corpus_lines, make_world_readable, train_tokenizer

ENCODER_KINDS = ("bert-embed", "qwen3-embed", "bert-rerank", "bert-classify")
ENCODER_SIZES = {
    # hidden, layers, heads, intermediate, max positions
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=128),
    # all-MiniLM-L6-v2's shape (22.7 M parameters with its 30k vocabulary; fewer with ours)
    "mini": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                 max_position_embeddings=512),
}
LABELS = ("negative", "neutral", "positive")
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def wordpiece_tokenizer(max_length: int, vocab_size: int = 1024):
    """A lower-casing WordPiece tokenizer trained on the embedded corpus: [CLS] A [SEP] (B [SEP])."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus_lines(), trainers.WordPieceTrainer(vocab_size=vocab_size,
                                                                      special_tokens=list(BERT_SPECIALS),
                                                                      show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_length,
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def eos_tokenizer(max_length: int):
    """The byte-level BPE tokenizer of model_maker with EOS appended (what last-token pooling reads)."""
    from tokenizers import processors

    fast = train_tokenizer()
    eos = fast.eos_token_id
    fast.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B:1 </s>:1", special_tokens=[("</s>", eos)])
    fast.model_max_length = max_length
    fast.chat_template = None
    return fast


def make_encoder(out_dir: str, kind: str = "bert-embed", size: str = "tiny", seed: int = 0) -> dict:
    """Write the checkpoint, its tokenizer and (embeddings) sentence-transformers' files; → the model card."""
    import torch
    import transformers

    if kind not in ENCODER_KINDS:
        raise ValueError(f"unknown encoder kind {kind!r}; choose one of {', '.join(ENCODER_KINDS)}")
    shape = ENCODER_SIZES[size]
    max_len = shape["max_position_embeddings"]
    tokenizer = eos_tokenizer(max_len) if kind == "qwen3-embed" else wordpiece_tokenizer(max_len)
    common = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, initializer_range=INIT_RANGE)
    torch.manual_seed(seed)
    if kind == "qwen3-embed":
        config = transformers.Qwen3Config(**shape, num_key_value_heads=max(1, shape["num_attention_heads"] // 2),
                                          head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                                          tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                                          eos_token_id=tokenizer.eos_token_id, **common)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif kind == "bert-embed":
        model = transformers.BertModel(transformers.BertConfig(**shape, **common))
    else:
        labels = LABELS if kind == "bert-classify" else ("LABEL_0",)
        config = transformers.BertConfig(**shape, **common, num_labels=len(labels),
                                         id2label=dict(enumerate(labels)), label2id={k: i for i, k in
                                                                                     enumerate(labels)})
        model = transformers.BertForSequenceClassification(config)
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if kind.endswith("-embed"):
        write_sentence_transformers(out_dir, shape["hidden_size"], "lasttoken" if kind == "qwen3-embed" else "mean",
                                    max_len)
    card = {"architecture": model.config.architectures[0] if model.config.architectures else type(model).__name__,
            "kind": kind, "size": size, "seed": seed, "num_parameters": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(out_dir, "lmi_model_card.json"), "w", encoding="utf-8") as f:
        json.dump(card, f, indent=2)
    make_world_readable(out_dir)
    return card


def write_sentence_transformers(out_dir: str, hidden: int, pooling: str, max_len: int) -> None:
    """modules.json (Transformer → Pooling → Normalize), the pooling config and max_seq_length, as
    sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    chosen = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens", "lasttoken": "lasttoken"}[pooling]
    flags = {f"pooling_mode_{name}": name == chosen for name in ("cls_token", "mean_tokens", "max_tokens",
                                                                 "mean_sqrt_len_tokens", "weightedmean_tokens",
                                                                 "lasttoken")}
    files = {"modules.json": modules,
             "sentence_bert_config.json": {"max_seq_length": max_len, "do_lower_case": False},
             "1_Pooling/config.json": {"word_embedding_dimension": hidden, **flags, "include_prompt": True}}
    for name, content in files.items():
        path = os.path.join(out_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
    os.makedirs(os.path.join(out_dir, "2_Normalize"), exist_ok=True)
