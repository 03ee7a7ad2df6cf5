"""Model facts, resolved once at start from config.json and generation_config.json: `ModelSpec`.

Every process that needs a fact of the checkpoint (the launcher's plan, the HTTP workers' length
limits, each engine rank's model code, every engine's stop tokens) calls `ModelSpec.read` once and
passes the spec down; nothing else opens config.json. Pure Python: no torch, no transformers.

Both forms of the rotary settings that checkpoints carry are read: transformers 5's
`rope_parameters` (one dict, or one per layer type) and the legacy `rope_theta` + `rope_scaling`
(`type` or `rope_type`; Phi-3's old `su` is `longrope`). The EOS *set* comes from
generation_config.json first (a Llama-3 instruct model stops on `<|eot_id|>` as well as
`<|end_of_text|>`), config.json's otherwise.
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

DEFAULT_MAX_MODEL_LEN = 2048
SLIDING, FULL = "sliding_attention", "full_attention"


class RopeSpec(msgspec.Struct, frozen=True):
    """One rotary embedding: its kind (default | linear | dynamic | llama3 | yarn | longrope), base
    and the kind's own parameters as the checkpoint states them (factor, original_max_position_embeddings,
    low_freq_factor, short_factor, ...)."""

    kind: str = "default"
    theta: float = 10000.0
    params: dict[str, Any] = {}

    def get(self, key: str, default=None):
        value = self.params.get(key)
        return default if value is None else value


class ModelSpec(msgspec.Struct, frozen=True):
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int | None  # what the checkpoint declares (None: it declares none)
    max_model_len: int  # option.max_model_len, else the checkpoint's limit, else DEFAULT_MAX_MODEL_LEN
    rope: RopeSpec
    rotary_dim: int  # the leading dims of each head that rotate (partial rotary: fewer than head_dim)
    sliding_windows: tuple[int | None, ...]  # per layer: keys within this many positions (None: all)
    local_rope: RopeSpec | None = None  # sliding layers' own rotary settings (Gemma-3 style), if any
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    checkpoint_dtype: str | None = None  # config.json's torch_dtype / dtype, as written
    config: dict[str, Any] = {}  # config.json itself (text_config merged in): the family's own keys

    @classmethod
    def read(cls, local_dir: str, max_model_len: int | None = None) -> "ModelSpec":
        """The spec of the checkpoint in `local_dir` (`max_model_len`: option.max_model_len)."""
        path = os.path.join(local_dir, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"no config.json in {local_dir}")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        generation = {}
        gen_path = os.path.join(local_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                generation = json.load(f)
        return cls.from_dicts(cfg, generation, max_model_len)

    @classmethod
    def of(cls, model) -> "ModelSpec":
        """The spec of an engine's model (an engines.config.ModelConfig): its directory and
        option.max_model_len."""
        return cls.read(model.local_dir, model.max_model_len)

    @classmethod
    def from_dicts(cls, cfg: dict, generation: dict | None = None, max_model_len: int | None = None) -> "ModelSpec":
        cfg = {**cfg, **(cfg.get("text_config") or {})}
        generation = generation or {}
        hidden = _first(cfg, "hidden_size", "n_embd", "n_embed", "d_model")
        layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
        heads = _first(cfg, "num_attention_heads", "n_head")
        if not all(isinstance(v, int) for v in (hidden, layers, heads)):
            raise ValueError("config.json: cannot find the hidden size, layers and heads of this architecture")
        kv_heads = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv",
                          default=1 if cfg.get("multi_query") else heads)
        if cfg.get("model_type") == "falcon" and not cfg.get("new_decoder_architecture"):
            kv_heads = 1 if cfg.get("multi_query", True) else heads  # Falcon-7B: `num_kv_heads` is not read
        head_dim = _first(cfg, "head_dim", default=None) or hidden // heads
        rope, local_rope = _rope(cfg)
        params = cfg.get("rope_parameters") or {}
        partial = _first(params.get(FULL, params), "partial_rotary_factor") or \
            _first(cfg, "partial_rotary_factor", "rotary_pct", default=_DEFAULT_ROTARY.get(cfg.get("model_type"), 1.0))
        declared = _first(cfg, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                          default=None)
        declared = declared if isinstance(declared, int) else None
        eos = _ids(generation.get("eos_token_id"))
        pad = _ids(_first(generation, "pad_token_id", default=cfg.get("pad_token_id")))
        max_len = max_model_len or declared or DEFAULT_MAX_MODEL_LEN
        # a window as long as any sequence can be is no window
        windows = tuple(w if w is not None and w < max_len else None for w in _windows(cfg, layers))
        return cls(
            architecture=(cfg.get("architectures") or ["unknown"])[0], model_type=cfg.get("model_type", ""),
            vocab_size=cfg.get("vocab_size", 0), hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=_intermediate_size(cfg) or 4 * hidden,
            max_position_embeddings=declared, max_model_len=max_len,
            rope=rope, local_rope=local_rope, rotary_dim=int(head_dim * partial),
            sliding_windows=windows,
            attn_logit_softcap=cfg.get("attn_logit_softcapping"),
            final_logit_softcap=cfg.get("final_logit_softcapping"),
            norm_eps=float(_first(cfg, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon",
                                  default=_DEFAULT_NORM_EPS.get(cfg.get("model_type"), 1e-6))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", cfg.get("model_type") in _TIED_BY_DEFAULT)),
            eos_token_ids=eos or _ids(cfg.get("eos_token_id")),
            bos_token_id=_first(generation, "bos_token_id", default=cfg.get("bos_token_id")),
            pad_token_id=pad[0] if pad else None,
            checkpoint_dtype=_first(cfg, "torch_dtype", "dtype", default=None), config=cfg)

    @property
    def attention_scale(self) -> float:
        """The score scale: 1/sqrt(head_dim), or Gemma-2's 1/sqrt(query_pre_attn_scalar)."""
        return float(self.config.get("query_pre_attn_scalar") or self.head_dim) ** -0.5


_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3_text", "gpt2", "falcon"}  # families whose config class defaults to tying
# the config classes' defaults where config.json leaves the key out
_DEFAULT_ROTARY = {"gpt_neox": 0.25}  # GPT-NeoX's rotary_pct
_DEFAULT_NORM_EPS = {"gpt_neox": 1e-5, "falcon": 1e-5}  # their LayerNorms' eps


def _first(cfg: dict, *keys: str, default=None):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _intermediate_size(cfg: dict) -> int | None:
    """The MLP's width under the key the architecture's transformers code reads: Falcon's config class
    reads `ffn_hidden_size` only (4 × hidden without it), and a config built with a stray
    `intermediate_size` keeps it as an attribute nothing uses."""
    if cfg.get("model_type") == "falcon":
        return _first(cfg, "ffn_hidden_size")
    return _first(cfg, "intermediate_size", "ffn_hidden_size", "n_inner")


def _ids(value) -> tuple[int, ...]:
    """An id, a list of ids or None → the ids, in order, once each."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(dict.fromkeys(int(v) for v in values))


def _rope(cfg: dict) -> tuple[RopeSpec, RopeSpec | None]:
    """(global rope, sliding layers' rope or None) from either config form."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # transformers 5, one set per layer type
        full = _rope_from(params.get(FULL) or next(iter(params.values())), cfg)
        local = _rope_from(params[SLIDING], cfg) if SLIDING in params else None
        return full, local if local != full else None
    legacy = dict(cfg.get("rope_scaling") or {})
    return _rope_from({**legacy, **(params or {})}, cfg), None


def _rope_from(params: dict, cfg: dict) -> RopeSpec:
    params = dict(params)
    theta = params.pop("rope_theta", None) or _first(cfg, "rope_theta", "rotary_emb_base", default=10000.0)
    params.pop("partial_rotary_factor", None)  # how much of a head rotates: ModelSpec.rotary_dim
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    kind = {"su": "longrope", "mrope": "default"}.get(kind, kind)
    return RopeSpec(kind=kind, theta=float(theta), params=params)


def _windows(cfg: dict, num_layers: int) -> tuple[int | None, ...]:
    """Per layer, the sliding window (None: full attention), as transformers applies it: `layer_types`
    where the config lists them; else Qwen2's `use_sliding_window` from layer `max_window_layers` on;
    else Gemma-2's alternation (even layers slide); else `sliding_window` on every layer (Mistral,
    Mixtral, Phi-3)."""
    window = cfg.get("sliding_window")
    if not window:
        return (None,) * num_layers
    types = cfg.get("layer_types")
    if not types:
        model_type = cfg.get("model_type")
        if "use_sliding_window" in cfg:  # the Qwen2 family
            first = cfg.get("max_window_layers", num_layers) if cfg["use_sliding_window"] else num_layers
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        elif model_type in ("gemma2", "gemma3_text", "cohere2"):
            pattern = cfg.get("sliding_window_pattern") or 2
            types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
        else:
            types = [SLIDING] * num_layers
    return tuple(int(window) if t == SLIDING else None for t in types[:num_layers])


def local_kv_heads(num_kv_heads: int, world_size: int) -> tuple[int, bool]:
    """KV heads per rank, and whether they are replicated (fewer KV heads than ranks)."""
    if num_kv_heads >= world_size:
        if num_kv_heads % world_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {world_size} ranks")
        return num_kv_heads // world_size, False
    if world_size % num_kv_heads:
        raise ValueError(f"{world_size} ranks do not share {num_kv_heads} KV heads evenly")
    return 1, True
