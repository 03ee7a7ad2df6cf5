"""Grammar-constrained decoding on llguidance (docs/structured-output.md; why llguidance: docs/decisions.md).

A constrained request carries its grammar in SamplingParams.grammar (llguidance's grammar text, made
and validated by the HTTP worker from response_format / guided_* / TGI's grammar / tools). On the
rank that samples, `Grammars` keeps

- the tokenizer as llguidance reads it (the model's tokenizer.json, loaded at the first constrained
  request), with the vocabulary as wide as the model's logits;
- compiled grammars, by text (LRU): a new request's matcher is a copy of the compiled one;
- each constrained request's matcher, advanced with every token it emits;
- the allowed-token bitmasks of the next step ([n, ceil(V / 32)] int32, bit t of a row: token t is
  allowed): computed on a thread right after the tokens are consumed, so that they are ready when
  the next step's logits are, the work overlapping that step's forward (llguidance computes without
  the GIL). A request whose mask is not ready (it just arrived) has it computed when sampled.

Speculative decoding: the matcher is advanced through the proposal to give a mask at each proposed
position (a proposal the grammar refuses is cut there), then rolled back past the rejected tokens.

`apply_bitmask` is plain torch over the logits' device (the same code on CPU and CUDA).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)

COMPILED_CACHE_SIZE = 256  # grammars kept compiled (a chat app sends the same schemas again and again)


def bitmask_width(vocab: int) -> int:
    return (vocab + 31) // 32


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [n, W] int32 → [n, vocab] bool (True: allowed)."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [n, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                  fallback: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] with rows `rows` [n] masked by `bitmask` [n, W] (on the logits' device): the
    disallowed tokens get -inf. fallback [B, V]: the logits before other masks (min_tokens, bad
    words); a row those masks left with no allowed token is masked from it instead (the grammar wins:
    it may allow EOS only)."""
    allowed = allowed_tokens(bitmask, logits.shape[1])
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    if fallback is not None:
        dead = masked.amax(dim=-1, keepdim=True) == float("-inf")
        masked = torch.where(dead, fallback.index_select(0, rows).masked_fill(~allowed, float("-inf")), masked)
    return logits.index_copy(0, rows, masked)


class Grammars:
    """Rank 0's grammar state (see the module's docstring)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: frozenset[int] | tuple[int, ...]):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._compiled: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._matchers: dict[str, object] = {}
        self._ready: dict[str, torch.Tensor] = {}  # request → its next mask [W], computed for its current state
        self._pending: Future | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._executor = None  # llguidance's thread pool (a batch of masks in parallel)
        self._lock = threading.Lock()
        # what a benchmark reads: the time masks took to compute (on the thread or not), and the
        # time sampling waited for them (what the overlap did not hide)
        self.num_masks = 0
        self.mask_seconds = 0.0
        self.wait_seconds = 0.0
        self.num_rollbacks = 0

    # -- tokenizer and compiled grammars --------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance
            path = os.path.join(self.tokenizer_dir, "tokenizer.json")
            eos = self.eos_token_ids or None
            tok = llguidance.LLTokenizer(path, eos_token=eos)
            if tok.vocab_size < self.vocab_size:  # the logits are wider than the tokenizer: padding ids
                tok = llguidance.LLTokenizer(path, n_vocab=self.vocab_size, eos_token=eos)
            self._tokenizer = tok
        return self._tokenizer

    def compiled(self, grammar: str):
        """The compiled matcher of `grammar` (a copy is each request's); ValueError if it is invalid."""
        import llguidance
        m = self._compiled.get(grammar)
        if m is not None:
            self._compiled.move_to_end(grammar)
            return m
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"the grammar does not compile: {m.get_error()}")
        self._compiled[grammar] = m
        while len(self._compiled) > COMPILED_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return m

    # -- requests ------------------------------------------------------------------------------------------

    def add(self, request_id: str, grammar: str, output_token_ids: list[int] = ()) -> None:
        self._settle()
        m = self.compiled(grammar).deep_copy()
        for t in output_token_ids:  # (a request that comes with tokens generated already)
            m.consume_token(t)
        self._matchers[request_id] = m

    def remove(self, request_id: str) -> None:
        self._settle()
        self._matchers.pop(request_id, None)
        self._ready.pop(request_id, None)

    def masks(self, request_ids: list[str]) -> torch.Tensor:
        """The masks of the requests' next tokens [n, W] (CPU): those computed during the step, the
        others now."""
        t0 = time.perf_counter()
        self._settle()
        self.wait_seconds += time.perf_counter() - t0
        missing = [rid for rid in request_ids if rid not in self._ready]
        if missing:
            t0 = time.perf_counter()
            self._ready.update(self._fill(missing, [self._matchers[rid] for rid in missing]))
            self.wait_seconds += time.perf_counter() - t0
        return torch.stack([self._ready[rid] for rid in request_ids])

    def advance(self, request_ids: list[str], tokens: list[int]) -> None:
        """Each request emitted its token: consume it, then start computing the next masks."""
        self._settle()
        for rid, t in zip(request_ids, tokens):
            m = self._matchers[rid]
            self._ready.pop(rid, None)
            if not m.consume_token(t):
                log.error("request %s: the grammar refused token %d it was masked to (%s)", rid, t, m.get_error())
        self._start(request_ids)

    def draft_masks(self, request_id: str, draft: list[int]) -> tuple[int, torch.Tensor]:
        """Speculation: → (k, masks [k + 1, W]): the first k proposed tokens the grammar accepts, and the
        mask at the request's next position and after each of them. The matcher is left advanced by
        k tokens (`settle_draft` rolls it back past the rejected ones)."""
        first = self.masks([request_id])
        m = self._matchers[request_id]
        k = m.validate_tokens(draft) if draft else 0
        rows = [first[0]]
        if k:
            bitmask = torch.empty(k, bitmask_width(self.vocab_size), dtype=torch.int32)
            t0 = time.perf_counter()
            for j, t in enumerate(draft[:k]):
                m.consume_token(t)
                fill_row(m, bitmask, j)
            self._count(k, time.perf_counter() - t0)
            rows += list(bitmask)
        self._ready.pop(request_id, None)
        return k, torch.stack(rows)

    def settle_draft(self, request_id: str, consumed: int, tokens: list[int]) -> None:
        """After `draft_masks` consumed `consumed` proposed tokens: the request emitted `tokens` (the
        accepted proposals, then one more): roll back the rest, consume the last."""
        m = self._matchers[request_id]
        accepted = len(tokens) - 1
        if consumed > accepted:
            m.rollback(consumed - accepted)
            self.num_rollbacks += 1
        if not m.consume_token(tokens[-1]):
            log.error("request %s: the grammar refused token %d it was masked to (%s)", request_id, tokens[-1],
                      m.get_error())

    def start(self, request_ids: list[str]) -> None:
        """Compute these requests' next masks on the thread (after settle_draft)."""
        self._settle()
        self._start(request_ids)

    # -- the masks' thread ---------------------------------------------------------------------------------

    def _start(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._matchers]
        if not live:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lmi-grammar")
        self._pending = self._pool.submit(self._fill, live, [self._matchers[rid] for rid in live])

    def _settle(self) -> None:
        """Wait for the masks being computed, and keep them."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._ready.update(pending.result())

    def _fill(self, request_ids: list[str], matchers: list) -> dict[str, torch.Tensor]:
        """(on the thread, or not) the requests' next masks; touches nothing else of self but counters"""
        import llguidance  # (not llguidance.torch: importing it imports torch.compile's machinery, seconds)
        t0 = time.perf_counter()
        width = bitmask_width(self.vocab_size)
        bitmask = torch.empty(len(request_ids), width, dtype=torch.int32)
        if len(matchers) == 1:
            fill_row(matchers[0], bitmask, 0)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                                   width * 4, len(matchers))
        self._count(len(request_ids), time.perf_counter() - t0)
        return dict(zip(request_ids, bitmask))

    def _count(self, n: int, seconds: float) -> None:
        with self._lock:
            self.num_masks += n
            self.mask_seconds += seconds

    def metrics(self) -> dict[str, float]:
        return {"grammar_masks": self.num_masks, "grammar_mask_seconds": self.mask_seconds,
                "grammar_wait_seconds": self.wait_seconds, "grammar_rollbacks": self.num_rollbacks}


def fill_row(matcher, bitmask: torch.Tensor, row: int) -> None:
    v = bitmask[row]
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
