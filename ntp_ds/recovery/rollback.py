"""Whether a recovery rolls the job back one step: decided alike on every member from what each offers.

Pure. Each member offers its own optimizer step, the steps of the copies it keeps (newest and previous) by owner,
whether its snapshot lies between the two votes of a step, and the step its last step began from (`offered`).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from operator import itemgetter


def offered(snapshot) -> dict:
    """A member's offer: its own optimizer step, its copies' and its previous copies' steps by owner, whether it
    holds state at all, whether it is between a step's votes, and the step its last step began from."""
    if snapshot is None:
        return {"held": False, "mid_step": False, "own_step": 0, "copies": {}, "previous": {}, "before_step": None}
    return {"held": True, "mid_step": snapshot.mid_step, "own_step": snapshot.optimizer_step,
            "copies": {o: c.step for o, c in snapshot.held.items()},
            "previous": {o: c.step for o, c in snapshot.previous.items()},
            "before_step": snapshot.before_step[3] if snapshot.before_step else None}


def roll_back(owners: Iterable[int], offers: list[dict], dead: frozenset[int]) -> bool:
    """Whether the members return to the state the last step began from.

    `owners`: the old anchor ranks whose state has buddy copies (none: the state is replicated). A step no member
    committed (the commit vote needs every rank) may be half applied: it is rolled back from the copies of the step
    before, unless no copies are kept (then every survivor finished the step, which goes forward). A committed step
    goes forward, unless a dead owner's newest state reached no buddy while the previous step's copies of every
    owner survive (`redundancy_keep_previous`). Linear in the members' copies, never members x owners.
    """
    owners = set(owners)
    if not owners:
        return False
    held = [g for g in offers if g["held"]]
    if all(g["mid_step"] for g in held):
        return True
    lost = dead & owners
    if not lost:  # no dead owner: every owner's newest state lives on with it
        return False
    newest = max(0, max(map(itemgetter("own_step"), held), default=0),  # (C loops over the W members' offers)
                 max(chain.from_iterable(map(dict.values, map(itemgetter("copies"), held))), default=0))
    if all(any(g["copies"].get(o) == newest for g in held) for o in lost):
        return False
    target = max((g["before_step"] for g in held if g["before_step"] is not None), default=None)
    kept = {o for g in held for copies in (g["copies"], g["previous"]) for o, s in copies.items() if s == target}
    return target is not None and owners <= kept
