"""The store directory's files below LMDB: data.mdb's meta pages, exclusive locks, disk space.

- :func:`read_lmdb_meta` checks ``meta/data.mdb`` before LMDB maps it. LMDB trusts
  its meta page: a file cut short under it is mapped past its end (SIGBUS on the
  first read), and a zero-length file is taken for a new, empty environment.
- :func:`lock_exclusive` takes a ``flock`` on an open file. The daemon holds one on
  the data file and one on ``data.mdb``: unlike ``kvstored.lock`` they cannot be
  unlinked from under it. (LMDB's own locks are ``fcntl`` locks on ``lock.mdb``;
  ``flock`` locks are independent of them.)
- :func:`reserve` and :func:`punch_hole` hold and hand back disk space, so that a
  full filesystem still lets the catalog commit a delete (see docs/durability.md).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from dataclasses import dataclass
from pathlib import Path

# LMDB 0.9 on a 64-bit host: a 16-byte page header, then MDB_meta in meta pages 0 and 1.
LMDB_MAGIC = 0xBEEFC0DE
LMDB_DATA_VERSION = 1
P_INVALID = (1 << 64) - 1
P_BRANCH, P_LEAF, P_META = 0x01, 0x02, 0x08
F_SUBDATA = 0x02
PAGE_HEADER = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
META = struct.Struct("<IIQQ48s48sQQ")  # magic, version, address, mapsize, dbs[FREE], dbs[MAIN], last_pg, txnid
DB = struct.Struct("<IHHQQQQQ")  # md_pad (page size in dbs[FREE]), flags, depth, branch, leaf, overflow, entries, root
NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
MIN_PAGE = 512


class StoreOpenError(RuntimeError):
    """The store cannot be opened as it is; the message says why and what to do."""


class CatalogFileError(RuntimeError):
    """data.mdb is not an LMDB file LMDB could map safely; the message says what is wrong."""


@dataclass(frozen=True)
class LmdbMeta:
    page_size: int
    last_pg: int
    txnid: int
    main_root: int
    free_root: int
    file_bytes: int

    @property
    def used_bytes(self) -> int:
        return (self.last_pg + 1) * self.page_size


def read_lmdb_meta(path: Path) -> LmdbMeta | None:
    """The current meta page of LMDB file ``path``, checked; None if the file is absent or empty.

    Picks the meta page with the higher transaction id, as LMDB does, and refuses a
    file whose meta pages are not LMDB's, that is shorter than its last page, or
    whose database roots are not the pages they name.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return None
            head = f.read(min(size, 2 * 65536))
            metas = []
            page_size = _page_size(path, head, size)
            for i in range(2):
                metas.append(_meta(path, head, i, page_size, size))
            best = max(metas, key=lambda m: m.txnid)
            if size < best.used_bytes:
                raise CatalogFileError(
                    f"{path} is {size} bytes but its last page ({best.last_pg}) ends at {best.used_bytes} bytes: "
                    "the file was cut short"
                )
            _check_roots(path, f, best)
            return best
    except FileNotFoundError:
        return None


def _page_size(path: Path, head: bytes, size: int) -> int:
    if size < PAGE_HEADER.size + META.size:
        raise CatalogFileError(f"{path} is {size} bytes, too short for an LMDB meta page")
    magic, _, _, _, free_db, _, _, _ = META.unpack_from(head, PAGE_HEADER.size)
    if magic != LMDB_MAGIC:
        raise CatalogFileError(f"{path} is not an LMDB file: meta page 0 holds magic {magic:#010x}, not {LMDB_MAGIC:#010x}")
    page_size = DB.unpack(free_db)[0]
    if page_size < MIN_PAGE or page_size & (page_size - 1) or page_size > 65536:
        raise CatalogFileError(f"{path}: meta page 0 names page size {page_size}, which LMDB never writes")
    if size < 2 * page_size:
        raise CatalogFileError(f"{path} is {size} bytes, shorter than its two {page_size}-byte meta pages")
    return page_size


def _meta(path: Path, head: bytes, i: int, page_size: int, size: int) -> LmdbMeta:
    base = i * page_size
    pgno, _, flags, _, _ = PAGE_HEADER.unpack_from(head, base)
    magic, version, _, _, free_db, main_db, last_pg, txnid = META.unpack_from(head, base + PAGE_HEADER.size)
    if magic != LMDB_MAGIC or not flags & P_META or pgno != i:
        raise CatalogFileError(f"{path}: meta page {i} is damaged (magic {magic:#010x}, flags {flags:#x}, page {pgno})")
    if version != LMDB_DATA_VERSION:
        raise CatalogFileError(f"{path}: meta page {i} is of LMDB data version {version}, not {LMDB_DATA_VERSION}")
    return LmdbMeta(page_size, last_pg, txnid, DB.unpack(main_db)[7], DB.unpack(free_db)[7], size)


def _check_roots(path: Path, f, meta: LmdbMeta) -> None:
    """Every database root, LMDB's two and the named ones in the main one, is the page it names."""
    main = _root_page(path, f, meta, meta.main_root, "LMDB's main database")
    _root_page(path, f, meta, meta.free_root, "LMDB's free-page database")
    if main is None or not PAGE_HEADER.unpack_from(main)[2] & P_LEAF:
        return  # empty, or (never with a handful of named databases) more than one page
    for name, sub in _subdatabases(main):
        _root_page(path, f, meta, DB.unpack(sub)[7], f"database {name!r}")


def _root_page(path: Path, f, meta: LmdbMeta, root: int, what: str) -> bytes | None:
    if root == P_INVALID:
        return None
    if not 2 <= root <= meta.last_pg:
        raise CatalogFileError(f"{path}: the root of {what} is page {root}, outside pages 2..{meta.last_pg}")
    f.seek(root * meta.page_size)
    page = f.read(meta.page_size)
    pgno, _, flags, _, _ = PAGE_HEADER.unpack_from(page)
    if pgno != root or not flags & (P_BRANCH | P_LEAF):
        raise CatalogFileError(f"{path}: the root of {what} names page {root}, which holds page {pgno} (flags {flags:#x})")
    return page


def _subdatabases(page: bytes) -> list[tuple[str, bytes]]:
    _, _, _, lower, _ = PAGE_HEADER.unpack_from(page)
    out = []
    for k in range(max(0, (lower - PAGE_HEADER.size) // 2)):
        (at,) = struct.unpack_from("<H", page, PAGE_HEADER.size + 2 * k)
        if at + NODE.size > len(page):
            continue
        lo, hi, flags, ksize = NODE.unpack_from(page, at)
        key_at = at + NODE.size
        if flags & F_SUBDATA and (lo | hi << 16) == DB.size and key_at + ksize + DB.size <= len(page):
            name = page[key_at : key_at + ksize].decode("utf-8", "backslashreplace")
            out.append((name, page[key_at + ksize : key_at + ksize + DB.size]))
    return out


# ---------------------------------------------------------------- exclusive locks


class StoreBusyError(StoreOpenError):
    """Another kvstored already serves this directory."""


def lock_exclusive(fd: int, path: Path, store: Path) -> None:
    """``flock`` ``fd`` (open on ``path``) for this process, or say which process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _flock_holder(fd)
        who = f"pid {pid}" if pid else "pid unknown"
        raise StoreBusyError(f"another kvstored ({who}) serves {store}: it holds {path.name} locked; stop it or "
                             "choose another --ssd") from None


def _flock_holder(fd: int) -> int | None:
    """The pid /proc/locks names for the flock on ``fd``'s file, if it can be read."""
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == dev and fields[4].isdigit():
                    return int(fields[4])
    except OSError:
        pass
    return None


# ---------------------------------------------------------------- disk space


def reserve(fd: int, nbytes: int) -> bool:
    """Allocate disk blocks for ``[0, nbytes)`` of ``fd``; False if the filesystem has no room."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return False
        raise
    return True


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch_hole(fd: int, offset: int, nbytes: int) -> bool:
    """Hand ``[offset, offset + nbytes)`` of ``fd`` back to the filesystem (it reads as zeros);
    False where the filesystem cannot."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, f"punching a hole of {nbytes} bytes at {offset}: {os.strerror(err)}")


_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 0x01, 0x02, 0x04
WAIT_WRITTEN = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WAIT_AFTER  # start_writeback's wait
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def start_writeback(fd: int, offset: int, nbytes: int, wait: int = 0) -> None:
    """Have the kernel write ``[offset, offset + nbytes)`` of ``fd`` 's dirty pages to the disk:
    started, waiting only for room in the disk's queue; with ``wait=WAIT_WRITTEN``, also
    waited for until they are written (``sync_file_range``: nothing is made durable, no
    metadata is written, nor the disk's cache flushed)."""
    if _libc.sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE | wait) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"writeback of {nbytes} bytes at {offset}: {os.strerror(err)}")
