"""Mixture-of-experts decoders, Mixtral and Qwen2-MoE: the Llama family's decoder (llama.py) with
the MLP replaced by a sparse block of SiLU-gated experts.

    router (replicated) → softmax in float32 → top-k experts per token → Σ weight · expert(x)
    (+ Qwen2-MoE: a shared expert, gated by sigmoid(shared_expert_gate(x)))

Tensor parallelism splits every expert's intermediate dimension over the ranks, as the dense MLP's
column/row-parallel pair does (gate/up by rows, down by columns): each rank sums its partial
outputs of the routed experts and of the shared expert, and one all-reduce per layer completes them.
Mixtral always renormalises the top-k weights and weighs the experts in float32; Qwen2-MoE
renormalises only with `norm_topk_prob` and rounds the weights to the activations' dtype first
(as transformers does). Qwen2-MoE's layers listed in `mlp_only_layers`, or off its
`decoder_sparse_step`, have a dense MLP; its q/k/v carry biases (`qkv_bias`, default true).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engines.dist import Communicator
from engines.layers.fused import UsesFusedOps
from engines.layers.linear import SliceReader, linear, shard_range
from engines.models.llama import MLP, DecoderLayer, LlamaForCausalLM

# Checkpoint names, after "model.layers.N.": the MoE block (Mixtral `block_sparse_moe`, Qwen2-MoE
# `mlp`), then `gate` (the router), `experts.E.<projection>`, and Qwen2-MoE's `shared_expert.*`
# and `shared_expert_gate`. transformers 5's save_pretrained writes these hub names too.
MOE_NAME = re.compile(r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\.(.+)\.weight")
EXPERT_NAME = re.compile(r"experts\.(\d+)\.(\w+)")
EXPERT_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down",  # Mixtral
                      "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}  # Qwen2-MoE


class SparseMoE(UsesFusedOps, nn.Module):
    """Top-k routed SwiGLU experts (+ an optional gated shared expert), all-reduced once."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, comm: Communicator,
                 *, renormalize: bool, float32_weights: bool, shared_intermediate_size: int | None = None):
        super().__init__()
        self.comm = comm
        self.top_k = top_k
        self.renormalize = renormalize
        self.float32_weights = float32_weights
        self.intermediate_size = intermediate_size  # all ranks'
        lo, hi = shard_range(intermediate_size, comm.rank, comm.world_size)
        self.router = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)  # replicated
        # this rank's slice of each expert: [E, 2 I/tp, H] (gate rows, then up rows) and [E, H, I/tp]
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * (hi - lo), hidden_size), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, hi - lo), requires_grad=False)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = MLP(hidden_size, shared_intermediate_size, comm)  # its down_proj's weight only
            self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, H]
        weights, experts = self.route(x)  # [N, k] each
        if x.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph: no host sync in it
            out = self.run_all_experts(x, weights, experts)
        else:
            out = self.run_experts(x, weights, experts)
        if self.shared_expert is not None:  # its partial sum joins the experts' before the one all-reduce
            shared = linear(self.fused.silu_and_mul(self.shared_expert.gate_up_proj(x)), self.shared_expert.down_proj.weight)
            out = out + torch.sigmoid(linear(x, self.shared_expert_gate)) * shared
        return self.comm.all_reduce(out).view(shape)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] → (each token's top-k expert weights [N, k], their expert ids [N, k])."""
        probs = torch.softmax(linear(x, self.router).float(), dim=-1)  # [N, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), experts

    @torch.compiler.disable  # option.cpu_compile: the loop's trip counts are data, a graph break
    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each token through its k experts, the tokens grouped by expert (one GEMM pair per expert
        hit): → this rank's partial Σ weight · expert(x) [N, H], in x's dtype, experts added in order."""
        flat = experts.flatten()  # [N k]: token-major
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k  # the token of each (token, slot) pair, grouped by expert
        pair_weights = weights.flatten()[order]
        counts = torch.bincount(flat, minlength=self.router.shape[0]).tolist()  # the layer's one host sync
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[start:start + count]
                h = self.fused.silu_and_mul(linear(x[rows], self.gate_up[expert]))
                y = linear(h, self.down[expert]) * pair_weights[start:start + count, None]
                out.index_add_(0, rows, y.to(x.dtype))
                start += count
        return out

    def run_all_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """run_experts with static shapes and no host sync, for a captured decode step (a replay must
        follow each step's routing): every expert on every token, weighted 0 where not chosen, at
        E/k times the FLOPs, which decode batches afford. → the same partial sum [N, H]."""
        dense = torch.zeros(x.shape[0], self.router.shape[0], dtype=weights.dtype, device=x.device)
        dense.scatter_(1, experts, weights)  # [N, E]
        h = self.fused.silu_and_mul(torch.matmul(x, self.gate_up.transpose(1, 2)))  # [E, N, I/tp]
        y = torch.matmul(h, self.down.transpose(1, 2)) * dense.t().unsqueeze(-1)  # [E, N, H]
        return y.to(x.dtype).sum(dim=0)

    # -- loading ---------------------------------------------------------------------------------
    def load_weight(self, name: str, shape: list[int], get: SliceReader) -> bool:
        """One tensor of the block (its name after the block's prefix, less ".weight") into its shard."""
        if name == "gate":
            self.router.data.copy_(get((slice(None),)))
        elif name == "shared_expert_gate" and self.shared_expert_gate is not None:
            self.shared_expert_gate.data.copy_(get((slice(None),)))
        elif name.startswith("shared_expert.") and self.shared_expert is not None:
            return self.shared_expert.load_weight(name.removeprefix("shared_expert."), "weight", shape, get)
        elif (match := EXPERT_NAME.fullmatch(name)) and match[2] in EXPERT_PROJECTIONS:
            self._load_expert(int(match[1]), EXPERT_PROJECTIONS[match[2]], get)
        else:
            return False
        return True

    def _load_expert(self, expert: int, role: str, get: SliceReader) -> None:
        lo, hi = shard_range(self.intermediate_size, self.comm.rank, self.comm.world_size)
        local = hi - lo
        if role == "down":  # [H, I]: this rank's columns
            self.down.data[expert].copy_(get((slice(None), slice(lo, hi))))
        else:  # [I, H]: this rank's rows, gate first
            at = 0 if role == "gate" else local
            self.gate_up.data[expert, at:at + local].copy_(get((slice(lo, hi),)))


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral (MixtralForCausalLM) and Qwen2-MoE (Qwen2MoeForCausalLM)."""

    def make_layer(self, idx: int) -> DecoderLayer:
        spec, cfg, comm = self.spec, self.spec.config, self.comm
        if spec.model_type == "mixtral":
            moe = SparseMoE(spec.hidden_size, cfg["num_local_experts"], cfg["num_experts_per_tok"],
                            spec.intermediate_size, comm, renormalize=True, float32_weights=True)
            return DecoderLayer(idx, spec, self.rotary, comm, moe)
        # Qwen2-MoE: sparse layers every `decoder_sparse_step`, except `mlp_only_layers` (dense)
        is_sparse = (idx not in (cfg.get("mlp_only_layers") or []) and cfg["num_experts"] > 0
                     and (idx + 1) % cfg.get("decoder_sparse_step", 1) == 0)
        if is_sparse:
            mlp = SparseMoE(spec.hidden_size, cfg["num_experts"], cfg["num_experts_per_tok"],
                            cfg["moe_intermediate_size"], comm, renormalize=bool(cfg.get("norm_topk_prob")),
                            float32_weights=False, shared_intermediate_size=cfg["shared_expert_intermediate_size"])
        else:
            mlp = MLP(spec.hidden_size, spec.intermediate_size, comm)
        return DecoderLayer(idx, spec, self.rotary, comm, mlp, qkv_bias=bool(cfg.get("qkv_bias", True)))

    def load_weight(self, name: str, shape: list[int], get: SliceReader) -> bool:
        """The MoE blocks' tensors here; everything else (and dense layers' MLPs) as Llama's."""
        match = MOE_NAME.fullmatch(name.removeprefix("model."))
        moe = self.layers[int(match[1])].mlp if match and int(match[1]) < len(self.layers) else None
        if isinstance(moe, SparseMoE):
            return moe.load_weight(match[2], shape, get)
        return super().load_weight(name, shape, get)
