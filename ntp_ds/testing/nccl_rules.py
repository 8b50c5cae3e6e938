"""The NCCL rules the `nccl_model` backend keeps, the switch that turns one off, and the errors a broken rule raises.

Each rule can be switched off alone (`NTP_NCCL_MODEL_OFF=rule,rule`), to show it is the one that catches a given bug:

- `coalesce`: `batch_isend_irecv` and the coalesced collectives return ONE Work for the whole batch, and it fails
  as a unit. torch takes its coalesced path only for a plain ProcessGroup with a C++ backend, which a Python group
  is not, so `nccl_model` wraps `torch.distributed.batch_isend_irecv` for its own groups (other groups are passed
  through untouched).
- `async`: an op's outputs (a collective's result, a received buffer) hold a poison pattern (NaN for floating
  tensors, the type's extreme value for integers) until its Work is waited or reports completion, and its inputs
  must not change before then: the wait raises `RuleViolation` when an input was written while in flight (NCCL
  would send whatever the buffer held when its kernel read it).
- `order`: each group runs its ops one after another, as an NCCL communicator's stream does, and a point-to-point
  op (alone or in a batch) runs only once the peer's matching op reaches the head of the peer's stream. A send
  posted before its receive on both sides of a pair (or around a ring) never progresses: after
  `NTP_NCCL_MODEL_DEADLOCK_S` seconds (default 60) its Work fails with `Deadlock`, naming the ops and ranks.
- `tags`: tags are ignored; messages between a pair match in posting order.
- `first`: a communicator's first op may be a batch of point-to-point ops only if it involves every rank of the
  group (torch documents anything else as undefined under NCCL); start a group with a collective.
- `abort`: no timeout ends an op (async error handling 0): an op whose peer died stays pending until the group is
  aborted. `abort()` ends every pending op as torch 2.13's `ProcessGroupNCCL` does: the aborted kernel exits, so
  the Work reports complete (`WorkNCCL::isCompleted` skips its error check once the communicator is aborted) and
  its wait returns without raising (`WorkNCCL::wait` only orders the stream); each output holds some chunks of the
  message (NCCL moves a message over several channels, in no fixed order) and what the memory held before
  elsewhere (here: the poison). Any later op on the group raises, as on an aborted NCCL communicator. Only a
  completion observed before the abort proves that an op's data arrived (`ntp_ds.comm.wire`, "proofs").
- `create`: a communicator is created at its group's first op (torch's `ProcessGroupNCCL::collective` and
  `pointToPoint` call `initNCCLComm` when the group has none; no device is bound at group creation), by a blocking
  `ncclCommInitRank` on the posting thread, which returns only once every member of the group has reached its own
  first op: the host blocks in the post, even of an async op, and no abort reaches it (torch enters the communicator
  in the map an abort walks only after the init returns). A member that never gets there strands the others: NCCL
  hangs for good; after `NTP_NCCL_MODEL_DEADLOCK_S` seconds the post raises `Deadlock`, naming the missing ranks.
  A non-blocking communicator (`config.blocking = 0` in the group's options, else
  `TORCH_NCCL_USE_COMM_NONBLOCKING=1`) is created the same way, but its first use waits for it at most
  `TORCH_NCCL_NONBLOCKING_TIMEOUT` seconds (1800 by default; torch's `NCCLComm::waitReady`) and then raises
  `DistBackendError` ("NCCL timeout"); no abort ends that wait either (it holds the communicator's mutex).
- `device`: the process has one device, which can stop (`hang_device`: a kernel that never ends on the stream the
  training thread queues to, as `torch.cuda._sleep` spins): an op posted after it never starts (ProcessGroupNCCL
  orders each op's stream after the current stream), pending until the group is aborted, and a device event
  recorded after it never completes (`record_event`, registered with `ntp_ds.comm.device`). With the rule off the
  device never stops.
- `sync`: a device sync (`synchronize`, registered with `ntp_ds.comm.device`; the product's `settle_device`) returns
  only once the device has run what it waits for. A stream sync (`torch.cuda.current_stream().synchronize()`, as a
  `.item()` or `.tolist()` of a device tensor makes) waits for everything queued on the training thread's stream: it
  never returns once the device has stopped (a spin kernel is not ended by an abort). A sync of the whole device
  (`torch.cuda.synchronize()`) also waits for every kernel still running on any of the process's communicators,
  until it completes or an abort of its communicator ends it. (A stream sync does not wait for a communicator's
  ops: the current stream waits on an op only once its Work is waited, and here a wait blocks the host.) NCCL
  hangs for good; after `NTP_NCCL_MODEL_DEADLOCK_S` seconds the sync raises `Deadlock`.
- `watchdog`: an op still pending at its group's timeout is caught by the group's watchdog, as torch's
  `Watchdog::runLoop` does under async error handling 0: nothing is aborted and the caller's Work does not change
  (the watchdog marks its own copy: the op stays incomplete, its wait returns nothing new, its exception stays
  None), but the watchdog then sleeps 4 x `TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC` (15 s by default) holding the
  group's work list, whatever the dump setting, so the next op posted on the group blocks its host until the sleep
  ends (one sleep per op that timed out, one after another).
"""

from __future__ import annotations

import os

from ntp_ds import envs

RULES = ("coalesce", "async", "order", "tags", "first", "abort", "device", "create", "sync", "watchdog")
OFF_ENV = envs.MODEL_OFF_ENV
DEADLOCK_ENV = envs.MODEL_DEADLOCK_ENV
NONBLOCKING_ENV = envs.NONBLOCKING_ENV
NONBLOCKING_TIMEOUT_ENV = envs.NONBLOCKING_TIMEOUT_ENV
DUMP_WAIT_ENV = envs.NCCL_DUMP_WAIT_ENV
DUMP_WAIT_MS = 15_000
"""torch's default for DUMP_WAIT_ENV: the watchdog sleeps four times this after each op that timed out."""


class DeviceStopped(RuntimeError):
    """An op queued behind a kernel that never ends: it never starts (pending until its group is aborted)."""


class RuleViolation(RuntimeError):
    """The program broke a rule NCCL imposes (a buffer used while its op was in flight)."""


class Deadlock(BaseException):
    """NCCL would hang here for good (a point-to-point op that never met its match, a blocking communicator
    creation a member never reached, a device sync behind a kernel that never ends). Not an Exception: the code
    under test cannot take it for a failure it recovers from, since on NCCL its thread would never return."""


class Aborted(RuntimeError):
    """An op was posted on an aborted communicator (its pending ops were cut: they report complete, and their
    outputs hold part of the message at most)."""


def rule_on(rule: str) -> bool:
    """Whether `rule` is enforced (all are, unless named in NTP_NCCL_MODEL_OFF)."""
    if rule not in RULES:
        raise ValueError(f"unknown nccl_model rule {rule!r}; rules: {', '.join(RULES)}")
    off = {r.strip() for r in os.environ.get(OFF_ENV, "").split(",") if r.strip()}
    unknown = off - set(RULES)
    if unknown:
        raise ValueError(f"{OFF_ENV} names unknown rules {sorted(unknown)}; rules: {', '.join(RULES)}")
    return rule not in off
