"""Fair shares of the DRAM tier between its owners (uids).

Importance hints are the client's own: they order one user's blocks against each other,
never one user's against another's, or a user sending the largest float32 would push
every other user out of the tier. The rule, when a block of owner O finds no free slot:

- Every owner with blocks in DRAM, O included, is *active*; each one's fair share is the
  tier's capacity split equally among them.
- While O holds less than its share, its block displaces a block of an owner holding more
  than its share (that owner's lowest-ranked one, whatever the two hints say), so a user
  reaches its share however the others rank their blocks.
- Otherwise O's block may displace only O's own blocks, by the usual rank (importance,
  then last use); an owner at or below its share keeps what it holds.

With one user the share is the whole tier and the rule is the plain rank. Each owner's
resident bytes are counted as blocks enter and leave (:meth:`DramShares.add`,
:meth:`DramShares.drop`), so a decision costs O(active owners), never a scan of blocks.
The store calls every method with its index lock held; this class has no lock of its own.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple


class Displacement(NamedTuple):
    """Whom ``count`` blocks of one owner may displace: ``(owner, blocks)`` taken from owners
    over their share whatever the rank, then up to ``own`` of the owner's own by rank."""

    from_others: list[tuple[int, int]]
    own: int


class DramShares:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._bytes: Counter[int] = Counter()

    def held(self, owner: int) -> int:
        """Bytes of ``owner``'s blocks in the tier now."""
        return self._bytes.get(owner, 0)

    def add(self, owner: int, nbytes: int) -> None:
        if nbytes:
            self._bytes[owner] += nbytes

    def drop(self, owner: int, nbytes: int) -> None:
        if not nbytes:
            return
        self._bytes[owner] -= nbytes
        assert self._bytes[owner] >= 0, "an owner cannot release more DRAM than it holds"
        if not self._bytes[owner]:
            del self._bytes[owner]  # no longer active: the others' shares grow

    def share(self, owner: int) -> int:
        """The fair share of ``owner``: the capacity over the active owners, ``owner`` among them."""
        active = len(self._bytes) + (owner not in self._bytes)
        return self.capacity // active

    def plan(self, owner: int, block_bytes: int, count: int) -> Displacement:
        """Whom ``count`` blocks of ``owner`` (``block_bytes`` each) that found no free slot may displace."""
        share = self.share(owner)
        room = -(-(share - self.held(owner)) // block_bytes)  # blocks until owner reaches its share
        taken: list[tuple[int, int]] = []
        left = min(count, max(room, 0))
        for other, nbytes in sorted(self._bytes.items(), key=lambda item: -item[1]):
            if left <= 0 or nbytes <= share:
                break  # by bytes, largest first: no later owner is over its share either
            if other == owner:
                continue
            n = min(left, -(-(nbytes - share) // block_bytes))
            taken.append((other, n))
            left -= n
        return Displacement(taken, count - sum(n for _, n in taken))
