"""`lmi make-model`: a random-weight model plus a tokenizer (with a chat template) trained on local
text, as safetensors.

Deterministic for a seed (same bytes for the same seed, architecture and size). Random weights give
nearly flat logits, where the float rounding of different batch shapes can flip a greedy choice;
so the weights are drawn wider than usual and the LM head is scaled, which makes the top-1 logit
margin large next to float32 noise. The median margin over a few prompts is measured and written to
`lmi_model_card.json` beside the weights.
"""

from __future__ import annotations

import json
import os
from importlib import resources

SIZES = {
    # hidden, layers, heads, kv heads, intermediate, max positions
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=1024),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=3072, max_position_embeddings=2048),
    # the families benchmark's shape (benchmarks/families.py): big enough that the layers, not Python, take the time
    "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=1024, max_position_embeddings=2048),
    # 1.01 B parameters (2.0 GB in bf16): the loading benchmark's model
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
               intermediate_size=8192, max_position_embeddings=2048),
}
DTYPES = ("float32", "bfloat16", "float16")
# --arch → (transformers config class, the family's settings beyond the size's shape): the model
# families we serve, each as its hub checkpoints are written (legacy `rope_theta`/`rope_scaling` keys
# where the family ships them: transformers 5 rewrites them to `rope_parameters` when it saves, and
# `legacy_rope` puts them back)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral-window": ("MistralConfig", {"sliding_window": 24}),
    "qwen2": ("Qwen2Config", {"sliding_window": None}),
    # Qwen2.5-0.5B's shape: 14 query heads over 2 KV heads (groups of 7), head_dim 64, tied head, theta 1e6
    "qwen2.5": ("Qwen2Config", {"num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 112,
                                "head_dim": 8, "tie_word_embeddings": True, "rope_theta": 1000000.0,
                                "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "phi3": ("Phi3Config", {"original_max_position_embeddings": 256, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.5 + 0.2 * i for i in range(8)], "original_max_position_embeddings": 256}}),
    "gemma": ("GemmaConfig", {"head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 24, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                                "tie_word_embeddings": True}),
    "falcon": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2, "parallel_attn": True,
                                "bias": False}),
    "falcon-7b": ("FalconConfig", {"new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
                                   "bias": False}),
    "neox": ("GPTNeoXConfig", {"rotary_pct": 0.25, "use_parallel_residual": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen2-moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                     "shared_expert_intermediate_size": 96, "norm_topk_prob": False}),
    "gpt2": ("GPT2Config", {}),
    # two more the fallback serves: OPT through transformers' attention interface (our paged KV),
    # BLOOM (ALiBi) with transformers' own cache in the padded engine
    "opt": ("OPTConfig", {}),
    "bloom": ("BloomConfig", {}),
}
ARCHITECTURES = tuple(FAMILIES)
VOCAB_SIZE = 1024
INIT_RANGE = 0.1
LM_HEAD_SCALE = 4.0
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
# A Zephyr-style chat template (what the OpenAI and chat routes render); it starts with the BOS token,
# so a rendered prompt is tokenized without adding special tokens, as transformers and vLLM do.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_lines() -> list[str]:
    text = resources.files("container").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def train_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer (never an unknown token) with <s> prepended to every input."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(arch: str, size: str, tokenizer, overrides: dict | None = None):
    """A transformers config for `arch` at `size`, with `overrides` (num_kv_heads etc.) applied."""
    import transformers

    shape = dict(SIZES[size], **(overrides or {}))
    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  initializer_range=INIT_RANGE, tie_word_embeddings=False)
    class_name, family = FAMILIES[arch]
    cls = getattr(transformers, class_name)
    if arch == "gpt2":
        return cls(n_embd=shape["hidden_size"], n_layer=shape["num_hidden_layers"], n_head=shape["num_attention_heads"],
                   n_inner=shape["intermediate_size"], n_positions=shape["max_position_embeddings"],
                   **{**common, **(overrides or {})})
    if arch == "opt":
        return cls(hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_hidden_layers"],
                   num_attention_heads=shape["num_attention_heads"], ffn_dim=shape["intermediate_size"],
                   max_position_embeddings=shape["max_position_embeddings"], word_embed_proj_dim=shape["hidden_size"],
                   **common)
    if arch == "bloom":
        return cls(hidden_size=shape["hidden_size"], n_layer=shape["num_hidden_layers"],
                   n_head=shape["num_attention_heads"], **common)
    settings = {**shape, **common, **family, **(overrides or {})}
    if class_name in ("FalconConfig", "GPTNeoXConfig"):
        # Falcon keeps `intermediate_size` as an attribute it never reads (its MLP is ffn_hidden_size,
        # 4 × hidden): left in, as a config built with it carries it
        settings.pop("num_key_value_heads")
    if class_name != "FalconConfig":
        settings.setdefault("rms_norm_eps" if class_name != "GPTNeoXConfig" else "layer_norm_eps", 1e-5)
    scaling = settings.get("rope_scaling") or {}
    if "short_factor" in scaling:  # longrope: one factor per rotated pair of this shape's heads
        pairs = (settings.get("head_dim") or settings["hidden_size"] // settings["num_attention_heads"]) // 2
        settings["rope_scaling"] = {**scaling, "short_factor": [1.0 + 0.05 * i / pairs * 8 for i in range(pairs)],
                                    "long_factor": [1.5 + 0.2 * i / pairs * 8 for i in range(pairs)]}
    return cls(**settings)


COPY_LAYER_SCALE = 0.01


def legacy_rope(out_dir: str) -> None:
    """Rewrite config.json's rotary settings in the form most hub checkpoints still carry: `rope_theta`
    and `rope_scaling` (`partial_rotary_factor` / GPT-NeoX's `rotary_pct` at the top level)."""
    path = os.path.join(out_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    params = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
    partial = params.pop("partial_rotary_factor", None)
    if partial is not None:
        cfg["rotary_pct" if cfg.get("model_type") == "gpt_neox" else "partial_rotary_factor"] = partial
    kind = params.get("rope_type", "default")
    cfg["rope_scaling"] = None if kind == "default" else params
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


def make_model(out_dir: str, arch: str = "llama", size: str = "tiny", seed: int = 0,
               overrides: dict | None = None, dtype: str = "float32", copy: bool = False,
               rope_form: str = "parameters") -> dict:
    """Write config, safetensors weights, tokenizer and a model card to `out_dir`; return the card.

    copy: a model whose greedy output repeats its input's last token: the LM head is the input
    embedding (scaled) and every layer's output projections are scaled by COPY_LAYER_SCALE, so the
    final hidden state stays near the current token's embedding, whose logit is then the largest.
    The layers compute as much as in any model of the size; the benchmark of speculative decoding
    needs outputs that copy their input, which random weights never give.
    rope_form: "parameters" (transformers 5's `rope_parameters`) or "legacy" (`rope_theta` and
    `rope_scaling`, see legacy_rope)."""
    import torch
    from transformers import AutoModelForCausalLM

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    tokenizer = train_tokenizer()
    config = model_config(arch, size, tokenizer, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight.mul_(LM_HEAD_SCALE)
        if copy:  # a model that repeats its input (speculative decoding's benchmark): see make_model's doc
            head.weight.copy_(model.get_input_embeddings().weight * LM_HEAD_SCALE)
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight")):
                    p.mul_(COPY_LAYER_SCALE)
    model.eval()
    margin = median_top1_margin(model, tokenizer)
    model.to(getattr(torch, dtype))  # the checkpoint's dtype (config.json says it too)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if rope_form == "legacy":
        legacy_rope(out_dir)
    tokenizer.save_pretrained(out_dir)
    card = {"architecture": config.architectures[0] if config.architectures else type(model).__name__,
            "size": size, "seed": seed, "num_parameters": sum(p.numel() for p in model.parameters()),
            "median_top1_margin": round(margin, 4), "dtype": dtype,
            "init_range": INIT_RANGE, "lm_head_scale": LM_HEAD_SCALE, "copy": copy}
    with open(os.path.join(out_dir, "lmi_model_card.json"), "w", encoding="utf-8") as f:
        json.dump(card, f, indent=2)
    make_world_readable(out_dir)
    return card


def make_draft(target_dir: str, out_dir: str, num_layers: int = 2) -> dict:
    """A draft model for speculative decoding cut from a model: its embeddings, its first
    `num_layers` decoder layers, its final norm and LM head, and its tokenizer (so the two agree on
    every token id). Its guesses are the model's own early-exit guesses: a draft that often agrees."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype="auto")
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"a draft of {target_dir} keeps 1 to {total - 1} of its {total} layers, not {num_layers}")
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:num_layers])
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(out_dir)
    card = {"architecture": model.config.architectures[0], "draft_of": os.path.abspath(target_dir),
            "num_hidden_layers": num_layers, "num_parameters": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(out_dir, "lmi_model_card.json"), "w", encoding="utf-8") as f:
        json.dump(card, f, indent=2)
    make_world_readable(out_dir)
    return card


def make_world_readable(out_dir: str) -> None:
    """safetensors writes the weights with mode 0600; the image serves as a non-root user, so a
    mounted model made here must be readable by others (0644 files, 0755 directories)."""
    os.chmod(out_dir, 0o755)
    for root, dirs, files in os.walk(out_dir):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)


def median_top1_margin(model, tokenizer, num_prompts: int = 8, new_tokens: int = 8) -> float:
    """Median gap between the best and second-best logit along greedy continuations of corpus lines."""
    import torch

    margins: list[float] = []
    with torch.no_grad():
        for line in corpus_lines()[:num_prompts]:
            ids = tokenizer(line[:60], return_tensors="pt").input_ids
            for _ in range(new_tokens):
                logits = model(ids).logits[0, -1].float()
                top2 = torch.topk(logits, 2).values
                margins.append(float(top2[0] - top2[1]))
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    margins.sort()
    return margins[len(margins) // 2]
