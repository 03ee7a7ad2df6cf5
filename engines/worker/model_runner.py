"""Runs prefill and decode forwards over a PaddedKVCache, on our model code or the HF fallback.

The strategy is chosen once at load: native for the architectures in the registry (any TP degree);
else `AutoModelForCausalLM` (TP 1 only), its attention through our KV cache backends where its
modeling code goes through transformers' attention interface (engines/worker/hf_paged.py: the
paged engine can then run it), with its own past key values otherwise (the padded engine only).
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch
from engines.attention.base import kv_storage_dtype
from engines.attention.step import LayerOptions
from engines.attention.registry import triton_runs
from engines.config import ModelConfig, fallback_refusal, lora_sources, together_refusal
from engines.dist import Communicator, SingleProcess
from engines.layers.fused import describe as describe_fused_ops, select as select_fused_ops, use_fused_ops
from engines.layers.cpu_linear import choose_cpu_linear, describe as describe_cpu_linear
from engines.layers.quant import METHODS as QUANTIZE_AT_LOAD, quantize_linears
from engines.weights.quant_checkpoint import check_quantize_option, read_checkpoint_quant
from engines.weights.loader import build_model, parameter_bytes, torch_dtype
from engines.process.startup import TIMELINE, throughput
from engines.models.registry import attention_interface_supported, fallback_reason, model_class
from engines.spec import ModelSpec
from engines.worker.padded_cache import GROW, PaddedKVCache

log = logging.getLogger(__name__)

CPU_WARM_UP_TOKENS = 16


class ModelRunner:
    def __init__(self, config: ModelConfig, spec: ModelSpec, comm: Communicator | None = None,
                 device: torch.device | None = None):
        self.config = config
        self.spec = spec
        self.max_model_len = spec.max_model_len
        self.comm = comm or SingleProcess()
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = None
        self.is_native = False  # our model code
        self.fallback_why: str | None = None  # why transformers runs the model instead (set by load)
        self.lora = None  # option.enable_lora: engines.layers.lora.LoraAdapters
        self.owns_kv = False  # the model attends through our KV backends (ours, or HF's via hf_paged)
        self.layer_options: list[LayerOptions] | None = None  # how each layer attends (native models)
        self.kv_layers = range(spec.num_layers)  # the layers whose K/V this rank keeps (its pipeline stage's)

    def load(self) -> None:
        started = time.perf_counter()
        spec = self.spec
        self.dtype = torch_dtype(self.config.dtype, spec.checkpoint_dtype)
        cfg = self.config
        self.kv_dtype = kv_storage_dtype(cfg.kv_cache_dtype, self.dtype)
        cls = None if cfg.trust_remote_code or cfg.model_impl == "transformers" else model_class(spec)
        quant = read_checkpoint_quant(spec.config)
        check_quantize_option(cfg.quantize, quant)
        why = None if cls is not None else "option.trust_remote_code=true" if cfg.trust_remote_code \
            else "option.model_impl=transformers" if cfg.model_impl == "transformers" else fallback_reason(spec)
        if quant and cls is None:
            raise ValueError(fallback_refusal("quant_checkpoint", spec.architecture, why, method=quant.method))
        if cls is not None:
            pipeline = self.comm.tp.pipeline
            if pipeline is not None and (quant or cfg.enable_lora):
                stages = f"option.pipeline_parallel_degree={pipeline.count}"
                raise ValueError(together_refusal("pipeline", "quant_checkpoint", stages, f"a {quant.method} checkpoint")
                                 if quant else together_refusal("pipeline", "lora", stages, "option.enable_lora=true"))
            self.model = build_model(cls, spec, cfg.local_dir, self.comm.tp, self.dtype, self.device,
                                     load_cache_dir=cfg.load_cache_dir)
            self.num_layers, self.kv_layers = spec.num_layers, self.model.held
            if self.model.pipeline is not None:
                pipe = self.model.pipeline
                log.info("pipeline stage %d of %d: layers %d-%d of %d (rank %d, TP rank %d of %d)", pipe.index,
                         pipe.count, self.kv_layers.start, self.kv_layers.stop - 1, spec.num_layers, pipe.world_rank,
                         self.comm.tp.rank, self.comm.tp.world_size)
            self.num_kv_heads, self.head_dim = self.model.num_kv_heads, self.model.head_dim
            self.layer_options = self._layer_options()
            self.is_native = self.owns_kv = True
            if cfg.quantize in QUANTIZE_AT_LOAD and quant is None:  # else the checkpoint's method, loaded as it is
                self._quantize(cfg.quantize)
            if cfg.enable_lora:
                self._load_adapters()
            if self.device.type == "cpu":
                self._choose_cpu_linear()
            fused = select_fused_ops(self.device.type, self.device.type == "cuda" and triton_runs(self.device))
            use_fused_ops(self.model, fused)
            log.info("fused ops (residual add + RMSNorm, rotary, SiLU x mul): %s", describe_fused_ops(fused))
        elif cfg.enable_lora:
            raise ValueError(fallback_refusal("lora", spec.architecture, why))
        elif cfg.quantize:
            raise ValueError(fallback_refusal("quantize", spec.architecture, why, method=cfg.quantize))
        elif not cfg.trust_remote_code and attention_interface_supported(spec.model_type):
            self._load_hf(on_our_kv=True)  # transformers' model, our KV cache
        else:
            self._load_hf()
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self.pad_token_id = spec.pad_token_id if spec.pad_token_id is not None else 0
        elapsed = time.perf_counter() - started
        self.fallback_why = why
        how = "native" if self.is_native else \
            f"the transformers fallback{' on our KV cache' if self.owns_kv else ''}: {self.fallback_why}"
        log.info("loaded %s (%s, %s%s) in %.1f s", spec.architecture, how, self.dtype,
                 f": {cfg.dtype_why}" if cfg.dtype_why else "", elapsed)
        TIMELINE.record("weight_load", elapsed, throughput(self.weight_bytes, elapsed))
        self.comm.barrier()  # every rank holds its shard before anyone serves

    def _choose_cpu_linear(self) -> None:
        """The fastest library kernel for this CPU, this dtype and these weights, measured on the model's
        widest linear (engines/layers/cpu_linear.py), in place of every linear's weight."""
        for kind, name, times, shape in choose_cpu_linear(self.model, self.dtype, self.config.cpu_linear):
            log.info("%s", describe_cpu_linear(kind, name, times, shape))

    def _load_adapters(self) -> None:
        """option.enable_lora: the adapters served from the start registered (read and checked) on this
        rank, the first max_loras of them placed in slots 1.. (the engine's LoraSlots does the same)."""
        from engines.layers.lora import LoraAdapters

        cfg = self.config
        sources = lora_sources(cfg)
        self.lora = LoraAdapters(self.model, sources, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras,
                                 self.dtype, self.device)
        for slot, name in enumerate(list(sources)[:cfg.max_loras], start=1):
            self.lora.activate(slot, name)
        log.info("LoRA adapters (rank, slot): %s; %d slots of rank %d hold %.1f MiB on rank %d",
                 ", ".join(f"{n} (r={self.lora.ranks[n]}, slot {self.lora.slots.get(n, '-')})" for n in sources)
                 or "none yet (register them at run time)",
                 cfg.max_loras, cfg.max_lora_rank, self.lora.num_bytes / 2**20, self.comm.rank)

    # -- LoRA adapters registered at run time, placed in slots (every rank: step operations) ---------
    def register_lora(self, name: str, path: str) -> int:
        """→ its rank (ValueError / OSError: it cannot be served)."""
        return self.lora.register(name, path).rank

    def unregister_lora(self, name: str) -> None:
        self.lora.unregister(name)

    def activate_lora(self, slot: int, name: str) -> None:
        self.lora.activate(slot, name)

    def _quantize(self, method: str) -> None:
        """option.quantize: this rank's linear shards → packed low-bit weights (engines/layers/quant.py)."""
        started, before = time.perf_counter(), self.weight_bytes
        done = quantize_linears(self.model, method)
        log.info("option.quantize=%s: %d linear layers weight-only %s (the embeddings and LM head stay %s); "
                 "weights %.1f -> %.1f MiB on rank %d in %.1f s", method, done["linears"], method, self.dtype,
                 before / 2**20, self.weight_bytes / 2**20, self.comm.rank, time.perf_counter() - started)

    def _layer_options(self) -> list[LayerOptions]:
        spec = self.spec
        return [LayerOptions(spec.attention_scale, window, spec.attn_logit_softcap) for window in spec.sliding_windows]

    def _load_hf(self, on_our_kv: bool = False) -> None:
        """on_our_kv: transformers' model with its attention through our backends (hf_paged)."""
        from transformers import AutoModelForCausalLM

        if self.comm.world_size > 1:
            raise ValueError("the HF fallback path runs at tensor_parallel_degree=1 (and pipeline_parallel_degree=1) "
                             "only")
        extra = {}
        if on_our_kv:
            from engines.worker import hf_paged

            hf_paged.register()
            extra["attn_implementation"] = hf_paged.ATTN_IMPLEMENTATION
        model = AutoModelForCausalLM.from_pretrained(
            self.config.local_dir, dtype=self.dtype, trust_remote_code=self.config.trust_remote_code,
            use_safetensors=True, **extra).to(self.device).eval()
        self.num_layers, self.num_kv_heads, self.head_dim = self.spec.num_layers, self.spec.num_kv_heads, \
            self.spec.head_dim
        if on_our_kv:
            self.model = hf_paged.HFPagedModel(model, self.spec)
            self.layer_options = self.model.layers  # what transformers' attention asks for, layer by layer
            self.owns_kv = True
        else:
            self.model = model

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, on this rank (its pipeline stage's layers)."""
        return 2 * len(self.kv_layers) * self.num_kv_heads * self.head_dim * \
            torch.empty((), dtype=self.kv_dtype).element_size()

    # -- forwards ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> int:
        """One prefill before serving. On CUDA it has `num_tokens` tokens and is the profiling
        forward: → its memory peak above what is held now (activations and its own KV, freed
        again), which the KV cache must leave free. On CPU a short one warms up; → 0."""
        is_cuda = self.device.type == "cuda"
        if is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        length = num_tokens if is_cuda else min(num_tokens, CPU_WARM_UP_TOKENS)
        logits, cache = self.prefill([[self.pad_token_id] * length])
        del logits, cache
        return torch.cuda.max_memory_allocated(self.device) - before if is_cuda else 0

    @property
    def weight_bytes(self) -> int:
        return parameter_bytes(self.model)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], prompt_rows: Sequence[int] = (), lora_slots: Sequence[int] = ()) \
            -> tuple[torch.Tensor, PaddedKVCache]:
        """A new left-padded batch from prompts → (last-token logits [n, V], its cache). For each
        row in `prompt_rows` the logits of its positions 0 .. len-2 follow, in that order (they
        predict its prompt tokens 1 .. len-1). lora_slots: each row's LoRA slot (0: the base model)."""
        width = max(len(p) for p in prompts)
        pads = [width - len(p) for p in prompts]
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, pads[i]:] = torch.tensor(p, dtype=torch.long)
        cache = PaddedKVCache.empty(self.num_layers, len(prompts), self.num_kv_heads, self.head_dim, pads,
                                    width + GROW, self.dtype, self.device, self.layer_options)
        index = None
        if prompt_rows:  # flattened [B * T] indices: each row's last position, then the prompt rows' others
            index = [b * width + width - 1 for b in range(len(prompts))]
            index += [b * width + c for b in prompt_rows for c in range(pads[b], width - 1)]
            index = torch.tensor(index, dtype=torch.long, device=self.device)
        return self._forward(cache, ids.to(self.device), index, lora_slots), cache

    @torch.inference_mode()
    def decode(self, cache: PaddedKVCache, last_tokens: list[int], lora_slots: Sequence[int] = ()) -> torch.Tensor:
        """One token per row → logits [B, V]."""
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device).view(-1, 1)
        return self._forward(cache, ids, None, lora_slots)

    def _forward(self, cache: PaddedKVCache, ids: torch.Tensor, logits_index: torch.Tensor | None = None,
                 lora_slots: Sequence[int] = ()) -> torch.Tensor:
        b, t = ids.shape
        cols = torch.arange(cache.width, cache.width + t, device=self.device).view(1, -1)
        positions = (cols - cache.pads.view(-1, 1)).clamp(min=0)  # [B, T]
        lora = self.lora if any(lora_slots) else None
        if lora is not None:  # token rows [B * T], row-major: each batch row's slot T times
            lora.step.set([slot for slot in lora_slots for _ in range(t)], b * t, self.device)
        cache.begin_forward(t)
        try:
            if self.owns_kv:
                return self.model(ids, positions, cache, None, logits_index)
            return self._hf_forward(cache, ids, positions, logits_index)
        finally:
            cache.end_forward()
            if lora is not None:
                lora.step.clear()

    def _hf_forward(self, cache: PaddedKVCache, ids: torch.Tensor, positions: torch.Tensor,
                    logits_index: torch.Tensor | None) -> torch.Tensor:
        from transformers import DynamicCache

        w, t = cache.width, ids.shape[1]
        past = DynamicCache(ddp_cache_data=[(k[:, :, :w], v[:, :, :w]) for k, v in zip(cache.keys, cache.values)]) \
            if w else DynamicCache()
        cols = torch.arange(w + t, device=self.device).view(1, -1)
        mask = (cols >= cache.pads.view(-1, 1)).long()  # [B, w + t]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                         use_cache=True)
        for i, layer in enumerate(out.past_key_values.layers):
            cache.set_layer(i, layer.keys, layer.values)
        if logits_index is not None:
            return out.logits.reshape(-1, out.logits.shape[-1])[logits_index].float()
        return out.logits[:, -1].float()
