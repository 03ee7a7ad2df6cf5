"""The draft-model proposer of speculative decoding (`option.speculative_method=draft`): a second,
smaller model with the target's tokenizer runs k greedy steps per engine step and proposes their
tokens.

It runs on rank 0 only, at TP 1, with a paged KV cache of its own: its own blocks (a BlockManager
without prefix caching) and a PagedRunner's backend, buckets and forward. Per request it keeps how
many tokens of the request its cache holds. A proposal first catches up on the verified tokens it
has not seen (a new request's whole prompt; else the tokens the last step accepted, the ones past
the last verified position being overwritten; the last verified token is always recomputed), which
gives its first guess, then decodes k - 1
more, all requests batched in each forward. Its cache holds, per running request, the request's
tokens plus k: sized for max_num_seqs requests of max_model_len tokens.
"""

from __future__ import annotations

import logging

import torch

from engines.attention.step import ForwardBatch, SeqChunk
from engines.config import ModelConfig
from engines.core.block_manager import BlockManager
from engines.core.request import Request
from engines.dist import SingleProcess
from engines.sampling_params import SamplingParams
from engines.models.registry import fallback_reason
from engines.spec import ModelSpec
from engines.worker.model_runner import ModelRunner
from engines.worker.paged_runner import PagedRunner

log = logging.getLogger(__name__)

_NO_SAMPLING = SamplingParams()


class DraftProposer:
    name = "draft"

    def __init__(self, model: ModelConfig, num_tokens: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, block_size: int, attention_backend: str, target_vocab: int):
        self.num_tokens = num_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.runner = ModelRunner(model, ModelSpec.read(model.local_dir, max_model_len), SingleProcess())
        self.runner.load()
        if not self.runner.is_native:
            raise ValueError(f"option.speculative_model {model.local_dir}: the draft model must run on our model "
                             f"code, and {fallback_reason(self.runner.spec)}")
        vocab = self.runner.model.lm_head.vocab_size
        if vocab != target_vocab:
            raise ValueError(f"option.speculative_model {model.local_dir} has a vocabulary of {vocab} tokens, the "
                             f"model {target_vocab}: the draft model must share the model's tokenizer")
        self.paged = PagedRunner(self.runner)
        blocks_per_seq = -(-(max_model_len + num_tokens) // block_size)
        num_blocks = max_num_seqs * blocks_per_seq
        # a forward catches up on one whole prompt at most: the buffers take max_model_len tokens
        self.paged.allocate(num_blocks, block_size, max_num_seqs, max(max_num_batched_tokens, max_model_len),
                            attention_backend)
        self.paged.warm_up_buckets()
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self._seqs: dict[str, Request] = {}  # request id -> the draft's view: its blocks, tokens computed
        log.info("draft model %s: %d layers, KV cache of %d blocks of %d tokens (%d bytes), %d tokens proposed "
                 "per step", model.local_dir, self.runner.num_layers, num_blocks, block_size,
                 self.paged.backend.num_bytes, num_tokens)

    def drop(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq)

    @torch.inference_mode()
    def propose(self, requests: list[Request], rooms: list[int]) -> dict[str, list[int]]:
        work: list[tuple[Request, Request, int]] = []  # (request, the draft's view, proposals wanted)
        for req, room in zip(requests, rooms):
            if room < 1:
                continue
            seq = self._seqs.get(req.request_id)
            if seq is None:
                seq = self._seqs[req.request_id] = Request(req.request_id, [], _NO_SAMPLING, frozenset(), 0)
            # slots for the unseen tokens and the room - 1 guesses fed back
            if self.blocks.allocate(seq, req.num_tokens + room - 1 - seq.num_computed_tokens):
                work.append((req, seq, room))
        guesses: dict[str, list[int]] = {req.request_id: [] for req in requests}
        for group in self._catch_up_groups(work):
            chunks, last = [], []
            for req, seq, _ in group:
                tokens, start = req.all_token_ids, seq.num_computed_tokens
                n = len(tokens) - start  # a few tokens after a verification: decode rows, not a prefill
                chunks.append(SeqChunk(start, n, seq.block_ids, tokens[start:], speculative=n <= self.num_tokens + 1))
                last.append(sum(c.num_tokens for c in chunks) - 1)
                # verified tokens but the last, recomputed next time (the guesses past it are overwritten):
                # a request whose guesses went unverified (not scheduled) still has one token to compute
                seq.num_computed_tokens = len(tokens) - 1
            logits = self.paged.forward(ForwardBatch(chunks, last))
            for (req, _, _), token in zip(group, logits.argmax(dim=-1).tolist()):
                guesses[req.request_id].append(token)
        for j in range(1, max((room for _, _, room in work), default=0)):
            batch = [(req, seq) for req, seq, room in work if room > j]
            chunks = [SeqChunk(req.num_tokens + j - 1, 1, seq.block_ids, [guesses[req.request_id][-1]])
                      for req, seq in batch]
            logits = self.paged.forward(ForwardBatch(chunks, list(range(len(batch)))))
            for (req, _), token in zip(batch, logits.argmax(dim=-1).tolist()):
                guesses[req.request_id].append(token)
        return guesses

    def _catch_up_groups(self, work: list[tuple[Request, Request, int]]):
        """The catch-up forwards: requests in order, at most max_num_batched_tokens tokens a forward
        (one request's prompt alone may be longer)."""
        group, size = [], 0
        for item in work:
            n = item[0].num_tokens - item[1].num_computed_tokens
            if group and size + n > self.max_num_batched_tokens:
                yield group
                group, size = [], 0
            group.append(item)
            size += n
        if group:
            yield group
