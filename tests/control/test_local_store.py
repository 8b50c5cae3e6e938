"""The harness's node store answers as HashStore does, call by call, and wakes a wait only for its own keys."""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.testing.local_store import LocalStore

KEYS = ["a", "b", "c"]
VALUES = st.sampled_from(["", "\0", "x", "y", b"\xff", "12"])
CALLS = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), VALUES),
    st.tuples(st.just("add"), st.sampled_from(KEYS), st.integers(-3, 3)),
    st.tuples(st.just("compare_set"), st.sampled_from(KEYS), VALUES, VALUES),
    st.tuples(st.just("check"), st.lists(st.sampled_from(KEYS), max_size=3)),
    st.tuples(st.just("delete_key"), st.sampled_from(KEYS)),
    st.tuples(st.just("num_keys")),
    st.tuples(st.just("multi_set"), st.lists(st.sampled_from(KEYS), max_size=3, unique=True), VALUES),
    st.tuples(st.just("get_present"), st.sampled_from(KEYS)),
)


def _call(store, call):
    name, *args = call
    if name == "multi_set":
        keys, value = args
        return store.multi_set(keys, [value] * len(keys))
    if name == "get_present":  # (a missing key blocks: read only what exists)
        return store.multi_get([args[0]]) if store.check([args[0]]) else None
    if name == "add":
        try:
            return store.add(*args)
        except Exception as err:  # a value that is no number
            return type(err).__name__
    return getattr(store, name)(*args)


@settings(max_examples=300, deadline=None)
@given(st.lists(CALLS, max_size=25))
def test_every_call_answers_as_hashstore_does(calls):
    ours, theirs = LocalStore(), dist.HashStore()
    for call in calls:
        expected = _call(theirs, call)
        got = _call(ours, call)
        if isinstance(expected, str) and isinstance(got, str):  # both failed: the error's kind is not the contract
            continue
        assert got == expected, call
    assert ours.num_keys() == theirs.num_keys()


def test_a_wait_runs_out_as_hashstore_s_does():
    for store in (LocalStore(), dist.HashStore()):
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="[Tt]imeout"):
            store.wait(["missing"], timedelta(seconds=0.2))
        assert 0.15 <= time.monotonic() - started < 5


def test_a_wait_ends_when_its_last_key_is_set_and_not_on_other_writes():
    store = LocalStore()
    done, woken = threading.Event(), []

    def waiter():
        store.wait(["k1", "k2"], timedelta(seconds=10))
        woken.append(time.monotonic())
        done.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    for i in range(50):  # writes to other keys do not end it (nor wake it: its event is under its key alone)
        store.set(f"other/{i}", "v")
    store.set("k1", "1")
    assert not done.wait(0.2)
    assert store._waiters.keys() == {"k2"}  # re-registered under the next missing key
    store.set("k2", "2")
    assert done.wait(5)
    thread.join(5)
    assert not store._waiters
