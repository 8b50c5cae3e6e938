"""Recovery planning at the scale the product is for, on shapes alone: a 70B-shaped Llama at TP 8 x 64 replicas."""

import json
import resource
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from ntp_ds.layout.generation import replica_membership
from ntp_ds.layout import KINDS, Topology, plan_gradient_sync
from ntp_ds.layout import units as U
from ntp_ds.recovery.plan import plan_unit_moves, rereplicated_moves
from ntp_ds.layout.regions import block_in_full
from ntp_ds.recovery.reslice import StateIndex, count_lost_state, plan_incoming, plan_outgoing
from ntp_ds.testing.shapes import gathered_offers, llama_70b, shape_specs, zero_addresses, zero_order

DEAD = 5 * 8 + 3  # TP rank 3 of replica 5


def _peak_rss_mb() -> float:
    """This interpreter's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the forking parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def plan_70b() -> dict:
    """Plan the loss of one GPU of TP 8 x 64 replicas; check the plan; return its figures."""
    start = time.monotonic()
    config = llama_70b()
    specs, shapes = shape_specs(config)
    old = Topology.from_degrees(config.units(), (8,) * 64)
    membership = replica_membership(old, {DEAD})
    new = membership.topology()
    old_rank_of = dict(enumerate(membership.ranks()))

    moves = plan_unit_moves(old, new, old_rank_of)
    degraded = set(new.ranks_of(5))
    assert {m.dst for m in moves} <= degraded
    assert all(new.locate(m.src)[0] != 5 for m in moves)
    again = {(m.src, m.dst, m.kind, m.units) for m in rereplicated_moves(old, new, old_rank_of, moves)}
    lost_layout = old.layouts[5]
    for kind in KINDS:
        for dst in degraded:
            fetched = [m.units for m in moves if m.kind == kind and m.dst == dst]
            assert sum(U.count(r) for r in fetched) == U.count(U.union(*fetched)), f"{kind} fetched twice by {dst}"
        alive = U.union(*(lost_layout.owned(kind, t) for t in range(8) if t != 3))
        lost = U.subtract(lost_layout.owned(kind, 3), alive)
        rebuilt = U.union(*(U.subtract(m.units, next((a[3] for a in again if a[:3] == (m.src, m.dst, m.kind)), ()))
                            for m in moves if m.kind == kind))
        assert rebuilt == lost, (kind, rebuilt, lost)

    # What recovery gathers: the steps of what each rank can serve. The addresses follow from the layouts; the
    # gathered ones (every rank's, as the fallback would gather them) are here to check the rule's plan against.
    gathered = gathered_offers(old, new, old_rank_of, specs, shapes)
    index = StateIndex.from_layouts([g["offer"]["steps"] for g in gathered], old, new, specs, shapes,
                                    zero_order(specs))
    planned = time.monotonic()
    incoming, outgoing, received, lost, restored = Counter(), Counter(), 0, 0, 0
    for rank in range(new.world_size):
        mine, wanted = plan_incoming(index, rank)
        assert sum(m.block.numel for m in mine) == sum(n for _, n in wanted), f"rank {rank} not covered"
        from_dead = defaultdict(list)
        for m in mine:
            if m.owner == DEAD:
                from_dead[m.name].append(block_in_full(index.new_grid(m.name, new.locate(rank)[1]), m.block))
        counts = count_lost_state(index, rank, {DEAD}, from_dead)
        lost, restored = lost + counts[0], restored + counts[1]
        incoming.update(m for m in mine if m.src != rank)
        outgoing.update(plan_outgoing(index, rank, gathered[rank]["offer"]["held"]))
        received += sum(m.block.numel for m in mine if m.src != rank)
    assert incoming == outgoing, "senders and receivers disagree"
    planning_s = time.monotonic() - planned
    # One rank alone (as in a job) computes only the entries of the TP index it held: its memory follows its shard,
    # not the world.
    anchors = plan_gradient_sync(new)
    for rank in (0, new.ranks_of(5)[3], new.world_size - 1):
        alone = StateIndex.from_layouts([g["offer"]["steps"] for g in gathered], old, new, specs, shapes,
                                        zero_order(specs))
        if anchors.is_anchor(new.locate(rank)[0]):
            plan_incoming(alone, rank)
        plan_outgoing(alone, rank, gathered[rank]["offer"]["held"])
        touched = {t for t, _ in alone.fragments} | {t for t, _ in alone.needs}
        assert touched == {old.locate(old_rank_of[rank])[1]}, (rank, touched)
    check = StateIndex.from_gathered(gathered, old, new, specs, shapes)
    for rank in range(0, new.world_size, 7):
        assert plan_incoming(check, rank) == plan_incoming(index, rank), f"rank {rank}: the two indexes disagree"
    dead_fragments = zero_addresses(old, DEAD, specs, shapes)
    dead_elements = sum(n for _, n in dead_fragments.values())
    # Every KV head is one rank's at TP 8 on 8 KV heads; the replicated tensors are also every other TP index's.
    unshared = sum(n for name, (_, n) in dead_fragments.items() if specs[name].kind != "replicated")
    assert 0 < unshared < dead_elements
    assert lost == unshared, f"lost {lost} state elements, the dead rank alone held {unshared}"
    assert restored == lost, f"the plan restores {restored} of {lost} lost state elements"
    rss_mb = _peak_rss_mb()
    return {"seconds": time.monotonic() - start, "max_rss_mb": rss_mb, "state_planning_s": planning_s,
            "unit_moves": len(moves), "state_moves": sum(incoming.values()),
            "state_elements_moved": received, "dead_rank_state_elements": dead_elements}


def test_70b_recovery_plan_moves_exactly_the_lost_units_in_bounded_memory():
    # A fresh interpreter, so the resident-memory figure is the planner's (plus torch's import), not the suite's.
    code = "import json, tests.test_recovery_scale as t; print(json.dumps(t.plan_70b()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(figures)
    # The planning time is printed, not asserted: it follows the host's speed (3.7 s quiet, 14 to 24 s under a load of
    # 9 here), and a timed test fails on a loaded machine. Memory does not depend on it.
    assert figures["max_rss_mb"] < 1024, figures
    assert figures["state_moves"] > 0
