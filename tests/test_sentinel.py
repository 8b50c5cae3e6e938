"""The sentinel's wait for the job's end: rank 0's sentinel judges it and publishes the verdict; every other sentinel
waits for that one key, so its wait costs the store the same whatever the world size."""

import threading

import torch.distributed as dist

from ntp_ds.control.liveness_store import mark_exited, prepare_store
from ntp_ds.control.keys import JOB_OVER_KEY, SENTINEL_DONE_KEY
from ntp_ds.supervise.sentinel import _outlast


class CountingStore:
    """A HashStore that records the keys each request names."""

    def __init__(self):
        self.store, self.keys = dist.HashStore(), set()

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def counted(*args, **kwargs):
            if args:
                self.keys.update(args[0] if isinstance(args[0], list) else [args[0]])
            return call(*args, **kwargs)

        return counted


def test_a_sentinel_other_than_rank_0s_waits_for_the_verdict_alone_at_any_world_size():
    for world in (8, 100_000):
        store = CountingStore()
        timer = threading.Timer(0.2, lambda s=store.store: s.set(JOB_OVER_KEY, "finished"))
        timer.start()
        assert _outlast(store, 5, world, {5: 1}, poll_s=0.02) == 0, "the job finished: its worker's crash is not news"
        timer.join()
        assert store.keys == {JOB_OVER_KEY, SENTINEL_DONE_KEY}, f"world {world}: read {sorted(store.keys)[:5]}..."
        assert store.store.add(SENTINEL_DONE_KEY, 0) == 1


def test_a_failed_job_gives_the_first_workers_status_as_a_shell_reports_it():
    store = CountingStore()
    store.store.set(JOB_OVER_KEY, "failed")
    assert _outlast(store, 3, 4, {3: -9}, poll_s=0.02) == 128 + 9
    assert _outlast(store, 3, 4, {3: 0}, poll_s=0.02) == 0


def test_rank_0s_sentinel_judges_the_end_publishes_it_and_waits_for_the_others():
    store = CountingStore()
    prepare_store(store.store)
    for rank in (1, 2):
        mark_exited(store.store, rank, "finished", alarm=False)
    store.store.add(SENTINEL_DONE_KEY, 2)  # the two other sentinels are done with the store
    assert _outlast(store, 0, 3, {0: 0}) == 0
    assert store.store.get(JOB_OVER_KEY) == b"finished"
