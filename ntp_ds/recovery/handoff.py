"""Hand-off: what every member of the new generation learns from the others before it installs its state.

One gather of a small offer per member (its stale units, whether it holds the interrupted step's gradients whole,
whether it holds a learning-rate state, and the steps of its state and copies: `rollback.offered`), then one
broadcast of the job's context from the lowest member that has it: the old generation, the steps and the
learning-rate state. From these every member decides alike whether the job rolls back a step (`rollback.roll_back`)
and which state it installs. A joiner offers nothing and learns the old generation here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ntp_ds.comm import wire
from ntp_ds.engine.recut import recuttable
from ntp_ds.engine.snapshot import Snapshot
from ntp_ds.layout.generation import Generation
from ntp_ds.recovery.rollback import offered, roll_back


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
    """Every old rank's stale units (its streamed copy of them never arrived)."""
    whole_by_rank: dict
    """Whether each old rank holds the interrupted step's gradients whole and keeps its engine's optimizer."""
    rolled_back: bool
    """The members return to the state the last step began from (`recovery.rollback`)."""
    any_mid_step: bool
    """Some member was between the votes of a step."""

    @property
    def params_from_masters(self) -> bool:
        """Whether the survivors' parameters may differ from the optimizer state installed (a step half applied, or
        rolled back), so the new engine derives them from its masters."""
        return self.any_mid_step or self.rolled_back


def offer(snapshot: Snapshot | None, whole: bool) -> dict:
    """A member's offer (a joiner's: `snapshot` None): its stale units, whether it keeps the interrupted step's
    gradients whole (`whole`), whether it holds a learning-rate state, and what `rollback.offered` reads."""
    return {"stale": snapshot.stale if snapshot is not None else {}, "whole": whole,
            "lr": snapshot is not None and snapshot.lr_state is not None, **offered(snapshot)}


def hand_off(job, snapshot: Snapshot | None, generation: Generation | None, *, held=None,
             dead: frozenset[int] = frozenset(), rank_index: int,
             gather: Callable[[dict], list] = wire.all_gather_object,
             broadcast: Callable[[object, int], object] = wire.broadcast_object) -> tuple[Snapshot, Handoff]:
    """Exchange the offers and the context on the new generation's world (`gather`, `broadcast`); return the
    snapshot to install from (a joiner's: empty, in the old topology's terms) and the hand-off.

    `snapshot`, `generation`: this member's (None on a joiner); `held`: its engine, detached (it keeps the
    interrupted step's gradients only if its optimizer can be re-cut); `dead`: the old global ranks that died;
    `rank_index`: this rank's index in the new world."""
    whole = snapshot is not None and snapshot.whole_grads and held is not None and recuttable(held.optimizer)
    gathered = gather(offer(snapshot, whole))
    buddies = job.buddies(snapshot.topology) if snapshot is not None else ()
    rolled_back = snapshot is not None and roll_back(buddies, gathered, dead)
    src = next((i for i, g in enumerate(gathered) if g["lr"]), None)
    if src is None:
        src = next(i for i, g in enumerate(gathered) if g["held"])
    context = None
    if rank_index == src:
        steps, samples, lr_state = snapshot.global_steps, snapshot.global_samples, snapshot.lr_state
        if rolled_back:
            steps, samples, lr_state, _ = snapshot.before_step
        context = {"generation": generation, "lr_state": lr_state, "global_steps": steps, "global_samples": samples}
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
        stale_by_rank={i: g["stale"] for i, g in enumerate(gathered)},
        whole_by_rank={i: g["whole"] for i, g in enumerate(gathered)},
        rolled_back=rolled_back, any_mid_step=any(g["mid_step"] for g in gathered))
