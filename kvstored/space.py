"""Disk space: the catalog's reserve, catalog writes as typed replies, and freed extents.

The catalog keeps a reserve of disk space so that a delete can always commit, also on a
full disk (docs/durability.md, Full disk). While the reserve cannot be kept, the store is
*short*: creates and puts are refused (:meth:`Space.check_room`) until deletes free
space. Every catalog write goes through :meth:`Space.catalog_write`, which turns LMDB's
errors into the replies a client sees.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import lmdb

from kvdrive.layout import align_up
from kvdrive.layout.format import META_DIR
from kvstored.catalog import RESERVE_MIN_BYTES, Catalog
from kvstored.config import DaemonConfig, format_size
from kvstored.files import punch_hole
from kvstored.protocol import ErrorCode, ProtocolError
from kvstored.ssd import SsdTier

log = logging.getLogger(__name__)

PUNCH_STEP = 256  # holes punched between two tries of the catalog's reserve on a full disk (Space._hand_back)


class Space:
    def __init__(self, cfg: DaemonConfig, catalog: Catalog, ssd: SsdTier, counters: Counter) -> None:
        self.cfg = cfg
        self.catalog = catalog
        self.ssd = ssd
        self.counters = counters
        self.short = False  # the disk cannot hold the catalog's reserve: creates and puts are refused

    def keep_reserve(self) -> None:
        """Top up the catalog's reserve; on a disk that cannot hold it, hand free data-file
        space back to the filesystem until it can (:meth:`_hand_back`)."""
        was_short = self.short
        self.short = not self.catalog.ensure_reserve()
        if self.short and not was_short:
            freed = self._hand_back()
            if self.short:
                log.warning("disk full under %s: creates and puts are refused until deletes free space "
                            "(%s of free data-file space handed back to the filesystem)", self.cfg.ssd_dir, format_size(freed))
            else:
                log.info("disk full under %s: %s of free data-file space handed back to the filesystem keeps the "
                         "catalog's reserve", self.cfg.ssd_dir, format_size(freed))
        if was_short and not self.short:
            log.info("disk space for the catalog's reserve is back: creates and puts are accepted again")

    def _hand_back(self) -> int:
        """Punch free space out of the data file, the tail past its last extent first, then its
        holes largest first, PUNCH_STEP at a time, until the catalog's reserve holds (``short``
        then says whether it did); the bytes handed back. Punching every hole at once cost
        27 us a hole here, so about 27 s at a million holes (a store after many deletes),
        with every put waiting."""
        alloc = self.ssd.allocator
        freed = self.punch([(alloc.end, max(0, os.fstat(self.ssd.fd).st_size - alloc.end))])
        holes = alloc.largest_holes()
        while True:
            self.short = not self.catalog.ensure_reserve()
            step = list(itertools.islice(holes, PUNCH_STEP))
            if not self.short or not step:
                return freed
            freed += self.punch(step)

    def check_room(self, what: str) -> None:
        self.keep_reserve()
        if self.short:
            self.counters["refused_disk_full"] += 1
            raise ProtocolError(
                ErrorCode.FULL,
                f"{what} refused: the disk under {self.cfg.ssd_dir} is full, and the space kept for deletes "
                "cannot grow; delete sequences to make room",
            )

    def punch(self, ranges: list[tuple[int, int]]) -> int:
        done = 0
        for off, nbytes in ranges:
            if nbytes > 0 and punch_hole(self.ssd.fd, off, nbytes):
                done += nbytes
        return done

    def release_extents(self, extents: list[tuple[int, int]]) -> None:
        """Free extents once no reader can still read them; on a full disk their blocks go
        back to the filesystem, so the reserve can grow again."""
        if self.short:
            self.punch([(o, align_up(n)) for o, n in extents])
        for o, n in extents:
            self.ssd.queue_free(o, n)

    @contextmanager
    def catalog_write(self, what: str) -> Iterator[lmdb.Transaction]:
        """A catalog write transaction whose LMDB errors become typed replies."""
        try:
            with self.catalog.begin() as txn:
                yield txn
        except lmdb.MapFullError:
            raise ProtocolError(ErrorCode.FULL, f"{what}: the catalog filled its {format_size(self.cfg.lmdb_map_bytes)} "
                                "LMDB map; delete sequences to make room") from None
        except (lmdb.CorruptedError, lmdb.PanicError, lmdb.PageNotFoundError) as exc:
            log.error("%s: the catalog cannot be written: %s", what, exc)
            raise ProtocolError(ErrorCode.IO, f"{what}: the catalog cannot be written ({exc}); restart kvstored, "
                                "which checks the catalog at open") from None
        except lmdb.Error as exc:
            if isinstance(exc, lmdb.DiskError) or self._disk_nearly_full():
                self.short = True
                raise ProtocolError(ErrorCode.FULL, f"{what}: no disk space left for the catalog under "
                                    f"{self.cfg.ssd_dir} ({exc}); delete sequences to make room") from None
            raise ProtocolError(ErrorCode.IO, f"{what}: writing the catalog failed ({exc})") from None

    def _disk_nearly_full(self) -> bool:
        st = os.statvfs(self.cfg.ssd_dir / META_DIR)
        return st.f_bavail * st.f_frsize < RESERVE_MIN_BYTES
