"""Gradients and parameters streamed between a contributor and its anchors while they compute.

The contributor sends a bucket as soon as the last gradient in it is final (a post-accumulate hook), so its
messages leave during its backward. The anchor posts its first receives before its backward starts and adds each
bucket in the tensor hook of the parameter it belongs to, before DeepSpeed reduces that gradient (any ZeRO stage):
its backward never waits for the contributor's to end, only for the bucket a gradient needs, and at most `window`
buckets per peer are buffered beyond the one being consumed. Messages between a pair are posted in bucket order on
both sides (receives are posted in order; a sender holds a finished bucket until every earlier one has left).
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch

from ntp_ds.comm import wire
from ntp_ds.comm.exchange import UnitExchange, bucket_index
from ntp_ds.layout import units as U


class OutgoingGradients:
    """A contributor's side: send each bucket once its gradients are final."""

    def __init__(self, exchange: UnitExchange):
        self.exchange = exchange
        self.pending: list[wire.Exchange] = []
        self._params: dict[str, torch.nn.Parameter] = {}
        self._left: dict[tuple[int, int], set[str]] = {}
        self._next: dict[int, int] = {}
        self._of_name = bucket_index(exchange.outgoing)

    def arm(self, params: dict[str, torch.nn.Parameter]) -> list:
        """Watch this backward's gradients; return the hook handles (remove them after backward)."""
        self._params = params
        self._left = {(p, k): set(b.names) for p, bs in self.exchange.outgoing.items() for k, b in enumerate(bs)}
        self._next = {p: 0 for p in self.exchange.outgoing}
        return [params[n].register_post_accumulate_grad_hook(partial(self._ready, n)) for n in self._of_name]

    def _ready(self, name: str, _param) -> None:
        for peer, k in self._of_name[name]:
            self._left[(peer, k)].discard(name)
            self._send_ready(peer)

    def _send_ready(self, peer: int, force: bool = False) -> None:
        buckets = self.exchange.outgoing[peer]
        while self._next[peer] < len(buckets) and (force or not self._left[(peer, self._next[peer])]):
            bucket = buckets[self._next[peer]]
            grads = {n: self._grad(n) for n in bucket.names}
            self.pending.append(wire.exchange({peer: self.exchange.pack(bucket, grads)}, {}, op="grad_bucket"))
            self._next[peer] += 1

    def _grad(self, name: str) -> torch.Tensor:
        p = self._params[name]
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def flush(self) -> None:
        """Send whatever is left (a parameter that got no gradient this step counts as zeros)."""
        for peer in self.exchange.outgoing:
            self._send_ready(peer, force=True)

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        for e in pending:
            e.wait()


class _Inbox:
    """Receives of one exchange's incoming buckets, posted per peer in bucket order, each into its own buffer."""

    def __init__(self, exchange: UnitExchange, window: int):
        self.exchange, self.window = exchange, window
        self._posted: dict[int, list] = {}
        self._like: dict[str, torch.Tensor] = {}
        self._of_name = bucket_index(exchange.incoming)

    def _open(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start a round: buffers shaped like `tensors`, the first `window` receives of every peer posted."""
        self._like = tensors
        self._posted = {p: [] for p in self.exchange.incoming}
        for peer, buckets in self.exchange.incoming.items():
            self._post_until(peer, min(self.window, len(buckets)) - 1)

    def _post_until(self, peer: int, k: int) -> None:
        """Post the receives of `peer`'s buckets up to index `k` (in order; already posted ones are kept)."""
        posted, buckets = self._posted[peer], self.exchange.incoming[peer]
        while len(posted) <= k:
            buf = self.exchange.receive_buffer(buckets[len(posted)], self._like)
            posted.append((wire.exchange({}, {peer: buf}, op=self.op), buf))


class IncomingGradients(_Inbox):
    """An anchor's side: receive buckets in order and add each into its parameter's gradient in backward."""

    op = "grad_bucket"

    def __init__(self, exchange: UnitExchange, window: int = 2):
        super().__init__(exchange, window)
        self._unused: dict[tuple[int, int], set[str]] = {}

    def arm(self, params: dict[str, torch.nn.Parameter]) -> list:
        """Post the first receives and hook the receiving parameters; return the hook handles."""
        self._unused = {(p, k): set(b.names) for p, bs in self.exchange.incoming.items() for k, b in enumerate(bs)}
        self._open(params)
        return [params[n].register_hook(partial(self._add, n)) for n in self._of_name]

    def _add(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        for peer, k in self._of_name[name]:
            self._post_until(peer, k)
            pending, buf = self._posted[peer][k]
            pending.wait()
            self.exchange.unpack(self.exchange.incoming[peer][k], buf, {name: out}, add=True, only=name)
            self._consumed(peer, k, name)
        return out

    def _consumed(self, peer: int, k: int, name: str) -> None:
        left = self._unused[(peer, k)]
        left.discard(name)
        if not left:
            self._posted[peer][k] = (self._posted[peer][k][0], None)  # free the buffer
            self._post_until(peer, min(k + self.window, len(self.exchange.incoming[peer]) - 1))

    def finish(self) -> None:
        """After backward: every bucket must have been received and added (a parameter whose gradient hook never
        ran would silently lose the contributor's share)."""
        missing = sorted({n for left in self._unused.values() for n in left})
        for peer, buckets in self.exchange.incoming.items():
            self._post_until(peer, len(buckets) - 1)
            for pending, _ in self._posted[peer]:
                pending.wait()
        self._posted, self._like = {}, {}
        if missing:
            raise RuntimeError(f"contributor gradients for {missing} arrived but no gradient of them was computed "
                               f"in this backward; every parameter must take part in the loss")


class OutgoingParameters:
    """An anchor's side of the parameter copy: after its optimizer step it posts every bucket (in forward order),
    each as its own message, and waits for them before its next optimizer step."""

    def __init__(self, exchange: UnitExchange):
        self.exchange = exchange
        self.pending: list[wire.Exchange] = []

    def post(self, params: dict[str, torch.Tensor]) -> None:
        """Post every bucket to every peer, all peers' buckets merged in forward order.

        NCCL runs this rank's sends one after another on its stream, and each peer receives only a window ahead of
        its forward: sent peer by peer, the first peer's later buckets would wait for a forward that waits (through
        its TP group) on another peer's first bucket, queued behind them."""
        self.wait()
        order = {name: i for i, name in enumerate(self.exchange.specs)}
        queue = sorted(((order[b.items[0][0]], peer, k, b) for peer, buckets in self.exchange.outgoing.items()
                        for k, b in enumerate(buckets)), key=lambda e: e[:3])
        for _, peer, _, bucket in queue:
            self.pending.append(wire.exchange({peer: self.exchange.pack(bucket, params)}, {}, op="param_bucket"))

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        for e in pending:
            e.wait()


class IncomingParameters(_Inbox):
    """A contributor's side: receive the updated parameters bucket by bucket while the next forward runs.

    `post` (after the step) posts the first `window` receives per anchor peer; `settle_for(names)` (a module's
    forward pre-hook) completes, in order, every bucket up to the last one holding those parameters and writes
    them in; `settle` completes the rest. With `salvage` (at a failure) a bucket not proven to have arrived
    (`wire.Exchange.proven`: under NCCL an aborted receive reports complete, its buffer part written) is left out,
    or, written in already, taken back: its units are returned as stale, to be fetched again from a live holder.
    `refused` counts the buckets whose wait returned but whose arrival was not proven.
    """

    op = "param_bucket"

    def __init__(self, exchange: UnitExchange, window: int = 2):
        super().__init__(exchange, window)
        self._done: dict[int, int] = {}
        self.refused = 0

    @property
    def names(self) -> set[str]:
        return set(self._of_name)

    def post(self, params: dict[str, torch.Tensor]) -> None:
        self.settle()
        self._done = {p: 0 for p in self.exchange.incoming}
        self._open(params)

    def settle_for(self, names) -> None:
        if not self._done:
            return
        for name in names:
            for peer, k in self._of_name.get(name, ()):
                self._settle_peer(peer, k)

    def _settle_peer(self, peer: int, k: int, salvage: bool = False) -> None:
        buckets = self.exchange.incoming[peer]
        while self._done[peer] <= k:
            j = self._done[peer]
            self._post_until(peer, j)
            pending, buf = self._posted[peer][j]
            pending.wait_received(peer, heed_failure=not salvage)
            if salvage and not pending.proven(peer):
                self.refused += 1
                raise wire.PeerFailure(f"parameter bucket {j} from rank {peer} was cut before it arrived")
            with torch.no_grad():
                self.exchange.unpack(buckets[j], buf, self._like)
            self._posted[peer][j] = (pending, None)
            self._done[peer] = j + 1
            self._post_until(peer, min(j + self.window, len(buckets) - 1))

    def settle(self, salvage: bool = False) -> dict[str, U.Ranges]:
        """Complete every bucket; return the units (by kind) whose bucket is not proven to have arrived (salvage
        only: a bucket written in during the forward counts only if its receive was seen complete before any
        abort)."""
        lost = []
        for peer, buckets in self.exchange.incoming.items():
            if not self._done:
                break
            try:
                self._settle_peer(peer, len(buckets) - 1, salvage)
            except RuntimeError:
                if not salvage:
                    raise
            if salvage:
                posted = self._posted[peer]
                cut = [j for j in range(self._done[peer]) if not posted[j][0].proven(peer)]
                self.refused += len(cut)  # written in during the forward, then found cut
                lost += [buckets[j] for j in cut] + buckets[self._done[peer]:]
        self._done, self._posted = {}, {}
        return stale_units(self.exchange, lost)


def stale_units(exchange: UnitExchange, buckets) -> dict[str, U.Ranges]:
    """The units (by kind) the incoming `buckets` of `exchange` carry."""
    stale: dict[str, list[int]] = defaultdict(list)
    for bucket in buckets:
        for name, units in bucket.items:
            stale[exchange.specs[name].kind] += list(U.units_of(units))
    return {kind: U.from_units(sorted(set(us))) for kind, us in stale.items()}
