"""A node's store played inside a harness process: the calls and answers of `torch.distributed.HashStore`, with a
wait that wakes only on its own keys.

`HashStore` wakes every waiting thread at every write (one condition variable for the whole store). On a node's
store of the scale harness (`failure_load`), where each rank's alarm thread waits for the relayed alarm while the
node's ranks beat, copy and count there, that is a wake of every waiter at each of those writes: at 4,096 ranks it
cost the harness's two cores more than the ranks' own code. The store a launcher hosts on its node (a TCPStore
server) answers each wait when its keys are set, as this one does. What a call returns, blocks on and raises is
HashStore's (`tests/control/test_local_store.py` compares the two call by call).
"""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(seconds=300)
"""HashStore's default for a blocking call."""


def _value(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _stoll(raw: bytes) -> int:
    """HashStore's reading of a counter (C++ `stoll`, an empty value 0): the leading integer, or ValueError."""
    if not raw:
        return 0
    match = re.match(rb"\s*[+-]?\d+", raw)
    if match is None:
        raise ValueError("stoll")
    return int(match.group())


class LocalStore:
    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT):
        self.timeout = timeout
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._waiters: dict[str, list[threading.Event]] = {}

    def _written(self, key: str) -> None:
        """Wake the waits whose next missing key is `key` (called under the lock)."""
        for event in self._waiters.pop(key, ()):
            event.set()

    def set(self, key: str, value) -> None:
        with self._lock:
            self._data[key] = _value(value)
            self._written(key)

    def multi_set(self, keys, values) -> None:
        with self._lock:
            for key, value in zip(keys, values, strict=True):
                self._data[key] = _value(value)
                self._written(key)

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = _stoll(self._data.get(key, b"")) + amount
            self._data[key] = str(value).encode()
            self._written(key)
            return value

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected, desired = _value(expected), _value(desired)
        with self._lock:
            current = self._data.get(key)
            if (current is None and not expected) or current == expected:
                self._data[key] = desired
                self._written(key)
                return desired
            return expected if current is None else current

    def check(self, keys) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._lock:
            return len(self._data)

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout).total_seconds()
        while True:
            with self._lock:
                missing = next((k for k in keys if k not in self._data), None)
                if missing is None:
                    return
                event = threading.Event()
                self._waiters.setdefault(missing, []).append(event)
            left = deadline - time.monotonic()
            if left <= 0 or not event.wait(left):
                with self._lock:
                    waiting = self._waiters.get(missing, [])
                    if event in waiting:
                        waiting.remove(event)
                    if all(k in self._data for k in keys):
                        return
                raise dist.DistStoreError("Wait timeout")

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys) -> list[bytes]:
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:  # (a key deleted between the wait and the read is waited for again, as HashStore does)
            self.wait(keys, timedelta(seconds=max(0.0, deadline - time.monotonic())))
            with self._lock:
                if all(k in self._data for k in keys):
                    return [self._data[k] for k in keys]
