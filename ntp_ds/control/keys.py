"""Every key ntp_ds reads or writes in the job's store, named once.

The store outlives every rank (the launcher hosts it, or etcd). Keys are grouped by who writes them; a key that
names a generation belongs to it alone (nothing of an older generation is read by a newer one). Counters are keys
whose value `add` moves; a barrier named B keeps one key per arrival (`B/{rank}`), a tree of counters of the
arrivals (`B/c/{level}/{node}`, `membership.BarrierWait`) and, once all arrived, `B/done`.
"""

from __future__ import annotations

import hashlib
from array import array

# -- the launcher and the sentinel ----------------------------------------------------------------------------------
MASTER_PORT_KEY = "launch/master_port"
"""Where node 0 publishes the env:// master port."""
MASTER_ADDR_KEY = "launch/master_addr"
"""On an etcd store, where node 0 publishes the env:// master host (on a TCPStore it is the store's host)."""
LAUNCH_RANKS_KEY = "launch/joined_ranks"
"""Counter of launch ranks given to joining workers (they number from the job's world size up)."""
PING_KEY = "launch/ping"
"""Read once through a store cluster to see that some member answers (never written)."""
JOB_OVER_KEY = "sentinel/job_over"
"""Set by rank 0's sentinel once the job is over: `finished` when some rank finished it, else `failed`."""
SENTINEL_DONE_KEY = "sentinel/done"
"""Store counter of the sentinels (other than rank 0's) done with the store."""

# -- the job ------------------------------------------------------------------------------------------------------------
JOB_KEY = "job/info"
STEP_KEY = "job/step"
STOP_KEY = "job/stop"
WANDB_ID_KEY = "run/wandb_id"
"""The writer's W&B run id, which a rank taking over the records resumes."""

# -- liveness -------------------------------------------------------------------------------------------------------------
EXITED_KEY = "exited"
"""The exit log: `mark_exited` files one `RANK REASON` entry per worker known to have exited (`log_entry_key`)."""
FENCE_KEY = "fence"
"""The fence log: `request_fence` files one `RANK REASON` entry per worker its peers declared dead (once: a counter
per rank, `fence_count_key`, admits the first request)."""
ALARM_EPOCH_KEY = "alarm/epoch"
"""Store counter of the alarms raised so far in the job."""
ALARM_BUCKETS_KEY = "alarm/buckets"
"""Store key to which the first watcher of each bucket appends the bucket's number: whose key an alarm sets."""


def heartbeat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


def node_key(node: int) -> str:
    return f"node/{node}"


def rack_store_key(rack: int) -> str:
    """Job-store key of the address of rack `rack`'s store (set by the launcher of its first node)."""
    return f"rack/{rack}/store"


# -- a node's own store (`control.node_store`): its workers' beats, what they watch, the launcher's mirror ----------
NODE_MIRROR_KEY = "mirror"
"""Node-store key of the launcher's copy of the job-store keys its workers' watchers poll (`NodeMirror`)."""


WATCHERS = ("heartbeat", "recovery")
"""The readers of a worker that list what they watch: its heartbeat's, its recovery's (`watching_key`)."""


def watching_key(rank: int, watcher: str = "heartbeat") -> str:
    """Node-store key listing the nodes whose keys a reader (`WATCHERS`) of worker `rank` watches (what the launcher
    copies for it)."""
    return f"watching/{rank}/{watcher}"


def alarm_key(bucket: int, epoch: int) -> str:
    """Store key whose setting wakes the watchers of `bucket` waiting for alarm `epoch`."""
    return f"alarm/{bucket}/{epoch}"


RELAYED_EPOCH_KEY = "relay/epoch"
"""Key of a node's own store: the job's alarm epoch as its launcher last relayed it (`liveness_store.AlarmRelay`)."""


def relayed_alarm_key(epoch: int) -> str:
    """Key of a node's own store whose setting wakes the node's watchers waiting for alarm `epoch`."""
    return f"relay/{epoch}"


def alarm_watchers_key(bucket: int) -> str:
    return f"alarm/watchers/{bucket}"


def fence_count_key(rank: int) -> str:
    return f"{FENCE_KEY}/{rank}"


def log_count_key(log: str) -> str:
    """Store counter of the entries filed in the job log `log` (`EXITED_KEY`, `FENCE_KEY`)."""
    return f"{log}/entries"


def log_entry_key(log: str, n: int) -> str:
    """Entry `n` (from 1) of the job log `log`: written once, never changed."""
    return f"{log}/entry/{n}"


# -- injected faults ------------------------------------------------------------------------------------------------------
FAULT_COUNT_KEY = "fault/count"
"""Store counter of faults sent to the running job; fault n is stored under `fault_key(n)`, n from 1."""


def fault_key(n: int) -> str:
    return f"fault/{n}"


def fired_key(rank: int) -> str:
    """Where a rank records the fault it fired and when (to measure detection)."""
    return f"fault/fired/{rank}"


# -- joins ----------------------------------------------------------------------------------------------------------------
JOIN_REQUESTS_KEY = "join/requests"
JOIN_EVENTS_KEY = "join/events"


def join_plan_key(generation: int) -> str:
    return f"join/plan/{generation}"


def join_verdict_key(rank: int) -> str:
    return f"join/verdict/{rank}"


# -- membership agreement -------------------------------------------------------------------------------------------------
def decision_key(generation: int) -> str:
    """The committed decision that ends `generation`."""
    return f"decision/{generation}"


def membership_key(generation: int, name: str) -> str:
    """`reports`, `events`, `acks`, `confirm` or `dead/{rank}` of `generation`'s agreement."""
    return f"membership/{generation}/{name}"


def process_group_prefix(generation: int) -> str:
    """The prefix of `generation`'s process groups' rendezvous keys (torch's and the groups' own)."""
    return f"pg/{generation}"


# -- recovery -------------------------------------------------------------------------------------------------------------
def departure_key(generation: int, group: str) -> str:
    """A departure from the group named `group` in `generation` (`recovery.keep.depart`)."""
    return f"left/{generation}/{group}"


def drain_key(generation: int, role: str, first: int) -> str:
    """The vote of a group the next generation may keep (`recovery.keep.keep`), named by its role and first member."""
    return f"drain/{generation}/{role}/{first}"


def barrier_key(generation: int, name: str, members) -> str:
    """A recovery's barrier: ranks that expect different members never share one (a joiner admitted at a boundary
    that a failure took instead waits at its own, and fails on the dead rank it names). Members are hashed as 8-byte
    integers: a member list is W long, and this is on every survivor's path."""
    return f"recovery/{generation}/{name}/{hashlib.sha256(array('q', members).tobytes()).hexdigest()[:12]}"


def generation_keys(generation: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(prefixes, exact keys) of every key that belongs to `generation` alone: its agreement, its process groups'
    rendezvous, its recovery's departures, drains and barriers, its decision and its join plan. Once two newer
    generations exist nobody reads them again (`control.store.forget_generation`)."""
    g = generation
    return ((membership_key(g, ""), f"{process_group_prefix(g)}/", f"left/{g}/", f"drain/{g}/", f"recovery/{g}/"),
            (decision_key(g), join_plan_key(g)))
