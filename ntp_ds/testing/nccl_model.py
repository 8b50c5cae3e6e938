"""`nccl_model`: a torch.distributed backend that runs over gloo and fails where NCCL would.

gloo forgives what NCCL does not: its point-to-point ops complete without a matching op posted in the same order,
its results are in place once the host passes the call, its Works are per op, its timeouts end any op. Importing
this module registers `nccl_model`, which wraps a gloo group and keeps NCCL's rules instead, so a CPU test of code
that would break on GPUs fails on CPU. Each rule can be switched off alone (`NTP_NCCL_MODEL_OFF=rule,rule`), to
show it is the one that catches a given bug; `ntp_ds.testing.nccl_rules` lists and explains them.

Here: the Works (`ModelWork`), the process group torch sees (`ModelGroup`: the ops a caller posts on a communicator,
`nccl_communicator`) and the registration of the backend and of its device (`nccl_device`).

Tensors live on the CPU; the package's `nccl` branches are taken for `nccl_model` too (`ntp_ds.comm.wire.is_nccl`).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ProcessGroupGloo

from ntp_ds.comm import device
from ntp_ds.testing.nccl_communicator import ModelCommunicator, StreamOp
from ntp_ds.testing.nccl_device import (communicator_created, communicator_sizes, device_stopped, hang_device,
                                        record_event, synchronize)
from ntp_ds.testing.nccl_rules import (NONBLOCKING_ENV, RULES, Aborted, Deadlock, DeviceStopped, RuleViolation,
                                       rule_on)

__all__ = ["CHANNELS", "NAME", "RULES", "Aborted", "Deadlock", "DeviceStopped", "ModelGroup", "ModelWork",
           "RuleViolation", "batch_isend_irecv", "communicator_sizes", "hang_device", "poison", "record_event",
           "rule_on", "synchronize"]

NAME = "nccl_model"

CHANNELS = 4
"""The chunks an output of an op cut by an abort is written in: the even ones arrived, the odd ones did not."""


def poison(t: torch.Tensor) -> None:
    """Fill `t` with the pattern an unfinished op's output holds."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        info = torch.iinfo(t.dtype)
        t.fill_(info.min if info.min < 0 else info.max)


def _poisoned_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    poison(out)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals NaN)."""
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# -- Works -------------------------------------------------------------------------------------------------------
# The Works and the ops that post them live in this file: `wire.is_wire_failure` knows an error of the wire by this
# file's name in its traceback, and a caller waits on a Work directly, not through torch.
class ModelWork(dist.Work):
    """One pending op (or batch): completes when its stream ran it; hands over its outputs at the wait."""

    def __init__(self, what: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]):
        super().__init__()
        self.what = what
        self.posted_at = time.monotonic()
        self.watched = False
        """Seen past its group's timeout by the watchdog (`watchdog`)."""
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._delivered = False
        self._cut = False
        self._lock = threading.Lock()
        self._poisoned: list[torch.Tensor] = []
        if not rule_on("async"):  # gloo's way: the op reads and writes the caller's buffers directly
            self._inputs = [(t, t) for t in inputs]
            self._outputs = [(t, t) for t in outputs]
            return
        # Outputs: the op writes a private buffer; the caller's holds poison until the wait copies the result in.
        # An input that aliases an output (in-place collectives) travels in that output's private copy.
        self._outputs = [(t, t.clone() if any(_overlaps(t, i) for i in inputs) else _poisoned_like(t))
                         for t in outputs]
        # Other inputs: a snapshot travels, and the caller's buffer must stay unchanged until the wait.
        self._inputs = [(t, t.clone()) for t in inputs if not any(_overlaps(t, o) for o in outputs)]
        for t in outputs:
            poison(t)
        self._poisoned = [t.clone() for t in outputs]

    # what the stream's worker sees
    def sent(self) -> list[torch.Tensor]:
        """The tensors the op reads (snapshots under the async rule)."""
        return [s for _, s in self._inputs]

    def received(self) -> list[torch.Tensor]:
        """The private buffers the op writes."""
        return [p for _, p in self._outputs]

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()

    def cut(self) -> None:
        """End the op as an abort ends its kernel: complete, no error, outputs partly written (`_deliver`)."""
        with self._lock:
            if self._done.is_set():
                return
            self._cut = True
            self._done.set()

    # the caller's side
    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None or timeout == timedelta(0) else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(f"nccl_model: {self.what} did not complete within {timeout}")
        self._deliver()
        return True

    def is_completed(self) -> bool:
        if not self._done.is_set():
            return False
        if self._error is None:
            self._deliver()
        return True

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        fut = torch.futures.Future()
        self.wait()
        fut.set_result([o for o, _ in self._outputs])
        return fut

    def _deliver(self) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._delivered:
                return
            self._delivered = True
            if self._cut:  # what reached the buffer before the abort: some chunks, the memory's old bytes elsewhere
                for t, private in self._outputs:
                    if private is not t and t.is_contiguous():
                        for i, (dst, src) in enumerate(zip(t.view(-1).chunk(CHANNELS),
                                                           private.view(-1).chunk(CHANNELS))):
                            if i % 2 == 0:
                                dst.copy_(src)
                return
            for t, snap in self._inputs:
                if not _same(t, snap):
                    raise RuleViolation(f"nccl_model: an input of {self.what} ({tuple(t.shape)}, {t.dtype}) was "
                                        "written before the op's Work completed; NCCL reads it asynchronously "
                                        "and would have sent whatever it held then")
            for (t, private), seen in itertools.zip_longest(self._outputs, self._poisoned):
                if seen is not None and not _same(t, seen):
                    raise RuleViolation(f"nccl_model: the output of {self.what} ({tuple(t.shape)}, {t.dtype}) was "
                                        "written before the op's Work completed; NCCL would overwrite it")
                if private is not t:
                    t.copy_(private)


class ModelGroup(ModelCommunicator):
    """The process group torch sees: an NCCL-like communicator whose ops each return one ModelWork (a batch too)."""

    def getBackendName(self) -> str:
        return NAME

    # -- posting -----------------------------------------------------------------------------------------------
    def _post(self, what: str, inputs, outputs, run, p2p=()) -> ModelWork:
        if self._aborted:
            raise Aborted(f"nccl_model: {what} on an aborted communicator ({self._aborted})")
        if self._gloo is None:
            with self._creating:
                if self._gloo is None:
                    self._create(what)
                    self._gloo = ProcessGroupGloo(*self._transport)
        if rule_on("watchdog"):
            self._behind_the_watchdog()
        work = ModelWork(what, list(inputs), list(outputs))
        with self._lock:  # with the abort's check: an op posted as another thread aborts is refused, never left pending
            if self._aborted:
                raise Aborted(f"nccl_model: {what} on an aborted communicator ({self._aborted})")
            self._pending.add(work)
            if not self._posted:  # NCCL creates a communicator at its group's first op
                communicator_created(self._size)
            self._posted += 1
        op = StreamOp(work, run, list(p2p), next(self._numbers), device_stopped())
        if not self._ordered and not op.behind_stop:  # gloo's way: every op starts as it is posted
            op.started = run(work)
        self._queue.put(op)
        return work

    def ops_posted(self) -> int:
        """Operations posted on this communicator so far (a batch counts once): NCCL's own sequence number."""
        return self._posted

    def _message(self, kind: str, peer: int) -> int:
        n = self._counts.get((kind, peer), 0)
        self._counts[(kind, peer)] = n + 1
        return n

    def _tag(self, tag: int) -> int:
        return 0 if rule_on("tags") else tag

    # -- point to point ----------------------------------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        (t,) = tensors
        if self._batch is not None:
            self._batch.append(("send", t, dst, tag))
            return None
        n = self._message("send", dst)
        return self._post(f"send #{n} to rank {dst}", [t], [],
                          lambda w: [self._gloo.send(w.sent(), dst, self._tag(tag))], [("send", dst, n)])

    def recv(self, tensors, src: int, tag: int = 0):
        (t,) = tensors
        if self._batch is not None:
            self._batch.append(("recv", t, src, tag))
            return None
        n = self._message("recv", src)
        return self._post(f"recv #{n} from rank {src}", [], [t],
                          lambda w: [self._gloo.recv(w.received(), src, self._tag(tag))], [("recv", src, n)])

    def batch(self, post: Callable[[], None]):
        """Run `post` (which posts sends and receives on this group) as one fused batch: one Work."""
        self._batch = []
        try:
            post()
            ops, self._batch = self._batch, None
        finally:
            self._batch = None
        involved = {peer for _, _, peer, _ in ops} | {self._rank}
        if not self._posted and rule_on("first") and len(involved) < self._size:
            raise RuleViolation(f"nccl_model: a batch with ranks {sorted(involved)} of {self._size} is the first op "
                                "of its communicator; its first op must involve every rank (start with a collective)")
        p2p = [(kind, peer, self._message(kind, peer)) for kind, _, peer, _ in ops]
        sends = [t for kind, t, _, _ in ops if kind == "send"]
        recvs = [t for kind, t, _, _ in ops if kind == "recv"]

        def run(w: ModelWork) -> list:
            sent, got, works = iter(w.sent()), iter(w.received()), []
            for kind, _, peer, tag in ops:
                if kind == "send":
                    works.append(self._gloo.send([next(sent)], peer, self._tag(tag)))
                else:
                    works.append(self._gloo.recv([next(got)], peer, self._tag(tag)))
            return works

        what = "batch of " + ", ".join(f"{k} #{n} {'to' if k == 'send' else 'from'} rank {p}" for k, p, n in p2p)
        return self._post(what, sends, recvs, run, p2p)

    # -- collectives ------------------------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._post("allreduce", tensors, tensors, lambda w: [self._gloo.allreduce(w.received(), opts)])

    def allreduce_coalesced(self, tensors, opts=None):
        def run(w):
            one = dist.AllreduceOptions()
            one.reduceOp = opts.reduceOp
            return [self._gloo.allreduce([t], one) for t in w.received()]
        return self._post("allreduce_coalesced", tensors, tensors, run)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        root = opts.rootRank == self._rank
        return self._post("broadcast", tensors, [] if root else tensors,
                          lambda w: [self._gloo.broadcast(w.sent() if root else w.received(), opts)])

    def reduce(self, tensors, opts=None):
        return self._post("reduce", tensors, tensors, lambda w: [self._gloo.reduce(w.received(), opts)])

    def barrier(self, opts=None):
        return self._post("barrier", [], [], lambda w: [self._gloo.allreduce([torch.zeros(1)])])

    def allgather(self, output_lists, inputs, opts=None):
        outs = [t for ts in output_lists for t in ts]
        sizes = [len(ts) for ts in output_lists]

        def run(w):
            return [self._gloo.allgather(_split(w.received(), sizes), self._inputs_for(w, inputs, outs),
                                         opts or AllgatherOptions())]
        return self._post("allgather", inputs, outs, run)

    def all_gather_single(self, output, input, opts=None):
        return self._all_gather_many([output], [input], opts, "all_gather_into_tensor")

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._all_gather_many(outputs, inputs, opts, "all_gather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _all_gather_many(self, outputs, inputs, opts, what):
        def run(w):
            sent = self._inputs_for(w, inputs, outputs)
            return [self._gloo._allgather_base(o, i, AllgatherOptions()) for o, i in zip(w.received(), sent)]
        return self._post(what, inputs, outputs, run)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        ins = [t for ts in input_lists for t in ts]

        def run(w):
            sent = _split(self._inputs_for(w, ins, outputs), [len(ts) for ts in input_lists])
            return [self._gloo.reduce_scatter(w.received(), sent, opts)]
        return self._post("reduce_scatter", ins, outputs, run)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_many([output], [input], opts, "reduce_scatter_tensor")

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter_many(outputs, inputs, opts, "reduce_scatter_tensor_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_many(self, outputs, inputs, opts, what):
        def run(w):
            sent = self._inputs_for(w, inputs, outputs)
            one = dist.ReduceScatterOptions()
            one.reduceOp = opts.reduceOp
            return [self._gloo._reduce_scatter_base(o, i, one) for o, i in zip(w.received(), sent)]
        return self._post(what, inputs, outputs, run)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        def run(w):
            (sent,) = self._inputs_for(w, [input], [output])
            return [self._gloo.alltoall_base(w.received()[0], sent, output_splits, input_splits,
                                             opts or dist.AllToAllOptions())]
        return self._post("all_to_all_single", [input], [output], run)

    def alltoall(self, outputs, inputs, opts=None):
        def run(w):
            return [self._gloo.alltoall(w.received(), self._inputs_for(w, inputs, outputs),
                                        opts or dist.AllToAllOptions())]
        return self._post("alltoall", inputs, outputs, run)

    @staticmethod
    def _inputs_for(work: ModelWork, inputs, outputs) -> list[torch.Tensor]:
        """The tensors an out-of-place op reads: the snapshots, with inputs that alias an output (in-place
        all-gather or reduce-scatter) read from the private copy of that output."""
        snaps = iter(work.sent())
        out = []
        for t in inputs:
            home = next((i for i, o in enumerate(outputs) if _overlaps(t, o)), None)
            if home is None:
                out.append(next(snaps))
                continue
            o, private = outputs[home], work.received()[home]
            offset = t.storage_offset() - o.storage_offset()
            out.append(private.view(-1)[offset:offset + t.numel()].view_as(t).clone())
        return out


def _split(flat: list, sizes: list[int]) -> list[list]:
    """Cut a flat list back into consecutive lists of the given sizes (torch's list-of-lists collectives)."""
    out, i = [], 0
    for n in sizes:
        out.append(flat[i:i + n])
        i += n
    return out


# -- registration ---------------------------------------------------------------------------------------------
def _create(opts, options) -> ModelGroup:
    """A group of the model, from torch's extended backend arguments and the group's options, whose shape is
    `ProcessGroupNCCL.Options`' (`config.blocking`: 0 non-blocking, 1 blocking; unset: TORCH_NCCL_USE_COMM_NONBLOCKING,
    as torch's `useNonblocking` reads them)."""
    chosen = getattr(getattr(options, "config", None), "blocking", None)
    blocking = chosen != 0 if chosen is not None else os.environ.get(NONBLOCKING_ENV, "0") not in ("1", "true")
    return ModelGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, blocking)


_batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv


def batch_isend_irecv(p2p_op_list):
    """torch's `batch_isend_irecv`, with NCCL's coalesced result (one Work) for nccl_model groups."""
    group = p2p_op_list[0].group if p2p_op_list else None
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(group, ModelGroup):
        return _batch_isend_irecv(p2p_op_list)

    def post():
        for op in p2p_op_list:
            key = "group_dst" if op.op is dist.isend else "group_src"
            op.op(op.tensor, group=op.group, tag=op.tag, **{key: op.group_peer})

    work = group.batch(post)
    return [work] if rule_on("coalesce") else [work] * len(p2p_op_list)


device.register(NAME, record_event, hang_device, synchronize)
if NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
    dist.distributed_c10d.batch_isend_irecv = batch_isend_irecv
    dist.batch_isend_irecv = batch_isend_irecv
