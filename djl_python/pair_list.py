"""An ordered list of (key, value) pairs whose keys may repeat (DJL's content container)."""

from __future__ import annotations


class PairList:
    def __init__(self, keys: list | None = None, values: list | None = None, pair_list: list | None = None):
        if pair_list is not None:
            keys, values = [k for k, _ in pair_list], [v for _, v in pair_list]
        self.keys = list(keys or [])
        self.values = list(values or [])
        if len(self.keys) != len(self.values):
            raise ValueError("PairList: as many keys as values")

    def add(self, key=None, value=None, index: int | None = None) -> None:
        if index is None:
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys.insert(index, key)
            self.values.insert(index, value)

    def size(self) -> int:
        return len(self.keys)

    def is_empty(self) -> bool:
        return not self.keys

    def key_at(self, index: int):
        return self.keys[index]

    def value_at(self, index: int):
        return self.values[index]

    def get(self, key):
        """The first value under `key` (None if there is none)."""
        for k, v in zip(self.keys, self.values):
            if k == key:
                return v
        return None

    def get_keys(self) -> list:
        return list(self.keys)

    def get_values(self) -> list:
        return list(self.values)

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self):
        return iter(zip(self.keys, self.values))
