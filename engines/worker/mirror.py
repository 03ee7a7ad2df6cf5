"""Rank 0 drives the other ranks by sending them each step operation before running it.

    rank 0:   Mirrored(target, comm).call("decode", last_tokens)
                  → comm.send_step(msgpack [name, args]) → target.decode(last_tokens)
    rank > 0: serve_steps(target, comm): receive, decode the arguments by the method's type hints,
              run the same method on its own shard (the collectives inside keep them in step)

Only plain data crosses (token ids, block ids, the scheduler's plan): never pickled objects.
"""

from __future__ import annotations

import logging
import typing

import msgspec

from engines.dist import STOP, Communicator

log = logging.getLogger(__name__)


class Mirrored:
    def __init__(self, target, comm: Communicator):
        self.target = target
        self.comm = comm

    def call(self, name: str, *args):
        if self.comm.world_size > 1:
            self.comm.send_step(msgspec.msgpack.encode([name, list(args)]))
        return getattr(self.target, name)(*args)

    def stop(self) -> None:
        if self.comm.world_size > 1:
            self.comm.send_step(STOP)

    def __getattr__(self, name: str):  # attributes that are not step operations (reads only)
        return getattr(self.target, name)


def serve_steps(target, comm: Communicator) -> None:
    """Ranks > 0: run rank 0's operations until it sends STOP."""
    while True:
        data = comm.receive_step()
        if data == STOP:
            return
        name, args = msgspec.msgpack.decode(data)
        method = getattr(target, name)
        hints = typing.get_type_hints(getattr(type(target), name))
        params = [p for p in hints if p != "return"]
        typed = [msgspec.convert(a, hints[p]) if p in hints else a for p, a in zip(params, args)]
        method(*typed)
