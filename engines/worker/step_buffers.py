"""The inputs of a forward, in persistent buffers sized once at start and written in place.

Every step (a plan's, a multi-step run's, the draft model's) is described by a ForwardBatch: the
chunk of each sequence it computes and the token rows whose logits are wanted. `write` puts it into
host buffers and copies the parts used to the device buffers, which the model, the attention
metadata and the captured decode graphs read as views: the eager, compiled and graph paths all run
on the same buffers, filled by the same code.

    host (pinned on CUDA; two sets, used in turn: a set is rewritten once the copies out of it have run)
        │  one non_blocking copy per section, of the part the step uses
        ▼
    device   input_ids [T] positions [T] slot_mapping [T] logits_indices [T]      (int64)
             query_start [S + 1] seq_lens [S] block_table [S, W]                  (int32)

    T = max tokens a step computes, S = max sequences, W = max blocks of one sequence.

A step's tokens are padded to a bucket (few shapes: CPU kernels and CUDA graphs are per shape):

    mixed step:   tokens [ a a a a | b | c c | pad pad pad ]   sequences a, b, c      (S = 3)
    decode step:  tokens [ a | b | c | pad ]                   sequences a, b, c, pad (S = 4)

Padding always points somewhere valid: a pad token has id 0 and position 0 and writes its K/V to
the scratch slot (the scratch block, past the requests' blocks); a pad sequence of a decode step
has context length 1 and a block-table row of the scratch block. Block-table entries past a
sequence's blocks keep whatever ids were there (valid ids: a kernel may gather them; the context
length masks them).

A chunk's last token may be fed on the device from the previous step's sampled tokens (async
scheduling, multi-step decode: the host does not have it yet): `fed_row` names its row there.
"""

from __future__ import annotations

import numpy as np
import torch

from engines.attention.step import ForwardBatch, StepView, bucket, token_buckets
from engines.devices import to_device


class _Buffers:
    """One set of the step's tensors (host or device)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device, pin: bool):
        def make(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        with torch.inference_mode(False):  # ordinary tensors: graphs and compiled steps read them
            self.ints = make((4, max_tokens), torch.int64)  # input ids, positions, slots, logits indices
            self.query_start = make(max_seqs + 1, torch.int32)
            self.seq_lens = make(max_seqs, torch.int32)
            self.block_table = make((max_seqs, max_blocks), torch.int32)
        self.input_ids, self.positions, self.slot_mapping, self.logits_indices = self.ints.unbind(0)
        self.copied: torch.cuda.Event | None = None  # a host set: its last copies to the device, once run


class StepBuffers:
    # staged: host sets copied to a separate device set. On CUDA always; on a CPU only in the tests,
    # which thereby run the copies a GPU runs (a section left uncopied would fail there too)
    STAGE_ON_CPU = False

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, scratch_block: int,
                 device: torch.device):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        self.token_buckets = token_buckets(max_tokens)
        self.decode_buckets = token_buckets(max_seqs)
        self.width_buckets = token_buckets(max_blocks)
        self.device_set = _Buffers(max_tokens, max_seqs, max_blocks, device, pin=False)
        if device.type == "cpu" and not self.STAGE_ON_CPU:  # the host set is the device set: nothing to copy
            self._host_sets = [self.device_set]
        else:
            self._host_sets = [_Buffers(max_tokens, max_seqs, max_blocks, torch.device("cpu"),
                                        pin=device.type == "cuda") for _ in range(2)]
        self._num_writes = 0

    @property
    def scratch_slot(self) -> int:
        return self.scratch_block * self.block_size

    def step_size(self, batch: ForwardBatch) -> int:
        """Tokens the step runs: its own padded to a bucket (decode steps: a bucket of max_num_seqs)."""
        buckets = self.decode_buckets if batch.is_decode_only else self.token_buckets
        return bucket(buckets, batch.num_tokens)

    def write(self, batch: ForwardBatch, fed_tokens: torch.Tensor | None = None) -> StepView:
        """Put the batch into the buffers (host, then device) → the view a forward runs on.
        fed_tokens: the previous step's sampled ids on the device, for chunks with fed_row >= 0."""
        size = self.step_size(batch)
        n = batch.num_tokens
        if size > self.max_tokens or len(batch.chunks) > self.max_seqs:
            raise ValueError(f"a step of {n} tokens in {len(batch.chunks)} sequences exceeds the buffers "
                             f"({self.max_tokens} tokens, {self.max_seqs} sequences)")
        host = self._host_sets[self._num_writes % len(self._host_sets)]
        self._num_writes += 1
        if host.copied is not None:  # the device may lag the host by steps (a multi-step run): its
            host.copied.synchronize()  # copies out of this set must have run before it is rewritten
        decode_only = batch.is_decode_only
        num_seqs = size if decode_only else len(batch.chunks)  # a decode step's pads are sequences
        ids, positions, slots, lens, starts, fed = self._flatten(batch, size, num_seqs)
        width = 1
        table = host.block_table.numpy()
        for i, chunk in enumerate(batch.chunks):
            nb = -(-chunk.context_len // self.block_size)
            table[i, :nb] = chunk.block_ids[:nb]
            width = max(width, nb)
        table[len(batch.chunks):num_seqs, 0] = self.scratch_block
        # a decode step's logits rows: all of its bucket's (a captured graph reads as many, whatever
        # this step wants: a stale index from a larger step would point past its tokens)
        rows = size if decode_only else bucket(self.decode_buckets, len(batch.logits_rows)) if batch.logits_rows else 0
        hi = host.ints.numpy()
        hi[0, :size], hi[1, :size], hi[2, :size] = ids, positions, slots
        hi[3, :rows] = batch.logits_rows + [0] * (rows - len(batch.logits_rows))
        host.query_start.numpy()[:num_seqs + 1] = starts
        host.seq_lens.numpy()[:num_seqs] = lens
        dev = self.device_set
        if host is not dev:
            width_used = bucket(self.width_buckets, width)
            dev.ints[:, :size].copy_(host.ints[:, :size], non_blocking=True)
            dev.query_start[:num_seqs + 1].copy_(host.query_start[:num_seqs + 1], non_blocking=True)
            dev.seq_lens[:num_seqs].copy_(host.seq_lens[:num_seqs], non_blocking=True)
            dev.block_table[:num_seqs, :width_used].copy_(host.block_table[:num_seqs, :width_used], non_blocking=True)
            if self.device.type == "cuda":
                host.copied = torch.cuda.Event()
                host.copied.record()
        if fed:
            if fed_tokens is None:
                raise ValueError("a chunk's last token is fed from the previous step, which sampled nothing")
            dst = to_device([d for d, _ in fed], self.device, torch.long)
            src = to_device([s for _, s in fed], self.device, torch.long)
            dev.input_ids.index_copy_(0, dst, fed_tokens.index_select(0, src))
        return StepView(size, num_seqs, rows, width, decode_only, dev.input_ids[:size], dev.positions[:size],
                        dev.slot_mapping[:size], dev.logits_indices[:rows], dev.query_start[:num_seqs + 1],
                        dev.seq_lens[:num_seqs], dev.block_table[:num_seqs], batch.chunks)

    def _flatten(self, batch: ForwardBatch, size: int, num_seqs: int):
        """Host lists of the step: token ids, positions, slots (padded to `size`), context lengths
        and query starts (padded to `num_seqs`), and the (token index, fed row) pairs."""
        bs, scratch = self.block_size, self.scratch_slot
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        starts: list[int] = [0]
        fed: list[tuple[int, int]] = []
        for chunk in batch.chunks:
            end = chunk.context_len
            if chunk.fed_row >= 0:
                fed.append((len(ids) + chunk.num_tokens - 1, chunk.fed_row))
                ids += chunk.token_ids + [0]
            else:
                ids += chunk.token_ids
            if len(ids) != starts[-1] + chunk.num_tokens:
                raise ValueError(f"a chunk of {chunk.num_tokens} tokens came with {len(chunk.token_ids)} token ids")
            if chunk.num_tokens == 1:
                p = chunk.start
                positions.append(p)
                slots.append(chunk.block_ids[p // bs] * bs + p % bs)
            else:
                pos = np.arange(chunk.start, end)
                positions += pos.tolist()
                slots += (np.asarray(chunk.block_ids)[pos // bs] * bs + pos % bs).tolist()
            lens.append(end)
            starts.append(len(ids))
        pad = size - len(ids)
        ids += [0] * pad
        positions += [0] * pad
        slots += [scratch] * pad
        num_pads = num_seqs - len(batch.chunks)  # decode steps: one pad token per pad sequence
        lens += [1] * num_pads
        starts += range(starts[-1] + 1, starts[-1] + 1 + num_pads)
        return ids, positions, slots, lens, starts, fed

    def static_view(self, num_rows: int) -> StepView:
        """The view of a decode step of `num_rows` rows at the buffers' full width, whatever they
        hold: what a captured graph reads at every replay."""
        dev = self.device_set
        return StepView(num_rows, num_rows, num_rows, self.max_blocks, True, dev.input_ids[:num_rows],
                        dev.positions[:num_rows], dev.slot_mapping[:num_rows], dev.logits_indices[:num_rows],
                        dev.query_start[:num_rows + 1], dev.seq_lens[:num_rows], dev.block_table[:num_rows])

    def check(self, view: StepView, num_blocks: int, vocab_size: int) -> None:
        """AssertionError unless every index a forward reads from the view is in range (tests):
        tokens, slots, positions, logits rows, and each sequence's context and blocks."""
        if view.decode_only:  # what the bucket's graph reads
            view = self.static_view(view.num_seqs)
        t, s = view.num_tokens, view.num_seqs
        ids, slots, rows = view.input_ids.tolist(), view.slot_mapping.tolist(), view.logits_indices.tolist()
        starts, lens = view.query_start.tolist(), view.seq_lens.tolist()
        table = view.block_table.tolist()
        _expect(all(0 <= i < vocab_size for i in ids), f"token ids out of range: {ids}")
        _expect(all(0 <= x < (num_blocks + 1) * self.block_size for x in slots), f"slots out of range: {slots}")
        _expect(all(0 <= r < t for r in rows), f"logits rows out of range: {rows}")
        _expect(starts[0] == 0 and all(a <= b for a, b in zip(starts, starts[1:])) and starts[-1] <= t,
                f"query starts {starts} for {t} tokens")
        for i in range(s):
            n, blocks = starts[i + 1] - starts[i], table[i][:-(-lens[i] // self.block_size)]
            _expect(1 <= n <= lens[i], f"sequence {i}: {n} query tokens, context {lens[i]}")
            _expect(all(0 <= b <= num_blocks for b in table[i]), f"sequence {i}: block table {table[i]}")
            _expect(all(b < num_blocks for b in blocks) or blocks == [self.scratch_block],
                    f"sequence {i} reads the scratch block among its own: {blocks}")


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
