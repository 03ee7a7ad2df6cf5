"""`Output`: what a custom handler returns.

`code` and `message` become the HTTP status (an `error(...)` is 424 "prediction failure" with the
body `{"code", "message", "error"}`); properties become response headers (`content-type`, ...); the
content is the body: the item under "data", else the first one. With `batch_index` (handlers written
for DJL's dynamic batching) an item's content is kept under `batch_<i>.<key>` and its error under
properties `batch_<i>_code` / `batch_<i>_message`; lmi-serve sends one request per call, so item 0
is the answer.
"""

from __future__ import annotations

import json

from djl_python.pair_list import PairList


class _Encoder(json.JSONEncoder):
    """numpy numbers and arrays, datetimes: as JSON has them."""

    def default(self, obj):
        import datetime
        if isinstance(obj, datetime.datetime):
            return str(obj)
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            if isinstance(obj, np.integer):
                return int(obj)
            if isinstance(obj, np.floating):
                return float(obj)
            if isinstance(obj, np.ndarray):
                return obj.tolist()
        return super().default(obj)


def _key(key, batch_index) -> str | None:
    if key is not None and not isinstance(key, str):
        key = str(key)
    if batch_index is None:
        return key
    return f"batch_{batch_index}.{key or 'data'}"


class Output:
    def __init__(self, code: int = 200, message: str = "OK"):
        self.code = code
        self.message = message
        self.properties: dict = {}
        self.content = PairList()

    def __str__(self) -> str:
        return json.dumps({"code": self.code, "message": self.message, "properties": self.properties,
                           "content": self.content.get_keys()})

    def set_code(self, code: int) -> "Output":
        self.code = code
        return self

    def set_message(self, message: str) -> "Output":
        self.message = message
        return self

    def add_property(self, key: str, val) -> "Output":
        self.properties[key] = str(val)
        return self

    def error(self, error: str, code: int = 424, message: str = "prediction failure", key=None,
              batch_index: int | None = None) -> "Output":
        body = {"code": code, "message": message, "error": error}
        if batch_index is None:
            self.code, self.message = code, message
            self.add_property("content-type", "application/json")
        else:
            self.add_property(f"batch_{batch_index}_code", code)
            self.add_property(f"batch_{batch_index}_message", message)
        return self.add_as_json(body, key=key, batch_index=batch_index)

    def add(self, value, key=None, batch_index: int | None = None) -> "Output":
        if isinstance(value, str):
            value = value.encode("utf-8")
        elif isinstance(value, bytearray):
            value = bytes(value)
        elif not isinstance(value, bytes):
            return self.add_as_json(value, key=key, batch_index=batch_index)
        self.content.add(key=_key(key, batch_index), value=value)
        return self

    def add_as_string(self, value: str, key=None, batch_index: int | None = None) -> "Output":
        return self.add(str(value), key=key, batch_index=batch_index)

    def add_as_json(self, val, key=None, batch_index: int | None = None) -> "Output":
        data = json.dumps(val, ensure_ascii=False, allow_nan=False, cls=_Encoder, separators=(",", ":"))
        self.content.add(key=_key(key, batch_index), value=data.encode("utf-8"))
        return self

    def add_as_npz(self, np_list, key=None, batch_index: int | None = None) -> "Output":
        import io

        import numpy as np
        buf = io.BytesIO()
        np.savez(buf, *np_list)
        self.content.add(key=_key(key, batch_index), value=buf.getvalue())
        return self
