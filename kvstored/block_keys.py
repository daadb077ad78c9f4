"""A block namespace's engine keys: key -> slot, and the slots least recently used first.

A store of 64 KiB engine blocks holds tens of millions of keys. An ``OrderedDict`` of key ->
slot cost 91 bytes an entry and an int object for each slot 32 more, beside the key
itself: two thirds of the daemon's memory per block. Here the map is an open-addressing
table of slots, probed by each key's hash (kept per slot), and the recency order a list
linked through two arrays by slot, both in compiled loops: about 28 bytes a block. The
keys themselves are kept by slot (:class:`_Keys`), so that a probe that meets an equal hash
is confirmed against the key (two keys of one 64-bit hash are told apart by a slower probe
of every slot of that hash): while every key has one length, as an engine's hash keys do,
as rows of one byte array (32 bytes a block for 32-byte keys, where a ``bytes`` object and
its pointer took 88), else as Python ``bytes``.
"""

from __future__ import annotations

import numba
import numpy as np

from kvdrive.protocol import jit_cache

jit_cache.use("kvstored")  # before the definitions below: they cache where it says

_EMPTY, _GONE = -1, -2  # a bucket never used; one whose slot was removed (probes go on past it)
MIN_BUCKETS = 64
HASH_CHUNK = 65536  # rows of keys made bytes objects at once to be hashed


@numba.njit(nogil=True, cache=True)
def _find(buckets, hashes, query, out):  # pragma: no cover - compiled
    """The first slot, along each query hash's probe, holding that hash; -1 where none does."""
    mask = len(buckets) - 1
    for i in range(len(query)):
        h = query[i]
        b = h & mask
        out[i] = -1
        while buckets[b] != _EMPTY:
            s = buckets[b]
            if s >= 0 and hashes[s] == h:
                out[i] = s
                break
            b = (b + 1) & mask


@numba.njit(nogil=True, cache=True)
def _insert(buckets, hashes, slots):  # pragma: no cover - compiled
    """Put each slot (its hash already in ``hashes``) in the first free bucket of its probe;
    how many of those were removed ones."""
    mask = len(buckets) - 1
    reused = 0
    for s in slots:
        b = hashes[s] & mask
        while buckets[b] >= 0:
            b = (b + 1) & mask
        reused += buckets[b] == _GONE
        buckets[b] = s
    return reused


@numba.njit(nogil=True, cache=True)
def _remove(buckets, hashes, slots):  # pragma: no cover - compiled
    mask = len(buckets) - 1
    for s in slots:
        b = hashes[s] & mask
        while buckets[b] != s and buckets[b] != _EMPTY:
            b = (b + 1) & mask
        if buckets[b] == s:
            buckets[b] = _GONE


@numba.njit(nogil=True, cache=True)
def _link(prev, nxt, ends, slots):  # pragma: no cover - compiled
    """Append ``slots`` to the order, in turn (``ends``: first and last slot, -1 when empty)."""
    for s in slots:
        last = ends[1]
        prev[s] = last
        nxt[s] = -1
        if last >= 0:
            nxt[last] = s
        else:
            ends[0] = s
        ends[1] = s


@numba.njit(nogil=True, cache=True)
def _unlink(prev, nxt, ends, slots):  # pragma: no cover - compiled
    for s in slots:
        p, n = prev[s], nxt[s]
        if p >= 0:
            nxt[p] = n
        else:
            ends[0] = n
        if n >= 0:
            prev[n] = p
        else:
            ends[1] = p
        prev[s] = -1
        nxt[s] = -1


@numba.njit(nogil=True, cache=True)
def _touch(prev, nxt, ends, slots):  # pragma: no cover - compiled
    """Move each of ``slots`` (linked ones), in turn, to the end: a slot named twice moves twice."""
    one = np.empty(1, np.int64)
    for s in slots:
        one[0] = s
        _unlink(prev, nxt, ends, one)
        _link(prev, nxt, ends, one)


@numba.njit(nogil=True, cache=True)
def _oldest(nxt, ends, n, skip):  # pragma: no cover - compiled
    """The first ``n`` slots of the order, but those in ``skip`` (sorted); all of them for ``n`` < 0."""
    out = np.empty(n if n >= 0 else len(nxt), np.int64)
    k, s = 0, ends[0]
    while s >= 0 and k < len(out):
        at = np.searchsorted(skip, s)
        if at == len(skip) or skip[at] != s:
            out[k] = s
            k += 1
        s = nxt[s]
    return out[:k]


def _grown(links: np.ndarray, capacity: int) -> np.ndarray:
    """Recency links for ``capacity`` slots: ``links``, then -1 (no slot)."""
    out = np.full(capacity, -1, np.int32)
    out[: len(links)] = links
    return out


def as_bytes(keys: list[bytes] | np.ndarray) -> list[bytes]:
    """Keys as ``bytes`` objects: rows of a byte array each made one; a list as it is."""
    if not isinstance(keys, np.ndarray):
        return keys
    w, raw = keys.shape[1], keys.tobytes()  # keys are never empty: w > 0
    return [raw[i:i + w] for i in range(0, len(raw), w)]


def _rows_of(keys: list[bytes] | np.ndarray) -> np.ndarray | None:
    """Keys (not none) as rows of one byte array; None where they are of several lengths."""
    if isinstance(keys, np.ndarray):
        return keys
    width = len(keys[0])
    if not (np.fromiter(map(len, keys), np.int64, len(keys)) == width).all():
        return None
    return np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), width)


def _hashes(keys: list[bytes] | np.ndarray) -> np.ndarray:
    """Each key's hash (Python's, as :meth:`BlockKeys.find` takes them); rows of a byte array
    are made ``bytes`` a chunk at a time, so that no more than a chunk of them exists at once."""
    if not isinstance(keys, np.ndarray):
        return np.fromiter(map(hash, keys), np.int64, len(keys))
    out = np.empty(len(keys), np.int64)
    for i in range(0, len(keys), HASH_CHUNK):
        chunk = as_bytes(keys[i:i + HASH_CHUNK])
        out[i:i + len(chunk)] = np.fromiter(map(hash, chunk), np.int64, len(chunk))
    return out


class _Keys:
    """Keys by slot: the rows of one byte array while every key stored has had one length,
    Python ``bytes`` objects (None in an empty slot) from the first key of another length on."""

    def __init__(self) -> None:
        self.rows: np.ndarray | None = None  # [capacity, width] uint8, once a key sets the width
        self.objects: np.ndarray | None = None
        self.capacity = 0

    def grow(self, capacity: int) -> None:
        more = capacity - self.capacity
        if more <= 0:
            return
        if self.objects is not None:
            self.objects = np.concatenate([self.objects, np.full(more, None, object)])
        elif self.rows is not None:
            self.rows = np.concatenate([self.rows, np.zeros((more, self.rows.shape[1]), np.uint8)])
        self.capacity = capacity

    def set(self, slots: np.ndarray, keys: list[bytes] | np.ndarray, held) -> None:
        """Keys ``keys`` (or rows of their bytes) in ``slots``; ``held()``: the slots holding
        a key now (kept, as objects, where ``keys`` are the first of another length)."""
        if not len(keys):
            return
        rows = _rows_of(keys) if self.objects is None else None  # a table of objects stays one: no join
        if rows is not None and (self.rows is None or self.rows.shape[1] == rows.shape[1]):
            if self.rows is None:
                self.rows = np.zeros((self.capacity, rows.shape[1]), np.uint8)
            self.rows[slots] = rows
            return
        if self.objects is None:  # the first key of another length: every key an object from now on
            kept = held() if self.rows is not None else np.zeros(0, np.int64)
            objects = np.full(self.capacity, None, object)
            objects[kept] = self.get(kept)
            self.objects, self.rows = objects, None
        self.objects[slots] = as_bytes(keys)

    def clear(self, slots: np.ndarray) -> None:
        if self.objects is not None:
            self.objects[slots] = None

    def get(self, slots: np.ndarray) -> list[bytes]:
        """The keys in ``slots`` (held ones)."""
        if self.objects is not None:
            return self.objects[slots].tolist()
        if self.rows is None:
            return [b""] * len(slots)  # no key has been stored: no slot is held
        return as_bytes(self.rows[slots])

    def same(self, slots: np.ndarray, keys: list[bytes]) -> np.ndarray:
        """Whether the key in each of ``slots`` is the key of ``keys`` in its place: as a rule
        all of them (a probe found each by its hash), which one comparison of the rows' bytes
        tells; key by key where not."""
        if self.rows is not None:
            w, joined = self.rows.shape[1], b"".join(keys)
            if len(joined) == w * len(keys) and self.rows[slots].tobytes() == joined and \
                    set(map(len, keys)) == {w}:
                return np.ones(len(keys), bool)
        return np.array([a == b for a, b in zip(self.get(slots), keys)], bool)


class BlockKeys:
    """Keys by slot, the slot of each key, and the slots in least recently used order.
    Not thread-safe: the index lock guards it, but for :meth:`prepare`, which the one
    thread that adds and removes keys (kvstored's writer) runs without it."""

    def __init__(self) -> None:
        self._keys = _Keys()
        self._hashes = np.zeros(0, np.int64)
        self._prev = np.zeros(0, np.int32)
        self._next = np.zeros(0, np.int32)
        self._links: tuple[np.ndarray, np.ndarray] | None = None  # prev and next, grown ahead
        self._ends = np.full(2, -1, np.int64)
        self._buckets = np.full(MIN_BUCKETS, _EMPTY, np.int32)
        self._count = self._gone = 0

    def __len__(self) -> int:
        return self._count

    def prepare(self, capacity: int, adding: int) -> None:
        """Ahead of :meth:`grow` to ``capacity`` and :meth:`add` of ``adding`` keys, without the
        index lock, by the thread that alone adds and removes keys: the keys and hashes
        grown, the recency links copied into grown arrays (copied again by :meth:`grow`:
        gets touch them meanwhile) and the table rehashed, where those would do it. Each is
        a new array swapped in whole, so a lookup meanwhile sees the old one or the new, both
        of every held key. At a doubling of a million keys these held the index lock, which
        every get waits on, for tens of ms."""
        self._grow_keys(capacity)
        if capacity > len(self._prev):
            self._links = (_grown(self._prev, capacity), _grown(self._next, capacity))
        if self._count + self._gone + adding > len(self._buckets) // 2:
            self._rehash(self._count + adding)

    def grow(self, capacity: int) -> None:
        """Room for slots below ``capacity``."""
        self._grow_keys(capacity)
        if capacity > len(self._prev):
            links = self._links
            if links is None or len(links[0]) != capacity:
                links = (_grown(self._prev, capacity), _grown(self._next, capacity))
            else:  # grown by prepare: copied again, as gets have moved slots since
                links[0][: len(self._prev)] = self._prev
                links[1][: len(self._next)] = self._next
            self._prev, self._next = links
        self._links = None

    def _grow_keys(self, capacity: int) -> None:
        more = capacity - len(self._hashes)
        if more > 0:
            self._keys.grow(capacity)
            self._hashes = np.concatenate([self._hashes, np.zeros(more, np.int64)])

    def find(self, keys: list[bytes]) -> np.ndarray:
        """The slot of each key, -1 for those not held."""
        query = np.fromiter(map(hash, keys), np.int64, len(keys))
        out = np.empty(len(keys), np.int64)
        _find(self._buckets, self._hashes, query, out)
        hit = np.flatnonzero(out >= 0)
        asked = keys if len(hit) == len(keys) else [keys[i] for i in hit.tolist()]
        same = self._keys.same(out[hit], asked)
        if not same.all():  # a key of the same hash as another
            for j in np.flatnonzero(~same).tolist():
                out[hit[j]] = self._probe(asked[j], int(query[hit[j]]))
        return out

    def key(self, slot: int) -> bytes:
        """The key held in ``slot``."""
        return self._keys.get(np.array([slot], np.int64))[0]

    def _probe(self, key: bytes, h: int) -> int:
        mask, b = len(self._buckets) - 1, h & (len(self._buckets) - 1)
        while (s := int(self._buckets[b])) != _EMPTY:
            if s >= 0 and self._hashes[s] == h and self.key(s) == key:
                return s
            b = (b + 1) & mask
        return -1

    def add(self, keys: list[bytes] | np.ndarray, slots: np.ndarray) -> None:
        """Hold new ``keys`` (none held already; or rows of their bytes, as start-up reads
        them) in ``slots`` (free ones), most recently used last."""
        slots = np.ascontiguousarray(slots, np.int64)
        if self._count + self._gone + len(slots) > len(self._buckets) // 2:
            self._rehash(self._count + len(slots))
        self._keys.set(slots, keys, self.oldest)
        self._hashes[slots] = _hashes(keys)
        self._gone -= _insert(self._buckets, self._hashes, slots)
        self._count += len(slots)
        _link(self._prev, self._next, self._ends, slots)

    def remove(self, slots: np.ndarray) -> None:
        """Forget the keys in ``slots``."""
        slots = np.unique(np.asarray(slots, np.int64))
        _remove(self._buckets, self._hashes, slots)
        _unlink(self._prev, self._next, self._ends, slots)
        self._keys.clear(slots)
        self._count -= len(slots)
        self._gone += len(slots)

    def touch(self, slots: np.ndarray) -> None:
        """``slots``, in turn, become the most recently used."""
        _touch(self._prev, self._next, self._ends, np.ascontiguousarray(slots, np.int64))

    def oldest(self, n: int = -1, skip: np.ndarray | None = None) -> np.ndarray:
        """The ``n`` least recently used slots (every slot, oldest first, for ``n`` < 0), but ``skip``'s."""
        skip = np.zeros(0, np.int64) if skip is None else np.sort(np.asarray(skip, np.int64))
        return _oldest(self._next, self._ends, n, skip)

    @classmethod
    def warm(cls) -> None:
        """Load the compiled loops now, at start (the first call of each in a process reads
        it from numba's cache, or compiles it), not in the first block request."""
        table = cls()
        table.grow(2)
        table.add([b"a", b"b"], np.arange(2))
        table.touch(table.find([b"a"]))
        table.remove(table.oldest(1, np.zeros(0, np.int64)))

    def items(self) -> list[tuple[bytes, int]]:
        """Every (key, slot), least recently used first."""
        slots = self.oldest()
        return list(zip(self._keys.get(slots), slots.tolist()))

    def _rehash(self, count: int) -> None:
        """A table of buckets for ``count`` keys, of the held slots (read from the buckets, as
        only adds and removes change them: the recency links gets change too), swapped in."""
        size = MIN_BUCKETS
        while size < 4 * count:
            size *= 2
        buckets = np.full(size, _EMPTY, np.int32)
        # int64 slots, as every other call passes them: the loop compiled (and warmed at
        # start) for those, where int32 ones (the buckets') made numba compile another
        # version at the first rehash, a stall of most of a second on the writer thread.
        _insert(buckets, self._hashes, self._buckets[self._buckets >= 0].astype(np.int64))
        self._buckets, self._gone = buckets, 0
