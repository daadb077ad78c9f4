"""On a disk too full for the catalog's reserve, kvstored hands free data-file space back to
the filesystem until the reserve holds: the tail past the last extent first, then the
holes, largest first, a step at a time; not every hole at once (27 us a hole here)."""

from __future__ import annotations

import logging
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from kvdrive.layout import ALIGN, ExtentAllocator
from kvstored import space as space_mod
from kvstored.space import Space

STEP = 16


class Reserve:
    """A catalog whose reserve holds once ``need`` bytes were punched."""

    def __init__(self, punched: list[tuple[int, int]], need: int) -> None:
        self.punched, self.need, self.tries = punched, need, 0

    def ensure_reserve(self) -> bool:
        self.tries += 1
        return sum(n for _, n in self.punched) >= self.need


@pytest.fixture
def rig(tmp_path, monkeypatch):
    """A data file with 300 holes of 1 to 9 units and a tail past its last extent."""
    punched: list[tuple[int, int]] = []
    monkeypatch.setattr(space_mod, "PUNCH_STEP", STEP)
    monkeypatch.setattr(space_mod, "punch_hole", lambda fd, off, n: punched.append((off, n)) or True)
    rng = np.random.default_rng(3)
    alloc = ExtentAllocator(1 << 40)
    starts = [alloc.allocate(int(rng.integers(1, 10)) * ALIGN) for _ in range(600)]
    sizes = {s: n for s, n in zip(starts, np.diff(starts + [alloc.end]).tolist())}
    for s in starts[:-1:2]:  # every other range: holes that do not merge; the last stays in use
        alloc.free(s, sizes[s])
    path = tmp_path / "data"
    path.write_bytes(b"")
    tail = 7 * ALIGN
    with open(path, "r+b") as f:
        f.truncate(alloc.end + tail)
        yield SimpleNamespace(alloc=alloc, fd=f.fileno(), punched=punched, tail=(alloc.end, tail))


def space(rig, need: int) -> tuple[Space, Reserve]:
    reserve = Reserve(rig.punched, need)
    ssd = SimpleNamespace(allocator=rig.alloc, fd=rig.fd)
    return Space(SimpleNamespace(ssd_dir="/nvme"), reserve, ssd, Counter()), reserve


def test_the_tail_then_the_largest_holes_go_back_until_the_reserve_holds(rig, caplog):
    largest = list(rig.alloc.largest_holes())
    assert len(largest) == 300 and largest[0][1] > largest[-1][1]
    need = rig.tail[1] + sum(n for _, n in largest[:2 * STEP + 3])  # in the third step
    sp, reserve = space(rig, need)
    reserve.need = -1  # the reserve holds at first
    sp.keep_reserve()
    assert not sp.short and rig.punched == []
    reserve.need = need
    with caplog.at_level(logging.INFO, logger="kvstored.space"):
        sp.keep_reserve()
    assert not sp.short
    assert rig.punched == [rig.tail, *largest[:3 * STEP]], "not the tail, then the largest holes, a step at a time"
    assert "handed back to the filesystem keeps the catalog's reserve" in caplog.text
    sp.keep_reserve()  # held: nothing more
    assert len(rig.punched) == 1 + 3 * STEP


def test_the_tail_alone_may_be_enough(rig):
    sp, _ = space(rig, rig.tail[1])
    sp.keep_reserve()
    assert not sp.short and rig.punched == [rig.tail]


def test_a_disk_too_full_for_every_hole_is_short_after_all_go_back(rig, caplog):
    sp, reserve = space(rig, 1 << 50)
    with caplog.at_level(logging.WARNING, logger="kvstored.space"):
        sp.keep_reserve()
    assert sp.short
    assert rig.punched == [rig.tail, *rig.alloc.largest_holes()]
    assert reserve.tries == 1 + 300 // STEP + 2  # the first try, one a step, one after the last
    assert "creates and puts are refused until deletes free space" in caplog.text
    before = len(rig.punched)
    sp.keep_reserve()  # still short: handed back once, when it became short
    assert sp.short and len(rig.punched) == before
