"""A block namespace's key table (kvstored/block_keys.py) against an OrderedDict doing the same."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from kvstored.block_keys import BlockKeys


class OneHash(bytes):
    """A key whose hash every other OneHash shares: probes must tell them apart by the key."""

    def __hash__(self) -> int:
        return -7


def check(table: BlockKeys, model: OrderedDict, absent: list) -> None:
    assert len(table) == len(model)
    assert table.items() == list(model.items())
    keys = list(model) + absent
    assert table.find(keys).tolist() == [model.get(k, -1) for k in keys]


# Keys of one length are kept as rows of a byte array, keys of several as bytes objects;
# "fixed" keys end in zero bytes, which a row must keep.
NAMES = {"varied": lambda i: b"key%d" % i, "fixed": lambda i: b"%09d\0\0" % i}


@pytest.mark.parametrize("ahead", [False, True], ids=["grown under the lock", "grown ahead"])
@pytest.mark.parametrize("collide", [False, True])
@pytest.mark.parametrize("kind", ["varied", "fixed"])
def test_random_adds_removes_and_uses_keep_the_map_and_the_order_of_an_ordered_dict(collide, kind, ahead):
    """With ``ahead``, each put's growth and rehash are prepared first (as kvstored's writer
    does without the index lock), a get moves slots between that and the put, and the put
    then rehashes nothing itself."""
    rng = np.random.default_rng(int(collide))
    make = (lambda k: OneHash(NAMES[kind](k))) if collide else NAMES[kind]
    table, model, free, top = BlockKeys(), OrderedDict(), [], 0
    names = iter(range(10**9))
    for step in range(300 if collide else 3000):
        op = rng.integers(0, 4)
        if op == 0 or not model:  # a put of new keys into free slots, lowest first
            n = int(rng.integers(1, 8))
            slots = sorted(free)[:n]
            free = [s for s in free if s not in slots]
            slots += list(range(top, top + n - len(slots)))
            top = max(top, max(slots) + 1)
            keys = [make(next(names)) for _ in slots]
            if ahead:
                table.prepare(top, len(slots))
                for k in [k for i, k in enumerate(model) if i % 3 == step % 3][:4]:  # a get meanwhile
                    table.touch(np.array([model[k]]))
                    model.move_to_end(k)
                table._rehash = None  # prepared: the put itself must not rehash
            table.grow(top)
            table.add(keys, np.array(slots))
            if ahead:
                del table._rehash
            model.update(zip(keys, slots))
        elif op == 1:  # a delete
            held = list(model)
            gone = [held[i] for i in rng.choice(len(held), size=min(len(held), int(rng.integers(1, 5))), replace=False)]
            slots = [model.pop(k) for k in gone]
            table.remove(np.array(slots))
            free += slots
        elif op == 2:  # a get, a key more than once too
            held = list(model)
            used = [held[i] for i in rng.choice(len(held), size=int(rng.integers(1, 6)))]
            table.touch(np.array([model[k] for k in used]))
            for k in used:
                model.move_to_end(k)
        else:  # a quota's victims, never the blocks a put just wrote
            keep = set(rng.choice(list(model.values()), size=min(3, len(model)), replace=False).tolist())
            n = int(rng.integers(0, 6))
            want = [s for s in model.values() if s not in keep][:n]
            assert table.oldest(n, np.array(sorted(keep))).tolist() == want
        if step % 10 == 0:
            check(table, model, [make(10**8 + step), b"never"])
    check(table, model, [make(10**8 - 1), b"absent"])
    assert (table._keys.rows is not None) == (kind == "fixed")  # kept as a byte array while of one length


def test_many_keys_grow_the_table_and_removed_buckets_are_reused():
    table = BlockKeys()
    keys = [b"k%07d" % i for i in range(20000)]
    table.grow(len(keys))
    for round_ in range(3):
        table.add(keys, np.arange(len(keys)))
        assert (table.find(keys) == np.arange(len(keys))).all()
        table.remove(np.arange(0, len(keys), 2))
        assert (table.find(keys[::2]) == -1).all() and (table.find(keys[1::2]) == np.arange(1, len(keys), 2)).all()
        table.remove(np.arange(1, len(keys), 2))
        assert len(table) == 0 and table.items() == []
    assert len(table._buckets) <= 4 * 2 * len(keys)  # rehashed, not grown for every round's removed keys


def test_keys_of_one_length_then_another_keep_every_key_held_and_forget_the_removed():
    table = BlockKeys()
    table.grow(8)
    table.add([b"a" * 32, b"b" * 32, b"c" * 32], np.arange(3))
    table.remove(np.array([1]))
    assert table.find([b"b" * 32, b"b" * 31, b"a" * 32]).tolist() == [-1, -1, 0]
    table.add([b"short", b"x" * 32], np.array([1, 3]))  # the first key of another length
    assert table.items() == [(b"a" * 32, 0), (b"c" * 32, 2), (b"short", 1), (b"x" * 32, 3)]
    assert table.find([b"short", b"b" * 32, b"c" * 32]).tolist() == [1, -1, 2]
    table.grow(64)
    table.add([b"z" * 7], np.array([40]))
    assert table.key(40) == b"z" * 7 and table.find([b"z" * 7]).tolist() == [40]


def test_the_compiled_loops_see_one_set_of_types_the_one_warmed_at_start():
    """kvstored warms the key table's compiled loops at start (BlockKeys.warm); a call with
    other types (int32 slots from the buckets, say) made numba compile another version of
    one at the first rehash: most of a second on the writer thread, in the middle of traffic."""
    from kvstored import block_keys as bk

    BlockKeys.warm()
    table = BlockKeys()
    keys = [b"k%07d" % i for i in range(3000)]
    for start in range(0, len(keys), 100):  # grows, and rehashes on the way, prepared ahead and not
        slots = np.arange(start, start + 100)
        if start % 200:
            table.prepare(start + 100, 100)
        table.grow(start + 100)
        table.add(keys[start: start + 100], slots)
        table.touch(slots[::7])
    table.remove(np.arange(0, 3000, 3))
    table.oldest(5, np.array([1, 2]))
    assert table.find(keys[1:3]).tolist() == [1, 2]
    for loop in (bk._find, bk._insert, bk._remove, bk._link, bk._unlink, bk._touch, bk._oldest):
        assert len(loop.signatures) == 1, f"{loop.__name__} compiled for {loop.signatures}"
