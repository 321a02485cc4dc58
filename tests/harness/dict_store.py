"""A job store in a dict, for tests that drive membership pieces (the reaper, FollowerWatch, at_step, StopAt) on
their own: the subset of torch's Store API they use, with its semantics (compare_set stores only when absent)."""

from __future__ import annotations


class DictStore:
    def __init__(self):
        self.kv: dict[str, bytes] = {}

    def check(self, keys) -> bool:
        return all(k in self.kv for k in keys)

    def get(self, key: str) -> bytes:
        return self.kv[key]

    def set(self, key: str, value) -> None:
        self.kv[key] = value.encode() if isinstance(value, str) else bytes(value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        if key not in self.kv:
            self.set(key, desired)
        return self.kv[key]
