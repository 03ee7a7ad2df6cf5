"""Proposers of speculative decoding (the strategy seam): each guesses the next few tokens of the
decoding requests, which the target model then verifies in one forward (paged engine: docs/paged.md).

    proposer.propose(requests, rooms) → {request id: up to rooms[i] guessed tokens}
    proposer.drop(request id)          forget a request (finished, aborted, preempted)

`NgramProposer` (prompt lookup, pure Python): the last n tokens of prompt + output, n from
`prompt_lookup_max` down to `prompt_lookup_min`, are looked up earlier in the same tokens; what
followed the latest earlier match is the guess. It costs no model, and pays when outputs copy their
input (summaries, code edits, "repeat this list"). The draft-model proposer lives with the workers
(engines/loop/draft.py): it needs torch.
"""

from __future__ import annotations

from array import array

from engines.core.request import Request

_INT = array("i").itemsize


class NgramProposer:
    name = "ngram"

    def __init__(self, num_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"ngram prompt lookup needs 1 <= min ({prompt_lookup_min}) <= max ({prompt_lookup_max})")
        self.num_tokens = num_tokens
        self.lookup_min, self.lookup_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, requests: list[Request], rooms: list[int]) -> dict[str, list[int]]:
        return {req.request_id: ngram_lookup(req.all_token_ids, self.lookup_min, self.lookup_max, room)
                for req, room in zip(requests, rooms)}

    def drop(self, request_id: str) -> None:
        pass


def ngram_lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    of n_max down to n_min tokens; [] when none occurs. The search is bytes.rfind over the tokens as
    int32s (C speed: a 2,048-token context takes microseconds), keeping only aligned matches."""
    if k < 1:
        return []
    packed = array("i", tokens).tobytes()
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = packed[-n * _INT:]
        end = len(packed) - _INT  # a match must end before the last token: not the suffix itself
        while True:
            at = packed.rfind(suffix, 0, end)
            if at < 0:
                break
            if at % _INT == 0:
                start = at // _INT + n
                return tokens[start:start + k]
            end = at + len(suffix) - 1  # a misaligned hit: look further left
    return []
