"""Each recovery phase in-process, against fake stores, readers, wires and engines: no spawned rank, no process group.

The spawned-rank suites (test_recovery, test_grow, test_kept_*) keep the end-to-end cases; these check each phase's
decisions directly: detection and agreement (`detect`), which old groups the next generation keeps (`keep`), the
hand-off and its roll-back (`handoff`), the choice to
keep or rebuild an engine and to keep an interrupted step's gradients (`install`), admission of joiners (`admit`),
the last good weights' refusals (`last_good`), the event's figures (`report`) and the next generation after a loss
or a join (`layout.generation`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import types

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_ds.control.joins import JoinRefused, JoinRequest, await_verdict, read_join_plan, refuse, request_join
from ntp_ds.control.liveness_store import LivenessView
from ntp_ds.control.membership import FailureReport, MembershipChange, count_arrival
from ntp_ds.engine.snapshot import Snapshot
from ntp_ds.layout import ModelUnits, Topology, plan_gradient_sync
from ntp_ds.layout.generation import Generation
from ntp_ds.recovery import admit, install, report
from ntp_ds.control.keys import barrier_key
from ntp_ds.recovery.detect import Detector
from ntp_ds.control.membership import Evicted
from ntp_ds.recovery.errors import RecoveryImpossible, failed_on_the_way
from ntp_ds.recovery.handoff import hand_off
from ntp_ds.recovery.last_good import save_last_good
from tests.helpers.stores import CountingStore
from tests.helpers.training import tiny_config

UNITS = ModelUnits(heads=4, kv_heads=2, ffn=8, vocab=16)


class Clock:
    """A monotonic clock that moves only when the code under test sleeps."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class Reader:
    """A liveness reader returning what the test wrote: exits and fences, no beats."""

    def __init__(self):
        self.exited, self.fences, self.reads = {}, {}, 0

    def read(self, ranks, fences=True, direct=True) -> LivenessView:
        self.reads += 1
        return LivenessView({}, dict(self.exited), dict(self.fences))


class FakeMembership:
    """The membership's surface the detection and agreement read and call."""

    def __init__(self, members, rank=0, generation=0, reports=()):
        self.members, self.rank, self.generation = tuple(members), rank, generation
        self._reports, self.calls = list(reports), []

    def reports(self, generation, max_age_s=0.0):  # (as `Membership.reports`: the age of a shared read)
        return self._reports

    def report_failure(self, generation, dead, wall, reason, silent):
        self.calls.append(("report", generation, frozenset(dead), reason, silent))

    def decision_wait(self, generation, bound):
        self.calls.append(("decision", generation, bound))
        dead = frozenset(r for c in self.calls if c[0] == "report" for r in c[2])
        change = MembershipChange(generation + 1, dead, tuple(m for m in self.members if m not in dead), 0.1, "lost")
        return types.SimpleNamespace(poll=lambda: change)

    def confirm_wait(self, change, bound):
        self.calls.append(("confirm", change.generation))
        return Waits(2)


class Waits:
    """A store barrier that completes after `polls` polls."""

    def __init__(self, polls: int):
        self.left = polls

    def poll(self):
        if self.left == 0:
            return None
        self.left -= 1
        return 0.01


def detector(reader=None, clock=None) -> Detector:
    clock = clock or Clock()
    return Detector(reader or Reader(), heartbeat_timeout_s=2.0, heartbeat_interval_s=0.5, first_beat_timeout_s=5.0,
                    collective_timeout_s=10.0, clock=clock, sleep=clock.sleep)


# -- detect and agree -------------------------------------------------------------------------------------------
def test_detection_names_an_exited_a_fenced_and_a_reported_member_with_their_reasons():
    reader = Reader()
    reader.exited, reader.fences = {3: "exit code -9"}, {5: "hung"}
    membership = FakeMembership(range(8), reports=[FailureReport(1, frozenset({6}), 0.0, "silent")])
    d = detector(reader)
    d.declared[7] = "rank 7 silent for 2.1 s"
    dead, reason = d.detect(membership, RuntimeError("connection closed"))
    assert dead == {3, 5, 6, 7}
    assert "rank 3 exited (exit code -9)" in reason and "declared dead by a peer (hung)" in reason
    assert "rank 7 silent for 2.1 s" in reason and "rank 6 reported dead by a peer" in reason
    # each with its own reason (what its fence files: one naming every dead rank, filed for each, grew the fence
    # log with the square of a rack's deaths)
    assert d.reasons == {3: "rank 3 exited (exit code -9)", 5: "rank 5 declared dead by a peer (hung)",
                         6: "rank 6 reported dead by a peer", 7: "rank 7 silent for 2.1 s"}
    store = dist.HashStore()
    from ntp_ds.control.liveness_store import prepare_store, read_fences, request_fence

    prepare_store(store)
    request_fence(store, dead, d.reasons)
    assert read_fences(store) == d.reasons


def test_detection_finding_nobody_dead_within_its_bound_raises_the_rank_s_own_error():
    clock = Clock()
    d = detector(clock=clock)
    own = ValueError("this rank's own bug")
    with pytest.raises(ValueError, match="own bug"):
        d.detect(FakeMembership(range(4)), own)
    assert clock.now - 100.0 >= 2 * 2.0 + 10.0  # it waited the whole bound, on the injected clock only


def test_detection_ignores_deaths_outside_the_generation():
    reader = Reader()
    reader.exited = {9: "left earlier", 2: "exit code 1"}
    dead, _ = detector(reader).detect(FakeMembership(range(4)), RuntimeError())
    assert dead == {2}


def test_ranks_missing_at_a_barrier_s_bound_are_dead_at_the_next_attempt():
    from ntp_ds.control.membership import BarrierTimeout

    d = detector()
    assert d.missed(BarrierTimeout("membership/4/confirm", frozenset({5, 6}), 13.0)) == {5, 6}
    dead, reason = d.detect(FakeMembership(range(8)), RuntimeError("barrier timed out"))
    assert dead == {5, 6}
    assert "rank 5 did not arrive at barrier 'membership/4/confirm' within 13 s" in reason


def test_agreement_reports_awaits_the_decision_and_confirms_it():
    membership = FakeMembership(range(4), generation=3)
    change = detector().agree(membership, frozenset({2}), "rank 2 exited", {2: 1.5, 0: 0.1})
    assert change.generation == 4 and change.survivors == (0, 1, 3)
    kinds = [c[0] for c in membership.calls]
    assert kinds == ["report", "decision", "confirm"]
    assert membership.calls[0][4] == {2: 1.5}  # only the dead's silences are reported
    assert membership.calls[1][2] == 2 * 10.0 + 2.0  # a peer blocked in a collective arrives after its timeout


def test_a_watched_peer_that_dies_while_the_decision_waits_joins_the_same_decision():
    # Rank 0 reported rank 2; before the decision commits, its watched peer 5 exits and an unwatched member 6 does
    # too: rank 0 reports 5 in the same generation (the decision then holds both), and leaves 6 to its own watchers
    # (a claim per survivor would make the dead rank's key a hot one): here none did, and the confirm fails on it.
    from ntp_ds.control.liveness import LivenessMonitor
    from ntp_ds.recovery.detect import Agreement

    class SlowDecision(FakeMembership):
        def decision_wait(self, generation, bound):
            self.calls.append(("decision", generation, bound))
            polls = iter(range(3))

            def poll():
                if next(polls, None) is not None:
                    return 0.2
                dead = frozenset(r for c in self.calls if c[0] == "report" for r in c[2])
                return MembershipChange(generation + 1, dead, tuple(m for m in self.members if m not in dead), 0.1,
                                        "lost")
            return types.SimpleNamespace(poll=poll)

    reader, clock = Reader(), Clock()
    d = detector(reader, clock)
    d.monitor = LivenessMonitor({1, 2, 5}, 2.0, clock=clock)
    membership = SlowDecision(range(8), generation=3)
    agreement = Agreement(d, membership, frozenset({2}), "rank 2 exited", {})
    assert agreement.poll() == 0.2  # reported, waiting
    reader.exited = {2: "exit code -9", 5: "exit code -9", 6: "exit code -9"}
    clock.now += 0.2
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[6\] died before the survivors confirmed generation 4"):
        while (pause := agreement.poll()) is not None:  # (6 is not in the decision: its confirm fails on it)
            clock.now += pause
    reports = [c for c in membership.calls if c[0] == "report"]
    assert [(c[1], c[2]) for c in reports] == [(3, {2}), (3, {5})]
    assert agreement.change.dead == {2, 5} and agreement.joined == {5}
    assert {5, 6} <= d.declared.keys()


def test_a_member_found_dead_during_a_watched_barrier_ends_it_at_once_and_is_kept_for_the_next_attempt():
    reader = Reader()
    d = detector(reader)
    reader.exited = {5: "exit code -9"}
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[5\] died before generation 2's rendezvous"):
        d.watch(Waits(1000), {1, 5}, "generation 2's rendezvous")
    assert reader.reads == 1 and d.declared == {5: "rank 5 exited (exit code -9)"}
    d.declared.clear()
    reader.exited = {}
    d.watch(Waits(3), {1, 5}, "anything")  # nobody dies: the barrier's own end
    assert not d.declared


def test_a_verdict_while_the_engine_trains_is_reported_at_once_unless_another_watched_peer_is_suspect():
    # The heartbeat's thread reports a verdict itself (a replica that lost nothing may be busy in its backward for a
    # while yet): the decision then needs nothing from its training thread. Not while another watched peer has been
    # silent for half the timeout (its verdict belongs in the same report), nor during a recovery (no engine).
    from ntp_ds.control.liveness import LivenessMonitor
    from ntp_ds.recovery.watch import Watch

    clock, reports = Clock(), []
    watch = object.__new__(Watch)  # the verdict's path only: no heartbeat thread, no wire
    engine = object()
    watch.rank, watch.timeout_s, watch.declared, watch.engine = 0, 2.0, {}, lambda: engine
    watch.report = lambda dead, wall, reason, silent, fenced: reports.append((dead, reason, silent))
    watch.heartbeat = types.SimpleNamespace(monitor=LivenessMonitor({1, 2, 3}, 2.0, clock=clock))
    clock.now += 0.5
    watch._report(frozenset({3}), 10.0, "rank 3 exited", frozenset())
    assert reports == [(frozenset({3}), "rank 3 exited", {3: 0.5})]
    clock.now += 0.6  # ranks 1 and 2 silent for 1.1 s: more than half the timeout
    watch._report(frozenset({3}), 11.0, "rank 3 exited", frozenset())
    assert len(reports) == 1
    watch.declared.update({1: "dead", 2: "dead"})  # their verdicts are in: the report may go
    watch._report(frozenset({3}), 11.0, "rank 3 exited", frozenset())
    assert len(reports) == 2
    watch.engine = lambda: None  # a recovery under way reports from its own detection
    watch._report(frozenset({3}), 12.0, "rank 3 exited", frozenset())
    assert len(reports) == 2


def test_barrier_keys_differ_for_different_members():
    assert barrier_key(2, "arrive", (0, 1, 3)) != barrier_key(2, "arrive", (0, 1, 2))
    assert barrier_key(2, "arrive", (0, 1, 3)).startswith("recovery/2/arrive/")


def test_the_rendezvous_watches_the_ring_neighbours_beats():
    d = detector()
    store = dist.HashStore()
    for i in (0, 2, 3):  # the other three arrived
        count_arrival(store, barrier_key(1, "arrive", (0, 2, 3, 5)), i, 4)
    d.arrive(store, 2, 1, (0, 2, 3, 5))
    assert set(d.monitor.ranks) == {0, 3}


def test_the_recovery_s_last_barrier_ends_at_once_when_a_member_dies_there():
    # A member that dies after the rendezvous, while the others wait for every engine to be installed, ends their
    # wait at its first read (the attempt then starts again without it), not at the job's timeout.
    reader = Reader()
    d = detector(reader)
    store, members = dist.HashStore(), (0, 2, 3, 5)
    for i in (0, 2):  # ranks 0 and 3 came (rank 2 arrives as it waits); rank 5 did not
        count_arrival(store, barrier_key(1, "done", members), i, 4)
    reader.exited = {5: "exit code -9"}
    ending = d.ending(store, 2, 1, members, 600.0)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[5\] died before generation 1's end"):
        ending.poll()  # (its first poll reads the exits)
    assert d.declared == {5: "rank 5 exited (exit code -9)"}
    count_arrival(store, barrier_key(1, "done", members), 3, 4)  # rank 5 comes after all: the barrier's own end
    reader.exited = {}
    d.finish(store, 2, 1, members, 600.0)


def test_the_last_barrier_of_a_grown_generation_sees_a_death_though_its_members_are_not_sorted():
    # A grown generation lists its members in global-rank order: a joiner (launch rank 7) seated in the first
    # replica comes before rank 2. A death among them still ends the wait at once.
    reader = Reader()
    d = detector(reader)
    store, members = dist.HashStore(), (0, 7, 2, 5)
    reader.exited = {7: "exit code -9"}
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[7\] died before generation 3's end"):
        d.ending(store, 2, 3, members, 600.0).poll()


# -- regroup: which groups the next generation keeps ---------------------------------------------------------------
class Group:
    """One rank's handle of a process group of the old generation: its role, members, the operations this rank
    posted on it and whether it has seen them complete."""

    def __init__(self, role, ranks, ops, drained=True):
        self.role, self.ranks, self.ops, self.drained = role, ranks, ops, drained


@pytest.fixture
def fake_groups(monkeypatch):
    """`keep.keep` on fake groups: their members, role and operations from the `Group`, a wire that closes nothing."""
    from ntp_ds.recovery import keep as phase

    closed = []
    monkeypatch.setattr(phase.dist, "get_process_group_ranks", lambda group: list(group.ranks))
    monkeypatch.setattr(phase, "role_of", lambda group: group.role)
    wire = types.SimpleNamespace(drained=lambda group, within_s: group.drained, ops_posted=lambda group: group.ops,
                                 stop_watching=list, discard=closed.extend, is_nccl=lambda group=None: False,
                                 waiting=contextlib.nullcontext)
    monkeypatch.setattr(phase, "wire", wire)
    return phase, closed


def run_keep(phase, groups_of, old=(0, 1, 2, 3), new=(0, 1, 2)):
    """Every surviving rank's `keep` at once (threads over one store) after rank 3 of (2, 2) died: the new topology is
    (2, 1), whose TP group of replica 0 holds the same members as before."""
    store = dist.HashStore()
    after = Generation.initial(Topology.from_degrees(UNITS, (2, 2))).after_loss({3}, 1, 1).after
    out = {}

    def rank(r):
        out[r] = phase.keep(store, r, groups_of[r], old, new, after.topology, plan_gradient_sync(after.topology), 1,
                            5.0)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in new]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(out) == len(new), "a rank's keep did not finish"
    return out


def test_a_group_whose_members_posted_alike_and_saw_it_all_complete_is_kept(fake_groups):
    phase, closed = fake_groups
    tp = {r: Group("tp", (0, 1), ops=7) for r in (0, 1)}
    hit = Group("tp", (2, 3), ops=7)  # replica 1's group: the new topology builds it with other members
    kept = run_keep(phase, {0: [tp[0]], 1: [tp[1]], 2: [hit]})
    assert kept == {0: [tp[0]], 1: [tp[1]], 2: []} and closed == [hit]


@pytest.mark.parametrize("why", ["counts differ", "not drained", "held by one member only"])
def test_a_group_is_closed_on_every_member_when_one_member_cannot_keep_it(fake_groups, why):
    phase, closed = fake_groups
    tp = {0: Group("tp", (0, 1), ops=7), 1: Group("tp", (0, 1), ops=6 if why == "counts differ" else 7,
                                                  drained=why != "not drained")}
    groups = {0: [tp[0]], 1: [] if why == "held by one member only" else [tp[1]], 2: []}
    kept = run_keep(phase, groups)
    assert kept == {0: [], 1: [], 2: []}, why
    assert tp[0] in closed


# -- hand-off -----------------------------------------------------------------------------------------------------
Copy = types.SimpleNamespace


def snapshot(topology, rank, *, steps=5, own_step=5, copies=None, previous=None, before=None, mid_step=False,
             lr=None, stale=None) -> Snapshot:
    return Snapshot(topology=topology, rank=rank, params={}, fragments={}, keys=(), optimizer_step=own_step,
                    held=copies or {}, global_steps=steps, global_samples=steps * 8, mid_step=mid_step,
                    stale=stale or {}, lr_state=lr, before_step=before, previous=previous or {})


class World:
    """A world of `n` ranks as threads whose object collectives meet at a barrier, as a process group's would."""

    def __init__(self, n: int):
        self.barrier, self.slots, self.sent = threading.Barrier(n, timeout=10), [None] * n, None
        self.said: list = []  # (rank, object) of every collect

    def _all(self, i: int, mine) -> list:
        self.slots[i] = mine
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def reduce(self, i: int):
        def reduce_ints(values, op):
            return [(sum if op == "sum" else max)(v) for v in zip(*self._all(i, values))]
        return reduce_ints

    def collect(self, i: int):
        def collect(obj):
            self.said.append((i, obj))
            return {r: o for r, o in enumerate(self._all(i, obj)) if o is not None}
        return collect

    def broadcast(self, i: int):
        def broadcast_object(obj, src):
            if i == src:
                self.sent = obj
            self.barrier.wait()
            out = self.sent
            self.barrier.wait()
            return out
        return broadcast_object


def run_hand_off(snapshots, generation, dead=frozenset(), buddies=None, held=None, world=None):
    """Every rank's `hand_off` at once on a `World`; return each rank's (snapshot, hand-off). `buddies`: the old
    anchors whose state has copies, with their planned holders (default: 0 and 2 onto 1 and 3); `held[i]`: rank i's
    detached engine."""
    world, out = world or World(len(snapshots)), {}
    buddies = {0: (1,), 2: (3,)} if buddies is None else buddies
    job_ = types.SimpleNamespace(buddies=lambda topology: buddies)
    survivors = frozenset(s.rank for s in snapshots if s is not None)

    def rank(i):
        out[i] = hand_off(job_, snapshots[i], generation if snapshots[i] is not None else None,
                          held=held[i] if held else None, dead=dead, survivors=survivors, rank_index=i,
                          reduce=world.reduce(i), collect=world.collect(i), broadcast=world.broadcast(i))

    threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(len(snapshots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(out) == len(snapshots), "a rank's hand-off did not finish"
    return [out[i] for i in range(len(snapshots))]


def test_a_joiner_learns_the_old_generation_steps_and_learning_rate_from_the_lowest_anchor():
    topology = Topology.from_degrees(UNITS, (2, 2))
    generation = Generation.initial(topology)
    snaps = [snapshot(topology, r, lr=("sched", [0.1]) if r >= 2 else None) for r in range(4)] + [None]
    out = run_hand_off(snaps, generation, buddies={})
    joiner_snapshot, joiner = out[4]
    assert joiner.before == generation and joiner_snapshot.rank is None and joiner_snapshot.topology == topology
    assert (joiner.global_steps, joiner.global_samples, joiner.carried_lr) == (5, 40, ("sched", [0.1]))
    assert all(h.carried_lr == ("sched", [0.1]) and not h.rolled_back for _, h in out)


def test_a_step_no_member_committed_is_rolled_back_to_the_copies_of_the_step_before():
    topology = Topology.from_degrees(UNITS, (2, 2))
    before = (4, 32, ("sched", [0.2]), 4)
    copies = {0: Copy(step=5, fragments={}), 2: Copy(step=5, fragments={})}
    previous = {0: Copy(step=4, fragments={}), 2: Copy(step=4, fragments={})}
    snaps = [snapshot(topology, r, mid_step=True, copies=copies, previous=previous, before=before,
                      lr=("sched", [0.1])) for r in range(4)]
    out = run_hand_off(snaps, Generation.initial(topology), dead=frozenset({3}))
    for snap, handoff in out:
        assert handoff.rolled_back and handoff.params_from_masters and handoff.any_mid_step
        assert (handoff.global_steps, handoff.global_samples, handoff.carried_lr) == (4, 32, ("sched", [0.2]))
        assert {o: c.step for o, c in handoff.held.items()} == {0: 4, 2: 4}  # only the step rolled back to
        assert snap.global_steps == 5  # the snapshot itself is a value: never changed


@pytest.mark.parametrize("arrived", [True, False])
def test_only_the_holders_of_a_dead_owner_s_copy_speak_and_a_copy_that_never_arrived_rolls_the_step_back(arrived):
    # Four anchors, each keeping copies of the two before it (and, of each, the step before's); owner 3 dies. Its
    # buddies, 0 and 1, hold its newest copy (step 5), or only the step before's (its stream never arrived): then
    # every owner's copy of step 4 survives, and the job rolls back to it. (With one copy each, the owner whose
    # copy the dead rank kept has none left, and no roll-back is possible.)
    topology = Topology.from_degrees(UNITS, (2, 2))
    buddies = {r: ((r + 1) % 4, (r + 2) % 4) for r in range(4)}
    before = (4, 32, ("sched", [0.2]), 4)
    snaps = []
    for r in range(3):
        owners = ((r - 1) % 4, (r - 2) % 4)
        snaps.append(snapshot(topology, r, copies={o: Copy(step=5 if arrived or o != 3 else 4, fragments={})
                                                    for o in owners},
                              previous={o: Copy(step=4, fragments={}) for o in owners}, before=before,
                              lr=("sched", [0.1])))
    world = World(3)
    out = run_hand_off(snaps, Generation.initial(topology), dead=frozenset({3}), buddies=buddies, world=world)
    assert all(h.rolled_back == (not arrived) for _, h in out)
    said = sorted((i, obj) for i, obj in world.said if obj is not None)
    assert said == [(0, {"lost": {3: 5 if arrived else 4}}), (1, {"lost": {3: 5 if arrived else 4}})], \
        "the dead owner's buddies alone speak; every planned copy of step 4 is there, so nothing is listed"
    if not arrived:
        assert {o: c.step for o, c in out[1][1].held.items()} == {0: 4, 3: 4}


def test_every_member_learns_every_rank_s_stale_units_and_whole_gradients(monkeypatch):
    from ntp_ds.recovery import handoff as phase

    monkeypatch.setattr(phase, "recuttable", lambda optimizer: optimizer == "zero")
    topology = Topology.from_degrees(UNITS, (2, 2))
    snaps = [dataclasses.replace(snapshot(topology, r, stale={"ffn": ((0, 2),)} if r == 1 else None),
                                 whole_grads=r != 3) for r in range(4)]
    # Rank 2's engine cannot be re-cut, so it cannot keep them; rank 3 holds no whole gradients.
    held = [types.SimpleNamespace(optimizer="zero" if r != 2 else "plain") for r in range(4)]
    out = run_hand_off(snaps, Generation.initial(topology), buddies={}, held=held)
    for _, handoff in out:
        assert handoff.stale_by_rank == {1: {"ffn": ((0, 2),)}}  # only the members that have any
        assert [handoff.whole_by_rank.get(i) for i in range(4)] == [True, True, False, False]
        assert not handoff.rolled_back and handoff.held == {}


# -- install ------------------------------------------------------------------------------------------------------
class NewEngine:
    """An engine as the install phase sets it up (steps, learning rate, copies, a resumed step)."""

    def __init__(self, replica=0):
        self.ntp_groups = types.SimpleNamespace(replica=replica)
        self.global_steps = self.global_samples = 0
        self.lr_scheduler, self.optimizer, self.resumed, self.refreshed = None, None, None, False

    def optimizer_keys(self):
        return ["exp_avg"]

    def refresh_copies(self, overlap):
        self.refreshed = overlap

    def resume(self, plan, grads, scale):
        self.resumed = (plan, grads, scale)


class HeldEngine(NewEngine):
    """A member's detached engine: what the install phase keeps (rebinds) or releases."""

    def __init__(self, grads=None):
        super().__init__()
        self.grads = grads or {}

    def take_grads(self):
        return self.grads


STATE = {"covered": 10, "wanted": 10, "checksums_ok": True, "fresh": True, "bytes_received": 40,
         "restored_bytes": 0, "lost_bytes": 0, "state_index": "layouts", "kept": 6, "from_copies": 0, "received": 4}


@pytest.fixture
def fake_install(monkeypatch):
    """The install phase with its engine builders, re-slice and wire replaced by recorders (one rank's world)."""
    seen = {"built": 0, "rebound": 0, "released": 0}

    def build_engine(job, topology, make_module, store, resharded):
        seen["built"] += 1
        return NewEngine()

    def rebind_engine(job, topology, held, serve):
        seen["rebound"] += 1
        return held

    monkeypatch.setattr(install, "build_engine", build_engine)
    monkeypatch.setattr(install, "rebind_engine", rebind_engine)
    monkeypatch.setattr(install, "recuttable", lambda optimizer: True)
    monkeypatch.setattr(install, "count_communicators", lambda: (3, 1))
    monkeypatch.setattr(install, "reslice", lambda engine, snap, copies, dead, own, **_: dict(STATE, own=own))
    # Every one of the new generation's three ranks measured the same figures.
    monkeypatch.setattr(install.wire, "sum_counts", lambda values, group=None: [3 * v for v in values])
    monkeypatch.setattr(install.wire, "traffic_since", lambda before: {("reslice", "received"): 40})
    monkeypatch.setattr(install.report, "keepable", lambda snap, engine, rolled_back: 6)
    return seen


def job(batch_policy="preserve_global_batch", resume=None):
    return types.SimpleNamespace(ds_config={}, ntp=types.SimpleNamespace(bucket_size=1 << 20),
                                 buddies=lambda topology: {},
                                 resume_plan=lambda topology, plan, kept: resume(kept) if resume else None)


def change_after_loss(topology, dead_rank, stepped=5, **handoff_changes) -> install.Change:
    before = Generation.initial(topology)
    loss = before.after_loss({dead_rank}, 1, 1)
    handoff = run_hand_off([snapshot(topology, r, steps=stepped) for r in range(topology.world_size)], before,
                           buddies={})[0][1]
    return install.Change(snapshot(topology, 0, steps=stepped), dataclasses.replace(handoff, **handoff_changes),
                          before, loss.after, frozenset({dead_rank}))


def test_a_rank_that_keeps_its_place_keeps_its_engine_and_the_event_sums_what_was_installed(fake_install):
    topology = Topology.from_degrees(UNITS, (2, 2))
    change = change_after_loss(topology, 3)  # replica 1 loses TP rank 1; rank 0 (replica 0) keeps its place
    released = []
    engine, event = install.install(job(), None, 0, change, held=HeldEngine(), release=lambda: released.append(1),
                                    on_phase=lambda step, phase: None, kept_here=["dp"], traffic_before={})
    assert fake_install["rebound"] == 1 and not fake_install["built"] and not released
    assert (engine.global_steps, engine.global_samples) == (5, 40) and engine.refreshed
    assert event["generation"] == 1 and event["degrees_before"] == [2, 2] and event["degrees_after"] == [2, 1]
    assert event["engines_rebuilt"] == 0 and event["communicators_created"] == 3 * 3 and event["lossless"]
    assert event["communicators_kept"] == 3 and event["optimizer_bytes_moved"] == 3 * 40
    assert event["traffic_bytes"]["optimizer"] == 3 * 40 and event["rank_state_elements"]["keepable"] == 6
    assert event["kept_here"] == ["dp"] and event["samples_kept"] == 0


def test_a_rank_whose_shard_changes_releases_its_engine_before_building_the_new_one(fake_install):
    topology = Topology.from_degrees(UNITS, (2, 2))
    change = change_after_loss(topology, 3)
    old_rank_2 = dataclasses.replace(change, snapshot=dataclasses.replace(change.snapshot, rank=2))
    released, phases = [], []
    engine, event = install.install(job(), None, 2, old_rank_2, held=HeldEngine(),
                                    release=lambda: released.append(1),
                                    on_phase=lambda step, phase: phases.append((step, phase)), kept_here=[],
                                    traffic_before={})
    assert released == [1] and fake_install["built"] == 1 and not fake_install["rebound"]
    assert event["engines_rebuilt"] == 3 and event["rank_state_elements"]["keepable"] is None
    assert phases == [(6, "groups")]  # "transfer" is the module builder's, not run by the fake


def test_an_installation_short_of_state_is_not_lossless(fake_install, monkeypatch):
    topology = Topology.from_degrees(UNITS, (2, 2))
    monkeypatch.setattr(install, "reslice", lambda *a, **k: dict(STATE, covered=9))
    _, event = install.install(job(), None, 0, change_after_loss(topology, 3), held=HeldEngine(),
                               release=lambda: None, on_phase=lambda s, p: None, kept_here=[], traffic_before={})
    assert not event["lossless"]


def test_a_parameter_no_survivor_holds_makes_recovery_impossible(fake_install):
    topology = Topology.from_degrees(UNITS, (1, 2))
    before = Generation.initial(topology)
    loss = before.after_loss({0}, 1, 1)  # replica 0 (TP 1) is gone; replica 1 holds everything: possible
    assert loss.after is not None
    stale = {i: {"ffn": ((0, 8),)} for i in range(3)}  # ...unless every holder's copy of the FFN is stale
    handoff = run_hand_off([snapshot(topology, r) for r in range(3)], before, buddies={})[0][1]
    change = install.Change(snapshot(topology, 1), dataclasses.replace(handoff, stale_by_rank=stale), before,
                            loss.after, frozenset({0}))
    with pytest.raises(RecoveryImpossible, match="restart from the last checkpoint"):
        install.install(job(), None, 1, change, held=HeldEngine(), release=lambda: None,
                        on_phase=lambda s, p: None, kept_here=[], traffic_before={})


def test_replicas_that_lost_nothing_keep_a_whole_step_s_gradients_and_only_the_rest_is_run():
    topology = Topology.from_degrees(UNITS, (2, 2))
    change = change_after_loss(topology, 3, whole_by_rank={0: True, 1: True, 2: True})
    change = dataclasses.replace(change, snapshot=dataclasses.replace(change.snapshot, batch_plan="plan"))
    kept_asked = []

    def resume(kept):
        kept_asked.append(kept)
        return types.SimpleNamespace(kept=8)

    engine = NewEngine(replica=0)
    samples = install.resume(job(resume=resume), 0, engine, change, {0: 0, 1: 1, 2: 2}, [], {"w": "grad"})
    assert kept_asked == [(0,)] and samples == 8 and engine.resumed[1] == {"w": "grad"}
    rolled = dataclasses.replace(change, handoff=dataclasses.replace(change.handoff, rolled_back=True))
    assert install.resume(job(resume=resume), 0, NewEngine(), rolled, {0: 0, 1: 1, 2: 2}, [], {}) == 0
    with pytest.raises(RecoveryImpossible, match="holds none"):
        install.resume(job(resume=resume), 0, NewEngine(replica=0), change, {0: 0, 1: 1, 2: 2}, [], {})


# -- admit ---------------------------------------------------------------------------------------------------------
def admission_job(min_tp=1):
    ntp = types.SimpleNamespace(replica_degrees=(2, 2), min_tp=min_tp, zero_redundancy=1, batch_policy="p",
                                control_fanout=8, timeout_s=4.0)
    return types.SimpleNamespace(model_config="llama-tiny", ds_config={"train_batch_size": 8}, ntp=ntp)


def test_rank_0_seats_a_due_joiner_in_the_degraded_replica_and_refuses_another_job_s_worker():
    store, job_ = dist.HashStore(), admission_job()
    topology = Topology.from_degrees(UNITS, (2, 2))
    degraded = Generation.initial(topology).after_loss({3}, 1, 1).after
    fingerprint = admit.job_fingerprint(job_)
    request_join(store, JoinRequest(7, fingerprint, 0, 0, 1.0))
    request_join(store, JoinRequest(8, "another", 0, 0, 1.0))
    request_join(store, JoinRequest(9, fingerprint, 50, 0, 1.0))  # not due before step 50
    plan = admit.Admission(store, 0, job_).plan(degraded, completed=4)
    assert plan == read_join_plan(store, 1)
    assert (plan.after, plan.joiners, plan.members_before, plan.members) == (5, (7,), (0, 1, 2), (0, 1, 2, 7))
    with pytest.raises(JoinRefused, match="another job configuration"):
        await_verdict(store, 8, 1.0)
    assert await_verdict(store, 7, 1.0).joiners == (7,)


def test_a_join_plan_grows_with_the_joins_not_with_the_world():
    # 100,000 members, a joiner seated in the middle of the global-rank order: the plan round-trips in a few
    # hundred bytes (as lists it was about 1.4 MB, past etcd's request limit).
    from ntp_ds.control.joins import JoinPlan

    before = tuple(r for r in range(100_000) if r != 40_003)
    members = before[:40_003] + (100_000,) + before[40_003:]
    plan = JoinPlan(7, 120, (100_000,), before, members, (5.0,))
    raw = plan.encode()
    assert len(raw) < 300 and JoinPlan.decode(raw) == plan


def test_a_joiner_without_a_free_place_is_refused():
    store, job_ = dist.HashStore(), admission_job()
    healthy = Generation.initial(Topology.from_degrees(UNITS, (2, 2)))
    request_join(store, JoinRequest(4, admit.job_fingerprint(job_), 0, 0, 1.0))
    assert admit.Admission(store, 0, job_).plan(healthy, completed=1) is None
    with pytest.raises(JoinRefused, match="no replica has a free place"):
        await_verdict(store, 4, 1.0)


def test_a_scheduled_repair_holds_the_boundary_for_half_the_collective_bound_at_most():
    clock = Clock()
    admission = admit.Admission(dist.HashStore(), 0, admission_job(), clock=clock, sleep=clock.sleep)
    admission.expected = [3, 40]
    admission.await_expected(completed=1)  # the repair of step 3 is due; its replacement never asks
    assert 2.0 <= clock.now - 100.0 <= 2.2 and admission.expected == [40]


def test_a_refused_joiner_hears_the_job_s_reason():
    store, job_ = dist.HashStore(), admission_job()
    refuse(store, 5, "rank 5: the job ended before it could take this worker in")
    with pytest.raises(JoinRefused, match="the job ended"):
        admit.await_admission(job_, store, 5, not_before=0, timeout_s=2.0, node=0, heartbeat_interval_s=0.5)


def boundary_rank(rank, store, engine):
    """A member's `Recovery` as far as its step boundary reads it (global rank `rank` of launch ranks 0..3)."""
    from ntp_ds.recovery.manager import Recovery

    recovery = object.__new__(Recovery)
    recovery.rank, recovery.store, recovery.engine = rank, store, engine
    recovery.generation = Generation.initial(Topology.from_degrees(UNITS, (2, 2)))
    recovery.membership = types.SimpleNamespace(generation=0)
    recovery.admission = admit.Admission(store, rank, admission_job())
    recovery.grow = lambda plan: ("grown", plan.joiners)
    return recovery


def test_only_global_rank_0_reads_the_store_at_a_boundary_and_the_commit_vote_announces_a_join():
    store = CountingStore()
    engines = {r: types.SimpleNamespace(join_notice=False, join_announced=False) for r in range(4)}
    ranks = {r: boundary_rank(r, store, engines[r]) for r in range(4)}
    for r in (1, 2, 3):
        assert ranks[r].at_boundary(1, 10) is None
    assert store.calls == 0  # while nobody joins, the other members never talk to the store
    # A joiner asks; at the boundary after step 1, rank 0 plans it for the boundary after step 2 and raises the
    # notice that step 2's commit vote carries.
    degraded = ranks[0].generation.after_loss({3}, 1, 0).after
    for r in range(4):
        ranks[r].generation = degraded
    request_join(store.inner, JoinRequest(7, admit.job_fingerprint(admission_job()), 0, 0, 1.0))
    assert ranks[0].at_boundary(1, 10) is None
    assert engines[0].join_notice and read_join_plan(store.inner, 0).after == 2
    for r in range(3):  # step 2 ran; its commit vote told every rank
        engines[r].join_announced = True
    assert all(ranks[r].at_boundary(2, 10) == ("grown", (7,)) for r in range(3))


# -- last good weights, errors, report ----------------------------------------------------------------------------
def test_last_good_weights_need_a_directory_and_a_holder_of_every_tensor(tmp_path):
    config = tiny_config()
    topology = Topology.from_degrees(config.units(16), (2,))
    job_ = types.SimpleNamespace(model_config=config)
    snap = snapshot(topology, 0)
    assert "no last_good_dir" in save_last_good(job_, None, 0, (0, 1), (0,), 1, snap, None)
    # Rank 1 died with the only replica: half of every sharded tensor has no holder, so nothing is written (and no
    # process group is built: every survivor stops at the same plan).
    said = save_last_good(job_, None, 0, (0, 1), (0,), 1, snap, tmp_path)
    assert "so no last good state was written" in said and not any(tmp_path.iterdir())


def test_only_failures_of_peers_or_the_wire_start_a_recovery_again():
    assert failed_on_the_way(RuntimeError("rank 3 died before the rendezvous"))
    assert failed_on_the_way(TimeoutError()) and failed_on_the_way(ConnectionError())
    assert not failed_on_the_way(RecoveryImpossible("no copy left"))
    # Declared dead by the committed decision (a false verdict too): it leaves the job, every attempt would say so.
    assert not failed_on_the_way(Evicted("rank 5 was declared dead in generation 2"))
    assert not failed_on_the_way(KeyError("a bug"))


def test_the_event_sums_every_rank_s_figures_and_is_lossless_only_if_every_rank_installed_whole():
    mine = dict.fromkeys(report.SUMMED, 1)
    two_ranks = lambda values: [2 * v for v in values]  # noqa: E731
    event = report.installed(mine, report.received_by_kind({("reshard", "received"): 5, ("x", "received"): 1,
                                                            ("reshard", "sent"): 9}), two_ranks, members=2)
    assert event["bytes_moved"] == 2 and event["lossless"]
    assert event["traffic_bytes"] == {"parameters": 10, "optimizer": 0, "redundancy": 0, "objects": 0, "control": 2}
    assert event["refused"] == {"param_buckets": 2, "copies": 2, "grads": 2}
    assert not report.installed(mine, {}, two_ranks, members=3)["lossless"]
    assert report.joined((4,)) == "rank 4 joined" and report.joined((4, 5)) == "ranks 4, 5 joined"


# -- the next generation ------------------------------------------------------------------------------------------
def test_a_loss_below_min_tp_drops_the_replica_and_a_join_brings_it_back():
    start = Generation.initial(Topology.from_degrees(UNITS, (2, 2, 2)))
    loss = start.after_loss({2, 3}, 1, 1)  # replica 1 is gone whole
    assert loss.dropped == () and loss.rebuilt == () and loss.after.members == (0, 1, 4, 5)
    assert loss.after.topology.degrees == (2, 2) and loss.after.number == 1
    grown, unseated = loss.after.after_join((2, 3), 1, 2)
    assert unseated == () and grown.members == (0, 1, 2, 3, 4, 5) and grown.topology == start.topology
    assert start.after_loss({0, 1, 2, 3, 4, 5}, 1, 1).after is None
    below = start.after_loss({3}, 2, 1)
    assert below.dropped == (1,) and below.after.members == (0, 1, 4, 5)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
@settings(max_examples=100, deadline=None)
def test_losing_ranks_then_taking_them_back_restores_the_configured_job(degrees, data):
    start = Generation.initial(Topology.from_degrees(UNITS, tuple(degrees)))
    dead = data.draw(st.sets(st.sampled_from(start.members), max_size=len(start.members) - 1))
    loss = start.after_loss(dead, 1, 1)
    assert set(loss.after.members) | set(dead) == set(start.members)
    assert loss.after.topology.world_size == len(loss.after.members)
    grown, unseated = loss.after.after_join(tuple(sorted(dead)), 1, 2)
    assert unseated == () and grown.topology == start.topology and sorted(grown.members) == sorted(start.members)


def test_a_detection_fences_only_the_dead_the_logs_do_not_name_yet():
    # Rank 1 exited (its launcher logged it), rank 2 was fenced by a peer, rank 3 this rank declared itself: only
    # rank 3 needs a fence request from this survivor (each request is a write to the rank's key).
    reader = Reader()
    reader.exited, reader.fences = {1: "exit code -9"}, {2: "silent"}
    d = detector(reader)
    d.declared[3] = "rank 3: no heartbeat for 3.1 s"
    dead, _ = d.detect(FakeMembership(range(4)), RuntimeError("none"))
    assert dead == {1, 2, 3}
    assert d.to_fence() == {3: "rank 3: no heartbeat for 3.1 s"}


def test_a_rank_the_decision_declared_dead_leaves_at_its_first_attempt():
    # A false verdict (a rank too slow to beat, say) evicts a live rank: the committed decision names it dead, and
    # every further attempt would read that same decision. It leaves at once instead of trying once per member.
    from ntp_ds.recovery.manager import Recovery

    recovery = object.__new__(Recovery)
    recovery.generation = types.SimpleNamespace(members=tuple(range(64)))
    recovery.rank, recovery.failed_attempts = 5, []
    calls = []

    def attempt(snapshot, before, error, failed_at):
        calls.append(error)
        raise Evicted("rank 5 was declared dead in generation 2: rank 5 declared dead by a peer")

    recovery._attempt = attempt
    with pytest.raises(Evicted, match="rank 5 was declared dead"):
        recovery._recover_from(object(), None, RuntimeError("a peer failed"), 0.0)
    assert len(calls) == 1 and not recovery.failed_attempts
