"""`Input`: what a custom handler's `handle(inputs)` receives.

The first call is the warm-up (`is_empty()` is true): no content, the model's configuration in the
properties (every `option.*` key without its prefix, the other serving.properties keys as they are,
and `model_dir`). Every later call is one HTTP request: its headers are the properties (names as the
client sent them; `get_property` ignores case), its body the content under the key "data".

A batch (DJL's dynamic batching, `batch_size` > 1 in the properties) carries its items' properties
as `batch_NNN_<name>` and their contents as `batch_NNN_<key>` (NNN: three digits); `get_batches()`
splits them. lmi-serve hands a handler one request per call, which `get_batches()` returns as a batch
of one.
"""

from __future__ import annotations

import io
import json

from djl_python.pair_list import PairList


class Input:
    def __init__(self, properties: dict | None = None, content: PairList | None = None):
        self.function_name = None
        self.properties: dict = dict(properties or {})
        self.content: PairList = content if content is not None else PairList()

    def __str__(self) -> str:
        return f"properties: {self.properties}, content keys: {self.content.get_keys()}"

    # -- properties -------------------------------------------------------------------------------------------

    def get_properties(self) -> dict:
        return self.properties

    def get_property(self, key: str):
        """The property `key`, whatever its case (HTTP header names), or None."""
        wanted = key.lower()
        return next((v for k, v in self.properties.items() if k.lower() == wanted), None)

    def get_function_name(self):
        return self.function_name

    # -- content ----------------------------------------------------------------------------------------------

    def get_content(self) -> PairList:
        return self.content

    def contains_key(self, key) -> bool:
        return self.content.get(key) is not None

    def is_empty(self) -> bool:
        return self.content.is_empty()

    def get_as_bytes(self, key=None):
        """The content under `key` (KeyError if absent); without a key, "data" or else the first item."""
        if self.content.is_empty():
            return None
        if key:
            value = self.content.get(key)
            if value is None:
                raise KeyError(f"requested data for key:{key} is not found!")
            return value
        value = self.content.get("data")
        return value if value is not None else self.content.value_at(0)

    def get_as_string(self, key=None) -> str:
        return bytes(self.get_as_bytes(key=key)).decode("utf-8")

    def get_as_json(self, key=None):
        return json.loads(self.get_as_string(key=key))

    def get_as_csv(self, key=None) -> list:
        import csv
        return list(csv.DictReader(io.StringIO(self.get_as_string(key=key))))

    def get_as_image(self, key=None):
        from PIL import Image
        return Image.open(io.BytesIO(self.get_as_bytes(key=key)))

    def get_as_npz(self, key=None) -> list:
        import numpy
        npz = numpy.load(io.BytesIO(self.get_as_bytes(key=key)))
        return [npz[name] for name in npz.files]

    def get_data(self, key=None):
        """The content decoded by its content-type: JSON, text, an image, else bytes."""
        kind = (self.get_property("content-type") or "").lower()
        if self.content.is_empty():
            return None
        if kind.startswith("application/json"):
            return self.get_as_json(key)
        if kind.startswith("text/"):
            return self.get_as_string(key)
        if kind == "tensor/npz":
            return self.get_as_npz(key)
        if kind.startswith("image/"):
            return self.get_as_image(key)
        return self.get_as_bytes(key=key)

    # -- batches ----------------------------------------------------------------------------------------------

    def is_batch(self) -> bool:
        return "batch_size" in self.properties

    def get_batch_size(self) -> int:
        return int(self.properties.get("batch_size", "1"))

    def get_batches(self) -> list["Input"]:
        if not self.is_batch():
            return [self]
        items = [Input() for _ in range(self.get_batch_size())]
        for key, value in self.properties.items():
            if key.startswith("batch_") and key != "batch_size":  # batch_NNN_<name>
                items[int(key[6:9])].properties[key[10:]] = value
        for key, value in self.content:
            items[int(key[6:9])].content.add(key[10:], value)
        return items
