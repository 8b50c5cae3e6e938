"""The recovery layer's errors, and which errors a recovery starts again from."""

from __future__ import annotations

from ntp_ds.comm import wire
from ntp_ds.control.membership import Evicted


class RecoveryImpossible(RuntimeError):
    """Training cannot go on in memory: no replica is left, or some parameter has no copy on any survivor."""


class NoReplicaLeft(RecoveryImpossible):
    """Every replica fell below `min_tp`."""


class QuiescedExit(SystemExit):
    """This rank leaves the job (its replica was dropped, or its own device failed)."""


def failed_on_the_way(error: BaseException) -> bool:
    """Whether `error`, raised while a recovery or a grow was under way, is a failure to start it again from: a
    member lost meanwhile (the recovery's own checks raise RuntimeError), a failure of the wire, or anything that
    fails once a peer has been declared dead (`wire.is_wire_failure`: DeepSpeed's own calls assert on a world the
    abort thread has aborted). Never `RecoveryImpossible`, nor `Evicted`: the committed decision declared this rank
    dead, so it leaves the job (another attempt would read the same decision again, up to once per member)."""
    if isinstance(error, (RecoveryImpossible, Evicted)):
        return False
    return isinstance(error, (RuntimeError, TimeoutError, ConnectionError)) or wire.is_wire_failure(error)
