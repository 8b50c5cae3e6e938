"""Gloo groups connect lazily: creating one is not a meeting of all its members (`comm.groups.prepare_backend`)."""

from datetime import timedelta

from ntp_ds.testing.spawn import free_port, run_ranks

INIT_TIMEOUT_S = 20.0


def _late_fourth(rank, world_size, port):
    import torch
    import torch.distributed as dist

    from ntp_ds.comm.groups import prepare_backend

    prepare_backend()
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False,
                          timeout=timedelta(seconds=INIT_TIMEOUT_S))
    if rank == world_size - 1:  # starts only once the others have built the world group and used a group of theirs
        store.wait(["first three done"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=INIT_TIMEOUT_S))
    out = {}
    if rank < world_size - 1:
        group = dist.new_group(list(range(world_size - 1)), use_local_synchronization=True)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=group)
        out["three"] = t.item()
        if rank == 0:
            store.set("first three done", "1")
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)  # the world group connects its pairs now, the late rank among them
    out["world"] = t.item()
    dist.destroy_process_group()
    return out


def test_a_world_group_is_built_without_waiting_for_every_rank():
    # Eager gloo would hold ranks 0-2 in init_process_group until rank 3 arrived, and rank 3 waits for them: the
    # init would time out. Lazily, each rank only publishes its address, and pairs connect at first use.
    results = run_ranks(_late_fourth, 4, free_port(), timeout=120.0)
    assert [r.get("three") for r in results] == [6.0, 6.0, 6.0, None]
    assert [r["world"] for r in results] == [10.0] * 4
