"""The coordination store on an etcd v3 cluster: a job that outlives any one host, its launcher's included.

`connect_store("etcd://HOST:PORT[,HOST:PORT...][/JOB]")` returns an `EtcdStore`: a `torch.distributed.Store` (so
process groups rendezvous on it as on a TCPStore) whose keys live in etcd under `/ntp_ds/JOB/` (JOB defaults to
`job`). It speaks etcd's gRPC API (the generated stubs of `etcd-sdk-python`), one member at a time; when that member
stops answering (or has no leader) it moves to the next and retries until the store's timeout. With three members
the cluster keeps its quorum through the loss of any one. A process keeps one channel per member and one watch
stream on it for all its waits, whatever its number of clients; a launcher, which forks its workers, speaks HTTP to
etcd's v3 gateway instead (`etcd3gw`; see `EtcdStore`).

torch's store semantics, kept exactly:
- `get` and `wait` block until the keys exist (bounded by the timeout); `check` does not. A wait reads the key, and
  if it is absent watches it (etcd's watch stream, from the revision it read), so a waiting rank costs the cluster
  one open stream and one read every `RECHECK_S`, not a poll every few milliseconds.
- `add` is an atomic counter kept as decimal text, `append` an atomic concatenation, `compare_set` a swap that
  returns the value now held (creating the key when `expected` is empty and the key is absent).
- `add`, `append` and `compare_set` each run as one etcd transaction guarded by the key's revision. A transaction
  whose answer was lost with its member may or may not have been applied: `add` and `append` leave a receipt key in
  the same transaction, so the retry returns the first attempt's result instead of applying it twice. A counter
  read (`add(key, 0)`) is one read, not a transaction: readers never retry each other out.
- A request etcd refuses as such (its space quota full, a revision compacted) raises `EtcdRefused` at once; only a
  member that does not answer sends the request to the next one.

What the job does for the cluster: its launchers compact etcd's history every `COMPACT_EVERY_REVISIONS` revisions
(`compact_if_due`, one claims it), and the first member of each new generation deletes the keys of the generation
two before (`delete_prefix`; `control.store.forget_generation`), so neither history nor keys grow with the job's age.

Every rank opens its own clients; a thread that must not be delayed (the heartbeat) takes `clone()`.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import threading
import time
import uuid

import torch.distributed as dist

from ntp_ds.control.address import parse_etcd_address
from ntp_ds.envs import ETCD_COMPACT_ENV, GRPC_FORK_SUPPORT_ENV

ROOT = "/ntp_ds/"
REQUEST_TIMEOUT_S = 2.0
"""Bound on one HTTP request to one member before the client tries the next."""
TXN_OPS = 128
"""Most operations one etcd transaction holds (etcd's default `--max-txn-ops`): `multi_set` and `multi_get` send
their keys in transactions of this many, not one request per key (an alarm at 100K ranks sets 3,125 keys)."""
RECHECK_S = 5.0
"""A wait's watch stream is given up and the key read again after this long without news (a member that hangs, or
a stream lost with its member, costs no more than this)."""
COMPACTION_KEY = b"__compaction"
"""Under the job's prefix: the revision the job last compacted the cluster's history to (`compact_if_due`)."""
COMPACT_EVERY_REVISIONS = 10_000
"""The job compacts the cluster's history once it has grown by this many revisions (writes) since the last time
(`NTP_ETCD_COMPACT_EVERY` sets another): etcd keeps every revision of every key until compacted, and its space
quota (2 GiB by default) once full refuses every write (NOSPACE)."""
REFUSED_CODES = {3: "invalid argument", 8: "resource exhausted", 11: "out of range"}
"""gRPC status codes (as the v3 gateway passes them on) of a request etcd refuses as such: no other member would
answer it otherwise, so it is not retried there (8: the space quota is full; 11: a revision already compacted)."""


TRANSPORTS = ("grpc", "http")


class _MemberFailed(Exception):
    """The current member did not answer (its cause says how): the request goes to the next one."""


class EtcdRefused(dist.DistStoreError):
    """etcd answered the request with a refusal (`REFUSED_CODES`), not a failure of its member."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _refusal(err) -> tuple[int, str] | None:
    """(gRPC code, message) of an answer that refuses the request itself (`REFUSED_CODES`), else None."""
    try:
        detail = json.loads(getattr(err, "detail_text", None) or "")
    except ValueError:
        return None
    code = detail.get("code") if isinstance(detail, dict) else None
    return (code, str(detail.get("error") or detail.get("message") or "")) if code in REFUSED_CODES else None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):  # what torch hands a Python store from C++ callers
        return bytes(value)
    raise TypeError(f"store values are bytes or str, got {type(value).__name__}")


def _prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of every key that starts with `prefix` (etcd's `range_end`)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class _Channels:
    """One process's gRPC connection to one etcd cluster: a channel per member and, on each, one watch stream that
    carries every watch of the process (pyetcd's `Watcher`). Every `EtcdStore` of the process on that cluster (its
    clones included) shares it, so a process holds one connection per member however many clients and waits it has
    (the v3 HTTP gateway took a connection per request in flight and per wait)."""

    _shared: dict = {}
    _lock = threading.Lock()

    def __init__(self, endpoints: list[tuple[str, int]]):
        # gRPC's own fork handlers restart its threads in a forked child, where a child that closes the descriptors
        # it inherited (a forked worker, `supervise.forked`) then aborts on the closed poller: off, a child holds
        # no gRPC thread and never touches the parent's channels (`of` keys them by process).
        os.environ.setdefault(GRPC_FORK_SUPPORT_ENV, "false")
        import grpc
        from pyetcd import etcdrpc

        self.channels = [grpc.insecure_channel(f"{host}:{port}") for host, port in endpoints]
        self.stubs = {"kv": [etcdrpc.KVStub(c) for c in self.channels],
                      "maintenance": [etcdrpc.MaintenanceStub(c) for c in self.channels]}
        self._watchers: list = [None] * len(endpoints)

    @classmethod
    def of(cls, endpoints: list[tuple[str, int]]) -> _Channels:
        key = (os.getpid(), tuple(endpoints))  # a forked child builds its own: a parent's channels are not its
        with cls._lock:
            if key not in cls._shared:
                cls._shared[key] = cls(endpoints)
            return cls._shared[key]

    def call(self, member: int, path: str, payload: dict) -> dict:
        """The gateway's request `payload` for `path`, sent as the gRPC call it stands for; its answer in the
        gateway's form (the protobuf JSON mapping both speak)."""
        from google.protobuf import json_format

        service, method, request = _GRPC_CALLS[path]
        stub = self.stubs[service][member]
        answer = getattr(stub, method)(json_format.ParseDict(payload, request()), timeout=REQUEST_TIMEOUT_S)
        return json_format.MessageToDict(answer, preserving_proto_field_name=True)

    def watcher(self, member: int):
        from pyetcd import etcdrpc
        from pyetcd.watch import Watcher

        with self._lock:
            if self._watchers[member] is None:
                self._watchers[member] = Watcher(etcdrpc.WatchStub(self.channels[member]), timeout=REQUEST_TIMEOUT_S)
            return self._watchers[member]


def _grpc_calls() -> dict:
    from pyetcd import etcdrpc

    return {"/kv/range": ("kv", "Range", etcdrpc.RangeRequest), "/kv/put": ("kv", "Put", etcdrpc.PutRequest),
            "/kv/txn": ("kv", "Txn", etcdrpc.TxnRequest),
            "/kv/deleterange": ("kv", "DeleteRange", etcdrpc.DeleteRangeRequest),
            "/kv/compaction": ("kv", "Compact", etcdrpc.CompactionRequest),
            "/maintenance/status": ("maintenance", "Status", etcdrpc.StatusRequest)}


class _Calls(dict):
    """`_grpc_calls()`, built at first use (the protobuf modules load only where gRPC is the transport)."""

    def __missing__(self, path):
        self.update(_grpc_calls())
        return self[path]


_GRPC_CALLS = _Calls()


class EtcdStore(dist.Store):
    """A `torch.distributed.Store` kept in an etcd v3 cluster (see the module docstring).

    `transport`: `grpc` (etcd's own API: one channel per member and one watch stream per process, shared by every
    client of the process) or `http` (the v3 gateway, a connection per request). A process that forks workers
    takes `http`: gRPC's state does not survive into a child that closes the descriptors it inherited, as a forked
    worker does (`supervise.forked`)."""

    def __init__(self, address: str, timeout_s: float = 60.0, transport: str = "grpc"):
        super().__init__()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} must be one of {', '.join(TRANSPORTS)}")
        self.address, self.transport = address, transport
        endpoints, job = parse_etcd_address(address)
        self._prefix = f"{ROOT}{job}/".encode()
        self._members = len(endpoints)
        if transport == "grpc":
            self._channels, self._clients = _Channels.of(endpoints), None
        else:
            from etcd3gw.client import Etcd3Client

            self._channels = None
            self._clients = [Etcd3Client(host=h, port=p, timeout=REQUEST_TIMEOUT_S, api_path="/v3/")
                             for h, p in endpoints]
        self._at = 0
        self._timeout_s = timeout_s
        every = os.environ.get(ETCD_COMPACT_ENV) or str(COMPACT_EVERY_REVISIONS)
        if not every.isdigit() or int(every) < 1:
            raise ValueError(f"{ETCD_COMPACT_ENV}={every!r} must be a positive number of revisions")
        self.compact_every = int(every)
        """Revisions between two compactions by the job (`compact_if_due`)."""
        self.set_timeout(datetime.timedelta(seconds=timeout_s))

    # -- transport -------------------------------------------------------------------------------------------------
    def _call(self, path: str, payload: dict) -> dict:
        """Send the gateway-form request `payload` for `path` to the current member, moving to the next one on a
        failure, until the store's timeout; a refusal (`REFUSED_CODES`) is raised at once (`EtcdRefused`)."""
        deadline = time.monotonic() + self._timeout_s
        pause = 0.05
        while True:
            try:
                return self._request(path, payload)
            except _MemberFailed as err:  # refused the connection, timed out, no leader
                failure = err.__cause__
            if time.monotonic() + pause > deadline:
                raise dist.DistStoreError(f"etcd store {self.address}: no member answered within {self._timeout_s}s "
                                          f"(last: {type(failure).__name__}: {str(failure)[:200]})")
            self._at = (self._at + 1) % self._members
            if self._at == 0:  # every member tried once: the cluster may be electing a leader
                time.sleep(pause)
                pause = min(2 * pause, 0.5)

    def _request(self, path: str, payload: dict) -> dict:
        """One request to the current member: its answer, or EtcdRefused, or _MemberFailed."""
        if self._channels is not None:
            import grpc

            try:
                return self._channels.call(self._at, path, payload)
            except grpc.RpcError as err:
                code, text = err.code().value[0], err.details() or ""
                if code in REFUSED_CODES:
                    raise self._refused(path, code, text) from None
                raise _MemberFailed() from err
        from etcd3gw import exceptions

        client = self._clients[self._at]
        try:
            return client.post(client.get_url(path), json=payload)
        except exceptions.Etcd3Exception as err:  # refused, timed out, no leader, or any other answer but 200
            refusal = _refusal(err)
            if refusal is not None:
                raise self._refused(path, *refusal) from None
            raise _MemberFailed() from err

    def _refused(self, path: str, code: int, text: str) -> EtcdRefused:
        hint = (": the cluster's space quota is full (NOSPACE); compact and defragment it, and raise "
                "--quota-backend-bytes" if code == 8 and "space" in text else "")
        return EtcdRefused(f"etcd store {self.address}: {path} refused ({REFUSED_CODES[code]}: {text}){hint}", code)

    def _key(self, key) -> bytes:
        return self._prefix + _bytes(key)

    def _range(self, key: bytes) -> dict | None:
        """The key's record (value, mod_revision) or None."""
        kvs = self._call("/kv/range", {"key": _b64(key)}).get("kvs")
        return kvs[0] if kvs else None

    def _txn(self, compare: list, success: list) -> bool:
        return bool(self._call("/kv/txn", {"compare": compare, "success": success, "failure": []}).get("succeeded"))

    @staticmethod
    def _put(key: bytes, value: bytes) -> dict:
        return {"request_put": {"key": _b64(key), "value": _b64(value)}}

    @staticmethod
    def _unchanged(key: bytes, record: dict | None) -> dict:
        """The transaction's guard: the key is as `record` found it (absent when None)."""
        if record is None:
            return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": record["mod_revision"]}

    def _update(self, key, change) -> bytes:
        """Apply `change(current bytes or None) -> new bytes` atomically and exactly once; return the new value."""
        full = self._key(key)
        receipt = self._prefix + b"__receipt/" + uuid.uuid4().hex.encode()
        while True:
            record = self._range(full)
            current = base64.b64decode(record.get("value", "")) if record is not None else None
            new = change(current)
            if self._txn([self._unchanged(full, record)], [self._put(full, new), self._put(receipt, new)]):
                break
            done = self._range(receipt)  # an earlier attempt may have been applied though its answer was lost
            if done is not None:
                new = base64.b64decode(done.get("value", ""))
                break
        self._call("/kv/deleterange", {"key": _b64(receipt)})
        return new

    # -- torch.distributed.Store ------------------------------------------------------------------------------------
    def set(self, key, value) -> None:
        self._call("/kv/put", {"key": _b64(self._key(key)), "value": _b64(_bytes(value))})

    def get(self, key) -> bytes:
        record = self._range(self._key(key))
        if record is None:  # not there yet: wait for it, then read it
            self.wait([key])
            record = self._range(self._key(key))
        if record is None:  # deleted between the wait and the read
            raise dist.DistStoreError(f"etcd store {self.address}: key {key!r} vanished")
        return base64.b64decode(record.get("value", ""))

    def add(self, key, amount: int) -> int:
        if int(amount) == 0:  # a counter read is a read: no transaction, no contention with the writers
            record = self._range(self._key(key))
            if record is not None:
                return int(base64.b64decode(record.get("value", "")) or b"0")
        return int(self._update(key, lambda cur: str(int(cur or b"0") + int(amount)).encode()))

    def append(self, key, value) -> None:
        tail = _bytes(value)
        self._update(key, lambda cur: (cur or b"") + tail)

    def compare_set(self, key, expected, desired) -> bytes:
        full, expected, desired = self._key(key), _bytes(expected), _bytes(desired)
        while True:
            record = self._range(full)
            if record is None and expected:
                return expected  # torch's stores answer so for a key that does not exist
            current = base64.b64decode(record.get("value", "")) if record is not None else b""
            if record is not None and current != expected:
                return current
            if self._txn([self._unchanged(full, record)], [self._put(full, desired)]):
                return desired
            # changed since the read (or applied by an attempt whose answer was lost): read again

    def check(self, keys) -> bool:
        return all(self._range(self._key(k)) is not None for k in keys)

    def wait(self, keys, timeout=None) -> None:
        limit = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else self._timeout_s
        deadline = time.monotonic() + limit
        for key in keys:
            full = self._key(key)
            while True:
                answer = self._call("/kv/range", {"key": _b64(full)})
                if answer.get("kvs"):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(f"etcd store {self.address}: timed out after {limit}s waiting for "
                                              f"key {_bytes(key).decode(errors='replace')!r}")
                self._watch_put(full, int(answer["header"]["revision"]) + 1, min(left, RECHECK_S))

    def _watch_put(self, key: bytes, revision: int, seconds: float) -> None:
        """Block until `key` is put at `revision` or later, or `seconds` pass without news, or the watch fails (its
        revision compacted, its stream lost with its member); the caller reads the key again in every case."""
        if self._channels is not None:
            self._watch_put_grpc(key, revision, seconds)
        else:
            self._watch_put_http(key, revision, seconds)

    def _watch_put_grpc(self, key: bytes, revision: int, seconds: float) -> None:
        from pyetcd import etcdrpc

        put = threading.Event()
        watcher = self._channels.watcher(self._at)
        try:  # on the process's one stream to this member, next to every other watch of the process
            watch = watcher.add_callback(key, lambda _answer: put.set(), start_revision=revision,
                                         filters=[etcdrpc.WatchCreateRequest.NODELETE])
        except Exception:  # not created in time, its revision compacted, or the stream lost
            time.sleep(min(seconds, 0.05))
            return
        try:
            put.wait(seconds)
        finally:
            watcher.cancel(watch)

    def _watch_put_http(self, key: bytes, revision: int, seconds: float) -> None:
        import requests

        client = self._clients[self._at]
        request = {"create_request": {"key": _b64(key), "start_revision": str(revision), "filters": ["NODELETE"]}}
        try:
            with client.session.post(client.get_url("/watch"), json=request, stream=True,
                                     timeout=(REQUEST_TIMEOUT_S, max(0.05, seconds))) as response:
                if response.status_code != 200:
                    time.sleep(min(seconds, 0.05))  # the caller's read moves on to another member if need be
                    return
                for line in response.iter_lines():
                    result = json.loads(line).get("result", {}) if line else {}
                    if result.get("events") or result.get("canceled"):  # (canceled: its revision was compacted)
                        return
        except (requests.exceptions.RequestException, ValueError):
            time.sleep(min(seconds, 0.05))  # a stream lost with its member, or no news within `seconds`

    def delete_prefix(self, prefix) -> int:
        """Delete every key that starts with `prefix` (one request); return how many there were."""
        start = self._key(prefix)
        answer = self._call("/kv/deleterange", {"key": _b64(start), "range_end": _b64(_prefix_end(start))})
        return int(answer.get("deleted", 0))

    def compact_if_due(self, every: int | None = None) -> int | None:
        """Compact the cluster's history to the current revision once it has grown by `every` revisions since the
        job last did; return that revision, or None when not due (or another client of the job claimed it first).

        Every launcher of the job calls this now and then (`ntp-ds launch`): one guarded transaction on
        `COMPACTION_KEY` picks the one that compacts, so the job compacts once per `every` revisions whichever
        nodes are left. Compaction keeps every key's current value; it drops the older ones, so the space they took
        is reused and the quota never fills with history. A wait watching from a compacted revision reads its key
        again (`_watch_put` gives up the stream)."""
        every = self.compact_every if every is None else every
        key = self._prefix + COMPACTION_KEY
        answer = self._call("/kv/range", {"key": _b64(key)})
        revision = int(answer["header"]["revision"])
        record = (answer.get("kvs") or [None])[0]
        last = int(base64.b64decode(record.get("value", ""))) if record is not None else 0
        if revision - last < every:
            return None
        if not self._txn([self._unchanged(key, record)], [self._put(key, str(revision).encode())]):
            return None
        try:
            self._call("/kv/compaction", {"revision": str(revision)})
        except EtcdRefused as refused:
            if refused.code != 11:  # 11: another job sharing the cluster compacted past it already
                raise
        return revision

    def delete_key(self, key) -> bool:
        return int(self._call("/kv/deleterange", {"key": _b64(self._key(key))}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        answer = self._call("/kv/range", {"key": _b64(self._prefix), "range_end": _b64(_prefix_end(self._prefix)),
                                          "count_only": True})
        return int(answer.get("count", 0))

    def multi_get(self, keys) -> list[bytes]:
        """One read-only transaction per TXN_OPS keys; a key not there yet is waited for as `get` does."""
        keys, out = list(keys), []
        for first in range(0, len(keys), TXN_OPS):
            chunk = keys[first:first + TXN_OPS]
            reads = [{"request_range": {"key": _b64(self._key(k))}} for k in chunk]
            answer = self._call("/kv/txn", {"compare": [], "success": reads, "failure": []})
            for k, response in zip(chunk, answer.get("responses", [])):
                kvs = response.get("response_range", {}).get("kvs")
                out.append(base64.b64decode(kvs[0].get("value", "")) if kvs else self.get(k))
        if len(out) != len(keys):
            raise dist.DistStoreError(f"etcd store {self.address}: a transaction of reads answered "
                                      f"{len(out)} of {len(keys)} keys")
        return out

    def multi_set(self, keys, values) -> None:
        """One transaction of puts per TXN_OPS keys (a put is idempotent: a retried transaction changes nothing)."""
        pairs = list(zip(keys, values))
        for first in range(0, len(pairs), TXN_OPS):
            puts = [self._put(self._key(k), _bytes(v)) for k, v in pairs[first:first + TXN_OPS]]
            self._call("/kv/txn", {"compare": [], "success": puts, "failure": []})

    def clone(self) -> "EtcdStore":
        return EtcdStore(self.address, self._timeout_s, self.transport)
