"""A `djl_python`-compatible API for custom handlers (`model.py` with `handle(inputs)`), written from
DJL Serving's documentation: `Input` (properties, content, JSON / text / bytes, batches) and `Output`
(code, message, properties, content, per-item errors). DJL's own handlers run on lmi-serve unchanged
when they use only this API (docs/custom-handlers.md)."""

from djl_python.inputs import Input
from djl_python.outputs import Output
from djl_python.pair_list import PairList

__all__ = ["Input", "Output", "PairList"]
