"""Stores for in-process tests."""

import torch.distributed as dist


class CountingStore:
    """A HashStore that counts the requests made to it (`inner`: the store itself, uncounted)."""

    def __init__(self):
        self.inner, self.calls = dist.HashStore(), 0

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def counted(*args):
            self.calls += 1
            return method(*args)
        return counted
