"""Hand-off: what every member of the new generation learns from the others before it installs its state.

No member receives every member's offer. Two fixed-size reductions (the newest step, the step the last step began
from, who holds a learning-rate state, whether any member is between a step's votes, how many keep the interrupted
step's gradients whole), then one collect in which only exceptions speak (stale units, a whole flag against the
majority, the copies of dead owners, copies kept off the buddy plan), then one sum, decide alike on every member
whether the job rolls back a step (`rollback.RollBack`); a broadcast from the lowest member that has it then gives
the job's context: the steps, the learning-rate state and, where a joiner is among the members, the old generation.
What a member receives grows with the deaths and the exceptions, never with the world. A joiner offers nothing and
learns the old generation here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ntp_ds.comm import wire
from ntp_ds.engine.recut import recuttable
from ntp_ds.engine.snapshot import Snapshot
from ntp_ds.layout.generation import Generation
from ntp_ds.recovery.rollback import Collect, Reduce, Reduced, RollBack, offered


@dataclass(frozen=True)
class Handoff:
    """What the members told each other: what the new generation's engine is built from besides the snapshot."""

    before: Generation
    """The generation the members leave (a joiner learns it here)."""
    global_steps: int
    global_samples: int
    carried_lr: tuple | None
    """The learning-rate state the new anchors take."""
    held: dict
    """The copies this rank serves, by owner: after a roll-back only those of the step rolled back to."""
    stale_by_rank: dict
    """The stale units of each member that has any (its streamed copy of them never arrived), by new rank."""
    whole_by_rank: "ByRank"
    """Whether each member holds the interrupted step's gradients whole and keeps its engine's optimizer."""
    rolled_back: bool
    """The members return to the state the last step began from (`recovery.rollback`)."""
    any_mid_step: bool
    """Some member was between the votes of a step."""

    @property
    def params_from_masters(self) -> bool:
        """Whether the survivors' parameters may differ from the optimizer state installed (a step half applied, or
        rolled back), so the new engine derives them from its masters."""
        return self.any_mid_step or self.rolled_back


@dataclass(frozen=True)
class ByRank:
    """A flag of every member, told as the majority's value and the members that differ from it."""

    default: bool
    exceptions: frozenset[int]

    def get(self, rank: int) -> bool:
        return self.default != (rank in self.exceptions)


def offer(snapshot: Snapshot | None, whole: bool) -> dict:
    """A member's offer (a joiner's: `snapshot` None): its stale units, whether it keeps the interrupted step's
    gradients whole (`whole`), whether it holds a learning-rate state, and what `rollback.offered` reads."""
    return {"stale": snapshot.stale if snapshot is not None else {}, "whole": whole,
            "lr": snapshot is not None and snapshot.lr_state is not None, **offered(snapshot)}


def hand_off(job, snapshot: Snapshot | None, generation: Generation | None, *, held=None,
             dead: frozenset[int] = frozenset(), survivors: frozenset[int] = frozenset(), rank_index: int,
             reduce: Reduce = wire.reduce_ints, collect: Collect = wire.collect,
             broadcast: Callable[[object, int], object] = wire.broadcast_object) -> tuple[Snapshot, Handoff]:
    """Settle the roll-back and the context on the new generation's world (`reduce`, `collect`, `broadcast`);
    return the snapshot to install from (a joiner's: empty, in the old topology's terms) and the hand-off.

    `snapshot`, `generation`: this member's (None on a joiner); `held`: its engine, detached (it keeps the
    interrupted step's gradients only if its optimizer can be re-cut); `dead`: the old global ranks that died;
    `survivors`: the old global ranks of the members that hold state; `rank_index`: this rank's index in the new
    world."""
    whole = snapshot is not None and snapshot.whole_grads and held is not None and recuttable(held.optimizer)
    mine = offer(snapshot, whole)
    rule = RollBack(job.buddies(snapshot.topology) if snapshot is not None else {}, dead, survivors)
    none = wire.LOWEST
    first = reduce(Reduced.part(mine) + [-rank_index if mine["lr"] else none, -rank_index if mine["held"] else none,
                                         int(mine["mid_step"])], "max")
    reduced, any_mid_step = Reduced.of(first[:3]), bool(first[5])
    src = -first[3] if first[3] != none else -first[4]
    members, whole_members, holding = reduce([1, int(whole), int(mine["held"])], "sum")
    majority = 2 * whole_members >= members
    said = {**rule.exceptions(mine, reduced), **({"stale": mine["stale"]} if mine["stale"] else {}),
            **({"whole": whole} if whole != majority else {})}
    told = collect(said or None)
    heard = rule.hear(reduced, list(told.values()))
    counted = reduce(rule.count(mine, reduced, heard), "sum")
    kind = rule.listing(counted)
    lists = collect(rule.listed(mine, reduced, heard, kind)) if kind is not None else {}
    rolled_back = snapshot is not None and rule.decide(heard, counted, lists)
    context = None
    if rank_index == src:
        steps, samples, lr_state = snapshot.global_steps, snapshot.global_samples, snapshot.lr_state
        if rolled_back:
            steps, samples, lr_state, _ = snapshot.before_step
        context = {"lr_state": lr_state, "global_steps": steps, "global_samples": samples,
                   "generation": generation if holding < members else None}  # (only a joiner needs it)
    context = broadcast(context, src)
    if snapshot is None:
        snapshot = Snapshot(topology=context["generation"].topology, rank=None, params={}, fragments={}, keys=(),
                            optimizer_step=0, held={}, global_steps=context["global_steps"],
                            global_samples=context["global_samples"], mid_step=False, stale={}, lr_state=None)
    served = snapshot.held
    if rolled_back:  # serve only the copies of the step rolled back to (the newest such of each owner)
        target = snapshot.before_step[3]
        served = {o: c for copies in (snapshot.previous, snapshot.held) for o, c in copies.items() if c.step == target}
    return snapshot, Handoff(
        before=generation if generation is not None else context["generation"],
        global_steps=context["global_steps"], global_samples=context["global_samples"],
        carried_lr=context["lr_state"], held=served,
        stale_by_rank={i: t["stale"] for i, t in told.items() if "stale" in t},
        whole_by_rank=ByRank(majority, frozenset(i for i, t in told.items() if "whole" in t)),
        rolled_back=rolled_back, any_mid_step=any_mid_step)
