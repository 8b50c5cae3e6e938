"""Whether a recovery rolls the job back one step: decided alike on every member from what each offers.

Pure. Each member offers its own optimizer step, the steps of the copies it keeps (newest and previous) by owner,
whether its snapshot lies between the two votes of a step, and the step its last step began from (`offered`).

No member receives the others' offers: the decision is reached in rounds of fixed-size reductions and of collects
in which only the exceptions to a rule every member applies speak (`RollBack`). The rule is the buddy plan: a member
holds copies of the owners planned onto it. So what a member receives grows with the deaths and the exceptions, not
with the world; a job with redundancy 1 decides from counts alone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from ntp_ds.recovery.holdings import planned_copies

NONE = -1
"""A step or index that is not there, in a reduction (steps and indices are never negative)."""


def offered(snapshot) -> dict:
    """A member's offer: its old global rank, its own optimizer step, its copies' and its previous copies' steps by
    owner, whether it holds state at all, whether it is between a step's votes, and the step its last step began
    from."""
    if snapshot is None:
        return {"rank": None, "held": False, "mid_step": False, "own_step": 0, "copies": {}, "previous": {},
                "before_step": None}
    return {"rank": snapshot.rank, "held": True, "mid_step": snapshot.mid_step, "own_step": snapshot.optimizer_step,
            "copies": {o: c.step for o, c in snapshot.held.items()},
            "previous": {o: c.step for o, c in snapshot.previous.items()},
            "before_step": snapshot.before_step[3] if snapshot.before_step else None}


Reduce = Callable[[list[int], str], list[int]]
"""A reduction of a few integers over every member ("sum" or "max"), the same list back on each."""
Collect = Callable[[object], dict]
"""Every member's object that is not None, by member index, on each."""


@dataclass(frozen=True)
class Reduced:
    """The first round's facts (one max-reduction): whether every member holding state is between a step's votes,
    the newest step any holds, and the step the last step began from (None: no member knows one)."""

    all_mid: bool
    newest: int
    target: int | None

    @staticmethod
    def part(offer: dict) -> list[int]:
        """This member's part of the max-reduction."""
        if not offer["held"]:
            return [0, NONE, NONE]
        return [int(not offer["mid_step"]), max([offer["own_step"], *offer["copies"].values()]),
                NONE if offer["before_step"] is None else offer["before_step"]]

    @classmethod
    def of(cls, values: list[int]) -> "Reduced":
        return cls(not values[0], max(0, values[1]), None if values[2] == NONE else values[2])


class RollBack:
    """The decision, over `buddies` (old anchor rank -> the old ranks planned to keep its copies; empty: the state
    is replicated), `dead` (old global ranks that died) and `survivors` (the old ranks of the members holding state).

    Round 1 is `Reduced`; round 2, `exceptions`, rides on a collect the caller makes anyway; round 3 is a sum of
    four integers (`count`) and, only where a dead owner's newest copy reached no buddy and an owner has several
    planned holders, a collect of the fewer of the covered or the lacking owners (`listing`, `listed`). Every member
    (a joiner too, who knows none of the above and passes zeros) takes the same branches, from what the rounds
    returned; `decide` then reads them on a member holding state."""

    def __init__(self, buddies: Mapping[int, Collection[int]], dead: Collection[int], survivors: Collection[int]):
        self.buddies, self.dead, self.survivors = buddies, frozenset(dead), frozenset(survivors)
        self.owners = frozenset(buddies)
        self.lost = self.dead & self.owners
        self.several = any(len(h) > 1 for h in buddies.values())
        self._planned: dict[int, list[int]] | None = None

    def planned(self, rank: int) -> list[int]:
        """The owners whose copies old rank `rank` is planned to keep."""
        if self._planned is None:
            self._planned = planned_copies(self.buddies)
        return self._planned.get(rank, [])

    @staticmethod
    def at(offer: dict, step: int | None) -> set[int]:
        """The owners whose copy this member keeps (newest or previous) of `step`."""
        return {o for copies in (offer["copies"], offer["previous"]) for o, s in copies.items() if s == step}

    def exceptions(self, offer: dict, reduced: Reduced) -> dict:
        """What this member says in round 2 (empty: nothing): its copies' steps of dead owners, and the owners it
        keeps of the target step without being planned to."""
        if not offer["held"] or not self.buddies:
            return {}
        out = {}
        lost = {o: s for o, s in offer["copies"].items() if o in self.lost}
        if lost:
            out["lost"] = lost
        extra = sorted((self.at(offer, reduced.target) - set(self.planned(offer["rank"]))) & self.owners)
        if extra:
            out["extra"] = extra
        return out

    def hear(self, reduced: Reduced, said: list[dict]) -> "Heard":
        """What round 2 settles, read once: the decision where it is settled, and the owners kept unplanned."""
        extra = frozenset(o for s in said for o in s.get("extra", ()))
        if not self.buddies:
            return Heard(False, extra)
        if reduced.all_mid:
            return Heard(True, extra)
        if not self.lost:  # no dead owner: every owner's newest state lives on with it
            return Heard(False, extra)
        fresh = {o for s in said for o, step in s.get("lost", {}).items() if step == reduced.newest}
        return Heard(False if self.lost <= fresh or reduced.target is None else None, extra)

    def count(self, offer: dict, reduced: Reduced, heard: "Heard") -> list[int]:
        """This member's part of round 3's sum: whether it must go on, its planned owners' copies of the target step
        and the pairs it is planned for (an owner some member keeps unplanned needs no count), and whether an owner
        has more than one planned holder (then the count alone does not say which owners are covered)."""
        if not offer["held"] or heard.early is not None:
            return [0, 0, 0, 0]
        mine = [o for o in self.planned(offer["rank"]) if o not in heard.extra]
        covered = self.at(offer, reduced.target)
        return [1, sum(o in covered for o in mine), len(mine), int(self.several)]

    @staticmethod
    def listing(counted: list[int]) -> str | None:
        """Which owners the members list in round 3's collect, from the counts (the fewer: those each keeps of the
        target step, or those it lacks); None: the counts decide, and nobody lists."""
        going, have, pairs, several = counted
        if not going or have == pairs or not several:
            return None
        return "covers" if have <= pairs - have else "lacks"

    def listed(self, offer: dict, reduced: Reduced, heard: "Heard", kind: str) -> dict | None:
        """This member's part of round 3's collect (None: nothing to list)."""
        if not offer["held"] or heard.early is not None:
            return None
        covered = self.at(offer, reduced.target)
        owners = sorted(o for o in self.planned(offer["rank"])
                        if o not in heard.extra and (o in covered) == (kind == "covers"))
        return {"rank": offer["rank"], "owners": owners} if owners else None

    def decide(self, heard: "Heard", counted: list[int], lists: Mapping[int, dict]) -> bool:
        """The decision on a member holding state, from the three rounds (`lists`: round 3's collect, if any)."""
        if heard.early is not None:
            return heard.early
        needed = self.owners - heard.extra
        if any(not any(h in self.survivors for h in self.buddies[o]) for o in needed):
            return False  # no member was planned to keep it, and none keeps it unplanned
        kind = self.listing(counted)
        if kind is None:  # every planned pair is of the target step, or (one holder each) exactly the owners' count
            return counted[1] == counted[2]
        if kind == "covers":
            return needed <= {o for s in lists.values() for o in s["owners"]}
        lacks = {s["rank"]: set(s["owners"]) for s in lists.values()}
        return all(any(h in self.survivors and o not in lacks.get(h, ()) for h in self.buddies[o]) for o in needed)


@dataclass(frozen=True)
class Heard:
    early: bool | None
    """The decision, where round 2 settles it."""
    extra: frozenset[int]
    """Owners some member keeps of the target step without being planned to."""


@dataclass(frozen=True)
class Rounds:
    """What the rounds of `RollBack` said, run over every member's offer at once (`run_rounds`)."""

    rule: RollBack
    reduced: Reduced
    told: dict[int, dict]
    """Round 2's collect: each member's exceptions, by index (the members with none left out)."""
    heard: Heard
    counted: list[int]
    lists: dict[int, dict]

    @property
    def decision(self) -> bool:
        return self.rule.decide(self.heard, self.counted, self.lists)


def run_rounds(buddies: Mapping[int, Collection[int]], offers: list[dict], dead: Collection[int]) -> Rounds:
    """The rounds of `RollBack` over a list of every member's offer, each reduction and collect done in place."""
    rule = RollBack(buddies, dead, {g["rank"] for g in offers if g["held"]})
    reduced = Reduced.of([max(v) for v in zip(*map(Reduced.part, offers))])
    told = {i: e for i, g in enumerate(offers) if (e := rule.exceptions(g, reduced))}
    heard = rule.hear(reduced, list(told.values()))
    counted = [sum(v) for v in zip(*(rule.count(g, reduced, heard) for g in offers))]
    kind = rule.listing(counted)
    lists = {} if kind is None else {i: o for i, g in enumerate(offers)
                                     if (o := rule.listed(g, reduced, heard, kind)) is not None}
    return Rounds(rule, reduced, told, heard, counted, lists)


def roll_back(buddies: Mapping[int, Collection[int]], offers: list[dict], dead: Collection[int]) -> bool:
    """Whether the members return to the state the last step began from, from every member's offer at once (the
    rounds of `RollBack`, run over a list: `run_rounds`).

    `buddies`: the old anchor ranks whose state has buddy copies, with the old ranks planned to keep them (none: the
    state is replicated). A step no member committed (the commit vote needs every rank) may be half applied: it is
    rolled back from the copies of the step before, unless no copies are kept (then every survivor finished the
    step, which goes forward). A committed step goes forward, unless a dead owner's newest state reached no buddy
    while the previous step's copies of every owner survive (`redundancy_keep_previous`).
    """
    return run_rounds(buddies, offers, dead).decision
