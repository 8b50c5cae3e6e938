"""Redundant in-memory copies of optimizer state: each anchor rank's fragments live on its buddies too.

The owner sends, after every optimizer step, a header (step, key count, each parameter's fragment start and size)
and one flat fp32 buffer (its masters and optimizer tensors) to each buddy. The buddy keeps the latest complete copy;
a copy is replaced only once the new one has fully arrived, so a sender dying mid-message leaves the old copy whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ntp_ds.recovery.state import Fragment

HEADER_TAG, DATA_TAG = 41, 43


@dataclass
class HeldCopy:
    """A copy of another rank's optimizer fragments, as of the end of optimizer step `step`."""

    owner: int
    step: int
    fragments: dict[str, Fragment]


class StateCopies:
    """Send this rank's fragments to its buddies and keep the fragments other ranks send here."""

    def __init__(self, rank: int, buddies: dict[int, tuple[int, ...]], names: list[str], timeout_s: float):
        self.targets = buddies.get(rank, ())
        self.owners = sorted(o for o, bs in buddies.items() if rank in bs)
        self.names = sorted(names)
        self.timeout = timedelta(seconds=timeout_s)
        self.held: dict[int, HeldCopy] = {}

    def refresh(self, fragments: dict[str, Fragment], keys: tuple[str, ...], step: int) -> None:
        """Exchange this step's copies (collective among owners and buddies only)."""
        works = []
        if self.targets:
            header, data = self._pack(fragments, keys, step)
            for t in self.targets:
                works += [dist.isend(header, t, tag=HEADER_TAG), dist.isend(data, t, tag=DATA_TAG)]
        headers = {}
        for o in self.owners:
            headers[o] = torch.empty(2 + 2 * len(self.names), dtype=torch.int64)
            works.append(dist.irecv(headers[o], o, tag=HEADER_TAG))
        for w in works[len(self.targets) * 2:]:
            w.wait(self.timeout)
        data_works = []
        for o, header in headers.items():
            n_keys = int(header[1])
            numel = int(header[3::2].sum())
            buf = torch.empty(numel * (1 + n_keys), dtype=torch.float32)
            data_works.append((o, header, buf, dist.irecv(buf, o, tag=DATA_TAG)))
        for o, header, buf, w in data_works:
            w.wait(self.timeout)
            self.held[o] = self._unpack(o, header, buf)
        for w in works[:len(self.targets) * 2]:
            w.wait(self.timeout)

    def _pack(self, fragments: dict[str, Fragment], keys: tuple[str, ...], step: int):
        header = [step, len(keys)]
        parts = []
        for name in self.names:
            frag = fragments.get(name)
            header += [frag.start, frag.numel] if frag else [0, 0]
            if frag:
                parts += [frag.tensors[k].detach().reshape(-1).float().cpu() for k in ("fp32",) + keys]
        data = torch.cat(parts) if parts else torch.empty(0)
        return torch.tensor(header, dtype=torch.int64), data

    def _unpack(self, owner: int, header: torch.Tensor, buf: torch.Tensor) -> HeldCopy:
        step, n_keys = int(header[0]), int(header[1])
        keys = ["fp32"] + [f"key{i}" for i in range(n_keys)]
        frags, pos = {}, 0
        for i, name in enumerate(self.names):
            start, numel = int(header[2 + 2 * i]), int(header[3 + 2 * i])
            if numel == 0:
                continue
            tensors = {}
            for k in keys:
                tensors[k] = buf[pos:pos + numel]
                pos += numel
            frags[name] = Fragment(start, numel, tensors)
        return HeldCopy(owner, step, frags)
