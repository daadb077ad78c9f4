"""What a scheduler knows of its tier's keys, within a bound: pure bookkeeping, no I/O.

An engine's scheduler asks its tier about every block key of every request, and must
never wait for kvstored to answer. :class:`KnownKeys` keeps the keys it knows stored
(hits). It holds at most ``capacity`` keys; past that, the keys least recently asked
about are forgotten. A forgotten key is not a wrong answer, only a question asked
again: the tier answers "retry" and asks kvstored. The keys are kept whole (no hash of
them, no filter that can answer yes for a key never seen), so a bound never turns into
a wrong hit.

Size: at most :data:`BYTES_PER_KEY` bytes per key of 36 bytes (vLLM's offload keys: a
SHA-256 block hash and a group index), the key itself included (about 100 measured;
tests/integrations/test_known_keys.py checks the bound): the default 262,144 keys take
at most 32 MiB, where the unbounded set this replaces grew by about 98 MiB per million
keys, for ever.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

DEFAULT_CAPACITY = 1 << 18
BYTES_PER_KEY = 128  # a set entry and a 36-byte bytes key (69 bytes), on CPython 3.11, at worst


class KnownKeys:
    """Keys known stored, at most ``capacity`` of them (see the module).

    Two generations of plain sets, each of at most half the capacity: new answers go to
    the young one, a key found in the old one moves to the young one, and when the young
    one is full the old one is dropped whole and the young one becomes old. So every
    call is O(1), the keys asked about recently stay, and the bound is exact.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 2:
            raise ValueError(f"known_keys must be a number of keys, at least 2, got {capacity!r}")
        self.capacity = capacity
        self._half = capacity // 2
        self._young: set[Hashable] = set()
        self._old: set[Hashable] = set()
        self.num_forgotten = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def stored(self, key: Hashable) -> bool:
        """Whether ``key`` is known stored (False: not known, which is not "missing")."""
        if key in self._young:
            return True
        if key not in self._old:
            return False
        self._old.discard(key)
        self._put(key)
        return True

    def add_stored(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._old.discard(key)
            self._put(key)

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Keys whose block turned out not loadable: known no more."""
        for key in keys:
            self._young.discard(key)
            self._old.discard(key)

    def _put(self, key: Hashable) -> None:
        if key not in self._young and len(self._young) >= self._half:
            self.num_forgotten += len(self._old)
            self._old, self._young = self._young, set()
        self._young.add(key)
