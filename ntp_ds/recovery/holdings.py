"""Who can serve each old owner's optimizer state after a failure, and of which step (pure).

A new rank serves its own old fragments (an old anchor, unless the job rolls back) and the buddy copies it keeps.
`Listed` reads that from every rank's offer; `Planned` from a rule every rank applies alike, the buddy plan at the
newest step, and the offers of the few ranks that differ from it (a copy missing or of another step, a fragment
the rule does not give): what a rank receives then grows with those ranks, not with the world.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def planned_copies(buddies: Mapping[int, Collection[int]]) -> dict[int, list[int]]:
    """Old rank -> the owners whose copies the buddy plan (`plan_buddies`: owner -> holders) puts on it."""
    out: dict[int, list[int]] = {}
    for owner, holders in buddies.items():
        for h in holders:
            out.setdefault(h, []).append(owner)
    return out


HOLDER_SCANS = 8
"""Owners whose holders `Listed.holders_of` finds by a scan each; more are found in one pass over the offers."""


class Listed:
    """From every new rank's offer: `steps[server]` = {owner: step} of what it can serve."""

    def __init__(self, steps: list[dict]):
        self._steps = steps
        self._holders: dict[int, list[tuple[int, int]]] = {}  # owner -> [(server, step)], for those looked up
        self._offered: set[int] | None = None
        self.step = max((max(offered.values()) for offered in steps if offered), default=0)

    def serves(self, owner: int) -> bool:
        if self._offered is None:
            self._offered = set().union(*self._steps)
        return owner in self._offered

    def holders_of(self, owners: tuple[int, ...]) -> dict[int, list[tuple[int, int]]]:
        """owner -> [(server, step)] of every copy of each of `owners`' state (and of owners looked up before).

        A plan under ZeRO looks up a few owners (two in a 100K-rank recovery): each is found by one scan of the
        offers, where a table of every owner would cost every rank a pass appending every offer. Many at once
        (identical fragments without ZeRO, one per anchor) are found in one such pass."""
        missing = [o for o in owners if o not in self._holders]
        if len(missing) <= HOLDER_SCANS:
            for owner in missing:
                self._holders[owner] = [(server, offered[owner]) for server, offered in enumerate(self._steps)
                                        if owner in offered]
        elif missing:
            wanted = set(missing)
            for owner in wanted:
                self._holders[owner] = []
            for server, offered in enumerate(self._steps):
                for owner, step in offered.items():
                    if owner in wanted:
                        self._holders[owner].append((server, step))
        return self._holders


class Planned:
    """From the rule and its exceptions.

    `step`: the newest step any rank serves; `old_rank_of`: new rank -> old global rank of the survivors;
    `anchors`: whether an old global rank was an anchor (serves its own fragments when `own`); `buddies`: old anchor
    rank -> old ranks planned to keep its copies. `tell` then gives the offers of the ranks that differ from the
    rule (`expected`)."""

    def __init__(self, step: int, old_rank_of: Mapping[int, int], anchors, buddies: Mapping[int, Collection[int]],
                 own: bool):
        self.step, self.own, self.buddies = step, own, buddies
        self._old_rank_of, self._anchor = old_rank_of, anchors
        self._new_rank: dict[int, int] | None = None
        self._planned: dict[int, list[int]] | None = None
        self.irregular: Mapping[int, dict] = {}
        self._by_owner: dict[int, list[tuple[int, int]]] = {}

    def tell(self, irregular: Mapping[int, dict]) -> "Planned":
        """Take `irregular` (new rank -> {owner: step}), the offers of every rank whose offer is not the rule's."""
        self.irregular, self._by_owner = irregular, {}
        for server, offered in irregular.items():
            for owner, s in offered.items():
                self._by_owner.setdefault(int(owner), []).append((server, int(s)))
        return self

    @staticmethod
    def newest(steps: dict) -> int:
        """This rank's part of the max-reduction that gives `step` (-1: it serves nothing)."""
        return max(steps.values(), default=-1)

    def expected(self, new_rank: int) -> dict[int, int]:
        """{owner: step} the rule says new rank `new_rank` serves."""
        old = self._old_rank_of.get(new_rank)
        if old is None:
            return {}
        if self._planned is None:
            self._planned = planned_copies(self.buddies)
        out = {old: self.step} if self.own and self._anchor(old) else {}
        if self.step >= 1:  # (the first copies are of the first optimizer step's state: none exist before it)
            out.update((o, self.step) for o in self._planned.get(old, ()))
        return out

    def serves(self, owner: int) -> bool:
        return bool(self.holders_of((owner,))[owner])

    def holders_of(self, owners: tuple[int, ...]) -> dict[int, list[tuple[int, int]]]:
        """owner -> [(server, step)] of every copy of each of `owners`' state: the regular ranks the rule names, at
        `step`, and the irregular ones that offered it."""
        if self._new_rank is None:
            self._new_rank = {old: new for new, old in self._old_rank_of.items()}
        out = {}
        for owner in owners:
            named = ([owner] if self.own and self._anchor(owner) else []) + list(
                self.buddies.get(owner, ()) if self.step >= 1 else ())
            servers = [self._new_rank[r] for r in named if r in self._new_rank]
            out[owner] = ([(s, self.step) for s in servers if s not in self.irregular]
                          + self._by_owner.get(owner, []))
        return out
