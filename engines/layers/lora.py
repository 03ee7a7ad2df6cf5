"""LoRA adapters for our model code: PEFT adapters read from disk, held in per-linear slot banks, and
their deltas added for a batch whose rows use different adapters (the punica / S-LoRA idea: no
merged copies of the model, no per-request weights).

    adapter = read_peft_adapter(path)                 # adapter_config.json + adapter_model.safetensors
    banks = LoraBanks(model, max_loras, max_rank, dtype, device)   # a bank per decoder linear
    banks.load(slot, adapter)                         # slot 1 .. max_loras (0: no adapter, all zeros)
    adapters = LoraAdapters(model, sources, ...)      # a rank's registry: banks hooked in, LRU in RAM
    step.set(row_slots, num_rows, device)             # each token row's slot, for one forward
    y += bank.delta(x, step)

For a linear W an adapter adds  Δy = (x Aᵀ) Bᵀ · scaling  with A [r, in], B [out, r],
scaling = lora_alpha / r (lora_alpha / √r with use_rslora), folded into B at load. A bank holds all
S = max_loras + 1 slots (slot 0: zeros, the base model), each W = P·R wide (P fused parts, R =
max_rank, ranks zero-padded):

    column-parallel (fused parts p = q, k, v or gate, up):
        A  [S, W, in]                  slot s, part p: rows p·R .. of A[s]
        Bt [S, W, out_local]           Bᵀ: part p's output columns read only its own R rows
    row-parallel (o, down):  P = 1
        A  [S, W, in_local]            this rank's input columns
        Bt [S, W, out]                 whole: each rank's partial delta joins the all-reduce with the
                                       partial product, since B·Σ(x_s A_sᵀ) = Σ B·(x_s A_sᵀ)

A step's delta is segment-grouped (punica's SGMV, in plain batched matmuls): the rows of each slot
from the lowest to the highest the step uses are gathered into one segment each, padded to the
longest, and two bmm over the segments give each row its own adapter's delta only; the products go
back to their rows (index_copy). Four ops per linear whatever the mix, and work in proportion to the
rows (plus padding), not to the adapters loaded. On CPU a C kernel (engines/kernels/cpu_lora.c) does
the same segment by segment, adding into the linear's output in place and skipping the padding; the
batched matmuls are its twin and the path on CUDA and in compiled steps. A column-parallel shard takes the rows of B the
base weight's shard takes (q: its heads; k/v: the KV heads this rank holds, replicated when there
are fewer than ranks); A whole. A part an adapter does not target stays zero.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from engines.devices import to_device
from engines.kernels import cpu_lora

# HF module name → (owner, our module, fused part or None)
TARGETS = {"q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
           "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", None),
           "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
           "down_proj": ("mlp", "down_proj", None)}
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.default)?\.weight$")


@dataclass
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    # (layer, HF module name) → (A [r, in], B [out, r]) in float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_peft_adapter(path: str, name: str | None = None) -> LoraAdapter:
    """A PEFT LoRA adapter directory → LoraAdapter; anything it cannot serve exactly is refused naming
    the field (bias training, extra trained modules, DoRA, per-module ranks, fan-in/fan-out layout)."""
    from safetensors.torch import load_file

    name = name or os.path.basename(os.path.normpath(path))
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    problems = [f"{key}={cfg.get(key)!r}" for key, ok in (
        ("peft_type", lambda v: v in (None, "LORA")), ("bias", lambda v: v in (None, "none")),
        ("modules_to_save", lambda v: not v), ("use_dora", lambda v: not v), ("fan_in_fan_out", lambda v: not v),
        ("rank_pattern", lambda v: not v), ("alpha_pattern", lambda v: not v)) if not ok(cfg.get(key))]
    if problems:
        raise ValueError(f"LoRA adapter {name!r} ({path}): {', '.join(problems)} in adapter_config.json is not "
                         "supported; adapters with plain LoRA weights on the attention and MLP projections are")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    adapter = LoraAdapter(name, rank, scaling)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if not m or m.group(3) not in TARGETS or TARGETS[m.group(3)][0] != m.group(2):
            raise ValueError(f"LoRA adapter {name!r}: {key} targets a module lmi-serve does not adapt (it adapts "
                             f"{', '.join(TARGETS)} of the decoder layers)")
        pairs.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = t.float()
    for where, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {where[0]} {where[1]} has lora_{''.join(ab)} alone")
        adapter.weights[where] = (ab["A"], ab["B"])
    return adapter


class LoraBank(nn.Module):
    """One linear's slots (see the module docstring): A [S, W, in] and Bt [S, W, out], W = P·R."""

    def __init__(self, linear: nn.Module, max_loras: int, max_rank: int, rows: list[tuple[int, int] | None],
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        weight = linear.weight  # a tensor, or option.quantize's packed module
        out, k = (weight.out_features, weight.in_features) if isinstance(weight, nn.Module) else weight.shape
        self.row_parallel = not hasattr(linear, "part_sizes")
        self.part_sizes = [out] if self.row_parallel else list(linear.part_sizes)
        self.rows = rows  # per part: this rank's rows of the full part (None: all)
        self.max_rank = max_rank
        width = len(self.part_sizes) * max_rank  # columns of one slot
        self.A = nn.Parameter(torch.zeros(max_loras + 1, width, k, dtype=dtype, device=device), requires_grad=False)
        self.Bt = nn.Parameter(torch.zeros(max_loras + 1, width, out, dtype=dtype, device=device), requires_grad=False)

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, cols: tuple[int, int] | None) -> None:
        """A [r, in_full], B [out_full_part, r] (scaling folded in) into `slot`'s part."""
        r = a.shape[0]
        start = sum(self.part_sizes[:part])
        lo, hi = self.rows[part] or (0, b.shape[0])
        a = a[:, cols[0]:cols[1]] if cols else a
        first = part * self.max_rank
        self.A.data[slot, first:first + r].copy_(a)
        self.Bt.data[slot, first:first + r, start:start + self.part_sizes[part]].copy_(b[lo:hi].T)

    def clear(self, slot: int) -> None:
        self.A.data[slot].zero_()
        self.Bt.data[slot].zero_()

    def delta(self, x: torch.Tensor, step: "LoraStep") -> torch.Tensor:
        """x [N, in] → Δy [N, out]: the rows of each slot in the step's range gathered into one padded
        segment each, two batched matmuls over the segments, the products put back in row order
        (padding rows and the base model's rows get zeros)."""
        lo, hi = step.lo, step.hi
        seg, src, dest = step.segments(x.shape[0])
        xs = x.index_select(0, src).view(hi - lo, seg, x.shape[1])  # [k, G, in]
        d = torch.bmm(torch.bmm(xs, self.A[lo:hi].transpose(1, 2)), self.Bt[lo:hi])  # [k, G, out]
        out = x.new_zeros(x.shape[0] + 1, d.shape[2])  # the last row takes the padding's products
        out.index_copy_(0, dest, d.view(-1, d.shape[2]))
        return out[:-1]


class LoraBanks:
    """A bank for every adapted linear of the decoder layers (Llama-style: self_attn.qkv_proj/o_proj,
    mlp.gate_up_proj/down_proj), shaped like this rank's shards."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.banks: dict[tuple[int, str], LoraBank] = {}
        for i, layer in enumerate(model.layers):
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if not hasattr(attn, "qkv_proj") or not hasattr(mlp, "gate_up_proj"):
                raise ValueError(f"LoRA adapters run on Llama-style decoder layers (self_attn.qkv_proj, "
                                 f"mlp.gate_up_proj); {type(model).__name__} layer {i} is not one")
            comm = attn.qkv_proj.comm
            q_rows = _shard(attn.qkv_proj.part_sizes[0] * comm.world_size, comm)
            kv_rows = attn.kv_rows or _shard(attn.kv_size, comm)  # a replicated KV head's rows, or the shard's
            gate = _shard(mlp.gate_up_proj.part_sizes[0] * comm.world_size, comm)
            for name, linear, rows in (("qkv_proj", attn.qkv_proj, [q_rows, kv_rows, kv_rows]),
                                       ("o_proj", attn.o_proj, [None]),
                                       ("gate_up_proj", mlp.gate_up_proj, [gate, gate]),
                                       ("down_proj", mlp.down_proj, [None])):
                self.banks[(i, name)] = LoraBank(linear, max_loras, max_rank, rows, dtype, device)
        self.comm = comm

    def check(self, adapter: LoraAdapter) -> None:
        """ValueError unless the adapter fits these banks (its rank, its layers)."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above option.max_lora_rank="
                             f"{self.max_rank}")
        for layer, module in adapter.weights:
            if (layer, TARGETS[module][1]) not in self.banks:
                raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer} is past the model's "
                                 f"{len(self.banks) // 4} layers")

    def clear(self, slot: int) -> None:
        for bank in self.banks.values():
            bank.clear(slot)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside 1..{self.max_loras}")
        self.check(adapter)
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            _, ours, part = TARGETS[module]
            bank = self.banks[(layer, ours)]
            cols = _shard(a.shape[1], self.comm) if bank.row_parallel else None
            bank.load(slot, part or 0, a, b * adapter.scaling, cols)


def _shard(size: int, comm) -> tuple[int, int] | None:
    if comm.world_size == 1:
        return None
    part = size // comm.world_size
    return comm.rank * part, (comm.rank + 1) * part


class LoraStep:
    """Which token rows of the forward running now use which slot (set by the model runner around
    each forward; `active` False: no row uses an adapter, nothing to add), as segments: slots lo..hi-1
    each get `segment` rows, src[i] the token row gathered into position i (padding: row 0) and
    dest[i] where its product goes (padding: N, a row that is dropped).

    Captured decode steps (CUDA graphs, torch.compile) need shapes that do not change with the mix:
    the static form gives every slot 1..max_loras a segment of the bucket's size, its row indices
    written into persistent buffers before each replay (`write_static`) and read through the same
    buffers the capture saw (`use_static`), sliced in the forward by its row count, so that a compiled
    step takes the rows as a symbol (one graph for every bucket) rather than a constant of the module:

        slots   1        2        3             rows = 4 (a decode bucket), max_loras = 3
        src   [2 0 0 0 | 0 0 0 0 | 1 3 0 0]     rows 0 base, 1 and 3 slot 3, 2 slot 1
        dest  [2 4 4 4 | 4 4 4 4 | 1 3 4 4]
    """

    def __init__(self, max_loras: int = 0):
        self.max_loras = max_loras
        self.active = self.static = False
        self.lo = self.hi = self.segment = 0
        self.src = self.dest = None
        self.static_src = self.static_dest = None

    def clear(self) -> None:
        self.active = False

    def set(self, row_slots: list[int], num_rows: int, device: torch.device) -> None:
        """row_slots: the slot (0: the base model) of each of the first token rows of the step's
        `num_rows` (the rest: padding); at least one row uses an adapter."""
        self.active, self.static = True, False
        rows: dict[int, list[int]] = {}
        for i, slot in enumerate(row_slots):
            if slot:
                rows.setdefault(slot, []).append(i)
        self.lo, self.hi = min(rows), max(rows) + 1
        self.segment = max(len(r) for r in rows.values())
        n = num_rows
        src, dest = [], []
        for slot in range(self.lo, self.hi):
            r = rows.get(slot, [])
            src += r + [0] * (self.segment - len(r))
            dest += r + [n] * (self.segment - len(r))
        self.src, self.dest = to_device(src, device, torch.long), to_device(dest, device, torch.long)

    def allocate_static(self, max_rows: int, device: torch.device) -> None:
        self.static_src = torch.zeros(self.max_loras * max_rows, dtype=torch.long, device=device)
        self.static_dest = torch.zeros(self.max_loras * max_rows, dtype=torch.long, device=device)

    def write_static(self, row_slots: list[int], rows: int) -> None:
        """The static form's indices for a step of `rows` token rows (row_slots: the first ones' slots,
        the rest padding), into the persistent buffers."""
        src, dest = [0] * (self.max_loras * rows), [rows] * (self.max_loras * rows)
        filled = [0] * (self.max_loras + 1)
        for i, slot in enumerate(row_slots):
            if slot:
                at = (slot - 1) * rows + filled[slot]
                src[at] = dest[at] = i
                filled[slot] += 1
        n = len(src)
        self.static_src[:n].copy_(torch.tensor(src, dtype=torch.long))
        self.static_dest[:n].copy_(torch.tensor(dest, dtype=torch.long))

    def segments(self, num_rows: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(segment, src, dest) for a forward of `num_rows` token rows; the static form's segment is
        the row count, read off the forward's input (a symbol when compiled, not a module constant)."""
        if not self.static:
            return self.segment, self.src, self.dest
        n = (self.hi - self.lo) * num_rows
        return num_rows, self.static_src[:n], self.static_dest[:n]

    def use_static(self) -> None:
        """Run the next forward in the static form, over the persistent buffers."""
        self.active = self.static = True
        self.lo, self.hi = 1, self.max_loras + 1


class LoraHook:
    """What an adapted linear calls (kept in its __dict__, outside the module tree, so that the model's
    parameters, state dict and load order stay as they are)."""

    def __init__(self, bank: LoraBank, step: LoraStep):
        self.bank, self.step = bank, step

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the linear's output for x) with each row's adapter delta added: in place by the CPU
        kernel where it runs, else y + the batched matmuls' delta."""
        if not self.step.active:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if cpu_lora.runs(flat_x, flat_y):
            cpu_lora.add_delta(flat_x, flat_y, self.bank.A, self.bank.Bt, self.step)
            return y
        return y + self.bank.delta(flat_x, self.step).view_as(y)


class LoraAdapters:
    """This rank's adapters: every one registered (name → its PEFT directory), the most recently used
    `max_cpu_loras` kept read in RAM, and the ones the scheduler placed in device slots loaded in the
    banks, which are hooked into the model's linears. slots: name → slot (resident ones)."""

    def __init__(self, model: nn.Module, sources: dict[str, str], max_loras: int, max_rank: int,
                 max_cpu_loras: int, dtype: torch.dtype, device: torch.device):
        self.banks = LoraBanks(model, max_loras, max_rank, dtype, device)
        self.max_cpu_loras = max_cpu_loras
        self.sources: dict[str, str] = {}
        self.ranks: dict[str, int] = {}
        self.slots: dict[str, int] = {}
        self._cpu: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        for name, path in sources.items():
            self.register(name, path)
        self.step = LoraStep(max_loras)
        for (layer, module), bank in self.banks.banks.items():
            owner = model.layers[layer].self_attn if module in ("qkv_proj", "o_proj") else model.layers[layer].mlp
            getattr(owner, module).__dict__["lora"] = LoraHook(bank, self.step)

    def register(self, name: str, path: str) -> LoraAdapter:
        """Read and check the adapter (ValueError / OSError naming what is wrong) and keep it in RAM."""
        adapter = read_peft_adapter(path, name)
        self.banks.check(adapter)
        self.sources[name], self.ranks[name] = path, adapter.rank
        self._keep(adapter)
        return adapter

    def unregister(self, name: str) -> None:
        self.sources.pop(name)
        self.ranks.pop(name)
        self._cpu.pop(name, None)
        slot = self.slots.pop(name, None)
        if slot is not None:
            self.banks.clear(slot)

    def activate(self, slot: int, name: str) -> None:
        """Load a registered adapter into `slot` (whatever held it leaves the device)."""
        adapter = self._cpu.get(name)
        if adapter is None:  # beyond max_cpu_loras: read again
            adapter = read_peft_adapter(self.sources[name], name)
        self._keep(adapter)
        for held, s in list(self.slots.items()):
            if s == slot:
                del self.slots[held]
        self.banks.load(slot, adapter)
        self.slots[name] = slot

    def _keep(self, adapter: LoraAdapter) -> None:
        self._cpu[adapter.name] = adapter
        self._cpu.move_to_end(adapter.name)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)

    @property
    def num_bytes(self) -> int:
        return sum(b.A.numel() * b.A.element_size() + b.Bt.numel() * b.Bt.element_size()
                   for b in self.banks.banks.values())
