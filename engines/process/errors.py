"""Failures the engines tell apart (no torch here: the engine process imports it before loading)."""

from __future__ import annotations


class FatalStepError(Exception):
    """A step failed with tensor parallelism: the ranks may be out of step, the group must go down."""


class HandlerError(RuntimeError):
    """A custom handler could not start (engines/custom/handler_engine.py): the reason is one line, the last of
    its traceback."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Host or device out of memory (torch's OutOfMemoryError is matched by name: no torch import)."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
